"""The steps the chunk codes' kernels share (``quantize``, ``quantize64``): a chunk's range from
order keys, its codes (and residual), 4-bit packing, and the rows of the slice owner's stage.

The operations of the NumPy kernels (``kernels.affine``) in the same order, one
chunk of 512 values at a time while it is in the L1 cache, so the bits are the same.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .primitives import _f32_from_bits, _max32, _min32, inline, kernel

_INF_KEY = np.int32(0x7F800000)  # order key (below) of +inf
_NEG_INF_KEY = np.int32(-0x7F800001)  # and of -inf

#: chunk ``redo`` marks (float64 kernels): left to NumPy, and why
REDO_BAD = 1        # a non-finite offset, scale or inverse: NumPy's whole block takes the reference path
REDO_TIE = 2        # an extreme that is a zero held with both signs (NumPy picks the zero)
REDO_ROUNDING = 3   # finite, but the rounding shortcut and the reference differ here: depends on the block


@intrinsic
def _order_key(typingctx, b):
    """float32 bits (as int32) -> an int32 that sorts like the float (-0 just below +0, NaNs
    beyond the infinities); its own inverse. Integer min/max vectorize and have no NaN or
    signed-zero ambiguity, unlike float comparisons. In 32-bit arithmetic (numba's own integer
    operators widen to 64 bits, which halves the vector lanes)."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        sign = builder.ashr(args[0], ir.Constant(i32, 31))
        return builder.xor(args[0], builder.and_(sign, ir.Constant(i32, 0x7FFFFFFF)))
    return types.int32(types.int32), codegen


@intrinsic
def _key_of(typingctx, x):
    """``_order_key`` of a float32 value's bits."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        sign = builder.ashr(bits, ir.Constant(i32, 31))
        return builder.xor(bits, builder.and_(sign, ir.Constant(i32, 0x7FFFFFFF)))
    return types.int32(types.float32), codegen


@inline
def _order_key64(b):
    """``_order_key`` of float64 bits (as int64)."""
    return b ^ ((b >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF))


def _zeros_of(bits):
    """(+0.0, -0.0) as the bits of ``bits``' values (float32 as int32, float64 as int64)."""


@overload(_zeros_of, inline="always")
def _zeros_of_impl(bits):
    if bits.dtype == types.int32:
        return lambda bits: (np.int32(0), np.int32(-0x80000000))
    return lambda bits: (np.int64(0), np.int64(-0x7FFFFFFFFFFFFFFF - 1))


@kernel
def _has_both_zeros(bits):
    """True when ``bits`` (float32 as int32, float64 as int64) hold both +0.0 and -0.0."""
    plus_zero, minus_zero = _zeros_of(bits)
    plus = minus = False
    for i in range(bits.shape[0]):
        plus |= bits[i] == plus_zero
        minus |= bits[i] == minus_zero
    return plus and minus


@inline
def _keys(xs, n):
    """The smallest and largest order key of ``xs[:n]`` (float32)."""
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    for i in range(n):
        kmin, kmax = _key_range(xs[i], kmin, kmax)
    return kmin, kmax


@inline
def _zero_grid32(lo, hi, top):
    """``kernels._zero_grid`` of one chunk: (offset, scale) of ``top - 1`` steps across the range
    widened to hold 0, the offset a whole number of steps below it; the same float32 operations.
    Either zero becomes +0, so an extreme held as both zeros is no tie here; a non-finite chunk
    is left to NumPy, which writes its canonical NaN pair."""
    zero = np.float32(0.0)
    lo = zero if lo >= zero else lo
    hi = zero if hi <= zero else hi
    scale = (hi - lo) / (top - np.float32(1.0))
    below = np.float32(np.ceil(-lo / (scale if scale > zero else np.float32(1.0))))
    return zero - below * scale, scale


@inline
def _range_of(kmin, kmax, top, bs, zero):
    """(offset, scale, 1/scale or 1, whether the NumPy kernels must redo the chunk) of a chunk
    whose order keys run from ``kmin`` to ``kmax`` (``bs``: its float32 bits as int32): the
    minimum and maximum, scale = range / levels (``zero``: ``_zero_grid32``). A chunk is redone
    for a NaN or Inf, a scale or inverse that is not finite, and an extreme that is a zero held
    with both signs (NumPy's SIMD min may return either zero)."""
    lo = _f32_from_bits(np.uint32(_order_key(kmin)))
    hi = _f32_from_bits(np.uint32(_order_key(kmax)))
    if zero:
        lo, scale = _zero_grid32(lo, hi, top)
    else:
        scale = (hi - lo) / top
    inv = np.float32(1.0) / (scale if scale > np.float32(0.0) else np.float32(1.0))
    bad = not (kmax < _INF_KEY and kmin > _NEG_INF_KEY and np.isfinite(scale) and np.isfinite(inv))
    if not bad and not zero and (kmin == np.int32(-1) or kmax == np.int32(0)):
        bad = _has_both_zeros(bs)  # (the zero grid makes either zero +0: no tie to redo)
    return lo, scale, inv, bad


@inline
def _codes(xs, cs, n, lo, inv, top):
    """``cs = clip(rint((x - min) * (1 / scale)), 0, levels)`` as uint8. ``n`` is passed, not
    read from a slice: LLVM vectorizes the fused callers' loops only with one shared bound."""
    zero = np.float32(0.0)
    for i in range(n):
        cs[i] = np.uint8(min(max(np.rint((xs[i] - lo) * inv), zero), top))


@inline
def _codes_and_error(xs, es, cs, n, lo, scale, inv, top):
    """``_codes`` and, in the same loop, ``es = xs - (code * scale + offset)``: the residual from
    the chunk's own codes decoded as ``dequantize_chunks`` does into a zeroed array (the code as a
    float is the clipped value itself: a whole number in [0, levels], never -0)."""
    zero = np.float32(0.0)
    for i in range(n):
        v = xs[i]
        q = min(max(np.rint((v - lo) * inv), zero), top)
        cs[i] = np.uint8(q)
        es[i] = v - ((zero + q * scale) + lo)


def _bytes(*arrays: types.Type) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.uint8 for a in arrays)


@intrinsic
def _pack4_groups(typingctx, cs, groups, out):
    """``out[16g:16g + 16]`` = the 32 codes ``cs[32g:32g + 32]`` two to a byte (even index in
    the low nibble) for ``g < groups``: two shuffles, a shift and an or per 32 codes. Both arrays
    contiguous from their first element."""
    if not _bytes(cs, out):
        return None

    def codegen(context, builder, signature, args):
        i8, i32 = ir.IntType(8), ir.IntType(32)
        v32, v16 = ir.VectorType(i8, 32), ir.VectorType(i8, 16)
        cdata = context.make_array(signature.args[0])(context, builder, args[0]).data
        odata = context.make_array(signature.args[2])(context, builder, args[2]).data
        even = ir.Constant(ir.VectorType(i32, 16), list(range(0, 32, 2)))
        odd = ir.Constant(ir.VectorType(i32, 16), list(range(1, 32, 2)))
        four = ir.Constant(v16, [4] * 16)
        with cgutils.for_range(builder, args[1]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, 32))
            v = builder.load(builder.bitcast(builder.gep(cdata, [at]), v32.as_pointer()), align=1)
            lo = builder.shuffle_vector(v, v, even)
            hi = builder.shuffle_vector(v, v, odd)
            packed = builder.or_(lo, builder.shl(hi, four))
            to = builder.mul(loop.index, ir.Constant(loop.index.type, 16))
            builder.store(packed, builder.bitcast(builder.gep(odata, [to]), v16.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(cs, groups, out), codegen


@intrinsic
def _unpack4_groups(typingctx, ps, groups, cs):
    """The inverse of ``_pack4_groups``: 32 codes from every 16 bytes."""
    if not _bytes(ps, cs):
        return None

    def codegen(context, builder, signature, args):
        i8, i32 = ir.IntType(8), ir.IntType(32)
        v32, v16 = ir.VectorType(i8, 32), ir.VectorType(i8, 16)
        pdata = context.make_array(signature.args[0])(context, builder, args[0]).data
        cdata = context.make_array(signature.args[2])(context, builder, args[2]).data
        mix = ir.Constant(ir.VectorType(i32, 32), [k // 2 + 16 * (k % 2) for k in range(32)])
        with cgutils.for_range(builder, args[1]) as loop:
            at = builder.mul(loop.index, ir.Constant(loop.index.type, 16))
            b = builder.load(builder.bitcast(builder.gep(pdata, [at]), v16.as_pointer()), align=1)
            lo = builder.and_(b, ir.Constant(v16, [15] * 16))
            hi = builder.lshr(b, ir.Constant(v16, [4] * 16))
            to = builder.mul(loop.index, ir.Constant(loop.index.type, 32))
            builder.store(builder.shuffle_vector(lo, hi, mix),
                          builder.bitcast(builder.gep(cdata, [to]), v32.as_pointer()), align=1)
        return context.get_dummy_value()
    return types.none(ps, groups, cs), codegen


@inline
def _pack4(cs, n, out):
    """Codes ``cs[:n]`` two to a byte into ``out`` (even index in the low nibble; an odd last code
    alone in its byte), as ``kernels.pack4`` of the codes padded with a zero."""
    groups = n // 32
    _pack4_groups(cs, groups, out)
    for j in range(16 * groups, n // 2):
        out[j] = cs[2 * j] | (cs[2 * j + 1] << np.uint8(4))
    if n % 2:
        out[n // 2] = cs[n - 1]


@inline
def _unpack4(ps, n, cs):
    """The inverse of ``_pack4``: ``n`` codes from ``ps`` into ``cs``."""
    groups = n // 32
    _unpack4_groups(ps, groups, cs)
    for j in range(16 * groups, n // 2):
        byte = ps[j]
        cs[2 * j] = byte & np.uint8(15)
        cs[2 * j + 1] = byte >> np.uint8(4)
    if n % 2:
        cs[n - 1] = ps[n // 2] & np.uint8(15)


@inline
def _codes_of(codes, ctmp, start, n, packed):
    """Where a chunk's codes are written first: the message itself (8-bit), or ``ctmp`` (packed
    after, ``_pack4``)."""
    if packed:
        return ctmp
    return codes[start:start + n]


@inline
def _packed_part(codes, start, n):
    return codes[start // 2:start // 2 + (n + 1) // 2]


@inline
def _decode_into(a, cs, n, scale, lo, add, zero):
    """``a (+)= codes * scale + offset`` over ``n`` values: ``a + code * scale`` then ``+ offset``,
    two roundings in ``a``'s dtype (the product in float32; the NumPy kernels' sequence, no fused
    multiply-add); writing is adding to ``zero`` (of ``a``'s dtype). Every decoder's loop: ``add``
    is a constant in most callers, and a branch around the two loops elsewhere."""
    if add:
        for i in range(n):
            a[i] = (a[i] + np.float32(cs[i]) * scale) + lo
    else:
        for i in range(n):
            a[i] = (zero + np.float32(cs[i]) * scale) + lo


@inline
def _key_range(v, kmin, kmax):
    """(kmin, kmax) widened to hold float32 ``v``'s order key."""
    k = _key_of(v)
    return _min32(kmin, k), _max32(kmax, k)


@inline
def _encode_chunk(xs, es, n, kmin, kmax, bits, top, zero, feedback, params, c, codes, ctmp, start, packed):
    """Chunk ``c`` of float32 values ``xs`` whose order keys run from ``kmin`` to ``kmax``
    (``bits``: its float32 bits as int32): its offset and scale into ``params``, its codes into
    ``codes`` (packed where ``packed``) and, with ``feedback``, ``es`` = its error. True (and
    nothing but ``params`` written) where the NumPy kernels must redo the chunk (``_range_of``)."""
    lo, scale, inv, bad = _range_of(kmin, kmax, top, bits, zero)
    params[0, c] = lo
    params[1, c] = scale
    if bad:
        return True
    cs = _codes_of(codes, ctmp, start, n, packed)
    if feedback:
        _codes_and_error(xs, es, cs, n, lo, scale, inv, top)
    else:
        _codes(xs, cs, n, lo, inv, top)
    if packed:
        _pack4(cs, n, _packed_part(codes, start, n))
    return False


@inline
def _keep_error(xs, es, cs, n, lo, scale):
    """``es = xs - (codes * scale + offset)``: the residual from the chunk's own codes, decoded
    as ``dequantize_chunks`` does into a zeroed array (float64 chunks)."""
    zero = np.zeros(1, es.dtype)[0]
    for i in range(n):
        es[i] = xs[i] - ((zero + np.float32(cs[i]) * scale) + lo)


@inline
def _row_codes(rows, r, base, start, n, packed, ctmp):
    """Row ``r``'s codes of values ``start:start + n`` (unpacked into ``ctmp`` where packed)."""
    if packed:
        _unpack4(rows[r, base + start // 2:base + start // 2 + (n + 1) // 2], n, ctmp)
        return ctmp
    return rows[r, base + start:base + start + n]


@inline
def _rows_finite(row_params, chunks, c):
    for r in range(row_params.shape[0]):
        if not (np.isfinite(row_params[r, c]) and np.isfinite(row_params[r, chunks + c])):
            return False
    return True


@inline
def _decode_rows(rows, row_params, chunks, c, start, n, packed, xs, ctmp, count):
    """Chunk ``c`` of the first ``count`` rows (one message per rank: parameters, then codes)
    decoded and summed in rank order into ``xs``, from zero: ``dequantize_chunks`` row after
    row. The rows' parameters are finite (``_rows_finite``)."""
    zero = np.zeros(1, xs.dtype)[0]
    for r in range(count):
        cs = _row_codes(rows, r, 8 * chunks, start, n, packed, ctmp)
        _decode_into(xs, cs, n, row_params[r, chunks + c], row_params[r, c], r > 0, zero)


@inline
def _mean_and_residual(xs, n, size, div, es, feedback):
    """The owner's sum of ``size`` rows in ``xs[:n]`` divided by ``div`` (more than one row), then
    with ``feedback`` the owner's residual ``es`` added: the runner's steps, in their order."""
    if size > 1:
        for i in range(n):
            xs[i] = xs[i] / div
    if feedback:
        for i in range(n):
            xs[i] = xs[i] + es[i]
