"""The sparsifiers' one-pass kernels (``topk_*``, ``randomk_*``, ``scatter_into``, Floyd's
sampling): they fold top-k's and random-k's passes over the bucket into one: the residual added,
the selection, the NaN check and the gather in one read, the output written once
(``compressors.sparsifiers`` and ``selection`` say what each replaces, with the same bits).
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from .primitives import _abs_bits32, _ctz64, _f64_bits, _max32, _popcount64, _prefetch, _store_fence, _stream, inline, kernel

_ABS64 = np.int64(0x7FFFFFFFFFFFFFFF)


def _abs_bits(v):
    """|v|'s bits as a signed integer of v's width (float32: int32, float64: int64): ordered
    like |v|, every NaN above infinity."""


@overload(_abs_bits, inline="always")
def _abs_bits_impl(v):
    if v == types.float32:
        return lambda v: _abs_bits32(v)
    if v == types.float64:
        return lambda v: _f64_bits(v) & _ABS64
    return None


def _larger(a, b):
    """The larger of two integers of one width (int32 in 32-bit arithmetic: ``_max32``)."""


@overload(_larger, inline="always")
def _larger_impl(a, b):
    if a == types.int32:
        return lambda a, b: _max32(a, b)
    return lambda a, b: max(a, b)


def _no_bits(x):
    """Zero in ``_abs_bits``'s integer type for ``x``'s values."""


@overload(_no_bits, inline="always")
def _no_bits_impl(x):
    if x.dtype == types.float32:
        return lambda x: np.int32(0)
    return lambda x: np.int64(0)


@inline
def _absmax_block(gs, es, m, feedback, top):
    """``es = gs + es`` (``feedback``) over a block, and the largest |value|'s bits."""
    if feedback:
        for i in range(m):
            v = gs[i] + es[i]
            es[i] = v
            top = _larger(top, _abs_bits(v))
    else:
        for i in range(m):
            top = _larger(top, _abs_bits(gs[i]))
    return top


@inline
def _gather_block(gs, es, b0, b1, feedback, index, values, t):
    """The values at ``index[t:]`` inside block ``b0:b1`` into ``values`` (and ``es`` zeroed
    there, ``feedback``); returns the next ``t``."""
    k = index.shape[0]
    src = es if feedback else gs
    while t < k and index[t] < b1:
        j = index[t] - b0
        values[t] = src[j]
        if feedback:
            es[j] = 0
        t += 1
    return t


@kernel
def randomk_gather(g, e, feedback, index, values, block):
    """random-k's encode in one pass over a float32 or float64 bucket, a block (in L1) at a
    time: ``e = g + e`` where ``feedback``, the values at ``index`` (ascending) into ``values``
    and, with ``feedback``, ``e`` zeroed there; returns the bits of the largest |value| (as
    int64; above infinity's when a value is NaN), from which the caller knows whether the
    bucket's sum is finite (``selection.sum_is_finite``)."""
    n = g.shape[0]
    top = _no_bits(g)
    t = 0
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        gs = g[b0:b1]
        es = e[b0:b1]
        top = _absmax_block(gs, es, b1 - b0, feedback, top)
        t = _gather_block(gs, es, b0, b1, feedback, index, values, t)
    return np.int64(top)


@inline
def _scatter_block(os, m, b0, b1, index, values, t, add, zero):
    """``os[:m] = zero`` (unless ``add``), then ``os[j - b0] += values[t]`` for the positions
    ``j = index[t]`` from ``t`` on that lie below ``b1``; returns the next ``t``."""
    if not add:
        for i in range(m):
            os[i] = zero
    k = index.shape[0]
    while t < k and index[t] < b1:
        j = index[t] - b0
        os[j] = os[j] + values[t]
        t += 1
    return t


@kernel
def scatter_into(out, index, values, block, add):
    """``out = 0`` then ``out[index] += values`` (``index`` ascending, no repeats; ``add``: no
    zeroing, just the adds), a block at a time: one write of ``out``."""
    n = out.shape[0]
    zero = np.zeros(1, out.dtype)[0]
    t = 0
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        t = _scatter_block(out[b0:b1], b1 - b0, b0, b1, index, values, t, add, zero)


@kernel
def scatter_into_streamed(out, index, values, tmp):
    """``scatter_into`` without ``add``, a block of ``len(tmp)`` values at a time made in
    ``tmp`` (in the L1 cache: zeros, then the values' ``0 + v``) and stored with ``_stream``:
    for a large ``out``, whose lines are then not read before they are written."""
    n = out.shape[0]
    block = tmp.shape[0]
    zero = np.zeros(1, out.dtype)[0]
    t = 0
    for b0 in range(0, n, block):
        b1 = min(b0 + block, n)
        t = _scatter_block(tmp, block, b0, b1, index, values, t, False, zero)
        _stream(out, b0, tmp, b1 - b0)
    _store_fence()


@kernel
def topk_sample(g, e, feedback, stride, sample):
    """``sample[i] = |g + e|`` (or ``|g|``) at position ``i * stride``."""
    for i in range(sample.shape[0]):
        j = i * stride
        v = g[j] + e[j] if feedback else g[j]
        sample[i] = abs(v)


@intrinsic
def _not_below(typingctx, g, e, start, groups, threshold, feedback, masks):
    """For float32 ``g`` (and ``e``) from ``start``, ``groups`` groups of 8: ``v = g + e``
    stored into ``e`` where ``feedback`` (else ``v = g``), and byte j of ``masks`` = bit k set
    where ``not |v| < threshold`` for value 8j + k (NaN included): eight at once."""
    def codegen(context, builder, signature, args):
        gty, ety, mty = signature.args[0], signature.args[1], signature.args[6]
        f32 = ir.FloatType()
        v8 = ir.VectorType(f32, 8)
        fabs = cgutils.get_or_insert_function(builder.module, ir.FunctionType(v8, [v8]), "llvm.fabs.v8f32")
        gdata = context.make_array(gty)(context, builder, args[0]).data
        edata = context.make_array(ety)(context, builder, args[1]).data
        mdata = context.make_array(mty)(context, builder, args[6]).data
        tv = builder.load(cgutils.alloca_once_value(builder, ir.Constant(v8, ir.Undefined)))
        for k in range(8):
            tv = builder.insert_element(tv, args[4], ir.Constant(ir.IntType(32), k))
        add = builder.icmp_unsigned("!=", args[5], ir.Constant(args[5].type, 0))
        with cgutils.for_range(builder, args[3]) as loop:
            at = builder.add(args[2], builder.mul(loop.index, ir.Constant(loop.index.type, 8)))
            gp = builder.bitcast(builder.gep(gdata, [at]), v8.as_pointer())
            ep = builder.bitcast(builder.gep(edata, [at]), v8.as_pointer())
            v = builder.load(gp, align=4)
            with builder.if_then(add):
                builder.store(builder.fadd(v, builder.load(ep, align=4)), ep, align=4)
            v = builder.select(add, builder.load(ep, align=4), v)
            mask = builder.fcmp_unordered(">=", builder.call(fabs, [v]), tv)
            builder.store(builder.bitcast(mask, ir.IntType(8)), builder.gep(mdata, [loop.index]))
        return context.get_dummy_value()
    return types.none(g, e, start, groups, threshold, feedback, masks), codegen


@kernel
def topk_candidates(g, e, feedback, threshold, cand, mags, vals, masks):
    """top-k's selection pass over float32 ``g``: ``e = g + e`` where ``feedback``, and the
    positions (ascending), magnitudes and values of the values whose magnitude is not below
    ``threshold`` (NaN included) into ``cand``, ``mags`` and ``vals``, as many as fit; returns how many
    there are. Eight values compared at once (``_not_below``) a block of ``8 * len(masks)``
    at a time, the few set bits then read out."""
    n = g.shape[0]
    cap = cand.shape[0]
    block = 8 * masks.shape[0]
    src = e if feedback else g
    count = 0
    for b0 in range(0, n - n % 8, block):
        groups = min(block, n - n % 8 - b0) // 8
        _not_below(g, e, b0, groups, threshold, feedback, masks)
        for j in range(groups):
            bits = masks[j]
            while bits:
                k = _ctz64(np.uint64(bits))
                bits &= bits - np.uint8(1)
                i = b0 + 8 * j + k
                if count < cap:
                    v = src[i]
                    cand[count] = i
                    mags[count] = abs(v)
                    vals[count] = v
                count += 1
    for i in range(n - n % 8, n):
        if feedback:
            v = g[i] + e[i]
            e[i] = v
        else:
            v = g[i]
        m = abs(v)
        if not (m < threshold):
            if count < cap:
                cand[count] = i
                mags[count] = m
                vals[count] = v
            count += 1
    return count


@kernel
def topk_take(cand, vals, picked, index, values, e, feedback):
    """The picked candidates (``picked[j]``: candidate j is among the top k; ``cand``
    ascending) into ``index`` and ``values`` in order, from the candidates' own values
    (``vals``, as ``topk_candidates`` read them: no gather from the bucket); with
    ``feedback``, ``e`` zeroed at them and at every other candidate that is NaN or Inf (the
    only places a non-finite value can be). Returns how many were taken."""
    t = 0
    for j in range(picked.shape[0]):
        v = vals[j]
        if picked[j]:
            index[t] = cand[j]
            values[t] = v
            t += 1
            if feedback:
                e[cand[j]] = 0
        elif feedback and not np.isfinite(v):
            e[cand[j]] = 0
    return t


@kernel
def floyd_bits(stream, n, k, j, used, bitmap):
    """Floyd's sampling of ``k`` of ``n`` positions as NumPy's ``Generator.choice(n, k,
    replace=False)`` draws them: for j from n - k to n - 1, a bounded draw in [0, j] (Lemire's
    multiply-and-reject on the bit generator's 32-bit outputs, ``stream``, from ``used``),
    the position itself unless already drawn, else j; drawn positions are set in ``bitmap``
    (uint64 words). Continues from ``j``; returns (the next j, values of ``stream`` used):
    j < n when the stream ran out."""
    m = stream.shape[0]
    ahead = 16  # draws: the bitmap word of the draw that many ahead is fetched now
    words = np.uint64(bitmap.shape[0])
    while j < n:
        if used + ahead < m:
            guess = (np.uint64(stream[used + ahead]) * (np.uint64(j + ahead) + np.uint64(1))) >> np.uint64(38)
            _prefetch(bitmap, min(guess, words - np.uint64(1)))
        bound = np.uint64(j) + np.uint64(1)
        if j == 0:
            val = np.uint64(0)
        else:
            first = used
            if used >= m:
                return j, first
            prod = np.uint64(stream[used]) * bound
            used += 1
            low = prod & np.uint64(0xFFFFFFFF)
            if low < bound:
                threshold = (np.uint64(0xFFFFFFFF) - np.uint64(j)) % bound
                while low < threshold:
                    if used >= m:
                        return j, first  # this j again, from its first draw, with more stream
                    prod = np.uint64(stream[used]) * bound
                    used += 1
                    low = prod & np.uint64(0xFFFFFFFF)
            val = prod >> np.uint64(32)
        word = val >> np.uint64(6)
        bit = np.uint64(1) << (val & np.uint64(63))
        if bitmap[word] & bit:
            val = np.uint64(j)
            word = val >> np.uint64(6)
            bit = np.uint64(1) << (val & np.uint64(63))
        bitmap[word] |= bit
        j += 1
    return j, used


@kernel
def bitmap_positions(bitmap, index):
    """The set bits of ``bitmap`` in ascending order into ``index`` (two entries longer than
    the count: the first two positions of every word are written whether or not they exist,
    which keeps the loop free of branches the CPU cannot predict), clearing them; returns how
    many."""
    t = 0
    one = np.uint64(1)
    for w in range(bitmap.shape[0]):
        word = bitmap[w]
        bitmap[w] = np.uint64(0)
        base = w * 64
        count = _popcount64(word)
        index[t] = base + _ctz64(word)
        rest = word & (word - one)
        index[t + 1] = base + _ctz64(rest)
        t += min(count, 2)
        if count > 2:
            rest &= rest - one
            while rest:
                index[t] = base + _ctz64(rest)
                t += 1
                rest &= rest - one
    return t
