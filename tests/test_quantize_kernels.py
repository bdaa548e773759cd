"""The quantization kernels, compiled (``gradcomp.jit``, numba) and NumPy, bit for bit.

Both paths must give the documented reference sequence's bits (``test_bench``'s reference), and
the same bits as each other on the inputs where the reference leaves NumPy's choices open (which
zero ``min`` returns when a chunk holds +0 and -0), for every shape of chunking: per channel with
a tail, chunks wider than the NumPy block, per tensor, lengths 0 and 1.
"""
from __future__ import annotations

import numpy as np
import pytest

from gradcomp import jit
from gradcomp.compressors.quantize import kernels as quantize_module
from gradcomp.compressors.quantize.kernels import chunk_count, dequantize, quantize

from .test_bench import _quantize_cases, _reference_dequantize_add, _reference_quantize

COMPILED = jit.available()
PATHS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(
    not COMPILED, reason="numba kernels unavailable (numba missing or GRADCOMP_JIT=0)"))]
SHAPES = [(8, 512), (4, 512), (1, 512), (8, 3), (8, 100000), (8, 300000), (8, None)]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run a test on one path: 'numpy' hides the compiled kernels from quantize.py."""
    if request.param == "numpy":
        monkeypatch.setattr(quantize_module, "_compiled", lambda *a: None)
    return request.param


class _Quantizer:
    """The kernels with one chunk width (None: the whole vector) and bit count."""

    def __init__(self, bits, width):
        self.levels, self.width = (1 << bits) - 1, width

    def _width(self, n):
        return self.width or max(n, 1)

    def quantize(self, x):
        params = np.empty((2, chunk_count(x.size, self._width(x.size))), np.float32)
        codes = np.empty(x.size, np.uint8)
        quantize(x, params, codes, self._width(x.size), self.levels)
        return params, codes

    def dequantize_add(self, acc, params, codes):
        dequantize(acc, params, codes, self._width(acc.size), add=True)


def _make(bits, width):
    return _Quantizer(bits, width)


def _round_trip(q, x, acc):
    params, codes = q.quantize(x)
    acc = acc.copy()
    q.dequantize_add(acc, params, codes)
    return params, codes, acc


def _signed_zero_cases():
    """Chunks whose minimum or maximum is a zero held with both signs, and their neighbours."""
    rng = np.random.default_rng(5)
    cases = {}
    x = np.abs(rng.standard_normal(4096)).astype(np.float32)  # min is a zero in every chunk
    x[rng.integers(0, x.size, 300)] = 0.0
    x[rng.integers(0, x.size, 300)] = -0.0
    cases["min-zero"] = x
    cases["max-zero"] = -x
    cases["all-zeros"] = rng.choice(np.array([0.0, -0.0], np.float32), 3000)
    cases["minus-zeros"] = np.full(1500, -0.0, np.float32)
    x = rng.standard_normal(5000).astype(np.float32)
    x[::7] = -0.0
    cases["inner-zeros"] = x
    return cases


def _non_finite_runs():
    """NaN and Inf in runs of adjacent chunks, isolated chunks and the tail (each its own run of
    chunks for the NumPy fallback of the compiled path)."""
    rng = np.random.default_rng(6)
    x = rng.standard_t(2, 512 * 40 + 100).astype(np.float32)
    x[512 * 3 + 5: 512 * 7] = np.nan  # chunks 3..6
    x[512 * 9 + 1] = np.inf
    x[512 * 10 + 2] = -np.inf
    x[512 * 20] = -np.nan
    x[-3] = np.nan  # the tail
    y = np.full(512 * 4 + 1, np.inf, np.float32)
    y[::2] = -np.inf
    return {"nan-runs": x, "infinities": y, "all-nan": np.full(1025, np.nan, np.float32)}


@pytest.mark.parametrize("bits,width", SHAPES)
def test_each_path_matches_the_reference(path, bits, width):
    q = _make(bits, width)
    cases = {**_quantize_cases(), **_non_finite_runs(), "empty": np.zeros(0, np.float32),
             "one": np.array([1.5], np.float32)}
    for name, x in cases.items():
        acc0 = np.random.default_rng(3).standard_normal(x.size).astype(np.float32)
        params, codes, acc = _round_trip(q, x, acc0)
        ref_params, ref_codes = _reference_quantize(x, bits, width)
        assert np.array_equal(params.view(np.uint32), ref_params.view(np.uint32)), name
        assert np.array_equal(codes, ref_codes), name
        ref = acc0.copy()
        _reference_dequantize_add(ref, ref_params, ref_codes, width)
        assert np.array_equal(acc.view(np.uint32), ref.view(np.uint32)), name


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("bits,width", SHAPES)
def test_compiled_and_numpy_paths_give_the_same_bits(bits, width, monkeypatch):
    q = _make(bits, width)
    cases = {**_quantize_cases(), **_non_finite_runs(), **_signed_zero_cases()}
    for name, x in cases.items():
        acc0 = np.random.default_rng(4).standard_normal(x.size).astype(np.float32)
        acc0[::5] = -0.0
        with monkeypatch.context() as m:
            m.setattr(quantize_module, "_compiled", lambda *a: None)
            expected = _round_trip(q, x, acc0)
        got = _round_trip(q, x, acc0)
        for e, g, what in zip(expected, got, ("params", "codes", "acc")):
            assert e.dtype == g.dtype and e.shape == g.shape, (name, what)
            assert np.array_equal(e.view(np.uint8), g.view(np.uint8)), (name, what)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
def test_numpy_arrays_use_the_compiled_kernels(monkeypatch):
    from gradcomp.compressors.quantize import compiled

    calls = []
    for name in ("quantize_chunks", "dequantize_add_chunks"):
        kernel = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    q = _make(8, 512)
    x = np.arange(2000, dtype=np.float32)
    q.dequantize_add(np.zeros(2000, np.float32), *q.quantize(x))
    assert calls == ["quantize_chunks", "dequantize_add_chunks"]


def test_dequantize_add_takes_parameters_from_an_unaligned_message(path):
    """run() reads each sender's parameters as a float32 view into a uint8 message, which need
    not be 4-byte aligned."""
    q = _make(8, 512)
    x = np.random.default_rng(7).standard_t(2, 3000).astype(np.float32)
    params, codes = q.quantize(x)
    raw = np.zeros(1 + params.nbytes + codes.size, np.uint8)
    raw[1:1 + params.nbytes] = params.reshape(-1).view(np.uint8)
    raw[1 + params.nbytes:] = codes
    view = raw[1:1 + params.nbytes].view(np.float32).reshape(2, -1)
    acc = np.ones(x.size, np.float32)
    q.dequantize_add(acc, view, raw[1 + params.nbytes:])
    expected = np.ones(x.size, np.float32)
    _reference_dequantize_add(expected, params, codes, 512)
    assert np.array_equal(acc.view(np.uint32), expected.view(np.uint32))
