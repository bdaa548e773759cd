"""Reduce-scatter buckets (``Bucket.scatter``): every method with a reduce-scatter form, on real
MPI ranks, against a float64 mean of each rank's row; its bytes against the codec's formula."""
from __future__ import annotations

import numpy as np
import pytest

import gradcomp as gc
from gradcomp.compressors.contract import parts
from tests.mpi_launch import run_ranks

#: registered names with a reduce-scatter form, and the largest relative error of one step's row
#: (per step for methods without error feedback; of the sum over the steps for those with it)
LOSSY = {"allreduce": 1e-6, "allgather": 1e-6, "fp16": 2e-3, "bf16": 1e-2, "quantize-channel": 2e-2,
         "quantize-tensor:warmup=0": 0.2, "int8:warmup=0": 5e-3, "int4:warmup=0": 5e-2,
         "onebit:warmup=0": 1.0, "topk:warmup=0": 0.8, "topk:stages=2,ratio=0.02,warmup=0": 0.8}
STEPS = 12
#: tensors straddling rows (the FSDP layout puts one shard of every parameter in each row)
SHAPES = [(700,), (33, 40), (5,), (1301,)]


def _inputs(rank, size, step, dtype):
    rng = np.random.default_rng(1000 * step + rank)
    n = sum(int(np.prod(s)) for s in SHAPES)
    n += -n % size
    x = rng.standard_normal(n) * np.linspace(0.1, 3.0, n)
    return x.astype(dtype)


def rank_scatter(name, dtype):
    comm = gc.MPICommunicator()
    size, rank = comm.size, comm.rank
    comp = gc.make(name)
    n = _inputs(0, size, 0, np.float64).shape[0]
    shapes = [*SHAPES, (n - sum(int(np.prod(s)) for s in SHAPES),)]
    keys = [f"t{i}" for i in range(len(shapes))]
    row = n // size
    mine = slice(rank * row, (rank + 1) * row)
    feedback = comp.error_feedback_on
    total_out = np.zeros(row)
    total_mean = np.zeros(row)
    worst = 0.0
    for step in range(STEPS):
        x = _inputs(rank, size, step, dtype)
        mean = np.mean([_inputs(r, size, step, dtype).astype(np.float64) for r in range(size)], axis=0)[mine]
        bucket = gc.Bucket(x.copy(), 0, shapes, True, scratch=step % 2 == 0, keys=keys, scatter=True)
        out = comp.reduce(bucket, comm).result()
        assert out.shape == (row,) and out.dtype == x.dtype, (out.shape, out.dtype)
        assert np.isfinite(out.astype(np.float64)).all()
        total_out += out.astype(np.float64)
        total_mean += mean
        if not feedback:
            worst = max(worst, np.abs(out - mean).max() / np.abs(mean).max())
    if feedback:
        worst = np.abs(total_out - total_mean).max() / np.abs(total_mean).max()
    assert worst <= LOSSY[name], f"{name} {dtype}: relative error {worst:.3g} > {LOSSY[name]}"
    stats = comp.stats()
    reference = (size - 1) / size * n * np.dtype(dtype).itemsize * STEPS
    assert abs(stats["reference_bytes"] - reference) <= 1e-6 * reference, (stats["reference_bytes"], reference)
    comm.close()


def rank_scatter_bytes(name):
    """int8/int4/onebit: an alltoall of one codec message per destination row, nothing else."""
    comm = gc.MPICommunicator()
    comp = gc.make(name)
    codec = [p for p in parts(comp) if isinstance(p, gc.compressors.codec.Codec)][0]
    n = 3 * 4096 * comm.size + 6 * comm.size
    bucket = gc.Bucket(np.ones(n, np.float32), scatter=True)
    comp.reduce(bucket, comm).result()
    sent = comp.stats()["bytes_sent"]
    expected = (comm.size - 1) * codec.message_size(n // comm.size)
    assert abs(sent - expected) <= 0.01 * expected, (name, sent, expected)
    comm.close()


def rank_scatter_refused():
    comm = gc.MPICommunicator()
    for name, words in [("powersgd", "no reduce-scatter form"), ("randomk", "no reduce-scatter form")]:
        try:
            gc.make(name).reduce(gc.Bucket(np.ones(6 * comm.size, np.float32), scatter=True), comm).result()
        except gc.CollectiveError as exc:
            assert words in str(exc), exc
        else:
            raise AssertionError(f"{name} reduce-scattered")
    try:
        gc.make("int8").reduce(gc.Bucket(np.ones(3 * comm.size + 1, np.float32), scatter=True), comm).result()
    except gc.CollectiveError as exc:
        assert "equal rows" in str(exc), exc
    else:
        raise AssertionError("an uneven reduce-scatter bucket was taken")
    comm.close()


@pytest.mark.parametrize("name", sorted(LOSSY))
def test_scatter_rows_against_the_float64_mean(name):
    run_ranks(3, "tests.compressors.test_scatter:rank_scatter", name, "float32", timeout=180)


@pytest.mark.parametrize("name", ["allreduce", "int8:warmup=0", "fp16"])
def test_scatter_other_dtypes(name):
    run_ranks(2, "tests.compressors.test_scatter:rank_scatter", name, "float64", timeout=180)


@pytest.mark.parametrize("name", ["int8:warmup=0", "int4:warmup=0", "onebit:warmup=0"])
def test_scatter_bytes_are_the_codec_messages(name):
    run_ranks(4, "tests.compressors.test_scatter:rank_scatter_bytes", name, timeout=180)


def test_methods_without_a_scatter_form_are_refused_on_every_rank():
    run_ranks(2, "tests.compressors.test_scatter:rank_scatter_refused", timeout=120)


def test_scatter_declarations():
    assert gc.make("int8").scatters and gc.make("fp16").scatters and gc.make("allreduce").scatters
    assert not gc.make("powersgd").scatters and not gc.make("fp16-powersgd").scatters
