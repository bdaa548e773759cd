"""The affine 8- and 4-bit chunk codes of float32 (and, from ``quantize64``, float64): one
kernel per stage, each touching the bucket's memory once.

The worker's encode with its residual (``quantize_feedback_chunks``), the slice owner's stage from
the ranks' messages to its own (``quantize_owner_chunks``: decode every row into a chunk in L1,
average, add the owner's residual, encode, keep the error) and the decode of the result
(``dequantize_chunks``, ``unpack4_dequantize_chunks``, ``dequantize_rows_chunks``), writing or
adding. 4-bit codes are packed and unpacked inside them (no code array of the bucket's length).
The decoders take float32 or float64 (numba compiles each); the float32 quantizers rank values
by integer order keys; float64 has its own (``quantize64``).
"""
from __future__ import annotations

import numpy as np

from .chunks import (
    _decode_into,
    _decode_rows,
    _encode_chunk,
    _key_range,
    _keys,
    _packed_part,
    _row_codes,
    _rows_finite,
    _unpack4,
)
from .half import _wide
from .primitives import _store_fence, _stream, inline, kernel


@kernel
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
        if _encode_chunk(xs, xs, n, kmin, kmax, bits[start:start + n], top, zero, False, params, c, codes, ctmp,
                         start, packed):
            redo[c] = True
            redone += 1
    return redone


@kernel
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
        _decode_into(a, cs, a.shape[0], scale, lo, add, zero)


@kernel
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
        _unpack4(_packed_part(packed, start, n), n, ctmp)
        _decode_into(a, ctmp, n, scale, lo, add, zero)


@kernel
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
            _decode_into(a, rows[r, base + start:base + start + n], n, scale, lo, r > 0, zero)
        if size > 1:
            for i in range(n):
                a[i] = a[i] / div


@kernel
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
        _decode_into(tmp, rows[0, base + start:base + start + n], n, scale, lo, False, zero)
        for r in range(1, size):
            lo = row_params[r, 0, c]
            scale = row_params[r, 1, c]
            good = good and np.isfinite(lo) and np.isfinite(scale)
            _decode_into(tmp, rows[r, base + start:base + start + n], n, scale, lo, True, zero)
        if size > 1:
            for i in range(n):
                tmp[i] = tmp[i] / div
        if not good:
            for i in range(n):
                tmp[i] = np.nan
        _stream(acc, start, tmp, n)
    _store_fence()


@kernel
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
            kmin, kmax = _key_range(v, kmin, kmax)
        if _encode_chunk(xs, es, n, kmin, kmax, tmp_bits[:n], top, zero, True, params, c, codes, ctmp, start,
                         packed):
            redo[c] = True
            redone += 1
    return redone


@inline
def _last_row(rows, row_params, chunks, c, start, n, packed, xs, es, feedback, div, ctmp):
    """The last row of chunk ``c`` added as ``_decode_rows`` adds (into zero when it is the
    only one), the sum divided by ``div`` (more than one row), ``es`` added (``feedback``), and
    the range of the result, in one loop; returns the smallest and largest order key."""
    size = rows.shape[0]
    r = size - 1
    lo = row_params[r, c]
    scale = row_params[r, chunks + c]
    cs = _row_codes(rows, r, 8 * chunks, start, n, packed, ctmp)
    if size == 1 and feedback:  # each case its own loop: the flags constants in it
        return _last_row_keys(xs, cs, es, n, scale, lo, div, True, True)
    if size == 1:
        return _last_row_keys(xs, cs, es, n, scale, lo, div, True, False)
    if feedback:
        return _last_row_keys(xs, cs, es, n, scale, lo, div, False, True)
    return _last_row_keys(xs, cs, es, n, scale, lo, div, False, False)


@inline
def _last_row_keys(xs, cs, es, n, scale, lo, div, alone, feedback):
    """``_last_row``'s loop: ``xs = (xs + code * scale) + offset`` (from zero where the row is
    ``alone``, else divided by ``div`` after), plus ``es`` (``feedback``), and the keys' range."""
    zero = np.float32(0.0)
    kmin = np.int32(0x7FFFFFFF)
    kmax = np.int32(-0x80000000)
    for i in range(n):
        if alone:
            v = (zero + np.float32(cs[i]) * scale) + lo
        else:
            v = ((xs[i] + np.float32(cs[i]) * scale) + lo) / div
        if feedback:
            v = v + es[i]
        xs[i] = v
        kmin, kmax = _key_range(v, kmin, kmax)
    return kmin, kmax


@kernel
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
        if _encode_chunk(xs, es, n, kmin, kmax, tmp_bits[:n], top, zero, feedback, params, c, codes, ctmp, start,
                         packed):
            redo[c] = True
            redone += 1
    return redone


# the float64 kernels, for callers that pick a kernel by dtype from this module
from .quantize64 import quantize64_chunks, quantize64_feedback_chunks, quantize64_owner_chunks  # noqa: E402, F401
