"""The NumPy example and the demo table, run for real under mpiexec at 2 ranks.

The example trains on scikit-learn's digits; a short run must already classify most of the test
split, and every rank must end with bit-identical weights (the example gathers a SHA-256 of the
weights from every rank). A short cosine schedule makes two epochs enough for > 80 %. The
example's backprop is checked against finite differences, and it must not import torch or cupy.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.mpi_launch import ROOT, mpiexec

RANKS = 2


def run(cmd: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize("name", ["allreduce", "quantize-channel"])
def test_numpy_mlp_learns_and_ranks_agree(tmp_path, name):
    out = tmp_path / "summary.json"
    proc = run([mpiexec(), "-n", str(RANKS), sys.executable, "examples/numpy_mlp.py",
                "--compressor", name, "--epochs", "2", "--json", str(out)])
    s = json.loads(out.read_text())
    assert s["ranks"] == RANKS and s["compressor"] == name
    assert s["test_accuracy"] > 0.8, s["test_accuracy"]
    assert s["epoch_losses"][-1] < s["epoch_losses"][0]
    assert len(s["weight_digests"]) == RANKS and len(set(s["weight_digests"])) == 1, s["weight_digests"]
    assert s["weights_identical"]
    # Several buckets per step, so is_last and bucket indices are exercised; bytes were counted.
    assert s["last_epoch"]["bytes_sent_per_step"] > 0
    if name == "allreduce":
        assert s["last_epoch"]["compression_ratio"] == pytest.approx(1.0)
    else:
        assert s["last_epoch"]["compression_ratio"] > 1.5
    assert "test accuracy" in proc.stdout and "epoch   2" in proc.stdout


def test_demo_prints_one_table(tmp_path):
    """One row per method; differences within allreduce's own spread at another seed marked '~'
    (fp16 after one epoch is within it), and what auto picked named in its row and under the table."""
    out = tmp_path / "all.json"
    proc = run([sys.executable, "scripts/demo.py", "--compressors", "allreduce", "fp16", "auto",
                "--ranks", str(RANKS), "--noise-seeds", "1", "--json", str(out), "--", "--epochs", "1"])
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows] == ["method", "allreduce", "fp16", "auto (picked allreduce)"], \
        proc.stdout
    results = json.loads(out.read_text())
    fp16 = results["fp16"][0]
    assert fp16["last_epoch"]["compression_ratio"] == pytest.approx(2.0, rel=0.01)
    assert f"{100 * fp16['test_accuracy']:.2f}" in rows[2]
    other = results["allreduce at other seeds"][0]
    assert other["seed"] == 1 and other["test_images"] == results["allreduce"][0]["test_images"]
    assert "~" not in rows[1] and rows[2].count(" ~ ") == 2, rows  # loss and accuracy, both within the noise
    assert "Single seed. '~'" in proc.stdout and "auto picked allreduce for its" in proc.stdout, proc.stdout


def load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("numpy_mlp", ROOT / "examples" / "numpy_mlp.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_numpy_mlp_imports_no_torch_and_backprop_matches_finite_differences():
    code = ("import runpy, sys; runpy.run_path('examples/numpy_mlp.py'); "
            "assert 'torch' not in sys.modules and 'cupy' not in sys.modules, 'example pulled in torch/cupy'")
    run([sys.executable, "-c", code])

    mlp = load_example()
    import numpy as np

    rng = np.random.default_rng(1)
    params = [p.astype(np.float64) + 0.01 * rng.standard_normal(p.shape)
              for p in mlp.init_params(3, [64, 16, 16, 10])]
    x, y = rng.random((8, 64)), rng.integers(0, 10, 8)
    _, grads = mlp.loss_and_grads(params, x, y)
    eps = 1e-6
    for p, g in zip(params, grads):
        for idx in list(np.ndindex(p.shape))[:: max(1, p.size // 7)]:
            keep = p[idx]
            p[idx] = keep + eps
            up = mlp.loss_and_grads(params, x, y)[0]
            p[idx] = keep - eps
            down = mlp.loss_and_grads(params, x, y)[0]
            p[idx] = keep
            assert abs((up - down) / (2 * eps) - g[idx]) < 1e-6, (p.shape, idx)


def test_diloco_example_learns_and_ranks_agree(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "diloco.json"
    proc = run([mpiexec(), "-n", str(RANKS), sys.executable, "examples/diloco.py", "--epochs", "2",
                "--sync-every", "10", "--json", str(out)])
    s = json.loads(out.read_text())
    assert s["ranks"] == RANKS and s["weights_identical"]
    assert s["outer_steps"] == s["steps"] // 10 + 1, s  # every 10 steps, and sync_now at the end
    assert s["test_accuracy"] > 70, s["test_accuracy"]
    # one int8 exchange per 10 steps against an fp32 allreduce at every step: far more than 10x
    assert s["compression_ratio"] > 20, s
    assert "DiLoCo(sync_every=10" in proc.stdout and "weights identical on every rank: True" in proc.stdout


def test_numpy_mlp_names_the_optimizer_that_ran(tmp_path):
    """``--optimizer dgc`` ran DGC, not the unused ``--compressor`` default: the first line and the
    JSON say so."""
    out = tmp_path / "summary.json"
    proc = run([mpiexec(), "-n", str(RANKS), sys.executable, "examples/numpy_mlp.py", "--optimizer", "dgc",
                "--lr", "0.01", "--epochs", "1", "--json", str(out)])
    first = proc.stdout.splitlines()[0]
    assert first.startswith("dgc: DGC(") and "allreduce" not in first.split(" on ")[0], first
    s = json.loads(out.read_text())
    assert s["optimizer"] == "dgc" and s["config"].startswith("DGC("), s["config"]
