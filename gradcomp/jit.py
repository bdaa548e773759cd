"""Compiled element-wise kernels for half precision, through numba (LLVM), when it is installed.

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
payload bits may differ from NumPy's software cast.

``available()`` says whether the kernels compiled and passed a self-check on this machine; when
numba is missing or ``GRADCOMP_JIT=0``, callers use the NumPy kernels of ``gradcomp.halfcast``.
Kernels are compiled on first use and cached on disk by numba (``cache=True``).
"""
from __future__ import annotations

import os

import numpy as np

try:  # numba is an install requirement, but gradcomp must still import without it
    from llvmlite import ir
    from numba import njit, types
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised by GRADCOMP_JIT=0 instead
    njit = None  # type: ignore[assignment]  # no numba: no kernels (available() is False)

_ok = None


def available() -> bool:
    """True when the compiled kernels can be used (numba present, not disabled, self-check passed)."""
    global _ok
    if _ok is None:
        _ok = njit is not None and os.environ.get("GRADCOMP_JIT", "1") != "0" and _self_check()
    return _ok


if njit is not None:
    _kernel = njit(cache=True, boundscheck=False, nogil=True)

    @intrinsic
    def _f16_encode(typingctx, x):
        """float32 -> float16 bits, rounded to nearest even, by the hardware conversion."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))
        return types.uint16(types.float32), codegen

    @intrinsic
    def _f16_decode(typingctx, u):
        """float16 bits -> float32 (exact)."""
        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
        return types.float32(types.uint16), codegen

    @intrinsic
    def _f32_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(32))
        return types.uint32(types.float32), codegen

    @intrinsic
    def _f32_from_bits(typingctx, u):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())
        return types.float32(types.uint32), codegen

    @njit(inline="always")
    def _bf16_encode(x):
        """float32 -> bfloat16 bits, rounded to nearest even; NaN -> quiet NaN with x's sign (as
        ml_dtypes does)."""
        b = _f32_bits(x)
        if (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
            return np.uint16((b >> np.uint32(16)) & np.uint32(0x8000) | np.uint32(0x7FC0))
        return np.uint16((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1)))
                         >> np.uint32(16))

    @njit(inline="always")
    def _bf16_decode(u):
        return _f32_from_bits(np.uint32(u) << np.uint32(16))

    @_kernel
    def encode(x, out, bf16):
        """``out[:] = x`` rounded to half bits (uint16); x float32."""
        if bf16:
            for i in range(x.shape[0]):
                out[i] = _bf16_encode(x[i])
        else:
            for i in range(x.shape[0]):
                out[i] = _f16_encode(x[i])

    @_kernel
    def decode(u, out, bf16):
        """``out[:] = u`` widened to float32; u half bits (uint16)."""
        if bf16:
            for i in range(u.shape[0]):
                out[i] = _bf16_decode(u[i])
        else:
            for i in range(u.shape[0]):
                out[i] = _f16_decode(u[i])

    @_kernel
    def add_into(acc, other, bf16, sign):
        """``acc += sign * other`` on half bits (``sign`` = +-1.0, so subtraction too), each result
        computed in float32 and rounded once."""
        if bf16:
            for i in range(acc.shape[0]):
                acc[i] = _bf16_encode(_bf16_decode(acc[i]) + sign * _bf16_decode(other[i]))
        else:
            for i in range(acc.shape[0]):
                acc[i] = _f16_encode(_f16_decode(acc[i]) + sign * _f16_decode(other[i]))

    @_kernel
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


def _self_check() -> bool:
    """Compile the kernels and compare them with NumPy / ml_dtypes on every float16 and bfloat16
    value and on awkward float32 inputs; any failure (no F16C lowering, a numba bug) means the
    NumPy kernels are used instead."""
    try:
        import ml_dtypes

        every = np.arange(1 << 16, dtype=np.uint16)
        probe = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e9, -1e9, 5.96e-8, 2.98e-8, 1e-40,
                          np.inf, -np.inf, 1.00048828125, 3.0e-5, 0.1], np.float32)
        for name, dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
            bf16 = name == "bfloat16"
            halves = every.view(dtype)
            finite = np.isfinite(halves.astype(np.float32))
            wide = np.empty(every.shape, np.float32)
            decode(every, wide, bf16)
            if not np.array_equal(wide[finite].view(np.uint32),
                                  halves[finite].astype(np.float32).view(np.uint32)):
                return False
            narrow = np.empty(probe.shape, np.uint16)
            encode(probe, narrow, bf16)
            with np.errstate(all="ignore"):
                if not np.array_equal(narrow, probe.astype(dtype).view(np.uint16)):
                    return False
        return True
    except Exception:  # noqa: BLE001 - any failure to compile or run means "not available"
        return False
