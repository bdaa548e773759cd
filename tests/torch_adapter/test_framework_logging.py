"""gradcomp's metrics through the frameworks' own loggers, for real at 2 ranks on the CPU under
torchrun (``test_frameworks.torchrun_job``): Lightning's ``CSVLogger`` file, the HF Trainer's
``log_history`` (and ``trainer_state.json``) and a callback after ``Compression`` writing CSV, and
``accelerator.log`` into a tracker writing CSV, each read back from disk.

Every job trains a governed top-k over a tight budget (``topk:warmup=0,budget=0.05``: it backs off
to safer rungs during the run) for 66 steps, logging every 6, then a short run with ``log=False``
(Accelerate: without the call). Checked: one row of gradcomp figures per logging step, with bytes
that grow, whole-run and recent ratios above 1, rung shares that sum to 1 and move off the method,
audit costs against the budget; one back-off line per governor decision over budget, through the
framework's warning channel; nothing of gradcomp's with ``log=False``.
"""
from __future__ import annotations

import math

import pytest

from tests.torch_adapter.test_frameworks import needs, torchrun_job

LOGGED_STEPS = 11  # 66 steps, logged every 6
RUNGS = ("gradcomp/rung_share_method", "gradcomp/rung_share_int4", "gradcomp/rung_share_int8")


def gradcomp_rows(rows: list[dict]) -> list[dict[str, float]]:
    """The rows (CSV rows as strings, or log records) that carry gradcomp's figures, as floats."""
    out = []
    for row in rows:
        mine = {k: float(v) for k, v in row.items() if k.startswith("gradcomp/") and v not in ("", None)}
        if mine:
            out.append({**mine, "step": float(row["step"])})
    return out


def check_logged(rows: list[dict], result: dict) -> None:
    logged = gradcomp_rows(rows)
    assert len(logged) == LOGGED_STEPS, logged
    steps = [r["step"] for r in logged]
    assert all(b - a == 6 for a, b in zip(steps, steps[1:])), steps  # the framework's interval
    sent = [r["gradcomp/bytes_sent"] for r in logged]
    assert sent[0] > 0 and all(b > a for a, b in zip(sent, sent[1:])), sent
    for r in logged:
        assert r["gradcomp/compression_ratio"] > 1 and r["gradcomp/recent_compression_ratio"] > 1, r
        assert r["gradcomp/warmup_done"] == 1.0 and r["gradcomp/guard_runaway"] in (0.0, 1.0), r
        assert math.isclose(sum(r[k] for k in RUNGS), 1.0, rel_tol=1e-6), r  # (Lightning logs float32)
    safer = [sum(i * r[k] for i, k in enumerate(RUNGS)) for r in logged]  # the mean rung, 0 = the method
    assert safer[-1] > safer[0], safer  # tensors moved to safer rungs
    audited = [r for r in logged if "gradcomp/audit_cost" in r]
    limit = result["limit"]  # (the budget, or its adaptive share under Adam: the HF Trainer's AdamW)
    assert audited and all(math.isclose(r["gradcomp/audit_budget"], limit, rel_tol=1e-6) for r in audited), logged
    assert max(r["gradcomp/audit_cost"] for r in audited) > limit, audited  # what made it back off
    # once per back-off, not per step; said through the framework's channel
    backed = [d for d in result["decisions"] if not d["cost"] <= result["limit"]]
    governor = [line for line in result["lines"] if line.startswith("gradcomp: the governor moved")]
    assert backed and len(governor) == len(backed) == len(set(governor)), (governor, result["decisions"])
    assert all(f"at step {d['step']}:" in line for d, line in zip(backed, governor)), governor


def check_silent(rows: list[dict], result: dict) -> None:
    assert rows and not gradcomp_rows(rows), rows[:3]  # the user's own figures are there, none of gradcomp's
    assert not result["off_lines"], result["off_lines"]


@needs("torch", "pytorch_lightning")
def test_lightning_callback_logs_through_the_csv_logger(tmp_path):
    result = torchrun_job("logging_lightning_job.py", tmp_path)
    assert result["steps"] == 66, result["steps"]
    check_logged(result["rows"], result)
    check_silent(result["off_rows"], result)


@needs("torch", "transformers", "accelerate")
def test_hf_trainer_callback_adds_to_the_trainers_logs(tmp_path):
    """The training logs in ``trainer_state.json``'s ``log_history`` and in the JSON lines a callback
    after Compression wrote (evaluation logs and the run's summary are left alone)."""
    result = torchrun_job("logging_transformers_job.py", tmp_path)
    assert result["steps"] == 66 and result["in_memory"], result["steps"]
    check_logged(result["history"], result)
    check_logged(result["rows"], result)
    summary = [r for r in result["history"] if "train_runtime" in r]
    assert summary and not gradcomp_rows(summary), summary
    check_silent(result["off_history"], result)
    check_silent(result["off_rows"], result)


@needs("torch", "accelerate")
def test_accelerate_log_reaches_the_trackers(tmp_path):
    """``gradcomp.torch.accelerate.log`` beside the loop's ``accelerator.log``: the figures in a
    tracker's CSV file, at the loop's steps, beside the user's own (``loss``, in rows of its own)."""
    result = torchrun_job("logging_accelerate_job.py", tmp_path)
    assert result["steps"] == 66, result["steps"]
    check_logged(result["rows"], result)
    assert sum(bool(r["loss"]) for r in result["rows"]) == LOGGED_STEPS, result["rows"]
