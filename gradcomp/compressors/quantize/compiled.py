"""Compiled (numba) kernels of the chunk codes: one pass per 512-value chunk while it is in the L1
cache, the operations of the NumPy kernels (``kernels``, ``onebit``) in the same order, so the
bits are the same. Only imported where ``gradcomp.jit.available()``.

Every stage of a two-stage code is one kernel here, so that each touches the bucket's memory once:
the worker's encode with its residual (``quantize_feedback_chunks``, ``onebit_encode_chunks``),
the slice owner's stage from the ranks' messages to its own (``quantize_owner_chunks``,
``onebit_owner_chunks``: decode every row into a chunk in L1, average, add the owner's residual,
encode, keep the error) and the decode of the result (``dequantize_chunks``,
``unpack4_dequantize_chunks``, ``onebit_decode_chunks``), writing or adding. 4-bit codes are
packed and unpacked inside them (no code array of the bucket's length).

float32 and float64: the decoders and the 1-bit kernels take either (numba compiles each); the
affine quantizers of float32 rank values by integer order keys, those of float64 have their own
kernels (``quantize64_chunks``...) because NumPy's float64 sequence rounds the offset to float32
first (see ``_chunk_range64``).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ...jit import (_bf16_decode, _f16_decode, _f32_bits, _f32_from_bits, _f64_from_bits, _popcount64, _store_fence,
                    _stream)

_kernel = njit(cache=True, boundscheck=False, nogil=True)

_INF_KEY = np.int32(0x7F800000)  # order key (below) of +inf
_NEG_INF_KEY = np.int32(-0x7F800001)  # and of -inf
_ROUND_MAGIC = np.float32(2.0 ** 23)

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
def _min32(typingctx, a, b):
    """The smaller of two int32, as an int32."""
    def codegen(context, builder, signature, args):
        return builder.select(builder.icmp_signed("<", args[0], args[1]), args[0], args[1])
    return types.int32(types.int32, types.int32), codegen


@intrinsic
def _max32(typingctx, a, b):
    """The larger of two int32, as an int32."""
    def codegen(context, builder, signature, args):
        return builder.select(builder.icmp_signed(">", args[0], args[1]), args[0], args[1])
    return types.int32(types.int32, types.int32), codegen


@intrinsic
def _key_of(typingctx, x):
    """``_order_key`` of a float32 value's bits."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        bits = builder.bitcast(args[0], i32)
        sign = builder.ashr(bits, ir.Constant(i32, 31))
        return builder.xor(bits, builder.and_(sign, ir.Constant(i32, 0x7FFFFFFF)))
    return types.int32(types.float32), codegen


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


@njit(inline="always")
def _order_key64(b):
    """``_order_key`` of float64 bits (as int64)."""
    return b ^ ((b >> np.int64(63)) & np.int64(0x7FFFFFFFFFFFFFFF))


@_kernel
def _has_both_zeros(bits):
    """True when ``bits`` (float32 as int32) hold both +0.0 and -0.0."""
    plus = minus = False
    for i in range(bits.shape[0]):
        plus |= bits[i] == np.int32(0)
        minus |= bits[i] == np.int32(-0x80000000)
    return plus and minus


@_kernel
def _has_both_zeros64(bits):
    """True when ``bits`` (float64 as int64) hold both +0.0 and -0.0."""
    plus = minus = False
    for i in range(bits.shape[0]):
        plus |= bits[i] == np.int64(0)
        minus |= bits[i] == np.int64(-0x7FFFFFFFFFFFFFFF - 1)
    return plus and minus


@njit(inline="always")
def _keys(xs, n):
    """The smallest and largest order key of ``xs[:n]`` (float32)."""
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    for i in range(n):
        k = _key_of(xs[i])
        kmin = _min32(kmin, k)
        kmax = _max32(kmax, k)
    return kmin, kmax


@njit(inline="always")
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


@njit(inline="always")
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


@njit(inline="always")
def _codes(xs, cs, n, lo, inv, top):
    """``cs = clip(rint((x - min) * (1 / scale)), 0, levels)`` as uint8. ``n`` is passed, not
    read from a slice: LLVM vectorizes the fused callers' loops only with one shared bound."""
    zero = np.float32(0.0)
    for i in range(n):
        cs[i] = np.uint8(min(max(np.rint((xs[i] - lo) * inv), zero), top))


@njit(inline="always")
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


@njit(inline="always")
def _pack4(cs, n, out):
    """Codes ``cs[:n]`` two to a byte into ``out`` (even index in the low nibble; an odd last code
    alone in its byte), as ``kernels.pack4`` of the codes padded with a zero."""
    groups = n // 32
    _pack4_groups(cs, groups, out)
    for j in range(16 * groups, n // 2):
        out[j] = cs[2 * j] | (cs[2 * j + 1] << np.uint8(4))
    if n % 2:
        out[n // 2] = cs[n - 1]


@njit(inline="always")
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


@njit(inline="always")
def _codes_of(codes, ctmp, start, n, packed):
    """Where a chunk's codes are written first: the message itself (8-bit), or ``ctmp`` (packed
    after, ``_pack4``)."""
    if packed:
        return ctmp
    return codes[start:start + n]


@njit(inline="always")
def _packed_part(codes, start, n):
    return codes[start // 2:start // 2 + (n + 1) // 2]


@_kernel
def quantize_chunks(x, bits, width, levels, params, codes, redo, packed, ctmp, zero):
    """Per-chunk affine quantization of float32 ``x`` (``bits`` is x viewed as int32) in one
    pass per chunk: ``params[0] = min``, ``params[1] = (max - min) / levels``, codes =
    clip(rint((x - min) * (1 / scale)), 0, levels) as uint8 (1 instead of 1/scale where scale
    is not > 0) -- the float32 operations of the NumPy kernels, in the same order; with
    ``packed``, two codes to a byte (``ctmp`` holds a chunk's codes first); ``zero``: offset and
    scale of the grid that holds zero (``_zero_grid32``).

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
        n = xs.shape[0]
        kmin, kmax = _keys(xs, n)
        lo, scale, inv, bad = _range_of(kmin, kmax, top, bits[start:start + n], zero)
        params[0, c] = lo
        params[1, c] = scale
        if bad:
            redo[c] = True
            redone += 1
            continue
        cs = _codes_of(codes, ctmp, start, n, packed)
        _codes(xs, cs, n, lo, inv, top)
        if packed:
            _pack4(cs, n, _packed_part(codes, start, n))
    return redone


@_kernel
def dequantize_chunks(acc, params, codes, width, add):
    """``acc (+)= codes * scale + offset`` per chunk: ``acc + code * scale`` then ``+ offset``,
    two roundings in ``acc``'s dtype (the product in float32; the NumPy kernels' sequence, no
    fused multiply-add; writing is adding to zero); chunks whose offset or scale is not finite
    become NaN. Per-chunk slices, as in ``quantize_chunks``."""
    zero = np.zeros(1, acc.dtype)[0]
    for c in range(params.shape[1]):
        start = c * width
        a = acc[start:start + width]
        cs = codes[start:start + width]
        lo = params[0, c]
        scale = params[1, c]
        if not (np.isfinite(lo) and np.isfinite(scale)):
            a[:] = np.nan
            continue
        if add:
            for i in range(a.shape[0]):
                a[i] = (a[i] + np.float32(cs[i]) * scale) + lo
        else:
            for i in range(a.shape[0]):
                a[i] = (zero + np.float32(cs[i]) * scale) + lo


@_kernel
def unpack4_dequantize_chunks(acc, params, packed, width, add, ctmp):
    """``dequantize_chunks`` with the codes two to a byte (even index in the low nibble),
    unpacked a chunk at a time into ``ctmp``."""
    zero = np.zeros(1, acc.dtype)[0]
    for c in range(params.shape[1]):
        start = c * width
        a = acc[start:start + width]
        n = a.shape[0]
        lo = params[0, c]
        scale = params[1, c]
        if not (np.isfinite(lo) and np.isfinite(scale)):
            a[:] = np.nan
            continue
        cs = ctmp
        _unpack4(_packed_part(packed, start, n), n, cs)
        if add:
            for i in range(n):
                a[i] = (a[i] + np.float32(cs[i]) * scale) + lo
        else:
            for i in range(n):
                a[i] = (zero + np.float32(cs[i]) * scale) + lo


@_kernel
def dequantize_rows_chunks(rows, row_params, base, width, acc, div):
    """``acc`` = the mean of every row's reconstruction (rows: one allgathered message per rank,
    its codes from byte ``base``; ``row_params`` (ranks, 2, chunks) their offsets and scales),
    one chunk at a time: row after row decoded as ``dequantize_chunks`` adds into zeros (a row
    whose chunk has non-finite parameters makes it NaN), then divided by ``div`` (more than one
    row): the runner's zero, add per rank and divide, in one write of ``acc``."""
    size = rows.shape[0]
    zero = np.zeros(1, acc.dtype)[0]
    for c in range(row_params.shape[2]):
        start = c * width
        a = acc[start:start + width]
        n = a.shape[0]
        for r in range(size):
            lo = row_params[r, 0, c]
            scale = row_params[r, 1, c]
            if not (np.isfinite(lo) and np.isfinite(scale)):
                a[:] = np.nan
                continue
            cs = rows[r, base + start:base + start + n]
            if r == 0:
                for i in range(n):
                    a[i] = (zero + np.float32(cs[i]) * scale) + lo
            else:
                for i in range(n):
                    a[i] = (a[i] + np.float32(cs[i]) * scale) + lo
        if size > 1:
            for i in range(n):
                a[i] = a[i] / div


@_kernel
def dequantize_rows_chunks_streamed(rows, row_params, base, width, acc, div, tmp):
    """``dequantize_rows_chunks`` a chunk at a time in ``tmp`` (``width`` values, in the L1
    cache), written to ``acc`` with ``_stream``: for a large ``acc``, whose lines are then not
    read before they are written. A row whose parameters are not finite makes the chunk NaN
    there (every later row adds to that NaN, which keeps its bits): here every row is decoded
    and the chunk overwritten after, since a branch around the loops (as there) keeps LLVM from
    vectorizing them in this kernel."""
    size = rows.shape[0]
    zero = np.zeros(1, acc.dtype)[0]
    for c in range(row_params.shape[2]):
        start = c * width
        n = min(width, acc.shape[0] - start)
        lo = row_params[0, 0, c]
        scale = row_params[0, 1, c]
        good = np.isfinite(lo) and np.isfinite(scale)
        cs = rows[0, base + start:base + start + n]
        for i in range(n):
            tmp[i] = (zero + np.float32(cs[i]) * scale) + lo
        for r in range(1, size):
            lo = row_params[r, 0, c]
            scale = row_params[r, 1, c]
            good = good and np.isfinite(lo) and np.isfinite(scale)
            cs = rows[r, base + start:base + start + n]
            for i in range(n):
                tmp[i] = (tmp[i] + np.float32(cs[i]) * scale) + lo
        if size > 1:
            for i in range(n):
                tmp[i] = tmp[i] / div
        if not good:
            for i in range(n):
                tmp[i] = np.nan
        _stream(acc, start, tmp, n)
    _store_fence()


@njit(inline="always")
def _keep_error(xs, es, cs, n, lo, scale):
    """``es = xs - (codes * scale + offset)``: the residual from the chunk's own codes, decoded
    as ``dequantize_chunks`` does into a zeroed array (float64 chunks)."""
    zero = np.zeros(1, es.dtype)[0]
    for i in range(n):
        es[i] = xs[i] - ((zero + np.float32(cs[i]) * scale) + lo)


@_kernel
def quantize_feedback_chunks(g, e, width, levels, params, codes, redo, tmp, tmp_bits, packed, ctmp, bf16, zero):
    """Error feedback fused with ``quantize_chunks``: per chunk, ``x = g + e`` (kept in ``tmp``,
    in the L1 cache) and its range in one loop, then its codes and ``e = x - (codes * scale +
    offset)`` with the NumPy kernels' roundings in another: one pass over ``g`` and ``e`` where
    the unfused sequence makes about five. ``g`` may be half precision (uint16 bits, ``bf16``
    saying which), widened exactly as the runner's cast does. Chunks marked in ``redo`` (as
    ``quantize_chunks`` marks them) are left untouched, ``e`` included, for the NumPy sequence.
    Returns how many were marked."""
    redone = 0
    top = np.float32(levels)
    for c in range(params.shape[1]):
        start = c * width
        gs = g[start:start + width]
        es = e[start:start + width]
        n = gs.shape[0]
        xs = tmp[:n]
        kmin = np.int32(0x7FFFFFFF)
        kmax = np.int32(-0x80000000)
        for i in range(n):
            v = _wide(gs[i], bf16) + es[i]
            xs[i] = v
            k = _key_of(v)
            kmin = _min32(kmin, k)
            kmax = _max32(kmax, k)
        lo, scale, inv, bad = _range_of(kmin, kmax, top, tmp_bits[:n], zero)
        params[0, c] = lo
        params[1, c] = scale
        if bad:
            redo[c] = True
            redone += 1
            continue
        cs = _codes_of(codes, ctmp, start, n, packed)
        _codes_and_error(xs, es, cs, n, lo, scale, inv, top)
        if packed:
            _pack4(cs, n, _packed_part(codes, start, n))
    return redone


@njit(inline="always")
def _row_codes(rows, r, base, start, n, packed, ctmp):
    """Row ``r``'s codes of values ``start:start + n`` (unpacked into ``ctmp`` where packed)."""
    if packed:
        _unpack4(rows[r, base + start // 2:base + start // 2 + (n + 1) // 2], n, ctmp)
        return ctmp
    return rows[r, base + start:base + start + n]


@njit(inline="always")
def _rows_finite(row_params, chunks, c):
    for r in range(row_params.shape[0]):
        if not (np.isfinite(row_params[r, c]) and np.isfinite(row_params[r, chunks + c])):
            return False
    return True


@njit(inline="always")
def _decode_rows(rows, row_params, chunks, c, start, n, packed, xs, ctmp, count):
    """Chunk ``c`` of the first ``count`` rows (one message per rank: parameters, then codes)
    decoded and summed in rank order into ``xs``, from zero: ``dequantize_chunks`` row after
    row. The rows' parameters are finite (``_rows_finite``)."""
    zero = np.zeros(1, xs.dtype)[0]
    base = 8 * chunks
    for r in range(count):
        lo = row_params[r, c]
        scale = row_params[r, chunks + c]
        cs = _row_codes(rows, r, base, start, n, packed, ctmp)
        if r == 0:
            for i in range(n):
                xs[i] = (zero + np.float32(cs[i]) * scale) + lo
        else:
            for i in range(n):
                xs[i] = (xs[i] + np.float32(cs[i]) * scale) + lo


@njit(inline="always")
def _last_row(rows, row_params, chunks, c, start, n, packed, xs, es, feedback, div, ctmp):
    """The last row of chunk ``c`` added as ``_decode_rows`` adds (into zero when it is the
    only one), the sum divided by ``div`` (more than one row), ``es`` added (``feedback``), and
    the range of the result, in one loop; returns the smallest and largest order key."""
    size = rows.shape[0]
    r = size - 1
    lo = row_params[r, c]
    scale = row_params[r, chunks + c]
    cs = _row_codes(rows, r, 8 * chunks, start, n, packed, ctmp)
    zero = np.float32(0.0)
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    if size == 1 and feedback:
        for i in range(n):
            v = ((zero + np.float32(cs[i]) * scale) + lo) + es[i]
            xs[i] = v
            k = _key_of(v)
            kmin = _min32(kmin, k)
            kmax = _max32(kmax, k)
    elif size == 1:
        for i in range(n):
            v = (zero + np.float32(cs[i]) * scale) + lo
            xs[i] = v
            k = _key_of(v)
            kmin = _min32(kmin, k)
            kmax = _max32(kmax, k)
    elif feedback:
        for i in range(n):
            v = (((xs[i] + np.float32(cs[i]) * scale) + lo) / div) + es[i]
            xs[i] = v
            k = _key_of(v)
            kmin = _min32(kmin, k)
            kmax = _max32(kmax, k)
    else:
        for i in range(n):
            v = ((xs[i] + np.float32(cs[i]) * scale) + lo) / div
            xs[i] = v
            k = _key_of(v)
            kmin = _min32(kmin, k)
            kmax = _max32(kmax, k)
    return kmin, kmax


@_kernel
def quantize_owner_chunks(rows, row_params, chunks, width, levels, packed, feedback, e, params, codes,
                          redo, tmp, tmp_bits, ctmp, zero):
    """The slice owner's stage in one pass per chunk: the ``rows`` (uint8, one message per rank:
    float32 offsets and scales of ``chunks`` chunks, ``row_params`` the same bytes as float32,
    then the codes) decoded and summed in rank order from zero, divided by the number of rows,
    with ``feedback`` the owner's residual ``e`` added, quantized into ``params`` and ``codes``
    and ``e`` left with the error: the operations of decoding each row into a zeroed slice,
    dividing and ``quantize_chunks`` / ``quantize_feedback_chunks``, in the same order, without
    the slice-sized sum. Chunks marked in ``redo`` (those kernels' marks, and any chunk a row
    decodes to NaN) are left untouched (``e`` included) for the NumPy sequence; returns how many."""
    top = np.float32(levels)
    div = np.float32(rows.shape[0])
    redone = 0
    for c in range(chunks):
        start = c * width
        n = width
        xs = tmp[:n]
        es = e[start:start + n]
        if not _rows_finite(row_params, chunks, c):  # that row's chunk decodes to NaN: so does the mean
            redo[c] = True
            redone += 1
            continue
        _decode_rows(rows, row_params, chunks, c, start, n, packed, xs, ctmp, rows.shape[0] - 1)
        kmin, kmax = _last_row(rows, row_params, chunks, c, start, n, packed, xs, es, feedback, div, ctmp)
        lo, scale, inv, bad = _range_of(kmin, kmax, top, tmp_bits[:n], zero)
        params[0, c] = lo
        params[1, c] = scale
        if bad:
            redo[c] = True
            redone += 1
            continue
        cs = _codes_of(codes, ctmp, start, n, packed)
        if feedback:
            _codes_and_error(xs, es, cs, n, lo, scale, inv, top)
        else:
            _codes(xs, cs, n, lo, inv, top)
        if packed:
            _pack4(cs, n, _packed_part(codes, start, n))
    return redone


# ---------------------------------------------------------------------------------------------
# float64: NumPy's sequence (kernels._quantize_blocked) on float64 values
# ---------------------------------------------------------------------------------------------
@njit(inline="always")
def _chunk_range64(xs, bs, top, wide, zero):
    """(offset, scale, 1/scale or 1, redo mark) of a float64 chunk as NumPy's kernels compute
    them: min and max in float64 (by order keys), the offset rounded to float32, the scale
    ``(max - offset) / levels`` in float64 rounded to float32 (``wide``: chunks longer than a
    NumPy block, ``(max - min) / levels`` with the minimum not rounded; ``zero``: ``_zero_grid32`` of
    the extremes rounded to float32), the inverse in float32. Marks
    ``REDO_BAD`` for a NaN or Inf, or an offset, scale or inverse that is not finite;
    ``REDO_TIE`` for an extreme that is a zero held with both signs."""
    kmin = np.int64(0x7FFFFFFFFFFFFFFF)
    kmax = np.int64(-0x7FFFFFFFFFFFFFFF - 1)
    for i in range(bs.shape[0]):
        k = _order_key64(bs[i])
        kmin = min(kmin, k)
        kmax = max(kmax, k)
    lo64 = _f64_from_bits(_order_key64(kmin))
    hi64 = _f64_from_bits(_order_key64(kmax))
    inf_key = np.int64(0x7FF0000000000000)
    mark = 0
    if not (kmax < inf_key and kmin > -inf_key - 1):
        mark = REDO_BAD
        lo = np.float32(0.0)
        scale = np.float32(0.0)
        inv = np.float32(1.0)
    elif zero:
        lo, scale = _zero_grid32(np.float32(lo64), np.float32(hi64), top)
    else:
        lo = np.float32(lo64)
        scale = np.float32((hi64 - (lo64 if wide else np.float64(lo))) / np.float64(top))
    if mark == 0:
        inv = np.float32(1.0) / (scale if scale > np.float32(0.0) else np.float32(1.0))
        if not (np.isfinite(lo) and np.isfinite(scale) and np.isfinite(inv)):
            mark = REDO_BAD
        elif not zero and (kmin == np.int64(-1) or kmax == np.int64(0)) and _has_both_zeros64(bs):
            mark = REDO_TIE
    return lo, scale, inv, mark


@njit(inline="always")
def _quantize_chunk64(xs, bs, cs, n, top, params, c, wide, zero):
    """Chunk ``c`` of float64 values: parameters into ``params``, codes into ``cs`` as NumPy's
    finite-block sequence makes them (``(x - offset)`` rounded to float32, times the inverse,
    plus 2**23, the low byte of the bits), unless marked; returns (mark, offset, scale). Marks
    ``REDO_ROUNDING`` (codes not written) where that shortcut and the reference sequence (rint,
    clip) would differ: NumPy's choice between them depends on the other chunks of its block."""
    lo, scale, inv, mark = _chunk_range64(xs, bs, top, wide, zero)
    if mark == REDO_BAD:  # the parameters as NumPy computes them come from NumPy
        return mark, lo, scale
    params[0, c] = lo
    params[1, c] = scale
    if mark:
        return mark, lo, scale
    wide = np.float64(lo)
    edge = top + np.float32(0.5)
    odd = False
    for i in range(n):
        q = np.float32(xs[i] - wide) * inv
        odd |= not (q >= np.float32(0.0) and q < edge)
        cs[i] = np.uint8(_f32_bits(q + _ROUND_MAGIC) & np.uint32(0xFF))
    if odd:
        return REDO_ROUNDING, lo, scale
    return 0, lo, scale


@_kernel
def quantize64_chunks(x, bits, width, levels, params, codes, redo, packed, ctmp, wide, zero):
    """``quantize_chunks`` for float64 ``x`` (``bits``: x as int64), NumPy's float64 sequence
    (``_quantize_chunk64``; ``wide``: chunks longer than NumPy's block); ``redo[c]`` holds the
    chunk's mark (0: done). Returns how many chunks were marked."""
    redone = 0
    top = np.float32(levels)
    for c in range(params.shape[1]):
        start = c * width
        xs = x[start:start + width]
        n = xs.shape[0]
        cs = _codes_of(codes, ctmp, start, n, packed)
        mark = _quantize_chunk64(xs, bits[start:start + n], cs, n, top, params, c, wide, zero)[0]
        if mark:
            redo[c] = mark
            redone += 1
        elif packed:
            _pack4(cs, n, _packed_part(codes, start, n))
    return redone


@_kernel
def quantize64_feedback_chunks(g, e, width, levels, params, codes, redo, tmp, tmp_bits, packed, ctmp, bf16, zero):
    """``quantize_feedback_chunks`` for float64 (marks as ``quantize64_chunks``; a marked chunk's
    ``e`` and codes are left untouched; ``bf16`` unused: no half-precision input)."""
    redone = 0
    top = np.float32(levels)
    for c in range(params.shape[1]):
        start = c * width
        gs = g[start:start + width]
        es = e[start:start + width]
        n = gs.shape[0]
        cs = _codes_of(codes, ctmp, start, n, packed)
        xs = tmp[:n]
        for i in range(n):
            xs[i] = gs[i] + es[i]
        mark, lo, scale = _quantize_chunk64(xs, tmp_bits[:n], cs, n, top, params, c, False, zero)
        if mark:
            redo[c] = mark
            redone += 1
            continue
        _keep_error(xs, es, cs, n, lo, scale)
        if packed:
            _pack4(cs, n, _packed_part(codes, start, n))
    return redone



@njit(inline="always")
def _mean_and_residual(xs, n, size, div, es, feedback):
    """The owner's sum of ``size`` rows in ``xs[:n]`` divided by ``div`` (more than one row), then
    with ``feedback`` the owner's residual ``es`` added: the runner's steps, in their order."""
    if size > 1:
        for i in range(n):
            xs[i] = xs[i] / div
    if feedback:
        for i in range(n):
            xs[i] = xs[i] + es[i]


@_kernel
def quantize64_owner_chunks(rows, row_params, chunks, width, levels, packed, feedback, e, params, codes,
                            redo, tmp, tmp_bits, ctmp, zero):
    """``quantize_owner_chunks`` for a float64 slice (the rows decoded in float64; marks as
    ``quantize64_chunks``, and ``REDO_BAD`` for a chunk a row decodes to NaN)."""
    size = rows.shape[0]
    top = np.float32(levels)
    div = np.float64(size)
    redone = 0
    for c in range(chunks):
        start = c * width
        n = width
        if not _rows_finite(row_params, chunks, c):
            redo[c] = REDO_BAD
            redone += 1
            continue
        xs = tmp[:n]
        _decode_rows(rows, row_params, chunks, c, start, n, packed, xs, ctmp, size)
        es = e[start:start + n]
        _mean_and_residual(xs, n, size, div, es, feedback)
        cs = _codes_of(codes, ctmp, start, n, packed)
        mark, lo, scale = _quantize_chunk64(xs, tmp_bits[:n], cs, n, top, params, c, False, zero)
        if mark:
            redo[c] = mark
            redone += 1
            continue
        if feedback:
            _keep_error(xs, es, cs, n, lo, scale)
        if packed:
            _pack4(cs, n, _packed_part(codes, start, n))
    return redone


# ---------------------------------------------------------------------------------------------
# 1-bit codes
# ---------------------------------------------------------------------------------------------
def _float_vector(dtype: types.Type, lanes: int) -> ir.VectorType:
    return ir.VectorType(ir.DoubleType() if dtype == types.float64 else ir.FloatType(), lanes)


def _contiguous_floats(*arrays: types.Type) -> bool:
    return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C"
               and a.dtype in (types.float32, types.float64) for a in arrays)


def _element(context, builder, aty, value, index, vector):
    """A pointer to ``vector`` values of array ``value`` (type ``aty``) from ``index``."""
    data = context.make_array(aty)(context, builder, value).data
    return builder.bitcast(builder.gep(data, [index]), vector.as_pointer())


def _abs_lanes_codegen(context, builder, aty, xs, starts, groups):
    """The float64 eight-lane sums of ``|x|`` of ``groups`` groups of 8 from each index in
    ``starts``, side by side in one loop (one vector of eight float64 lanes per start: lane k adds
    values 8j + k in order, what eight scalar sums do in that order), each reduced in lane order
    ``((a0 + a1) + a2) ... + a7``."""
    v8d = ir.VectorType(ir.DoubleType(), 8)
    src = _float_vector(aty.dtype, 8)
    fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8d, [v8d]), "llvm.fabs.v8f64")
    sums = [cgutils.alloca_once_value(builder, ir.Constant(v8d, [0.0] * 8)) for _ in starts]
    align = 8 if aty.dtype == types.float64 else 4
    with cgutils.for_range(builder, groups) as loop:
        base = builder.mul(loop.index, ir.Constant(loop.index.type, 8))
        for start, acc in zip(starts, sums):
            v = builder.load(_element(context, builder, aty, xs, builder.add(start, base), src), align=align)
            wide = v if aty.dtype == types.float64 else builder.fpext(v, v8d)
            builder.store(builder.fadd(builder.load(acc), builder.call(fabs, [wide])), acc)
    i32 = ir.IntType(32)
    totals = []
    for acc in sums:
        a = builder.load(acc)
        total = builder.extract_element(a, ir.Constant(i32, 0))
        for k in range(1, 8):
            total = builder.fadd(total, builder.extract_element(a, ir.Constant(i32, k)))
        totals.append(total)
    return totals


@intrinsic
def _abs_lane_total(typingctx, xs, groups):
    """The float64 sum of ``|xs|`` over the first ``8 * groups`` values (float32 or float64) in
    a fixed order: eight lanes, lane k adding values 8j + k in order, then the lanes in order
    (``((a0 + a1) + a2) ... + a7``). One vector of eight float64 lanes: the same additions, in
    the same order, as eight scalar sums (which LLVM leaves scalar)."""
    if not _contiguous_floats(xs):
        return None

    def codegen(context, builder, signature, args):
        zero = ir.Constant(args[1].type, 0)
        return _abs_lanes_codegen(context, builder, signature.args[0], args[0], [zero], args[1])[0]
    return types.float64(xs, types.intp), codegen


#: chunks whose mean magnitudes ``_abs_lane_totals`` sums at once
TOTALS_AT_ONCE = 4


@intrinsic
def _abs_lane_totals(typingctx, xs, stride, groups, out):
    """``out[k]`` = ``_abs_lane_total`` of the ``8 * groups`` values of ``xs`` from ``k * stride``,
    for ``k < TOTALS_AT_ONCE``: the same additions in the same order per chunk, the chunks' sums
    interleaved in one loop. One chunk's sum is a chain of dependent additions (each waits for
    the last: the float64 add's latency, not the memory, bounds it); four chunks' chains run side
    by side."""
    if not (_contiguous_floats(xs) and isinstance(out, types.Array) and out.dtype == types.float64):
        return None

    def codegen(context, builder, signature, args):
        stride = args[1]
        starts = [builder.mul(stride, ir.Constant(stride.type, k)) for k in range(TOTALS_AT_ONCE)]
        totals = _abs_lanes_codegen(context, builder, signature.args[0], args[0], starts, args[2])
        odata = context.make_array(signature.args[3])(context, builder, args[3]).data
        for k, total in enumerate(totals):
            builder.store(total, builder.gep(odata, [ir.Constant(ir.IntType(64), k)]))
        return context.get_dummy_value()
    return types.none(xs, stride, groups, out), codegen


def _bytes_of(builder, groups):
    """(pairs, odd): ``groups`` bytes as pairs of bytes (16 values) and whether one is left."""
    one = ir.Constant(groups.type, 1)
    return builder.lshr(groups, one), builder.and_(groups, one)


@intrinsic
def _sign_bits(typingctx, xs, groups, out):
    """Byte j of ``out`` (uint8) = the signs of ``xs[8j:8j + 8]``, bit k for value 8j + k, 1 = not
    negative (``x >= 0``: NaN is 0): sixteen compares and two bytes at a time (a 16-bit store,
    little-endian: the first eight values in the first byte), eight for an odd last byte."""
    if not (_contiguous_floats(xs) and isinstance(out, types.Array) and out.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        aty, oty = signature.args[0], signature.args[2]
        align = 8 if aty.dtype == types.float64 else 4
        odata = context.make_array(oty)(context, builder, args[2]).data
        pairs, odd = _bytes_of(builder, args[1])

        def signs(lanes, byte_index):
            vec = _float_vector(aty.dtype, lanes)
            v = builder.load(_element(context, builder, aty, args[0], builder.mul(byte_index, ir.Constant(byte_index.type, 8)),
                                      vec), align=align)
            mask = builder.bitcast(builder.fcmp_ordered(">=", v, ir.Constant(vec, [0.0] * lanes)), ir.IntType(lanes))
            ptr = builder.bitcast(builder.gep(odata, [byte_index]), ir.IntType(lanes).as_pointer())
            builder.store(mask, ptr, align=1)
        with cgutils.for_range(builder, pairs) as loop:
            signs(16, builder.mul(loop.index, ir.Constant(loop.index.type, 2)))
        with builder.if_then(builder.icmp_unsigned("!=", odd, ir.Constant(odd.type, 0))):
            signs(8, builder.sub(args[1], ir.Constant(args[1].type, 1)))
        return context.get_dummy_value()
    return types.none(xs, groups, out), codegen


@intrinsic
def _from_signs(typingctx, out, bits, groups, scale, add):
    """``out[8j + k] (+)= scale`` where bit k of ``bits[j]`` is set, else ``-scale`` (``scale``
    float32, widened to ``out``'s dtype; adding as ``out + value``): a select of two vectors per
    two bytes (eight values for an odd last byte). ``add``: 0 (or False) writes, 1 (or True)
    adds, 2 writes ``0 + value`` (what adding to zeros gives, -0 included, without the zeros)."""
    if not (_contiguous_floats(out) and isinstance(bits, types.Array) and bits.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        oty, bty = signature.args[0], signature.args[1]
        s = args[3]
        if oty.dtype == types.float64:
            s = builder.fpext(s, ir.DoubleType())
        align = 8 if oty.dtype == types.float64 else 4
        bdata = context.make_array(bty)(context, builder, args[1]).data
        i64 = ir.IntType(64)
        mode = builder.zext(args[4], i64) if args[4].type.width < 64 else args[4]
        pairs, odd = _bytes_of(builder, args[2])

        def splat(lanes):
            vec = _float_vector(oty.dtype, lanes)
            v = ir.Constant(vec, ir.Undefined)
            for k in range(lanes):
                v = builder.insert_element(v, s, ir.Constant(ir.IntType(32), k))
            return v, builder.fneg(v), ir.Constant(vec, [0.0] * lanes)

        def put(lanes, byte_index, how, vectors):
            pos, neg, zero = vectors
            vec = _float_vector(oty.dtype, lanes)
            bp = builder.bitcast(builder.gep(bdata, [byte_index]), ir.IntType(lanes).as_pointer())
            mask = builder.bitcast(builder.load(bp, align=1), ir.VectorType(ir.IntType(1), lanes))
            value = builder.select(mask, pos, neg)
            ptr = _element(context, builder, oty, args[0], builder.mul(byte_index, ir.Constant(byte_index.type, 8)), vec)
            if how == 1:
                value = builder.fadd(builder.load(ptr, align=align), value)
            elif how == 2:
                value = builder.fadd(zero, value)
            builder.store(value, ptr, align=align)

        wide, narrow = splat(16), splat(8)
        with builder.if_else(builder.icmp_unsigned("==", mode, ir.Constant(i64, 1))) as (adding, other):
            with adding:
                _sign_loops(builder, pairs, odd, args[2], put, 1, wide, narrow)
            with other:
                with builder.if_else(builder.icmp_unsigned("==", mode, ir.Constant(i64, 2))) as (zeros, plain):
                    with zeros:
                        _sign_loops(builder, pairs, odd, args[2], put, 2, wide, narrow)
                    with plain:
                        _sign_loops(builder, pairs, odd, args[2], put, 0, wide, narrow)
        return context.get_dummy_value()
    return types.none(out, bits, groups, scale, add), codegen


def _sign_loops(builder, pairs, odd, groups, put, how, wide, narrow):
    """``put`` over the byte pairs, then the odd last byte (``_from_signs``)."""
    with cgutils.for_range(builder, pairs) as loop:
        put(16, builder.mul(loop.index, ir.Constant(loop.index.type, 2)), how, wide)
    with builder.if_then(builder.icmp_unsigned("!=", odd, ir.Constant(odd.type, 0))):
        put(8, builder.sub(groups, ir.Constant(groups.type, 1)), how, narrow)


@njit(inline="always")
def _onebit_totals(xs, m, width, totals):
    """``totals[j]`` = the float64 sum of ``|x|`` of chunk j of ``xs[:m]`` (chunks of ``width``
    values, the last one possibly shorter; every length a multiple of 8) in the eight-lane order
    of ``_abs_lane_total``: four full chunks at once (``_abs_lane_totals``), else one by one.
    Returns the number of chunks."""
    k = -(-m // width)
    if k == TOTALS_AT_ONCE and m == TOTALS_AT_ONCE * width:
        _abs_lane_totals(xs, width, width // 8, totals)
    else:
        for j in range(k):
            lo = j * width
            n = min(width, m - lo)
            totals[j] = _abs_lane_total(xs[lo:lo + n], n // 8)
    return k


@njit(inline="always")
def _mean_magnitude(total, n):
    """A chunk's scale from the float64 sum of its ``n`` magnitudes: one expression for both
    owner paths (value by value and by sign patterns), so their bits cannot part."""
    return np.float32(total / n)


@njit(inline="always")
def _onebit_chunk(xs, n, total, es, feedback):
    """The scale of the ``n`` values of ``xs`` (a chunk, in the L1 cache; ``n`` a multiple of 8)
    whose magnitudes sum to ``total`` (float64, eight lanes: lane k takes values 8j + k in order,
    then the lanes in order, as ``onebit`` does in NumPy; ``_onebit_totals``): their mean
    magnitude; with ``feedback`` ``es = xs - scale * sign``. Returns the scale (the sign bits
    are ``_onebit_block``'s)."""
    scale = _mean_magnitude(total, n)
    if feedback:
        neg = -scale
        for i in range(n):
            es[i] = xs[i] - (scale if xs[i] >= np.float32(0.0) else neg)
    return scale


@_kernel
def onebit_encode_chunks(g, e, width, scales, bits, feedback, tmp, bf16):
    """Sign bits and a mean-magnitude scale per chunk (``_onebit_chunk``); with ``feedback``,
    ``x = g + e`` first and ``e = x - scale * sign`` after. ``width`` and every chunk's length
    are multiples of 8; ``tmp`` (the values' dtype) holds ``TOTALS_AT_ONCE * width`` values (a
    block of chunks, whose sums run side by side: ``_onebit_totals``), or ``width`` (one chunk
    at a time); ``g`` may be half precision (uint16 bits, ``bf16`` saying which), widened to
    float32 exactly. Returns how many chunks have a non-finite scale: only those can leave a
    non-finite residual (elsewhere ``|e| <= max(|x|, scale)``). Each case is its own loop, with
    ``feedback`` a constant in it: one loop for both ran the plain encode 1.4x slower (6.4 ms
    against 4.5 for 100 MB)."""
    bad = 0
    chunks = scales.shape[0]
    size = g.shape[0]
    block = min(TOTALS_AT_ONCE, tmp.shape[0] // width)
    totals = np.zeros(TOTALS_AT_ONCE, np.float64)
    if not feedback:
        for c0 in range(0, chunks, block):
            start = c0 * width
            m = min(block * width, size - start)
            xb = _values(g[start:start + m], tmp[:m], m, bf16)
            bad += _onebit_block(xb, m, width, totals, xb, False, bits, scales, start, c0)  # (no residual)
        return bad
    for c0 in range(0, chunks, block):
        start = c0 * width
        m = min(block * width, size - start)
        gs = g[start:start + m]
        eb = e[start:start + m]
        xb = tmp[:m]
        for i in range(m):
            xb[i] = _wide(gs[i], bf16) + eb[i]
        bad += _onebit_block(xb, m, width, totals, eb, True, bits, scales, start, c0)
    return bad


@njit(inline="always")
def _onebit_block(xb, m, width, totals, eb, feedback, bits, scales, start, c0):
    """Encode a block of chunks held in ``xb`` (``m`` values, chunk ``c0`` onwards, values
    ``start`` onwards of the bucket): the sign bits of the whole block in one pass in order,
    then the chunks' magnitude sums side by side, then each chunk's scale and residual
    (``_onebit_chunk``). The sign pass comes first because ``xb`` may be the bucket itself, in
    memory: read in order, the prefetchers stream it into the cache (the sums read four chunks
    2 KB apart, which they follow badly: 9.4 ms against 4.5 ms for 100 MB, the same bits).
    Returns how many scales are not finite."""
    bad = 0
    _sign_bits(xb, m // 8, bits[start // 8:(start + m) // 8])
    k = _onebit_totals(xb, m, width, totals)
    for j in range(k):
        lo = j * width
        n = min(width, m - lo)
        scale = _onebit_chunk(xb[lo:lo + n], n, totals[j], eb[lo:lo + n], feedback)
        scales[c0 + j] = scale
        if not np.isfinite(scale):
            bad += 1
    return bad


@njit(inline="always")
def _onebit_add(scale, bs, o, add):
    """``o (+)= scale * sign`` for one chunk (``_from_signs``, ``add`` its mode); a NaN scale makes it one
    canonical NaN (a NaN product's sign is not portable)."""
    if np.isnan(scale):
        o[:] = np.nan
        return
    _from_signs(o, bs, o.shape[0] // 8, scale, add)


#: the most rows (ranks) whose sign patterns the owner's stage counts (``_pattern_chunk``: 2**N
#: patterns a chunk); above it, every value is decoded and summed
PATTERN_ROWS = 4
_EXACT_SPAN = 2.0 ** 19  # magnitudes within this ratio sum exactly (``_pattern_chunk``)


@intrinsic
def _word(typingctx, a, i):
    """The 8 bytes of the uint8 array ``a`` from byte ``i``, as a little-endian uint64 (bit k of
    byte j is bit 8j + k: value 8j + k of a sign code), at any alignment."""
    if not (isinstance(a, types.Array) and a.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        return builder.load(ptr, align=1)
    return types.uint64(a, i), codegen


@intrinsic
def _put_word(typingctx, a, i, w):
    """``_word(a, i)`` = ``w``: the 8 bytes from byte ``i`` of the uint8 array ``a``."""
    if not (isinstance(a, types.Array) and a.dtype == types.uint8):
        return None

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        ptr = builder.bitcast(builder.gep(data, [args[1]]), ir.IntType(64).as_pointer())
        builder.store(args[2], ptr, align=1)
        return context.get_dummy_value()
    return types.none(a, i, types.uint64), codegen


@njit(inline="always")
def _pattern_means(row_scales, size, c, div, vals, mags, pos):
    """For every sign pattern p of the rows (bit r: row r's sign bit is set), the mean the
    per-value path makes of a value with that pattern: from zero, ``+/-`` each row's scale in rank
    order, divided by ``div`` (``vals``, the values' dtype: the same operations in the same
    order), its magnitude in float64 (``mags``) and whether it is >= 0 (``pos``: a mask of ones).
    True when every mean is finite and of float32 precision and the nonzero magnitudes lie within
    ``_EXACT_SPAN`` of each other: then any sum of up to 512 of them is exact in float64 (each a
    multiple of 2**(e - 23), e the smallest one's exponent, the sum below 2**(e + 30))."""
    lo = np.inf
    hi = 0.0
    ones = ~np.uint64(0)
    vals[0] = 0
    for r in range(size):  # the patterns of rows 0..r from those of rows 0..r-1: rank order
        s = row_scales[r, c]
        half = 1 << r
        for p in range(half):
            vals[p + half] = vals[p] + s
            vals[p] = vals[p] + -s
    for p in range(1 << size):
        v = vals[p]
        if size > 1:
            v = v / div
        m = np.float64(abs(v))
        if not np.isfinite(m) or np.float64(np.float32(m)) != m:
            return False
        mags[p] = m
        pos[p] = ones if v >= 0 else np.uint64(0)
        if m > 0.0:
            lo = min(lo, m)
            hi = max(hi, m)
    return hi <= lo * _EXACT_SPAN


@njit(inline="always")
def _pattern_chunk(rows, size, first, bits, out0, mags, pos, counts, mint):
    """A whole chunk (512 values) of the owner's stage without a residual, by sign patterns
    (``_pattern_means`` said yes): the 64 bytes of signs from byte ``first`` of each row, eight at
    a time, split into the masks of each pattern (``mint``); the chunk's signs (from byte ``out0``
    of ``bits``) are those of the patterns whose mean is >= 0, and its magnitude sum is the
    patterns' counts times their magnitudes, which (exact) is the per-value path's eight-lane
    float64 sum. Returns that sum. A rank's code decodes to its scale times a sign, so a chunk's
    mean takes at most 2**size values: this reads the signs instead of decoding, summing and
    re-encoding every value (the owner's stage for 100 MB: 0.9 ms against 4.6 at 1 rank, 1.8
    against 3.2 at 4 ranks, their slices of it)."""
    for p in range(1 << size):
        counts[p] = 0
    for w in range(8):
        mint[0] = ~np.uint64(0)
        for r in range(size):
            b = _word(rows[r], first + 8 * w)
            half = 1 << r
            for p in range(half):
                mint[p + half] = mint[p] & b
                mint[p] = mint[p] & ~b
        out = np.uint64(0)
        for p in range(1 << size):
            counts[p] += _popcount64(mint[p])
            out |= mint[p] & pos[p]
        _put_word(bits, out0 + 8 * w, out)
    total = 0.0
    for p in range(1 << size):
        total += counts[p] * mags[p]
    return total


@_kernel
def onebit_owner_chunks(rows, row_scales, chunks, width, n, div, feedback, e, scales, bits, tmp):
    """The slice owner's stage in one pass per block of chunks: the ``rows`` (one message per
    rank: float32 scales of ``chunks`` chunks, ``row_scales`` the same bytes as float32, then the
    sign bits of ``n`` values) decoded and summed in rank order from zero, divided by the number
    of rows, with ``feedback`` ``e`` added (``div``: the number of rows in ``tmp``'s dtype),
    encoded into ``scales`` and ``bits`` and ``e`` left with the error: the operations of
    decoding each row into a zeroed slice, dividing and ``onebit_encode_chunks``, in the same
    order, without the slice-sized sum. ``tmp`` as in that kernel (a block of chunks). Without
    feedback and with at most ``PATTERN_ROWS`` rows, each chunk whose patterns allow it is
    counted instead (``_pattern_owner``; ``width`` 512; the same bits). Returns the count
    of non-finite scales, as that kernel."""
    size = rows.shape[0]
    base = 4 * chunks
    bad = 0
    block = min(TOTALS_AT_ONCE, tmp.shape[0] // width)
    totals = np.zeros(TOTALS_AT_ONCE, np.float64)
    if not feedback and width == 512:  # the row count a constant in each copy: its loops unroll (2-4x faster)
        if size == 1:
            return _pattern_owner(rows, row_scales, 1, chunks, width, n, div, e, scales, bits, tmp, totals)
        if size == 2:
            return _pattern_owner(rows, row_scales, 2, chunks, width, n, div, e, scales, bits, tmp, totals)
        if size == 3:
            return _pattern_owner(rows, row_scales, 3, chunks, width, n, div, e, scales, bits, tmp, totals)
        if size == 4:
            return _pattern_owner(rows, row_scales, 4, chunks, width, n, div, e, scales, bits, tmp, totals)
    for c0 in range(0, chunks, block):
        m = min(block * width, n - c0 * width)
        bad += _owner_block(rows, row_scales, size, base, c0, m, width, div, feedback, e, scales, bits, tmp[:m],
                            totals)
    return bad


@njit(inline="always")
def _pattern_owner(rows, row_scales, size, chunks, width, n, div, e, scales, bits, tmp, totals):
    """``onebit_owner_chunks`` without feedback, chunk by chunk: whole chunks by sign patterns
    where ``_pattern_means`` allows (``_pattern_chunk``), else value by value (``_owner_block``)."""
    base = 4 * chunks
    bad = 0
    mags = np.empty(1 << size, np.float64)
    pos = np.empty(1 << size, np.uint64)
    counts = np.empty(1 << size, np.int64)
    mint = np.empty(1 << size, np.uint64)
    for c in range(chunks):
        start = c * width
        cn = min(width, n - start)
        if cn == 512 and _pattern_means(row_scales, size, c, div, tmp[:1 << size], mags, pos):
            total = _pattern_chunk(rows, size, base + start // 8, bits, start // 8, mags, pos, counts, mint)
            scales[c] = _mean_magnitude(total, cn)
        else:
            bad += _owner_block(rows, row_scales, size, base, c, cn, width, div, False, e, scales, bits, tmp[:cn],
                                totals)
    return bad


@_kernel
def _owner_block(rows, row_scales, size, base, c0, m, width, div, feedback, e, scales, bits, xb, totals):
    """``onebit_owner_chunks`` on the ``m`` values of the chunks from ``c0``, decoded into ``xb``
    value by value (a call, not inlined: inside ``_pattern_owner``'s loop it made the pattern
    path 2x slower)."""
    start = c0 * width
    for j in range(-(-m // width)):
        lo = j * width
        cn = min(width, m - lo)
        at = start + lo
        for r in range(size):  # into zeros: the first row written as 0 + value (mode 2)
            _onebit_add(row_scales[r, c0 + j], rows[r, base + at // 8:base + (at + cn) // 8], xb[lo:lo + cn],
                        2 if r == 0 else 1)
    eb = e[start:start + m]
    _mean_and_residual(xb, m, size, div, eb, feedback)
    return _onebit_block(xb, m, width, totals, eb, feedback, bits, scales, start, c0)


@_kernel
def onebit_decode_chunks(scales, bits, out, width, add):
    """``out (+)= scale * sign`` per chunk (the bits as ``onebit_encode_chunks`` packs them); a
    chunk whose scale is NaN becomes one canonical NaN (a NaN product's sign is not portable)."""
    for c in range(scales.shape[0]):
        start = c * width
        o = out[start:start + width]
        _onebit_add(scales[c], bits[start // 8:(start + o.shape[0]) // 8], o, add)



@_kernel
def onebit_decode_chunks_streamed(scales, bits, out, width, tmp):
    """``out = scale * sign`` per chunk as ``onebit_decode_chunks`` writes it, each chunk made in
    ``tmp`` (``width`` values, in the L1 cache) and stored with ``_stream``: for a large
    ``out``, whose lines are then not read before they are written."""
    size = out.shape[0]
    for c in range(scales.shape[0]):
        start = c * width
        n = min(width, size - start)
        scale = scales[c]
        _from_signs(tmp, bits[start // 8:(start + n) // 8], n // 8, scale, False)
        if np.isnan(scale):  # after, not around it (see dequantize_rows_chunks_streamed)
            for i in range(n):
                tmp[i] = np.nan
        _stream(out, start, tmp, n)
    _store_fence()
