"""Conformance suite: every registered compressor, on 1-4 real MPI ranks.

A compressor added to ``gradcomp.REGISTRY`` gets all of these checks without new test code:
output length and dtype, input untouched, bit-identical results on every rank, odd lengths
(0, 1, 511, 512, 513, a prime), a bucket with a layout, several steps (so stateful methods leave
their warm-up), every float dtype, NaN and Inf that neither desynchronize ranks nor break the next
bucket, and buckets whose length, dtype or buffer differ across ranks (a CollectiveError on every
rank, never a hang). Where the method's error is known analytically (``BOUNDS``) the result is also
compared with a float64 reference mean.
"""
from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np
import pytest

import gradcomp as gc
from tests.mpi_launch import run_ranks

LENGTHS = [0, 1, 511, 512, 513, 1009]
LAYOUT = [(24, 16), (16,), (6, 5, 4), (1, 9)]
STEPS = 14  # past the short warm-up of the registered PowerSGD variants
NAN_EFFECT = {  # what a NaN at one position does to the result (None: method-specific)
    "allreduce": "element", "allgather": "element", "fp16": "element", "bf16": "element",
    "quantize-channel": "chunk", "quantize-tensor": "bucket",
}


def eps_of(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps)


def tiny_of(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).smallest_subnormal)


def chunk_scales(inputs: np.ndarray, width: int | None) -> np.ndarray:
    """Per element: mean over ranks of half the quantization step of its chunk (8 bits)."""
    n = inputs.shape[1]
    width = width or max(n, 1)
    out = np.zeros(n)
    for start in range(0, n, width):
        part = inputs[:, start:start + width].astype(np.float32)
        step = (part.max(axis=1) - part.min(axis=1)).astype(np.float64) / 255
        out[start:start + width] = step.mean() / 2
    return out


def bound(name: str, inputs: np.ndarray, dtype) -> np.ndarray | None:
    """Largest allowed |result - float64 mean| per element, or None when not analytic."""
    n_ranks = inputs.shape[0]
    x = inputs.astype(np.float64)
    mean_abs = np.abs(x).sum(axis=0) / n_ranks
    if name in ("allreduce", "allgather"):
        return (n_ranks + 1) * eps_of(dtype) * mean_abs + n_ranks * tiny_of(dtype)
    if name in ("fp16", "bf16"):
        half = np.float16 if name == "fp16" else ml_dtypes.bfloat16
        return ((n_ranks + 2) * eps_of(half) + eps_of(dtype)) * mean_abs + 2 * n_ranks * tiny_of(half)
    if name.startswith("quantize"):
        width = 512 if name == "quantize-channel" else None
        peak = np.abs(x).max(initial=0.0)
        return chunk_scales(inputs, width) * 1.001 + 8 * eps_of(np.float32) * peak \
            + eps_of(dtype) * np.abs(x.mean(axis=0))
    return None


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def everyone(comm, value):
    return comm.comm.allgather(value)  # test-side check only; the library never pickles


def check_result(name, comm, inputs_local, out, dtype, where):
    assert out.dtype == np.dtype(dtype), f"{where}: dtype {out.dtype} != {dtype}"
    assert out.shape == inputs_local.shape, f"{where}: shape {out.shape} != {inputs_local.shape}"
    digests = everyone(comm, digest(out))
    assert len(set(digests)) == 1, f"{where}: ranks disagree: {digests}"
    inputs = np.stack(everyone(comm, inputs_local))
    limit = bound(name, inputs, dtype)
    if limit is not None and out.size:
        err = np.abs(out.astype(np.float64) - inputs.astype(np.float64).mean(axis=0))
        worst = int(np.argmax(err - limit))
        assert (err <= limit).all(), (
            f"{where}: error {err[worst]:.3g} > bound {limit[worst]:.3g} at {worst}")


# ---------------------------------------------------------------------------------------------
# rank-side checks
# ---------------------------------------------------------------------------------------------
def rank_lengths_and_steps(name):
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(100 + comm.rank)
    layout_n = sum(math.prod(s) for s in LAYOUT)
    for length in LENGTHS:
        comp = gc.make(name)
        for step in range(STEPS):
            a = rng.standard_normal(layout_n).astype(np.float32)
            b = rng.standard_t(4, length).astype(np.float32)
            a0, b0 = a.copy(), b.copy()
            fa = comp.reduce(gc.Bucket(a, 0, LAYOUT, is_last=False), comm)
            fb = comp.reduce(gc.Bucket(b, 1, is_last=True), comm)
            out_a, out_b = fa.result(), fb.result()
            assert np.array_equal(a, a0) and np.array_equal(b, b0), "input buffer was modified"
            check_result(name, comm, a, out_a, np.float32, f"{name} layout step {step}")
            check_result(name, comm, b, out_b, np.float32, f"{name} length {length} step {step}")
        stats = comp.stats()
        assert stats["calls"] == 2 * STEPS and stats["steps"] == STEPS
        if comm.size > 1:
            assert stats["bytes_sent"] > 0
        for key, value in comp.state_dict().items():  # numpy.savez-able: arrays and numbers
            assert isinstance(key, str) and isinstance(value, (np.ndarray, int, float, str, np.number)), key


def rank_dtypes(name):
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(7 + comm.rank)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float64):
        comp = gc.make(name)
        for step in range(STEPS):
            x = (rng.standard_normal(777) * 0.1).astype(dtype)
            out = comp.reduce(gc.Bucket(x, 0, [(37, 21)], is_last=True), comm).result()
            check_result(name, comm, x, out, dtype, f"{name} {np.dtype(dtype).name} step {step}")


def rank_non_finite(name):
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(3 + comm.rank)
    n, pos = 1500, 700  # pos lies in the second 512-value chunk
    effect = NAN_EFFECT.get(name)
    for bad in (np.nan, np.inf):
        comp = gc.make(name)
        for step in range(STEPS):
            x = rng.standard_normal(n).astype(np.float32)
            if comm.rank == comm.size - 1 and step == STEPS - 2:
                x[pos] = bad
            out = comp.reduce(gc.Bucket(x, 0, [(30, 50)], is_last=True), comm).result()
            assert len(set(everyone(comm, digest(out)))) == 1, f"{name}: ranks disagree after {bad}"
            if step != STEPS - 2 or effect is None:
                continue
            finite = np.isfinite(out)
            if effect == "element":
                expect_bad = np.arange(n) == pos
            elif effect == "chunk":
                expect_bad = np.arange(n) // 512 == pos // 512
            else:
                expect_bad = np.ones(n, bool)
            assert not finite[expect_bad].any(), f"{name}: {bad} did not propagate"
            assert finite[~expect_bad].all(), f"{name}: {bad} corrupted other values"
        # the step after: clean input gives clean output on every rank (unless state carries it)
        if effect is not None:
            assert np.isfinite(out).all()


def rank_mismatches(name):
    comm = gc.MPICommunicator()
    comp = gc.make(name)
    last = comm.size - 1
    good = np.ones(100, np.float32)
    cases = [  # (words the error must contain, what the last rank passes)
        ("length", np.ones(101, np.float32)),
        ("dtype", np.ones(100, np.float64)),
        ("cannot be a bucket", np.ones(100, np.int32)),
        ("cannot be a bucket", np.ones((10, 10), np.float32)),
        ("cannot be a bucket", np.ones(200, np.float32)[::2]),
    ]
    for words, odd in cases:
        x = odd if comm.rank == last else good
        if comm.size == 1 and words in ("length", "dtype"):
            continue  # nothing to disagree with
        with pytest.raises(gc.CollectiveError, match=words):
            comp.reduce(x, comm).result()
        # the communicator is still in step on every rank
        after = np.full(64, comm.rank, np.float32)
        out = comp.reduce(gc.Bucket(after), comm).result()
        assert len(set(everyone(comm, digest(out)))) == 1


# ---------------------------------------------------------------------------------------------
# pytest side
# ---------------------------------------------------------------------------------------------
NAMES = sorted(gc.REGISTRY)


@pytest.mark.parametrize("nranks", [1, 2, 3, 4])
@pytest.mark.parametrize("name", NAMES)
def test_lengths_layouts_steps(name, nranks):
    run_ranks(nranks, "tests.test_conformance:rank_lengths_and_steps", name, timeout=300)


@pytest.mark.parametrize("name", NAMES)
def test_float_dtypes(name):
    run_ranks(3, "tests.test_conformance:rank_dtypes", name)


@pytest.mark.parametrize("name", NAMES)
def test_nan_and_inf(name):
    run_ranks(3, "tests.test_conformance:rank_non_finite", name)


@pytest.mark.parametrize("nranks", [1, 3])
@pytest.mark.parametrize("name", NAMES)
def test_mismatch_raises_everywhere(name, nranks):
    run_ranks(nranks, "tests.test_conformance:rank_mismatches", name, timeout=60)
