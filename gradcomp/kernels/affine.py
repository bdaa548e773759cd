"""Quantization: affine codes of 512-value chunks (offset = the chunk's minimum, scale = range /
levels), and bit packing for codes narrower than a byte. The NumPy kernels, and the one dispatch
(``compiled``) to their compiled form (``gradcomp.kernels.quantize``, ``quantize64``, ``chunks``).

With ``zero`` the grid holds zero exactly (``_zero_grid``): the range widened to include 0,
``levels - 1`` steps across it, the offset a whole number of steps below 0, so a value within half
a step of zero is sent as exactly 0 instead of a fixed offset's rounding. Under error feedback
that is what a small coordinate needs: its residual builds up and goes out now and then as one
step, where a grid without zero sends it a rounding error every step (noise that, we think, an
adaptive optimizer's second moment counts as signal; BENCHMARKS.md section 6: int4 on the LM).

``quantize(x, params, codes, width, levels)`` and ``dequantize(acc, params, codes, width, add)``
pick the fastest kernel once for every quantizer: the compiled one-pass loops (``compiled``) for
contiguous NumPy float32 and float64, else NumPy kernels working a block of chunks at a time (about ten
passes over each block, but in the L2 cache), else whole-array operations (CuPy). All give the
same bits.

Non-finite values: a chunk holding NaN or Inf gets non-finite parameters, which every rank sees;
such a chunk dequantizes to NaN, so a loss scaler notices, and no other chunk is touched.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import ROUND_MAGIC, array_module, load
from .elementwise import zero_non_finite

_BLOCK = 1 << 18  # values per NumPy block (1 MiB of float32 scratch: fewer Python round trips)


def chunk_count(n: int, width: int) -> int:
    return -(-n // width) if n else 0


def compiled(*arrays: Any) -> Any:
    """``gradcomp.kernels.quantize`` (which holds ``quantize64``'s kernels too) when the compiled
    kernels can take ``arrays``: contiguous NumPy arrays, the first one float32 or float64, numba
    present and enabled; else None. The one place the quantizers choose compiled or NumPy."""
    if arrays[0].dtype not in (np.float32, np.float64):
        return None
    return load("quantize", *arrays)


def _runs(flags):
    """(first, stop) of each run of consecutive True values in a bool vector."""
    idx = np.flatnonzero(flags)
    for run in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1):
        if run.size:
            yield int(run[0]), int(run[-1]) + 1


def _split(n: int, width: int):
    rows, tail = divmod(n, width)
    return rows, tail


def _scale(xp, lo, hi, levels):
    with np.errstate(invalid="ignore", over="ignore"):
        return (hi - lo) / xp.float32(levels)


def _zero_grid(xp, lo, hi, levels):
    """(offset, scale) of ``levels - 1`` steps across ``[min(lo, 0), max(hi, 0)]`` with zero on
    the grid: the offset is ``-ceil(-lo / scale)`` steps, all in float32; both NaN where either
    is not finite (the chunk decodes to NaN, as on the range's grid). Comparisons, not
    ``minimum``: a zero of either sign becomes +0 (NumPy's minimum of two signed zeros may return
    either), so every path computes the same bits, and a NaN stays NaN, so its chunk stays flagged."""
    f = np.float32
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        lo, hi = lo.astype(f), hi.astype(f)
        lo = xp.where(lo >= 0, f(0.0), lo)
        hi = xp.where(hi <= 0, f(0.0), hi)
        scale = (hi - lo) / f(levels - 1)
        below = xp.ceil(-lo / xp.where(scale > 0, scale, f(1.0)))
        offset = f(0.0) - below * scale
        # a NaN or Inf chunk: both NaN, one NaN on every path (vector and scalar loops sign NaNs apart)
        lost = ~(xp.isfinite(offset) & xp.isfinite(scale))
        return xp.where(lost, f(np.nan), offset), xp.where(lost, f(np.nan), scale)


def _inverse(xp, scale):
    """The factor that maps (value - offset) to codes; 1 where the chunk is constant."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        return xp.float32(1.0) / xp.where(scale > 0, scale, xp.float32(1.0))


def _finish_codes(xp, q, inv, levels):
    """q = (x - offset) in place -> rint((x - offset) / scale) clipped to the levels; codes of
    non-finite chunks are 0 (those chunks are flagged by their params)."""
    with np.errstate(invalid="ignore", over="ignore"):
        q *= inv[:, None]
        xp.rint(q, out=q)
        xp.clip(q, 0, levels, out=q)
        q[~xp.isfinite(q)] = 0


def _pieces(n, width):
    """The blocks the NumPy kernels work on, as (start, stop, chunk slice): runs of whole chunks
    of about ``_BLOCK`` values (the tail chunk on its own), or, for chunks longer than a block
    (per tensor, say), block-sized parts that share their chunk's slice."""
    rows, _ = _split(n, width)
    if width <= _BLOCK:
        per = _BLOCK // width
        for r0 in range(0, rows, per):
            r1 = min(r0 + per, rows)
            yield r0 * width, r1 * width, slice(r0, r1)
        if n > rows * width:
            yield rows * width, n, slice(rows, rows + 1)
        return
    for c, start in enumerate(range(0, n, width)):
        stop = min(start + width, n)
        for b in range(start, stop, _BLOCK):
            yield b, min(b + _BLOCK, stop), slice(c, c + 1)


def quantize(x, params, codes, width: int, levels: int, zero: bool = False) -> None:
    """Write float32 (or float64) ``x``'s per-chunk offsets and scales into ``params`` (2, chunks)
    and its codes (0..levels) into ``codes`` (uint8, ``x``'s length); ``zero``: on a grid that
    holds zero (see the module)."""
    xp = array_module(x)
    n = x.shape[0]
    if xp is np:
        jit = compiled(x, params, codes)
        if jit is None:
            _quantize_blocked(x, params, codes, width, levels, zero=zero)
            return
        quantize_compiled(jit, x, params, codes, width, levels, zero=zero)
        return
    rows, _ = _split(n, width)
    parts = ((x[:rows * width].reshape(rows, width), codes[:rows * width].reshape(rows, width), slice(0, rows)),
             (x[rows * width:].reshape(1, -1), codes[rows * width:].reshape(1, -1), slice(rows, rows + 1)))
    for part, out, sl in parts:
        if part.size == 0:
            continue
        # in float32 where the NumPy kernels are (float64 chunks too): the offset rounded first,
        # the scale from it, then x - offset (the parameters sent are these float32 values)
        lo, hi = part.min(axis=1).astype(np.float32, copy=False), part.max(axis=1)
        if zero:
            lo, scale = _zero_grid(xp, lo, hi, levels)
        else:
            scale = _scale(xp, lo, hi, levels).astype(np.float32, copy=False)
        q = (part - lo[:, None]).astype(np.float32, copy=False)
        _finish_codes(xp, q, _inverse(xp, scale), levels)
        out[...] = q
        params[0, sl] = lo
        params[1, sl] = scale


def quantize_compiled(jit, x, params, codes, width: int, levels: int, packed: bool = False,
                      ctmp=None, zero: bool = False) -> None:
    """``quantize`` by the compiled kernels (contiguous NumPy float32 or float64), the codes two to
    a byte where ``packed`` (``ctmp``: uint8 scratch of a chunk); the chunks they leave to NumPy
    (``redone``) redone here."""
    if ctmp is None:
        ctmp = np.empty(width if packed else 1, np.uint8)
    redo = np.zeros(params.shape[1], np.uint8)
    if x.dtype == np.float32:
        marked = jit.quantize_chunks(x, x.view(np.int32), width, levels, params, codes, redo, packed, ctmp, zero)
    else:
        marked = jit.quantize64_chunks(x, x.view(np.int64), width, levels, params, codes, redo, packed, ctmp,
                                       width > _BLOCK, zero)
    if marked:
        redone(redo, x.shape[0], width, levels, params, codes, packed,
               lambda part: x[part], None, zero)


def redone(redo, n: int, width: int, levels: int, params, codes, packed: bool, values, residual,
           zero: bool = False) -> None:
    """Redo the chunks a compiled kernel marked (``redo``), by the NumPy kernels: quantize
    ``values(part)`` (the chunks' values, a slice of the bucket's) into ``params`` and ``codes``
    (packed where ``packed``) and, with ``residual`` (the chunks' residual, ``values`` then
    without it), keep the error there as the runner's steps do. The marks of the float64 kernels
    say why (``kernels.chunks.REDO_*``): a chunk whose rounding depends on its NumPy block takes that
    block's path (the reference where the block holds a non-finite chunk)."""
    from .chunks import REDO_BAD, REDO_ROUNDING

    rows = n // width
    per = max(1, _BLOCK // width) if width <= _BLOCK else 1

    def block_bad(c: int) -> bool:
        if c >= rows or width > _BLOCK:  # the tail chunk, or chunks longer than a block: alone
            return bool(redo[c] == REDO_BAD)
        b0 = c // per * per
        return bool((redo[b0:min(b0 + per, rows)] == REDO_BAD).any())

    rounding = redo == REDO_ROUNDING
    runs = [(c0, c1, False) for c0, c1 in _runs(redo.astype(bool) & ~rounding)]
    runs += [(c, c + 1, block_bad(c)) for c in np.flatnonzero(rounding).tolist()]
    for c0, c1, reference in runs:
        part = slice(c0 * width, min(c1 * width, n))
        xs = values(part)
        if residual is not None:
            xs = xs + residual[part]
        count = part.stop - part.start
        out = np.empty(count, np.uint8) if packed else codes[part]
        _quantize_blocked(xs, params[:, c0:c1], out, width, levels, reference, zero)
        if residual is not None:
            own = np.zeros_like(xs)
            dequantize(own, params[:, c0:c1], out, width, add=True)
            with np.errstate(invalid="ignore", over="ignore"):
                np.subtract(xs, own, out=residual[part])
            zero_non_finite(residual[part])  # the other chunks' residuals are finite
        if packed:
            padded = np.zeros(count + count % 2, np.uint8)
            padded[:count] = out
            pack4(padded, codes[part.start // 2:part.start // 2 + padded.shape[0] // 2])


def _quantize_blocked(x, params, codes, width, levels, reference=False, zero=False):
    """NumPy's kernels; ``zero``: the grid holding zero, whose codes may need the clip (the
    reference sequence)."""
    scratch = np.empty(min(_BLOCK, x.shape[0]), np.float32)
    whole_chunks = width <= _BLOCK  # else each chunk's parameters come first, in one pass
    if not whole_chunks:
        for c, start in enumerate(range(0, x.shape[0], width)):
            part = x[start:start + width]
            lo, hi = part.min(keepdims=True), part.max(keepdims=True)
            if zero:
                params[:, c:c + 1] = _zero_grid(np, lo, hi, levels)
            else:
                params[0, c:c + 1] = lo
                params[1, c:c + 1] = _scale(np, lo, hi, levels)
    for start, stop, chunks in _pieces(x.shape[0], width):
        k = chunks.stop - chunks.start
        part, out = x[start:stop].reshape(k, -1), codes[start:stop].reshape(k, -1)
        if whole_chunks and zero:
            params[:, chunks] = _zero_grid(np, part.min(axis=1), part.max(axis=1), levels)
        elif whole_chunks:
            params[0, chunks] = part.min(axis=1)
            params[1, chunks] = _scale(np, params[0, chunks], part.max(axis=1), levels)
        _encode_block(part, out, params[0, chunks], params[1, chunks], scratch, levels, reference or zero)


def _encode_block(part, out, lo, scale, scratch, levels, reference=False):
    """codes of a (chunks, width) block with per-chunk ``lo`` and ``scale``; ``reference``: the
    reference sequence even where every chunk is finite (what the block of a float64 chunk that
    was redone alone took, see ``redone``)."""
    inv = _inverse(np, scale)
    q = scratch[:part.size].reshape(part.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        np.subtract(part, lo[:, None], out=q)
    finite = np.isfinite(lo).all() and np.isfinite(scale).all() and np.isfinite(inv).all()
    if reference or not finite:  # a chunk with NaN/Inf, an overflowing or subnormal range: the reference
        _finish_codes(np, q, inv, levels)
        out[...] = q
        return
    # Finite chunks need no clip: 0 <= fl(x - lo) <= fl(max - min) = d, and with a finite 1/scale
    # fl(d * fl(1/fl(d/levels))) is within 4 ulp of ``levels``, so q < levels + 0.5 rounds into
    # [0, levels]; rint + narrowing is one float add of 2**23 (round half to even, the integer in
    # the low mantissa bits) and an integer copy (tests compare with the reference bit for bit).
    np.multiply(q, inv[:, None], out=q)
    np.add(q, ROUND_MAGIC, out=q)
    np.copyto(out, q.view(np.uint32), casting="unsafe")


def dequantize(acc, params, codes, width: int, add: bool = False) -> None:
    """``acc (+)= codes * scale + offset`` per chunk, as two float32 roundings on every path;
    chunks with non-finite parameters become NaN."""
    xp = array_module(acc)
    if xp is np:
        jit = compiled(acc, params, codes)
        if jit is not None:
            jit.dequantize_chunks(acc, params, codes, width, add)
            return
    if not add:
        acc[...] = 0
    if xp is np:
        scratch = np.empty(min(_BLOCK, acc.shape[0]), np.float32)
        for start, stop, chunks in _pieces(acc.shape[0], width):
            k = chunks.stop - chunks.start
            _decode_add(np, acc[start:stop].reshape(k, -1), codes[start:stop].reshape(k, -1),
                        params[0, chunks], params[1, chunks], scratch)
        return
    rows, _ = _split(acc.shape[0], width)
    parts = ((acc[:rows * width].reshape(rows, width), codes[:rows * width].reshape(rows, width), slice(0, rows)),
             (acc[rows * width:].reshape(1, -1), codes[rows * width:].reshape(1, -1), slice(rows, rows + 1)))
    for a, c, sl in parts:
        if a.size:
            _decode_add(xp, a, c, params[0, sl], params[1, sl])


def _decode_add(xp, a, c, lo, scale, scratch=None):
    with np.errstate(invalid="ignore", over="ignore"):
        if scratch is None:
            a += c * scale[:, None]
        else:
            t = scratch[:a.size].reshape(a.shape)
            np.copyto(t, c)  # uint8 -> float32, exact
            np.multiply(t, scale[:, None], out=t)
            np.add(a, t, out=a)
        a += lo[:, None]
    bad = ~(xp.isfinite(lo) & xp.isfinite(scale))
    if bad.any():
        a[bad] = xp.nan


# ---------------------------------------------------------------------------------------------
# codes narrower than a byte
# ---------------------------------------------------------------------------------------------
def pack4(codes, out) -> None:
    """Two 4-bit codes per byte (even index in the low nibble); ``codes`` has an even length."""
    xp = array_module(codes)
    xp.left_shift(codes[1::2], 4, out=out)
    xp.bitwise_or(out, codes[0::2], out=out)


def unpack4(packed, out) -> None:
    xp = array_module(packed)
    xp.bitwise_and(packed, 15, out=out[0::2])
    xp.right_shift(packed, 4, out=out[1::2])
