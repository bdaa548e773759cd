"""The compiled half-precision kernels (``gradcomp.kernels.half``) and their dispatch
(``gradcomp.kernels.halfcast``, ``elementwise``) behind ``gradcomp.arrays``.

Every result must carry NumPy's (float16) or ml_dtypes' (bfloat16) bits, with one documented
exception: the hardware conversion quiets signalling NaNs, so only NaN-ness and sign are compared
for NaN. Each dispatch test runs twice: with the compiled kernels and with them switched off (the
NumPy fallback a machine without numba gets).
"""
from __future__ import annotations

import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

from gradcomp import arrays, kernels
from gradcomp.kernels import halfcast

if kernels.available():
    from gradcomp.kernels import half as jit
from tests.kernels.test_kernels import _awkward_float32_bits

HALVES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}

needs_jit = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable here")


@pytest.fixture(params=["jit", "numpy"])
def backend(request, monkeypatch):
    """Run a test with the compiled kernels, then with the NumPy fallback."""
    if request.param == "jit" and not kernels.available():
        pytest.skip("numba kernels unavailable here")
    if request.param == "numpy":  # the one dispatch of the half kernels, casts and element-wise
        monkeypatch.setattr(halfcast, "compiled", lambda array: None)
    return request.param


def _same_bits_or_both_nan(got, expected, sign=True):
    """Equal bit patterns, or NaN on both sides (with the same sign, if ``sign``: arithmetic on
    two NaNs may return either one's)."""
    g, e = got.view(np.uint16), expected.view(np.uint16)
    gf, ef = got.astype(np.float32), expected.astype(np.float32)
    nan = np.isnan(gf) & np.isnan(ef) & ((np.signbit(gf) == np.signbit(ef)) | (not sign))
    bad = np.flatnonzero((g != e) & ~nan)
    return bad.size == 0, [(int(i), hex(int(e[i])), hex(int(g[i]))) for i in bad[:5]]


@needs_jit
@pytest.mark.parametrize("name", sorted(HALVES))
def test_encode_and_decode_match_numpy_on_every_value(name):
    dtype = HALVES[name]
    bf16 = name == "bfloat16"
    x = _awkward_float32_bits().view(np.float32)
    got = np.empty(x.shape, np.uint16)
    jit.encode(x, got, bf16)
    with np.errstate(all="ignore"):
        expected = x.astype(dtype)
    ok, bad = _same_bits_or_both_nan(got.view(dtype), expected)
    assert ok, bad
    every = np.arange(1 << 16, dtype=np.uint16)
    wide = np.empty(every.shape, np.float32)
    jit.decode(every, wide, bf16)
    ref = every.view(dtype).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(wide[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    assert np.isnan(wide[nan]).all() and np.array_equal(np.signbit(wide[nan]), np.signbit(ref[nan]))


@pytest.mark.parametrize("name", sorted(HALVES))
@pytest.mark.parametrize("shape", [(0,), (7,), (255,), (256,), (1 << 16,), (3 * 65536 + 7,), (300, 257)])
def test_cast_dispatch(backend, name, shape):
    dtype = HALVES[name]
    rng = np.random.default_rng(sum(shape))
    x = (rng.standard_t(3, size=shape) * 1e-3).astype(np.float32)
    x.reshape(-1)[:4] = [np.inf, -np.inf, 1e30, -1e-30][: x.size]
    with np.errstate(all="ignore"):
        h = arrays.cast(x, dtype)
        assert h.dtype == dtype and h.shape == x.shape
        assert np.array_equal(h.view(np.uint16), x.astype(dtype).view(np.uint16))
        back = arrays.cast(h, np.float32)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.array_equal(back.view(np.uint32), h.astype(np.float32).view(np.uint32))
    assert not np.shares_memory(h, x)


@pytest.mark.parametrize("name", sorted(HALVES))
def test_add_subtract_divide_match_numpy(backend, name):
    dtype = HALVES[name]
    rng = np.random.default_rng(5)
    a = rng.integers(0, 1 << 16, 1 << 18, dtype=np.uint16).view(dtype)
    b = rng.integers(0, 1 << 16, 1 << 18, dtype=np.uint16).view(dtype)
    before = a.copy()
    with np.errstate(all="ignore"):
        for op, ref in ((arrays.add_into, a + b), (arrays.subtract_into, a - b)):
            acc = a.copy()
            assert op(acc, b) is acc
            ok, bad = _same_bits_or_both_nan(acc, ref, sign=False)
            assert ok, (op.__name__, bad)
        for d in (2, 3, 4, 7, 1024):
            ok, bad = _same_bits_or_both_nan(arrays.divide(a, d), a / dtype(d), sign=False)
            assert ok, (d, bad)
            inplace = a.copy()  # in place, and out of place above (copy, then in place)
            assert arrays.divide(inplace, d, out=inplace) is inplace
            ok, bad = _same_bits_or_both_nan(inplace, a / dtype(d), sign=False)
            assert ok, ("in place", d, bad)
    assert np.array_equal(a.view(np.uint16), before.view(np.uint16))  # divide leaves its input


def test_gradcomp_jit_0_switches_the_kernels_off():
    code = ("import numpy as np; from gradcomp import arrays; "
            "arrays.cast(np.ones(4096, np.float32), np.float16); "
            "from gradcomp.kernels import halfcast; "
            "print(halfcast.compiled(np.ones(4096, np.float32)) is None, 'numba' in __import__('sys').modules)")
    env = dict(os.environ, GRADCOMP_JIT="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "True"


def test_float32_work_never_imports_numba():
    """numba costs a good fraction of a second to import: only half-precision work loads it."""
    code = ("import sys, numpy as np; from gradcomp import arrays, compressors; "
            "x = np.ones(4096, np.float32); arrays.cast(x, np.float64); arrays.divide(x, 3); "
            "print('numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
