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
    njit = None

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


# -- int8 affine quantization (gradcomp.compressors.quantize) -----------------------------------------
# Appended in its own block: the quantize kernels are independent of the half-precision ones above.
if njit is not None:
    _INF_KEY = np.int32(0x7F800000)  # order key (below) of +inf
    _NEG_INF_KEY = np.int32(-0x7F800001)  # and of -inf

    @njit(inline="always")
    def _order_key(b):
        """float32 bits (as int32) -> an int32 that sorts like the float (-0 just below +0, NaNs
        beyond the infinities); its own inverse. Integer min/max vectorize and have no NaN or
        signed-zero ambiguity, unlike float comparisons."""
        return b ^ ((b >> np.int32(31)) & np.int32(0x7FFFFFFF))

    @_kernel
    def _has_both_zeros(bits):
        """True when ``bits`` (float32 as int32) hold both +0.0 and -0.0."""
        plus = minus = False
        for i in range(bits.shape[0]):
            plus |= bits[i] == np.int32(0)
            minus |= bits[i] == np.int32(-0x80000000)
        return plus and minus

    @_kernel
    def quantize_chunks(x, bits, width, levels, params, codes, redo):
        """Per-chunk affine quantization of float32 ``x`` (``bits`` is x viewed as int32) in one
        pass per chunk: ``params[0] = min``, ``params[1] = (max - min) / levels``, codes =
        clip(rint((x - min) * (1 / scale)), 0, levels) as uint8 (1 instead of 1/scale where scale
        is not > 0) -- the float32 operations of the NumPy kernels, in the same order.

        Chunks whose result this loop cannot promise bit for bit are marked ``redo[c] = True`` and
        left to the NumPy kernels: a NaN or Inf (NaN payloads and the flags follow NumPy's
        sequence), a range whose scale or inverse is not finite, and a chunk whose minimum or
        maximum is a zero held with both signs (NumPy's SIMD min may return either zero).
        Returns how many chunks were marked.

        The inner loops run over per-chunk slices from 0 to their length: LLVM vectorizes that
        form, not a loop over ``range(start, stop)`` of the whole array (8x slower here)."""
        redone = 0
        top = np.float32(levels)
        for c in range(params.shape[1]):
            start = c * width
            xs = x[start:start + width]
            bs = bits[start:start + width]
            cs = codes[start:start + width]
            kmin = np.int32(0x7FFFFFFF)
            kmax = np.int32(-0x80000000)
            for i in range(bs.shape[0]):
                k = _order_key(bs[i])
                kmin = min(kmin, k)
                kmax = max(kmax, k)
            lo = _f32_from_bits(np.uint32(_order_key(kmin) & 0xFFFFFFFF))
            hi = _f32_from_bits(np.uint32(_order_key(kmax) & 0xFFFFFFFF))
            scale = (hi - lo) / top
            inv = np.float32(1.0) / (scale if scale > np.float32(0.0) else np.float32(1.0))
            params[0, c] = lo
            params[1, c] = scale
            bad = not (kmax < _INF_KEY and kmin > _NEG_INF_KEY
                       and np.isfinite(scale) and np.isfinite(inv))
            if not bad and (kmin == np.int32(-1) or kmax == np.int32(0)):  # an extreme is -0 or +0
                bad = _has_both_zeros(bs)
            if bad:
                redo[c] = True
                redone += 1
                continue
            for i in range(xs.shape[0]):
                q = np.rint((xs[i] - lo) * inv)
                cs[i] = np.uint8(min(max(q, np.float32(0.0)), top))
        return redone

    @_kernel
    def dequantize_add_chunks(acc, params, codes, width):
        """``acc += codes * scale`` then ``acc += offset`` per chunk, as two float32 roundings
        (the NumPy kernels' sequence, no fused multiply-add); chunks whose offset or scale is not
        finite become NaN. Per-chunk slices, as in ``quantize_chunks``."""
        for c in range(params.shape[1]):
            start = c * width
            a = acc[start:start + width]
            cs = codes[start:start + width]
            lo = params[0, c]
            scale = params[1, c]
            if not (np.isfinite(lo) and np.isfinite(scale)):
                a[:] = np.float32(np.nan)
                continue
            for i in range(a.shape[0]):
                a[i] = (a[i] + np.float32(cs[i]) * scale) + lo
