"""The affine chunk codes of float64: NumPy's float64 sequence (``kernels._quantize_blocked``),
which rounds the offset to float32 first (``_chunk_range64``); ``redo`` marks say which chunks
are left to NumPy, and why (``chunks.REDO_*``).
"""
from __future__ import annotations

import numpy as np

from . import ROUND_MAGIC
from .chunks import (
    REDO_BAD,
    REDO_ROUNDING,
    REDO_TIE,
    _codes_of,
    _decode_rows,
    _has_both_zeros,
    _keep_error,
    _mean_and_residual,
    _order_key64,
    _pack4,
    _packed_part,
    _rows_finite,
    _zero_grid32,
)
from .primitives import _f32_bits, _f64_from_bits, inline, kernel


# ---------------------------------------------------------------------------------------------
# float64: NumPy's sequence (kernels._quantize_blocked) on float64 values
# ---------------------------------------------------------------------------------------------
@inline
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
        elif not zero and (kmin == np.int64(-1) or kmax == np.int64(0)) and _has_both_zeros(bs):
            mark = REDO_TIE
    return lo, scale, inv, mark


@inline
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
        cs[i] = np.uint8(_f32_bits(q + ROUND_MAGIC) & np.uint32(0xFF))
    if odd:
        return REDO_ROUNDING, lo, scale
    return 0, lo, scale


@kernel
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


@kernel
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


@kernel
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
