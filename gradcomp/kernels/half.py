"""float32 <-> float16/bfloat16 kernels and half-precision arithmetic on half bits (uint16).

NumPy has no hardware float16 arithmetic: ``astype(float16)``, ``+`` and ``/`` on float16 convert
one value at a time in C (numpy#28753), and bfloat16 (ml_dtypes) works the same way. Here each
kernel is one loop that LLVM compiles for this CPU: float16 <-> float32 become the conversion
instructions (F16C ``vcvtps2ph``/``vcvtph2ps`` on x86-64, native on AArch64) through LLVM's
``half`` type, bfloat16 is integer rounding, and the loops are vectorized. A decode, a float32
operation and an encode then cost about one memory pass instead of a dozen.

Bits: every result equals NumPy's (float16) or ml_dtypes' (bfloat16) for every finite and
infinite input; ``+``, ``/`` computed in float32 and rounded once are the correctly rounded
half-precision results (float32 has more than twice the half formats' precision plus two bits).
NaN stays NaN with its sign, but the hardware conversion quiets signalling NaNs, so a NaN's
payload bits may differ from NumPy's software cast. ``_wide`` and ``_values`` widen a gradient
given in half precision inside the chunk codes' kernels.
"""
from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from .primitives import (
    _f16_decode,
    _f16_encode,
    _f32_bits,
    _f32_from_bits,
    inline,
    kernel,
)


@inline
def _bf16_encode(x):
    """float32 -> bfloat16 bits, rounded to nearest even; NaN -> quiet NaN with x's sign (as
    ml_dtypes does)."""
    b = _f32_bits(x)
    if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((b >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0))
    return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                     >> np.uint32(16))


@inline
def _bf16_decode(u):
    return _f32_from_bits(np.uint32(u) << np.uint32(16))


@kernel
def encode(x, out, bf16):
    """``out[:] = x`` rounded to half bits (uint16); x float32."""
    if bf16:
        for i in range(x.shape[0]):
            out[i] = _bf16_encode(x[i])
    else:
        for i in range(x.shape[0]):
            out[i] = _f16_encode(x[i])


@kernel
def decode(u, out, bf16):
    """``out[:] = u`` widened to float32; u half bits (uint16)."""
    if bf16:
        for i in range(u.shape[0]):
            out[i] = _bf16_decode(u[i])
    else:
        for i in range(u.shape[0]):
            out[i] = _f16_decode(u[i])


@kernel
def add_into(acc, other, bf16, sign):
    """``acc += sign * other`` on half bits (``sign`` = +-1.0, so subtraction too), each result
    computed in float32 and rounded once."""
    if bf16:
        for i in range(acc.shape[0]):
            acc[i] = _bf16_encode(_bf16_decode(acc[i]) + sign * _bf16_decode(other[i]))
    else:
        for i in range(acc.shape[0]):
            acc[i] = _f16_encode(_f16_decode(acc[i]) + sign * _f16_decode(other[i]))


@kernel
def divide_in_place(u, divisor, bf16):
    """``u /= divisor`` on half bits; ``divisor`` a float32 that is exactly the half value
    NumPy would divide by. In place only: a loop from one array into another that may be the
    same array runs scalar code (LLVM's vector loop is guarded by a no-overlap check), about
    ten times slower, and in place is what the reductions need."""
    if bf16:
        for i in range(u.shape[0]):
            u[i] = _bf16_encode(_bf16_decode(u[i]) / divisor)
    else:
        for i in range(u.shape[0]):
            u[i] = _f16_encode(_f16_decode(u[i]) / divisor)


def _wide(v, bf16):
    """A gradient value as the kernels compute with it: floats as they are, half precision (its
    bits, uint16) widened to float32 (exact; ``bf16``: bfloat16, else float16)."""


@overload(_wide, inline="always")
def _wide_impl(v, bf16):
    if isinstance(v, types.Float):
        return lambda v, bf16: v
    if v == types.uint16:
        def widen(v, bf16):
            if bf16:
                return _bf16_decode(v)
            return _f16_decode(v)
        return widen
    return None


def _values(gs, xb, m, bf16):
    """The ``m`` values of ``gs`` as the 1-bit kernels compute with them: ``gs`` itself where it
    holds them already (float32 or float64 of ``xb``'s dtype: no copy), else widened into ``xb``
    (half precision, its uint16 bits) and ``xb``."""


@overload(_values, inline="always")
def _values_impl(gs, xb, m, bf16):
    if gs.dtype == xb.dtype:
        return lambda gs, xb, m, bf16: gs

    def widen(gs, xb, m, bf16):
        for i in range(m):
            xb[i] = _wide(gs[i], bf16)
        return xb
    return widen
