"""The kernels the benchmarks measure, correctness only (moved here from the benchmarks' tests).

* ``gradcomp.kernels.halfcast`` (behind ``arrays.cast``) is bit-identical to NumPy's float16 casts.
* The blocked NumPy quantization kernels are bit-identical to the documented reference sequence
  (its helpers serve tests/test_half_kernels.py and tests/test_quantize_kernels.py too).
"""
from __future__ import annotations

import numpy as np
import pytest

from gradcomp.arrays import cast
from gradcomp.compressors import QuantizePerChannel, QuantizePerTensor
from gradcomp.kernels import halfcast


# -- float16 kernels --------------------------------------------------------------------------------
def _awkward_float32_bits() -> np.ndarray:
    """Every float16 value as float32, the rounding midpoints between neighbours and the values one
    ulp either side, plus random bit patterns (NaN payloads, subnormals, huge values)."""
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    h = h.astype(np.int64)
    near = [h + d for d in (0, 1, -1, 1 << 12, (1 << 12) - 1, (1 << 12) + 1, 1 << 13, (1 << 13) - 1,
                            (1 << 13) + 1)]
    rng = np.random.default_rng(0)
    random_bits = rng.integers(0, 1 << 32, 1 << 20, dtype=np.int64)
    special = np.array([0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x7F802000, 0x7F801FFF,
                        0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x33000000, 0x33000001,
                        0x387FC000, 0x387FE000, 0x00000001, 0x80000000], dtype=np.int64)
    return (np.concatenate(near + [random_bits, special]) % (1 << 32)).astype(np.uint32)


def test_float32_to_float16_is_numpy_bit_for_bit():
    x = _awkward_float32_bits().view(np.float32)
    with np.errstate(all="ignore"):
        expected = x.astype(np.float16).view(np.uint16)
    got = halfcast.float32_to_float16(x).view(np.uint16)
    bad = np.flatnonzero(got != expected)
    assert bad.size == 0, [(hex(int(x.view(np.uint32)[i])), hex(int(expected[i])), hex(int(got[i])))
                           for i in bad[:5]]


def test_float16_to_float32_is_numpy_bit_for_bit():
    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    expected = every_half.astype(np.float32).view(np.uint32)
    assert np.array_equal(halfcast.float16_to_float32(every_half).view(np.uint32), expected)


@pytest.mark.parametrize("shape", [(0,), (5,), (halfcast.MIN_SIZE,), (3 * halfcast.CHUNK + 7,),
                                   (300, 257)])
def test_cast_dispatch_keeps_shape_and_values(shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_t(3, size=shape) * 1e-3).astype(np.float32)
    h = cast(x, np.float16)
    assert h.dtype == np.float16 and h.shape == x.shape
    assert np.array_equal(h.view(np.uint16), x.astype(np.float16).view(np.uint16))
    back = cast(h, "float32")
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.array_equal(back.view(np.uint32), h.astype(np.float32).view(np.uint32))
    assert x.flags.writeable and np.shares_memory(h, x) is False


def test_cast_of_a_strided_view_still_works():
    x = np.arange(200000, dtype=np.float32)[::2] / np.float32(1000)
    assert np.array_equal(cast(x, np.float16), x.astype(np.float16))


def _same_or_both_nan(a, b):
    """Bit-identical, except that which NaN payload survives a NaN + NaN is not specified."""
    return bool(np.all((a.view(np.uint16) == b.view(np.uint16)) | (np.isnan(a) & np.isnan(b))))


def test_half_divide_and_add_are_numpy_bit_for_bit():
    from gradcomp.arrays import add_into, divide

    every_half = np.arange(1 << 16, dtype=np.uint16).view(np.float16)
    rng = np.random.default_rng(4)
    with np.errstate(all="ignore"):
        for d in (2, 3, 4, 7, 1024):
            assert _same_or_both_nan(divide(every_half, d), every_half / np.float16(d)), d
        a = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16).view(np.float16)
        b = rng.integers(0, 1 << 16, 1 << 20, dtype=np.uint16).view(np.float16)
        expected = a + b
        acc = a.copy()
        assert add_into(acc, b) is acc
        assert _same_or_both_nan(acc, expected)
        small = np.ones(10, np.float16)  # below MIN_SIZE: plain NumPy
        assert np.array_equal(add_into(small, small), np.full(10, 2, np.float16))


# -- quantization kernels -----------------------------------------------------------------------------
def _reference_quantize(x, bits, width, zero=False):
    """The documented semantics, written plainly: per chunk offset = min, scale = (max-min)/levels,
    codes = clip(rint((x - offset) / scale)) with 1/scale computed once; non-finite -> code 0.
    ``zero``: the range widened to hold 0 (a zero of either sign as +0), scale = range / (levels -
    1), offset = -ceil(-min / scale) * scale (scale 1 in that division where it is 0), in float32."""
    levels = (1 << bits) - 1
    n = x.shape[0]
    width = width or max(n, 1)
    starts = list(range(0, n, width))
    params = np.empty((2, len(starts)), np.float32)
    codes = np.empty(n, np.uint8)
    with np.errstate(all="ignore"):
        for c, s in enumerate(starts):
            part = x[s:s + width]
            lo, hi = part.min(), part.max()
            if zero:
                lo, hi = np.float32(0.0 if lo >= 0 else lo), np.float32(0.0 if hi <= 0 else hi)
                scale = (hi - lo) / np.float32(levels - 1)
                lo = np.float32(0.0) - np.ceil(-lo / (scale if scale > 0 else np.float32(1.0))) * scale
                if not (np.isfinite(lo) and np.isfinite(scale)):
                    lo = scale = np.float32(np.nan)
            else:
                scale = (hi - lo) / np.float32(levels)
            inv = np.float32(1.0) / (scale if scale > 0 else np.float32(1.0))
            q = (part - lo) * inv
            q = np.clip(np.rint(q), 0, levels)
            q[~np.isfinite(q)] = 0
            codes[s:s + width] = q
            params[:, c] = lo, scale
    return params, codes


def _reference_dequantize_add(acc, params, codes, width):
    n = acc.shape[0]
    width = width or max(n, 1)
    with np.errstate(all="ignore"):
        for c, s in enumerate(range(0, n, width)):
            lo, scale = params[0, c], params[1, c]
            a = acc[s:s + width]
            a += codes[s:s + width] * scale
            a += lo
            if not (np.isfinite(lo) and np.isfinite(scale)):
                a[...] = np.nan


def _quantize_cases():
    rng = np.random.default_rng(2)
    cases = {f"t2-{n}": rng.standard_t(2, n).astype(np.float32) for n in (1, 7, 511, 512, 513, 70001, 600001)}
    x = rng.standard_t(2, 140000).astype(np.float32)
    x[[10, 5000, 90000]] = [np.nan, np.inf, -np.inf]
    cases["non-finite"] = x
    x = np.zeros(3000, np.float32)
    x[3] = 1e-40  # a subnormal range: 1/scale overflows
    cases["subnormal-range"] = x
    x = rng.standard_t(2, 3000).astype(np.float32)
    x[7], x[8] = 3e38, -3e38  # the range overflows
    cases["overflowing-range"] = x
    base = np.float32(1.0) + np.arange(4096, dtype=np.float32) * np.float32(2.0 ** -23)
    cases["few-ulp-ranges"] = rng.permutation(np.repeat(base, 3))  # ranges of a few ulp
    cases["constant"] = np.full(2000, 0.25, np.float32)
    return cases


def _kernel_quantize(x, bits, width):
    """(params, codes) from the quantizers' shared kernels (``kernels.affine``)."""
    from gradcomp.kernels.affine import chunk_count, quantize

    width = width or max(x.shape[0], 1)
    params = np.empty((2, chunk_count(x.shape[0], width)), np.float32)
    codes = np.empty(x.shape[0], np.uint8)
    quantize(x, params, codes, width, (1 << bits) - 1)
    return params, codes


def _kernel_dequantize_add(acc, params, codes, width):
    from gradcomp.kernels.affine import dequantize

    dequantize(acc, params, codes, width or max(acc.shape[0], 1), add=True)


@pytest.mark.parametrize("bits,width", [(8, 512), (4, 512), (1, 512), (8, 3), (8, 100000), (8, None)])
def test_quantize_kernels_match_the_reference_bit_for_bit(bits, width):
    for name, x in _quantize_cases().items():
        params, codes = _kernel_quantize(x, bits, width)
        ref_params, ref_codes = _reference_quantize(x, bits, width)
        assert np.array_equal(params.view(np.uint32), ref_params.view(np.uint32)), name
        assert np.array_equal(codes, ref_codes), name
        acc = np.random.default_rng(3).standard_normal(x.size).astype(np.float32)
        ref = acc.copy()
        _kernel_dequantize_add(acc, params, codes, width)
        _reference_dequantize_add(ref, ref_params, ref_codes, width)
        assert np.array_equal(acc.view(np.uint32), ref.view(np.uint32)), name


def test_quantizers_use_those_kernels():
    """The allgather quantizers' round trip through a message gives the kernels' bits."""
    x = _quantize_cases()["t2-70001"]
    for q, bits, width in ((QuantizePerChannel(8, 512), 8, 512), (QuantizePerTensor(4), 4, None)):
        message = np.empty(q.message_size(x.size), np.uint8)
        q.encode(x, message, None)
        out = np.empty_like(x)
        q.decode(message, out, None)
        params, codes = _kernel_quantize(x, bits, width)
        expected = np.zeros_like(x)
        _kernel_dequantize_add(expected, params, codes, width)
        assert np.array_equal(out.view(np.uint32), expected.view(np.uint32)), type(q).__name__
