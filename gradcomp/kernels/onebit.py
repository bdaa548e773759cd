"""The 1-bit chunk code's kernels: sign bits and a mean-magnitude scale per chunk of 512 values,
the operations of ``compressors.quantize.onebit``'s NumPy path in the same order (the same bits).
The worker's encode with its residual (``onebit_encode_chunks``), the slice owner's stage
(``onebit_owner_chunks``, by sign patterns where few ranks allow) and the decode
(``onebit_decode_chunks``). float32 and float64 (numba compiles each).
"""
from __future__ import annotations

import numpy as np

from .chunks import _mean_and_residual
from .half import _values, _wide
from .primitives import _popcount64, _store_fence, _stream, inline, kernel
from .signs import (
    TOTALS_AT_ONCE,
    _abs_lane_total,
    _abs_lane_totals,
    _from_signs,
    _put_word,
    _sign_bits,
    _word,
)

#: the most rows (ranks) whose sign patterns the owner's stage counts (``_pattern_chunk``: 2**N
#: patterns a chunk); above it, every value is decoded and summed
PATTERN_ROWS = 4
_EXACT_SPAN = 2.0 ** 19  # magnitudes within this ratio sum exactly (``_pattern_chunk``)


@inline
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


@inline
def _mean_magnitude(total, n):
    """A chunk's scale from the float64 sum of its ``n`` magnitudes: one expression for both
    owner paths (value by value and by sign patterns), so their bits cannot part."""
    return np.float32(total / n)


@inline
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


@kernel
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


@inline
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


@inline
def _onebit_add(scale, bs, o, add):
    """``o (+)= scale * sign`` for one chunk (``_from_signs``, ``add`` its mode); a NaN scale makes it one
    canonical NaN (a NaN product's sign is not portable)."""
    if np.isnan(scale):
        o[:] = np.nan
        return
    _from_signs(o, bs, o.shape[0] // 8, scale, add)


@inline
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


@inline
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


@kernel
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


@inline
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


@kernel
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


@kernel
def onebit_decode_chunks(scales, bits, out, width, add):
    """``out (+)= scale * sign`` per chunk (the bits as ``onebit_encode_chunks`` packs them); a
    chunk whose scale is NaN becomes one canonical NaN (a NaN product's sign is not portable)."""
    for c in range(scales.shape[0]):
        start = c * width
        o = out[start:start + width]
        _onebit_add(scales[c], bits[start // 8:(start + o.shape[0]) // 8], o, add)


@kernel
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
