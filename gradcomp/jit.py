"""Compiled element-wise kernels for half precision, and the sparsifiers' one-pass kernels,
through numba (LLVM), when it is installed.

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

The sparsifiers' kernels (``topk_*``, ``randomk_*``, ``scatter_into``) fold top-k's and
random-k's passes over the bucket into one: the residual added, the selection, the NaN check and
the gather in one read, the output written once (``compressors.sparse`` says what each replaces,
with the same bits).

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
    from numba.core import cgutils
    from numba.extending import intrinsic
except ImportError:  # pragma: no cover - exercised by GRADCOMP_JIT=0 instead
    njit = None  # type: ignore[assignment]  # no numba: no kernels (available() is False)

_ok = None

#: an output array of at least this many bytes is written around the caches (``stream``):
#: it is larger than a core's share of the last-level cache, so it would be evicted before
#: anything reads it, and a plain store first reads every line it writes (twice the traffic)
STREAM_BYTES = 4 << 20


def stream(out) -> bool:
    """Whether a kernel writing all of ``out`` should do it with ``_stream`` (``STREAM_BYTES``)."""
    return out.nbytes >= STREAM_BYTES



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

    @intrinsic
    def _f64_from_bits(typingctx, u):
        """int64 bits -> the float64 they encode."""
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType())
        return types.float64(types.int64), codegen

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


if njit is not None:

    @intrinsic
    def _f64_bits(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.IntType(64))
        return types.int64(types.float64), codegen

    @intrinsic
    def _abs_bits32(typingctx, x):
        """|x|'s float32 bits as an int32: ordered like |x|, every NaN above infinity."""
        def codegen(context, builder, signature, args):
            i32 = ir.IntType(32)
            return builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))
        return types.int32(types.float32), codegen

    @intrinsic
    def _max32(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return builder.select(builder.icmp_signed(">", args[0], args[1]), args[0], args[1])
        return types.int32(types.int32, types.int32), codegen

    @intrinsic
    def _ctz64(typingctx, x):
        """The number of trailing zero bits of a uint64 (64 for zero)."""
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            cttz = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]),
                                                  "llvm.cttz.i64")
            return builder.call(cttz, [args[0], ir.Constant(ir.IntType(1), 0)])
        return types.int64(types.uint64), codegen

    @intrinsic
    def _prefetch(typingctx, array, index):
        """A hint: ``array[index]`` (uint64, in bounds or not) will be written soon."""
        def codegen(context, builder, signature, args):
            data = context.make_array(signature.args[0])(context, builder, args[0]).data
            i8p = ir.IntType(8).as_pointer()
            i32 = ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0i8")
            ptr = builder.bitcast(builder.gep(data, [args[1]]), i8p)
            builder.call(fn, [ptr, ir.Constant(i32, 1), ir.Constant(i32, 3), ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return types.none(array, index), codegen

    @intrinsic
    def _popcount64(typingctx, x):
        def codegen(context, builder, signature, args):
            i64 = ir.IntType(64)
            ctpop = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i64, [i64]), "llvm.ctpop.i64")
            return builder.call(ctpop, [args[0]])
        return types.int64(types.uint64), codegen

    @intrinsic
    def _stream(typingctx, dst, start, src, n):
        """``dst[start:start + n] = src[:n]`` (both contiguous 1-d, one float or integer dtype;
        ``src`` a chunk in the L1 cache) with non-temporal stores of 16 bytes where ``dst`` is
        16-byte aligned there (NumPy's arrays are, and so is every chunk of a multiple of 16
        bytes), plain stores for the rest: the store buffers combine consecutive stores into
        whole lines, which go to memory without being read first (a plain store reads every line
        it writes). Stores of whole 64-byte lines would need 64-byte alignment, which an array
        offset by 16 bytes only gets part of the way through each chunk, and mixing both kinds of
        store on one line is slower than either. The caller ends the kernel with
        ``_store_fence``."""
        if not (isinstance(dst, types.Array) and isinstance(src, types.Array) and dst.ndim == 1
                and src.ndim == 1 and dst.dtype == src.dtype and dst.layout == "C" and src.layout == "C"):
            return None

        def codegen(context, builder, signature, args):
            dty, sty = signature.args[0], signature.args[2]
            elem = context.get_data_type(dty.dtype)
            size = context.get_abi_sizeof(elem)
            lanes = 16 // size
            vec = ir.VectorType(elem, lanes)
            i64 = ir.IntType(64)
            dd = context.make_array(dty)(context, builder, args[0]).data
            sd = context.make_array(sty)(context, builder, args[2]).data
            start = builder.sext(args[1], i64) if args[1].type.width < 64 else args[1]
            n = builder.sext(args[3], i64) if args[3].type.width < 64 else args[3]
            base = builder.gep(dd, [start])
            aligned = builder.icmp_unsigned("==", builder.and_(builder.ptrtoint(base, i64), ir.Constant(i64, 15)),
                                            ir.Constant(i64, 0))
            groups = builder.select(aligned, builder.udiv(n, ir.Constant(i64, lanes)), ir.Constant(i64, 0))
            body_end = builder.mul(groups, ir.Constant(i64, lanes))
            nt = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            with cgutils.for_range(builder, groups) as loop:
                at = builder.mul(loop.index, ir.Constant(i64, lanes))
                v = builder.load(builder.bitcast(builder.gep(sd, [at]), vec.as_pointer()), align=size)
                store = builder.store(v, builder.bitcast(builder.gep(base, [at]), vec.as_pointer()), align=16)
                store.set_metadata("nontemporal", nt)
            with cgutils.for_range(builder, builder.sub(n, body_end)) as loop:
                at = builder.add(body_end, loop.index)
                builder.store(builder.load(builder.gep(sd, [at])), builder.gep(base, [at]))
            return context.get_dummy_value()
        return types.none(dst, start, src, n), codegen

    @intrinsic
    def _store_fence(typingctx):
        """A full fence after a kernel's ``_stream`` stores: non-temporal stores are weakly
        ordered, and whoever reads the output next (another thread, MPI) must see them."""
        def codegen(context, builder, signature, args):
            builder.fence("seq_cst")
            return context.get_dummy_value()
        return types.none(), codegen

    _ABS64 = np.int64(0x7FFFFFFFFFFFFFFF)

    @njit(inline="always")
    def _absmax_block(gs, es, m, feedback, top):
        """``es = gs + es`` (``feedback``) over a block, and the largest |value|'s bits."""
        if feedback:
            for i in range(m):
                v = gs[i] + es[i]
                es[i] = v
                top = _max32(top, _abs_bits32(v))
        else:
            for i in range(m):
                top = _max32(top, _abs_bits32(gs[i]))
        return top

    @njit(inline="always")
    def _absmax_block64(gs, es, m, feedback, top):
        if feedback:
            for i in range(m):
                v = gs[i] + es[i]
                es[i] = v
                top = max(top, _f64_bits(v) & _ABS64)
        else:
            for i in range(m):
                top = max(top, _f64_bits(gs[i]) & _ABS64)
        return top

    @njit(inline="always")
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

    @_kernel
    def randomk_gather(g, e, feedback, index, values, block):
        """random-k's encode in one pass over a float32 bucket, a block (in L1) at a time:
        ``e = g + e`` where ``feedback``, the values at ``index`` (ascending) into ``values`` and,
        with ``feedback``, ``e`` zeroed there; returns the bits of the largest |value| (above
        infinity's when a value is NaN), from which the caller knows whether the bucket's sum is
        finite (``sparse._sum_is_finite``)."""
        n = g.shape[0]
        top = np.int32(0)
        t = 0
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            gs = g[b0:b1]
            es = e[b0:b1]
            top = _absmax_block(gs, es, b1 - b0, feedback, top)
            t = _gather_block(gs, es, b0, b1, feedback, index, values, t)
        return np.int64(top)

    @_kernel
    def randomk_gather64(g, e, feedback, index, values, block):
        """``randomk_gather`` of a float64 bucket (the bits as int64)."""
        n = g.shape[0]
        top = np.int64(0)
        t = 0
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            gs = g[b0:b1]
            es = e[b0:b1]
            top = _absmax_block64(gs, es, b1 - b0, feedback, top)
            t = _gather_block(gs, es, b0, b1, feedback, index, values, t)
        return top

    @_kernel
    def scatter_into(out, index, values, block, add):
        """``out = 0`` then ``out[index] += values`` (``index`` ascending, no repeats; ``add``: no
        zeroing, just the adds), a block at a time: one write of ``out``."""
        n = out.shape[0]
        k = index.shape[0]
        zero = np.zeros(1, out.dtype)[0]
        t = 0
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            os = out[b0:b1]
            if not add:
                for i in range(b1 - b0):
                    os[i] = zero
            while t < k and index[t] < b1:
                j = index[t] - b0
                os[j] = os[j] + values[t]
                t += 1

    @_kernel
    def scatter_into_streamed(out, index, values, tmp):
        """``scatter_into`` without ``add``, a block of ``len(tmp)`` values at a time made in
        ``tmp`` (in the L1 cache: zeros, then the values' ``0 + v``) and stored with ``_stream``:
        for a large ``out``, whose lines are then not read before they are written."""
        n = out.shape[0]
        k = index.shape[0]
        block = tmp.shape[0]
        zero = np.zeros(1, out.dtype)[0]
        t = 0
        for b0 in range(0, n, block):
            b1 = min(b0 + block, n)
            for i in range(block):
                tmp[i] = zero
            while t < k and index[t] < b1:
                j = index[t] - b0
                tmp[j] = tmp[j] + values[t]
                t += 1
            _stream(out, b0, tmp, b1 - b0)
        _store_fence()

    @_kernel
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

    @_kernel
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

    @_kernel
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

    @_kernel
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

    @_kernel
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
