"""examples/torch_lm.py, run for real under mpiexec at 2 ranks with a tiny model for a few steps.

The full-size run is benchmarks/scripts/convergence.py's job; here a 1-layer, 32-wide model with a 32-byte
context must already beat a uniform guess (ln 256 = 5.55 nats per byte) on the held-out split, end
with bit-identical weights on both ranks, and count the bytes it sent.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tests.mpi_launch import ROOT, mpiexec

pytest.importorskip("torch")

RANKS = 2
TINY = ["--steps", "12", "--eval-every", "6", "--layers", "1", "--d-model", "32", "--heads", "2",
        "--context", "32", "--batch-size", "8", "--val-windows", "32", "--corpus-mb", "0.3",
        "--warmup", "3", "--lr", "1e-2"]


@pytest.mark.parametrize("name, optimizer", [("allreduce", "adamw"), ("fp16", "adamw"), ("fp16", "sgd"),
                                             ("none", "adamw"), ("none", "onebitadam:warmup=100")])
def test_lm_example_learns_and_ranks_agree(tmp_path, name, optimizer):
    out = tmp_path / "lm.json"
    lr = ["--lr", "0.5"] if optimizer == "sgd" else []  # momentum SGD's step wants a larger rate
    cmd = [mpiexec(), "-n", str(RANKS), sys.executable, "examples/torch_lm.py", "--compressor", name,
           "--json", str(out), *TINY, "--optimizer", optimizer, *lr]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    s = json.loads(out.read_text())
    assert s["compressor"] == name and s["ranks"] == RANKS and s["steps"] == 12
    assert s["config"]["optimizer"] == optimizer
    assert [point[0] for point in s["val_curve"]] == [0, 6, 12]
    first, final = s["val_curve"][0][1], s["final_val_loss"]
    assert abs(first - math.log(256)) < 0.3, first  # small initial weights: close to uniform
    assert math.isfinite(final) and final < first - 0.5, s["val_curve"]
    assert len(s["train_loss_curve"]) == 2 and all(math.isfinite(l) for _, l in s["train_loss_curve"])
    assert s["weights_identical"] and len(set(s["weight_digests"])) == 1 and len(s["weight_digests"]) == RANKS
    assert s["bytes_sent_per_step"] > 0
    # (onebitadam:warmup=100: 12 steps of its int8 warm-up, about 4x)
    expected = 2.0 if name == "fp16" else 3.9 if optimizer.startswith("onebitadam") else 1.0
    assert s["compression_ratio"] == pytest.approx(expected, rel=0.02)
    if name in ("none", "allreduce") and expected == 1.0:  # DDP's own fp32 allreduce: every gradient, bandwidth-optimal
        assert s["bytes_sent_per_step"] == pytest.approx(2 * (RANKS - 1) / RANKS * 4 * s["parameters"])
    assert "final val loss" in proc.stdout
    # which ratio covers what: the second half, and the whole run's beside it
    assert s["traffic_steps"] == [6, 12], s["traffic_steps"]
    assert s["whole_run"]["compression_ratio"] == pytest.approx(s["stats"]["compression_ratio"])
    assert s["whole_run"]["bytes_sent_per_step"] == pytest.approx(s["stats"]["bytes_sent"] / 12)
    ran = (f"{optimizer} (gradcomp's optimizer: its own exchange)" if expected == 3.9 else
           f"{optimizer}, DDP's own fp32 allreduce" if name == "none" else f"{optimizer}, gradients averaged by {name}")
    assert s["method"] == ran and proc.stdout.count(ran) == 1, (s["method"], proc.stdout)
    assert "over the second half" in proc.stdout and "over the whole run" in proc.stdout
