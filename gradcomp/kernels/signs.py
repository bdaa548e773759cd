"""The 1-bit code's vector intrinsics (LLVM IR): sign bits of 16 values at a time, values from
sign bits, the eight-lane float64 magnitude sums (four chunks side by side), and unaligned 8-byte
words of sign codes.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


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
