"""Half casts: float32 <-> float16/bfloat16, the NumPy kernels and the one dispatch (``cast_kernel``)
that picks them, the compiled ones (``gradcomp.kernels.half``) or ``astype``.

NumPy float16 without NumPy's software cast:

NumPy's ``astype(float16)`` and back convert one value at a time in C (numpy#28753: its wheels
target a baseline without the F16C instructions), several times slower than a memcpy. PyTorch uses
the hardware instructions, but gradcomp must not need PyTorch. These kernels do the same IEEE
conversion with a handful of whole-array integer and float operations that NumPy runs with SIMD,
on chunks small enough to stay in the L2 cache, so each operation costs a fraction of a memory
pass.

The results are bit-identical to NumPy's cast for every input: round to nearest, ties to even;
subnormal halves; overflow to +-inf; NaN payloads kept the way NumPy keeps them (the top 10
mantissa bits, a NaN that would become Inf becomes 0x7c01). ``tests/kernels/test_kernels.py`` checks every
float16 value, the midpoints and their neighbours, and random float32 bit patterns.

The float32 -> float16 conversion follows the branch-free scheme of M. Dukhan's FP16 library
(fp16_ieee_from_fp32_value, MIT licence; the arithmetic is re-derived here, not copied): scale
|x| so that overflow becomes inf, then add a power of two chosen from x's exponent (floored at
float16's smallest normal) so that the FPU itself rounds to float16's precision, ties to even, for
normal and subnormal results alike; the float16 bits are then read off the sum with two masks.
No per-element selection means no data-dependent branches (a masked select between a "normal"
and a "subnormal" path is slow on gradients, where many values are tiny). float16 ->
float32 moves exponent and mantissa into place with a shift and rescales the exponent with one
float multiply by 2**112, which also normalizes subnormals exactly.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from . import load

#: Values per chunk: 64 Ki values = 256 KiB per uint32 scratch array, a few of which fit in L2.
CHUNK = 1 << 16

#: Below this many values NumPy's own cast is as fast (the chunk loop has a fixed Python cost).
MIN_SIZE = 1 << 14

#: Below this many values a compiled kernel call costs more than NumPy's own loop.
JIT_MIN = 256

_TO_INF = np.float32(2.0 ** 112)
_BACK = np.float32(2.0 ** -110)
_BIAS_FLOOR = np.uint32(0x38800000)  # 2**-14, float16's smallest normal, as float32 bits
_BIAS_SHIFT = np.uint32(0x07800000)  # + 15 in the exponent field
_F32_INF = np.uint32(0x7F800000)
_EXP_SCALE = np.float32(2.0 ** 112)


def float32_to_float16(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round a contiguous 1-D float32 array to float16 (bit-identical to ``x.astype(float16)``)."""
    bits = x.view(np.uint32)
    n = bits.shape[0]
    if out is None:
        out = np.empty(n, np.float16)
    result = out.view(np.uint16)
    size = min(CHUNK, n)
    mag, base, expo = (np.empty(size, np.uint32) for _ in range(3))
    with np.errstate(all="ignore"):
        for start in range(0, n, CHUNK):
            b = bits[start:start + CHUNK]
            k = b.shape[0]
            a, v, e = mag[:k], base[:k], expo[:k]
            vf = v.view(np.float32)
            np.bitwise_and(b, 0x7FFFFFFF, out=a)
            # |x| * 4, by way of 2**112 so that everything from 2**16 up overflows to inf
            np.multiply(a.view(np.float32), _TO_INF, out=vf)
            np.multiply(vf, _BACK, out=vf)
            # bias = 2**(E + 15), E = max(exponent of x, -14). 4|x| < 2**(E + 3) added to it keeps
            # 10 bits below its leading bit, so the FPU rounds |x| to float16's precision (ties to
            # even); with E floored at -14, subnormal results keep fewer bits, as they must
            np.bitwise_and(a, _F32_INF, out=e)
            np.maximum(e, _BIAS_FLOOR, out=e)
            np.add(e, _BIAS_SHIFT, out=e)
            np.add(e.view(np.float32), vf, out=vf)
            # the sum's low bits are the float16 exponent (bits 23-27 -> 10-14) and mantissa
            np.right_shift(v, 13, out=e)
            np.bitwise_and(e, 0x7C00, out=e)
            np.bitwise_and(v, 0x0FFF, out=v)
            np.add(e, v, out=e)
            if a.max() > _F32_INF:  # NaN present (rare): keep NumPy's payload rule
                _nan_payloads(a, e)
            np.right_shift(b, 16, out=v)
            np.bitwise_and(v, 0x8000, out=v)
            np.bitwise_or(e, v, out=e)
            np.copyto(result[start:start + k], e, casting="unsafe")
    return out


def _nan_payloads(a, r):
    """NaN keeps its top 10 mantissa bits, as NumPy does; one that would read as Inf gets 0x7c01."""
    nan = a > _F32_INF
    payload = np.uint32(0x7C00) + ((a[nan] & 0x7FFFFF) >> 13)
    payload[payload == 0x7C00] = 0x7C01
    r[nan] = payload


def float16_to_float32(h: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Widen a contiguous 1-D float16 array to float32 (bit-identical to ``h.astype(float32)``)."""
    u = h.view(np.uint16)
    n = u.shape[0]
    if out is None:
        out = np.empty(n, np.float32)
    result = out.view(np.uint32)
    size = min(CHUNK, n)
    value, sign = np.empty(size, np.uint32), np.empty(size, np.uint32)
    mask = np.empty(size, np.bool_)
    with np.errstate(all="ignore"):
        for start in range(0, n, CHUNK):
            c = u[start:start + CHUNK]
            k = c.shape[0]
            v, s, m = value[:k], sign[:k], mask[:k]
            np.left_shift(c, 13, out=v, dtype=np.uint32, casting="unsafe")
            np.bitwise_and(v, 0x8000 << 13, out=s)
            np.left_shift(s, 3, out=s)
            np.bitwise_and(v, 0x7FFF << 13, out=v)
            special = v.max() >= np.uint32(0x7C00 << 13)  # Inf/NaN present (rare)
            if special:
                np.greater_equal(v, np.uint32(0x7C00 << 13), out=m)
            # exponent bias 15 -> 127 and subnormals normalized, by one exact multiply
            np.multiply(v.view(np.float32), _EXP_SCALE, out=v.view(np.float32))
            if special:
                v[m] |= _F32_INF  # Inf/NaN: all exponent bits set, mantissa kept
            np.bitwise_or(v, s, out=result[start:start + k])
    return out


def numpy_vector(array: Any) -> bool:
    """Whether ``array`` is a contiguous NumPy array (what the kernels of this module take)."""
    return type(array) is np.ndarray and array.flags.c_contiguous


def half_name(dtype: Any) -> str | None:
    """'float16' or 'bfloat16' for a half-precision dtype, else None."""
    name = np.dtype(dtype).name
    return name if name in ("float16", "bfloat16") else None


def half_kind(x: Any, residual: Any) -> str | None:
    """'float16' or 'bfloat16' for a half-precision ``x`` with a float32 residual (what the
    compiled error-feedback kernels widen themselves), else None."""
    name = np.dtype(x.dtype).name
    return name if name in ("float16", "bfloat16") and residual.dtype == np.float32 else None


def compiled(array: Any) -> Any:
    """``gradcomp.kernels.half`` where it runs here and takes ``array`` (contiguous NumPy, at least
    ``JIT_MIN`` values), else None: the dispatch of the half-precision kernels, casts and
    element-wise alike. Asked only for half-precision work (numba is imported on first need)."""
    if array.size < JIT_MIN:
        return None
    return load("half", array)


def cast_kernel(array: Any, source: Any, target: np.dtype) -> Callable[[Any, Any], Any] | None:
    """The fast kernel ``(flat source, flat out)`` for converting ``array`` from ``source`` to
    ``target``, or None where ``astype`` is the way: compiled kernels for float32 <->
    float16/bfloat16, else this module's NumPy float16 kernels. Conversions that involve no half
    type never reach ``compiled``, which would import numba."""
    if source == target or not (half_name(source) or half_name(target)) or not numpy_vector(array):
        return None
    jit = compiled(array)
    if jit is not None:
        if source == np.float32 and half_name(target):
            return lambda x, out: jit.encode(x, out.view(np.uint16), target.name == "bfloat16")
        if half_name(source) and target == np.float32:
            return lambda x, out: jit.decode(x.view(np.uint16), out, source.name == "bfloat16")
    elif array.size >= MIN_SIZE:
        if source == np.float32 and target == np.float16:
            return float32_to_float16
        if source == np.float16 and target == np.float32:
            return float16_to_float32
    return None
