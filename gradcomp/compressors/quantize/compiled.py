"""Compiled (numba) kernels of affine chunk quantization: one pass per 512-value chunk while it is
in the L1 cache, the float32 operations of the NumPy kernels (``kernels``) in the same order, so
the bits are the same. Only imported where ``gradcomp.jit.available()``."""
from __future__ import annotations

import numpy as np
from numba import njit

from ...jit import _f32_from_bits

_kernel = njit(cache=True, boundscheck=False, nogil=True)

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

@njit(inline="always")
def _chunk_range(bs, top):
    """(offset, scale, 1/scale or 1, whether the NumPy kernels must redo the chunk) of a chunk's
    float32 bits ``bs``: the minimum and maximum by order keys, scale = range / levels. A chunk is
    redone for a NaN or Inf, a scale or inverse that is not finite, and an extreme that is a zero
    held with both signs (NumPy's SIMD min may return either zero)."""
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
    bad = not (kmax < _INF_KEY and kmin > _NEG_INF_KEY and np.isfinite(scale) and np.isfinite(inv))
    if not bad and (kmin == np.int32(-1) or kmax == np.int32(0)):
        bad = _has_both_zeros(bs)
    return lo, scale, inv, bad


@njit(inline="always")
def _quantize_chunk(xs, bs, cs, n, top, params, c):
    """Chunk ``c``'s parameters into ``params`` and, unless the chunk must be redone, its ``n``
    codes ``clip(rint((x - min) * (1 / scale)), 0, levels)`` into ``cs``; returns (redo, min,
    scale). ``n`` is passed, not read from a slice: LLVM vectorizes the fused caller's loops only
    with one shared bound."""
    lo, scale, inv, bad = _chunk_range(bs, top)
    params[0, c] = lo
    params[1, c] = scale
    if not bad:
        for i in range(n):
            q = np.rint((xs[i] - lo) * inv)
            cs[i] = np.uint8(min(max(q, np.float32(0.0)), top))
    return bad, lo, scale

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
        if _quantize_chunk(xs, bs, cs, xs.shape[0], top, params, c)[0]:
            redo[c] = True
            redone += 1
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


@_kernel
def quantize_feedback_chunks(g, e, width, levels, params, codes, redo, tmp, tmp_bits):
    """Error feedback fused with ``quantize_chunks``: per chunk, ``x = g + e`` (kept in ``tmp``,
    in the L1 cache), its parameters and codes, then ``e = x - (codes * scale + offset)`` with the
    NumPy kernels' roundings: one pass over ``g`` and ``e`` where the unfused sequence makes
    about five. Chunks marked in ``redo`` (as ``quantize_chunks`` marks them) are left untouched,
    ``e`` included, for the NumPy sequence. Returns how many were marked."""
    redone = 0
    top = np.float32(levels)
    for c in range(params.shape[1]):
        start = c * width
        gs = g[start:start + width]
        es = e[start:start + width]
        cs = codes[start:start + width]
        n = gs.shape[0]
        xs = tmp[:n]
        bs = tmp_bits[:n]
        for i in range(n):
            xs[i] = gs[i] + es[i]
        bad, lo, scale = _quantize_chunk(xs, bs, cs, n, top, params, c)
        if bad:
            redo[c] = True
            redone += 1
            continue
        for i in range(n):
            es[i] = xs[i] - ((np.float32(0.0) + np.float32(cs[i]) * scale) + lo)
    return redone


@_kernel
def unpack4_dequantize_chunks(acc, params, packed, width, add):
    """``acc (+)= code * scale + offset`` with the codes two to a byte (even index in the low
    nibble): ``dequantize_add_chunks`` without unpacking first. ``width`` is even."""
    for c in range(params.shape[1]):
        start = c * width
        a = acc[start:start + width]
        ps = packed[start // 2:(start + width) // 2 + 1]
        lo = params[0, c]
        scale = params[1, c]
        if not (np.isfinite(lo) and np.isfinite(scale)):
            a[:] = np.float32(np.nan)
            continue
        for j in range(a.shape[0] // 2):
            byte = ps[j]
            low = np.float32(byte & np.uint8(15))
            high = np.float32(byte >> np.uint8(4))
            if add:
                a[2 * j] = (a[2 * j] + low * scale) + lo
                a[2 * j + 1] = (a[2 * j + 1] + high * scale) + lo
            else:
                a[2 * j] = (np.float32(0.0) + low * scale) + lo
                a[2 * j + 1] = (np.float32(0.0) + high * scale) + lo


#: multiplying 8 bytes of 0 or 1 (a uint64, little-endian) by this gathers byte k's bit into bit
#: 56 + k, with no carries between the partial products: the 8 signs packed in one multiply
_GATHER_BITS = np.uint64(0x0102040810204080)


@njit(inline="always")
def _onebit_chunk(xs, n, es, feedback, flags, bs):
    """Encode the ``n`` values of ``xs`` (a chunk, in the L1 cache): its mean magnitude (float64,
    eight lanes: lane k takes values 8j + k in order, then the lanes in order, as ``onebit`` does
    in NumPy), its signs packed into ``bs`` (value 8j + k is bit k of byte j, 1 = not negative),
    and with ``feedback`` ``es = xs - scale * sign``. Returns the scale. Separate loops, each one
    LLVM vectorizes (a fused loop does not)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    for j in range(n // 8):
        b = 8 * j
        a0 += abs(np.float64(xs[b]))
        a1 += abs(np.float64(xs[b + 1]))
        a2 += abs(np.float64(xs[b + 2]))
        a3 += abs(np.float64(xs[b + 3]))
        a4 += abs(np.float64(xs[b + 4]))
        a5 += abs(np.float64(xs[b + 5]))
        a6 += abs(np.float64(xs[b + 6]))
        a7 += abs(np.float64(xs[b + 7]))
    total = ((((((a0 + a1) + a2) + a3) + a4) + a5) + a6) + a7
    scale = np.float32(total / n)
    fs = flags[:n]
    for i in range(n):
        fs[i] = np.uint8(xs[i] >= np.float32(0.0))
    eights = flags.view(np.uint64)
    for j in range(n // 8):
        bs[j] = np.uint8((eights[j] * _GATHER_BITS) >> np.uint64(56))
    if feedback:
        neg = -scale
        for i in range(n):
            es[i] = xs[i] - (scale if xs[i] >= np.float32(0.0) else neg)
    return scale


@_kernel
def onebit_encode_chunks(g, e, width, scales, bits, feedback, tmp, flags):
    """Sign bits and a mean-magnitude scale per chunk (``_onebit_chunk``); with ``feedback``,
    ``x = g + e`` first and ``e = x - scale * sign`` after. ``width`` and every chunk's length
    are multiples of 8; ``tmp`` (float32) and ``flags`` (uint8) hold ``width`` values. Returns
    how many chunks have a non-finite scale: only those can leave a non-finite residual
    (elsewhere ``|e| <= max(|x|, scale)``)."""
    bad = 0
    for c in range(scales.shape[0]):
        start = c * width
        gs = g[start:start + width]
        n = gs.shape[0]
        xs = tmp[:n]
        es = e[start:start + n]
        if feedback:
            for i in range(n):
                xs[i] = gs[i] + es[i]
        else:
            for i in range(n):
                xs[i] = gs[i]
        scale = _onebit_chunk(xs, n, es, feedback, flags, bits[start // 8:(start + n) // 8])
        scales[c] = scale
        if not np.isfinite(scale):
            bad += 1
    return bad


@njit(inline="always")
def _onebit_add(scale, bs, o, add):
    """``o (+)= scale * sign`` for one chunk; a NaN scale makes it one canonical NaN (a NaN
    product's sign is not portable)."""
    if np.isnan(scale):
        o[:] = np.float32(np.nan)
        return
    for j in range(bs.shape[0]):
        byte = bs[j]
        for k in range(8):
            bit = (byte >> np.uint8(k)) & np.uint8(1)
            value = scale if bit else -scale
            if add:
                o[8 * j + k] += value
            else:
                o[8 * j + k] = value


@_kernel
def onebit_owner_chunks(rows, chunks, width, n, e, scales, bits, tmp, flags):
    """The slice owner's stage in one pass per chunk: the ``rows`` (one message per rank: float32
    scales of ``chunks`` chunks, then the sign bits of ``n`` values) decoded and summed in rank
    order from 0.0, divided by the number of rows, ``e`` added, encoded into ``scales`` and
    ``bits`` and ``e`` left with the error: the operations of decoding each row into a zeroed
    slice, dividing and ``onebit_encode_chunks`` with feedback, in the same order, without the
    slice-sized sum. Returns the count of non-finite scales, as that kernel."""
    size = rows.shape[0]
    row_scales = [rows[r, :4 * chunks].view(np.float32) for r in range(size)]
    bad = 0
    for c in range(chunks):
        start = c * width
        m = min(width, n - start)
        xs = tmp[:m]
        for i in range(m):
            xs[i] = np.float32(0.0)
        for r in range(size):
            _onebit_add(row_scales[r][c], rows[r, 4 * chunks + start // 8:4 * chunks + (start + m) // 8], xs, True)
        if size > 1:
            div = np.float32(size)
            for i in range(m):
                xs[i] = xs[i] / div
        es = e[start:start + m]
        for i in range(m):
            xs[i] = xs[i] + es[i]
        scale = _onebit_chunk(xs, m, es, True, flags, bits[start // 8:(start + m) // 8])
        scales[c] = scale
        if not np.isfinite(scale):
            bad += 1
    return bad


@_kernel
def onebit_decode_chunks(scales, bits, out, width, add):
    """``out (+)= scale * sign`` per chunk (the bits as ``onebit_encode_chunks`` packs them); a
    chunk whose scale is NaN becomes one canonical NaN (a NaN product's sign is not portable)."""
    for c in range(scales.shape[0]):
        start = c * width
        o = out[start:start + width]
        _onebit_add(scales[c], bits[start // 8:(start + o.shape[0]) // 8], o, add)
