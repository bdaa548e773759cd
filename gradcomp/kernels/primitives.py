"""The compile policy and the LLVM intrinsics the kernels share. Imported only where
``gradcomp.kernels.available()`` (this is where numba is loaded).

``kernel``: a compiled entry point (cached on disk by numba, no bounds checks, the GIL
released); ``inline``: a helper inlined into its callers' loops (numba's IR inliner: flags that
are constants in a caller fold there, so one helper serves every variant without a branch in
the loop); ``summing`` and ``summing_inline``: the same with reassociated float sums. The intrinsics are single LLVM instructions numba's own operators do not give: the
half-precision conversions (``half``: F16C ``vcvtps2ph``/``vcvtph2ps`` on x86-64), float bits,
32-bit integer min/max (numba widens int32 arithmetic to 64 bits, which halves vector lanes),
bit counts, a prefetch and non-temporal stores.
"""
from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

kernel = njit(cache=True, boundscheck=False, nogil=True)
inline = njit(inline="always")
#: ``kernel`` and ``inline`` whose float sums LLVM may reassociate (PowerSGD's products: vector
#: partial sums, in an order that does not depend on the arrays' addresses)
summing = njit(cache=True, boundscheck=False, nogil=True, fastmath={"reassoc", "contract"})
summing_inline = njit(inline="always", boundscheck=False, fastmath={"reassoc", "contract"})


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


def _bitcast(source, target):
    """An intrinsic: a ``source`` value's bits read as a ``target`` of the same width (no
    instruction: LLVM's bitcast)."""
    def reinterpret(typingctx, x):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(target))
        return target(source), codegen
    return intrinsic(reinterpret)


_f32_bits = _bitcast(types.float32, types.uint32)
_f32_from_bits = _bitcast(types.uint32, types.float32)
_f64_bits = _bitcast(types.float64, types.int64)
_f64_from_bits = _bitcast(types.int64, types.float64)


def _select32(op):
    """An intrinsic: of two int32, the one that wins ``op`` against the other ("<": the smaller,
    ">": the larger), as an int32."""
    def pick(typingctx, a, b):
        def codegen(context, builder, signature, args):
            return builder.select(builder.icmp_signed(op, args[0], args[1]), args[0], args[1])
        return types.int32(types.int32, types.int32), codegen
    return intrinsic(pick)


_min32 = _select32("<")
_max32 = _select32(">")


@intrinsic
def _abs_bits32(typingctx, x):
    """|x|'s float32 bits as an int32: ordered like |x|, every NaN above infinity."""
    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        return builder.and_(builder.bitcast(args[0], i32), ir.Constant(i32, 0x7FFFFFFF))
    return types.int32(types.float32), codegen


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
