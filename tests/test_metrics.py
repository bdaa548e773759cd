"""``gradcomp.metrics`` / ``Meter`` / ``backoffs`` (``gradcomp/metrics.py``) on the stats of real
compressors at 2 ranks under mpiexec (int8's fixed warm-up, a governed method that backs off twice,
governed ``onebit``, ``auto``, DiLoCo, OneBitAdam), and on hand-made stats for what a short run does not reach (the
guard's runaway, ``auto`` changing its mind, a hierarchical schedule, DiLoCo's fragments). The
framework loggers are tested through the real frameworks in tests/torch_adapter/test_framework_logging.py.
"""
from __future__ import annotations

import math
import re
import sys

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

SHAPES = [(200, 100), (100,), (50, 40)]
NAME = re.compile(r"^gradcomp/[a-z0-9_]+$")


def _grads(rank: int, step: int) -> list[np.ndarray]:
    common, own = np.random.default_rng(0), np.random.default_rng([step, rank])
    return [(common.standard_normal(s) * np.cos(step / 30) + own.standard_normal(s)).astype(np.float32)
            for s in SHAPES]


def _well_formed(values: dict) -> None:
    assert values and all(NAME.match(k) for k in values), values
    assert all(type(v) is float for v in values.values()), values


def _reduce(spec, comm, steps, each=None):
    """``steps`` steps of ``spec`` through a GradientReducer; ``each(step, compressor)`` after each."""
    import gradcomp as gc

    comp = gc.make(spec)
    reducer = gc.GradientReducer([np.zeros(s, np.float32) for s in SHAPES], comp, comm)
    for step in range(steps):
        for g, new in zip(reducer.gradients, _grads(comm.rank, step)):
            g[...] = new
        reducer.step(reducer.gradients)
        if each is not None:
            each(step, comp)
    return comp


def rank_metrics_of_real_compressors():
    import gradcomp as gc

    comm = gc.MPICommunicator()

    # int8: 5 fp32 warm-up steps, then 8-bit codes; the figures against stats() and between readings
    meter, readings = gc.Meter(), {}
    comp = _reduce("int8:warmup=5", comm, 20,
                   lambda step, c: readings.update({step: (c.stats(), meter.update(c.stats()))}) if step in (2, 9, 19) else None)
    (s2, m2), (s9, m9), (s19, m19) = readings[2], readings[9], readings[19]
    for m in (m2, m9, m19):
        _well_formed(m)
    assert m2["gradcomp/warmup_done"] == 0.0 and m2["gradcomp/warmup_steps_left"] == 2.0, m2
    assert m2["gradcomp/compression_ratio"] == 1.0 == m2["gradcomp/recent_compression_ratio"], m2
    assert m19["gradcomp/warmup_done"] == 1.0 and m19["gradcomp/warmup_steps_left"] == 0.0, m19
    assert m19["gradcomp/bytes_sent"] == s19["bytes_sent"] > 0 and m19["gradcomp/steps"] == 20.0, m19
    assert m19["gradcomp/compression_ratio"] == s19["reference_bytes"] / s19["bytes_sent"] > 1, m19
    recent = (s19["reference_bytes"] - s9["reference_bytes"]) / (s19["bytes_sent"] - s9["bytes_sent"])
    assert m19["gradcomp/recent_compression_ratio"] == recent, (m19, recent)
    assert recent > m19["gradcomp/compression_ratio"] > 1, m19  # the whole run still counts the warm-up
    assert m19["gradcomp/recent_bytes_sent_per_step"] == (s19["bytes_sent"] - s9["bytes_sent"]) / 10, m19
    assert m19["gradcomp/guard_runaway"] == 0.0 and not meter.events, m19
    stateless = gc.metrics(comp.stats())
    assert stateless == {k: v for k, v in m19.items() if "recent" not in k}, stateless  # (no step since)
    assert set(gc.metrics(comp.stats(), prefix="x/")) == {"x/" + k[len("gradcomp/"):] for k in stateless}

    # a governed method over a tight budget: 8-bit codes everywhere after two back-offs (steps 49, 61)
    meter, lines = gc.Meter(), []

    def read(step, c):
        meter.update(c.stats())
        lines.extend(meter.events)

    comp = _reduce("topk:warmup=0,budget=0.05", comm, 70, read)
    stats, m = comp.stats(), gc.metrics(comp.stats())
    _well_formed(m)
    gov = stats["governor"]
    shares = {k: v for k, v in m.items() if k.startswith("gradcomp/rung_share_")}
    assert set(shares) == {"gradcomp/rung_share_method", "gradcomp/rung_share_int4", "gradcomp/rung_share_int8"}
    assert math.isclose(sum(shares.values()), 1.0), shares
    levels = list(gov["levels"].values())
    assert shares["gradcomp/rung_share_int8"] == levels.count("int8") / len(levels) > 0, (shares, gov)
    assert m["gradcomp/audit_cost"] == gov["audits"][-1][2] and m["gradcomp/audit_budget"] == 0.05, m
    assert m["gradcomp/audit_share"] == gov["audit_bytes"] / stats["bytes_sent"], m
    backed = [d for d in gov["decisions"] if d["cost"] > gov["limit"]]
    assert len(backed) >= 1 and len(lines) == len(backed), (lines, gov["decisions"])  # once each, read every step
    assert all(line.startswith("gradcomp: the governor moved") and " to int" in line for line in lines), lines
    assert gc.backoffs(None, stats) == lines and gc.backoffs(stats, stats) == []

    # onebit as shipped: governed, after a warm-up that ends when the gradients settle (step 60 here)
    stats = _reduce("onebit", comm, 70).stats()
    m = gc.metrics(stats)
    _well_formed(m)
    assert m["gradcomp/warmup_done"] == 1.0 and m["gradcomp/warmup_ended_at"] == stats["warmup_ended_at"], m
    assert m["gradcomp/rung_share_method"] + m["gradcomp/rung_share_int4"] + m["gradcomp/rung_share_int8"] == 1.0, m
    assert m["gradcomp/audit_cost"] == stats["governor"]["audits"][-1][2] and m["gradcomp/audit_budget"] == 1.0, m
    assert m["gradcomp/compression_ratio"] == stats["reference_bytes"] / stats["bytes_sent"] > 1, m

    # auto on one host: the first allowed method for every bucket, nothing measured
    m = gc.metrics(_reduce("auto", comm, 3).stats())
    _well_formed(m)
    assert m["gradcomp/auto_share_allreduce"] == 1.0 and m["gradcomp/compression_ratio"] == 1.0, m
    assert m["gradcomp/auto_probe_bytes"] == 0.0, m

    # DiLoCo: outer steps, its ratio against DDP's allreduce at every inner step
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    outer = gc.optim.DiLoCo(params, sync_every=3, compressor="int8", comm=comm)
    meter = gc.Meter()
    for step in range(1, 13):
        for p, g in zip(params, _grads(comm.rank, step)):
            p -= np.float32(0.01) * g
        outer.step()
        if step == 7:
            meter.update(outer.stats())
    m = meter.update(outer.stats())
    _well_formed(m)
    s = outer.stats()
    assert m["gradcomp/outer_steps"] == 4.0 and m["gradcomp/steps"] == 12.0, m
    assert m["gradcomp/compression_ratio"] == s["reference_bytes"] / s["bytes_sent"] > 1, m
    assert m["gradcomp/exchange_compression_ratio"] == s["exchange_compression_ratio"], m
    assert "gradcomp/recent_compression_ratio" in m  # one outer step (12) since step 7
    meter.update(outer.stats())  # no step since: nothing sent, no recent ratio
    assert "gradcomp/recent_compression_ratio" not in meter.update(outer.stats())

    # OneBitAdam: its warm-up, which ends when the gradients' scale settles, and its governor
    params = [np.zeros(s, np.float32) for s in SHAPES[:2]]
    opt = gc.optim.OneBitAdam(params, comm=comm)
    for step in range(80):
        opt.step([g + np.float32(1) for g in _grads(comm.rank, 0)[:2]])  # the same scale at every step
        if step == 9:
            early = gc.metrics(opt.stats())
    assert early["gradcomp/warmup_done"] == 0.0 and "gradcomp/warmup_ended_at" not in early, early
    m = gc.metrics(opt.stats())
    _well_formed(m)
    assert m["gradcomp/warmup_done"] == 1.0 and m["gradcomp/warmup_ended_at"] == opt.stats()["warmup_ended_at"] > 9, m
    assert m["gradcomp/rung_share_method"] == 1.0 and m["gradcomp/compression_ratio"] > 1, m
    print(f"rank {comm.rank}: ok", flush=True)
    comm.close()


def test_metrics_of_real_compressors():
    out = run_ranks(2, "tests.test_metrics:rank_metrics_of_real_compressors", timeout=240)
    assert "rank 0: ok" in out and "rank 1: ok" in out, out


def test_importing_gradcomp_metrics_imports_no_torch():
    import subprocess

    code = "import sys, gradcomp; gradcomp.metrics({}); from gradcomp.metrics import Meter; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"


# -- what a short run does not reach ---------------------------------------------------------------------------
def _governor(decisions=(), levels=None, audits=()):
    return {"budget": 1.0, "limit": 1.0, "levels": levels or {"a": "method", "b": "int8"},
            "tensor_steps": {"method": 5, "int4": 0, "int8": 5}, "last_cost": {}, "decisions": list(decisions),
            "audits": list(audits), "audit_bytes": 10.0, "audit_share": 0.1}


def test_guard_runaway_and_auto_change_are_told_once():
    import gradcomp as gc

    choice = {"bucket": 0, "numel": 10, "chosen": "int8", "why": "fastest predicted"}
    before = {"bytes_sent": 100.0, "guard": {"warned": False, "worst_tensor": "", "worst_ratio": 0.0},
              "choices": [choice, {**choice, "bucket": 1}]}
    now = {"bytes_sent": 200.0, "guard": {"warned": True, "worst_tensor": "w", "worst_ratio": 40.0},
           "choices": [{**choice, "chosen": "fp16", "why": "replanned"}, {**choice, "bucket": 1},
                       {**choice, "numel": 99, "chosen": "allreduce"}]}  # another layout: not a change
    lines = gc.backoffs(before, now)
    assert len(lines) == 2 and "bucket 0 (10 values) with fp16 instead of int8: replanned" in lines[0], lines
    assert "run away" in lines[1] and "'w', 40x" in lines[1], lines
    assert gc.backoffs(now, now) == []
    m = gc.metrics(now)
    assert m["gradcomp/guard_runaway"] == 1.0 and m["gradcomp/guard_worst_ratio"] == 40.0
    # bucket 0's latest layout chose allreduce, bucket 1 int8
    assert m["gradcomp/auto_share_allreduce"] == m["gradcomp/auto_share_int8"] == 0.5 and "gradcomp/auto_share_fp16" not in m


def test_governor_step_downs_within_budget_and_nested_stats():
    import gradcomp as gc

    down = {"step": 9, "tensors": ["a", "b"], "to": "int4", "cost": 3.0, "why": "over budget 1"}
    up = {"step": 20, "tensors": ["a"], "to": "method", "cost": 0.5, "why": "within budget 1"}
    runaway = {"step": 30, "tensors": ["a", "b", "c", "d"], "to": "one rung down", "cost": math.nan, "why": "the guard"}
    assert len(gc.backoffs(None, {"governor": _governor([down, up])})) == 1  # a kept try above is no back-off
    lines = gc.backoffs({"governor": _governor([down, up])}, {"governor": _governor([down, up, runaway])})
    assert lines == ["gradcomp: the governor moved tensor(s) 'a', 'b', 'c', ... to one rung down at step 30: the guard"]
    # Hierarchical nests its method's stats; DiLoCo's fragments each have a governor
    nested = {"bytes_sent": 100.0, "reference_bytes": 400.0, "compression_ratio": 4.0, "local_bytes_sent": 50.0,
              "inner": {"warmup_ended_at": None, "warmup": "auto", "governor": _governor(audits=[(5, 0, 2.0)])}}
    m = gc.metrics(nested)
    assert m["gradcomp/warmup_done"] == 0.0 and "gradcomp/warmup_ended_at" not in m, m
    assert m["gradcomp/rung_share_method"] == m["gradcomp/rung_share_int8"] == 0.5 and m["gradcomp/rung_share_int4"] == 0
    assert m["gradcomp/audit_cost"] == 2.0 and m["gradcomp/audit_share"] == 0.1 and m["gradcomp/local_bytes_sent"] == 50
    fragments = {"bytes_sent": 40.0, "governor": [_governor(levels={"a": "int4"}, audits=[(5, 0, 2.0), (9, 1, 0.5)]),
                                                  _governor(levels={"b": "method"}, audits=[(9, 0, 0.7)])]}
    m = gc.metrics(fragments)
    assert m["gradcomp/rung_share_int4"] == m["gradcomp/rung_share_method"] == 0.5, m
    assert m["gradcomp/audit_cost"] == 0.7 and m["gradcomp/audit_share"] == 0.5, m  # the worst at the latest step
    assert gc.metrics({"phase": "warm-up", "recipe": "int8()", "warned": True}) == {}  # no strings, no bools


@pytest.mark.parametrize("label,name", [("hier-int8", "auto_share_hier_int8"),
                                        ("powersgd:rank=4", "auto_share_powersgd_rank_4")])
def test_names_are_lower_snake_case(label, name):
    import gradcomp as gc

    assert list(gc.metrics({"choices": [{"bucket": 0, "numel": 1, "chosen": label}]})) == ["gradcomp/" + name]
