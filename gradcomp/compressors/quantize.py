"""8-bit (or fewer) affine quantization, per tensor or per 512-value channel, allgathered.

Each rank quantizes its own bucket with its own parameters (``offset`` = the chunk minimum, the
zero point; ``scale`` = range / levels), so nothing needs agreeing on before the data moves. One
allgather carries every rank's message, ``[offset, scale per chunk (float32) | codes (uint8)]``
(a codec, see ``codec``); every rank then dequantizes every sender's codes with that sender's
parameters and averages them in float32, in rank order, so all ranks hold the same bits. This is
what PyTorch's quantization hooks do; its traffic grows with the number of ranks.

Error: each code is within ``scale/2`` of its value, so the mean is within the mean of the
senders' ``scale/2`` of the true mean (plus float32 rounding).

Non-finite values: a chunk holding NaN or Inf on any rank has non-finite parameters, which every
rank sees; that chunk becomes NaN in the result on every rank (so a loss scaler notices), and no
other chunk is touched. Per tensor, the chunk is the whole bucket.
"""
from __future__ import annotations

import numpy as np

import ml_dtypes

from ..arrays import array_module, compiled_kernels
from ..params import check_int
from .codec import Codec


def _compiled(*arrays):
    """``gradcomp.jit`` when its compiled quantize kernels can take ``arrays`` (contiguous NumPy
    arrays, numba present and enabled), else None: then the NumPy kernels below are used."""
    if all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays):
        return compiled_kernels()
    return None


def _runs(flags):
    """(first, stop) of each run of consecutive True values in a bool vector."""
    idx = np.flatnonzero(flags)
    for run in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1):
        if run.size:
            yield int(run[0]), int(run[-1]) + 1


class QuantizePerChannel(Codec):
    """Quantize each run of ``channel_size`` consecutive values with its own scale and offset.

    One outlier then only coarsens its own 512 values instead of the whole bucket, which is why
    per-channel error is far lower on heavy-tailed gradients. A bucket whose length is not a
    multiple of ``channel_size`` gets one shorter last chunk; no padding is sent. Costs
    ``8 / channel_size`` extra bytes per value for the parameters (1.6% at 512).

    Traffic: an allgather, ``(N-1) * (n + 8 * chunks)`` bytes per rank, which grows with N.
    """

    collective = "allgather"
    nan_effect = "chunk"

    def __init__(self, bits: int = 8, channel_size: int | None = 512):
        super().__init__()
        self.bits = check_int("bits", bits, 1, 8)
        self.channel_size = None if channel_size is None else check_int("channel_size", channel_size, 1)
        self.levels = (1 << self.bits) - 1

    # -- the codec -----------------------------------------------------------------------------------
    def message_size(self, n):
        rows, _, tail = self._split(n)
        return 8 * (rows + (tail > 0)) + n

    def _views(self, message, n):
        chunks = (self.message_size(n) - n) // 8
        params = message[:8 * chunks].view(np.float32).reshape(2, chunks)
        return params, message[8 * chunks:]

    def encode(self, x, message, workspace):
        params, codes = self._views(message, x.shape[0])
        self.quantize_into(x, params, codes)

    def decode(self, message, out, add=False):
        params, codes = self._views(message, out.shape[0])
        if not add:
            out[...] = 0
        self.dequantize_add(out, params, codes)

    def error_bound(self, inputs, dtype):
        """Each code is within half a step of its value: the mean over senders of half their
        chunk's step, plus float32 rounding of the offsets and the sum."""
        width = self.channel_size or max(inputs.shape[1], 1)
        n = inputs.shape[1]
        half_steps = np.zeros(n)
        for start in range(0, n, width):
            part = inputs[:, start:start + width].astype(np.float32)
            step = (part.max(axis=1) - part.min(axis=1)).astype(np.float64) / self.levels
            half_steps[start:start + width] = step.mean() / 2
        peak = np.abs(inputs).max(initial=0.0)
        eps32 = float(np.finfo(np.float32).eps)
        return half_steps * 1.001 + 8 * eps32 * peak + float(ml_dtypes.finfo(dtype).eps) * np.abs(inputs.mean(axis=0))

    # -- chunking ----------------------------------------------------------------------------------
    def _split(self, n: int):
        """(rows, width, tail): ``rows`` full chunks of ``width`` values, then ``tail`` values."""
        width = self.channel_size if self.channel_size is not None else max(n, 1)
        rows, tail = divmod(n, width)
        return rows, width, tail

    def _chunks(self, x, rows, width):
        """The full chunks as a (rows, width) view and the tail as a (1, tail) view."""
        return x[: rows * width].reshape(rows, width), x[rows * width:].reshape(1, -1)

    # -- quantize / dequantize ---------------------------------------------------------------------
    def quantize(self, x):
        """float32 ``x`` -> (params float32 [2, chunks] = offsets and scales, codes uint8)."""
        xp = array_module(x)
        rows, width, tail = self._split(x.shape[0])
        codes = xp.empty(x.shape[0], dtype=xp.uint8)
        params = xp.empty((2, rows + (tail > 0)), dtype=xp.float32)
        self.quantize_into(x, params, codes)
        return params, codes

    def quantize_into(self, x, params, codes):
        """Write float32 ``x``'s offsets and scales into ``params`` [2, chunks] and its codes into
        ``codes`` (uint8, ``x``'s length)."""
        xp = array_module(x)
        rows, width, tail = self._split(x.shape[0])
        if xp is np:
            jit = _compiled(x) if x.dtype == np.float32 else None
            if jit is not None:
                self._quantize_compiled(jit, x, params, codes, rows, width)
            else:
                self._quantize_blocked(x, params, codes, rows, width)
            return
        parts = zip(self._chunks(x, rows, width), self._chunks(codes, rows, width))
        for i, (part, out) in enumerate(parts):
            if part.size == 0:
                continue
            sl = slice(0, rows) if i == 0 else slice(rows, rows + 1)
            lo = part.min(axis=1)
            hi = part.max(axis=1)
            scale = self._scale(xp, lo, hi)
            inv = self._inverse(xp, scale)
            q = part - lo[:, None]
            self._finish_codes(xp, q, inv)
            out[...] = q
            params[0, sl] = lo
            params[1, sl] = scale

    def _scale(self, xp, lo, hi):
        """Per-chunk scale = (max - min) / levels."""
        with np.errstate(invalid="ignore", over="ignore"):
            return (hi - lo) / xp.float32(self.levels)

    @staticmethod
    def _inverse(xp, scale):
        """The factor that maps (value - offset) to codes; 1 where the chunk is constant."""
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return xp.float32(1.0) / xp.where(scale > 0, scale, xp.float32(1.0))

    def _finish_codes(self, xp, q, inv):
        """q = (x - offset) in place -> rint((x - offset) / scale) clipped to the levels; codes of
        non-finite chunks are 0 (those chunks are flagged by their params)."""
        with np.errstate(invalid="ignore", over="ignore"):
            q *= inv[:, None]
            xp.rint(q, out=q)
            xp.clip(q, 0, self.levels, out=q)
            q[~xp.isfinite(q)] = 0

    # NumPy kernels: the same arithmetic, a block of chunks at a time so the scratch stays in the
    # L2 cache, and rint + float->uint8 done as one float add of 2**23 (which rounds half to even,
    # like rint, and leaves the integer in the low mantissa bits) plus an integer narrowing.
    _BLOCK = 1 << 18  # values per block (1 MiB of float32 scratch: fewer Python round trips)
    _ROUND_MAGIC = np.float32(2.0 ** 23)

    def _pieces(self, n, rows, width):
        """The blocks the NumPy kernels work on, as (start, stop, chunk slice): runs of whole
        chunks of about ``_BLOCK`` values (the tail chunk on its own), or, for chunks longer than a
        block (per tensor, say), block-sized parts that share their chunk's slice."""
        if width <= self._BLOCK:
            per = self._BLOCK // width
            for r0 in range(0, rows, per):
                r1 = min(r0 + per, rows)
                yield r0 * width, r1 * width, slice(r0, r1)
            if n > rows * width:
                yield rows * width, n, slice(rows, rows + 1)
            return
        for c, start in enumerate(range(0, n, width)):
            stop = min(start + width, n)
            for b in range(start, stop, self._BLOCK):
                yield b, min(b + self._BLOCK, stop), slice(c, c + 1)

    def _quantize_compiled(self, jit, x, params, codes, rows, width):
        """The compiled kernel: min, max, scale and codes of each chunk in one pass over it while
        it is in the L1 cache (the NumPy kernels make about ten passes over each block), then the
        NumPy kernels for the chunks it leaves to them (non-finite values, ranges whose scale or
        inverse is not finite, a +0/-0 tie at an extreme), a run of adjacent chunks at a time, so
        every bit is the NumPy path's."""
        redo = np.zeros(params.shape[1], bool)
        if jit.quantize_chunks(x, x.view(np.int32), width, self.levels, params, codes, redo):
            for c0, c1 in _runs(redo):
                start, stop = c0 * width, min(c1 * width, x.shape[0])
                self._quantize_blocked(x[start:stop], params[:, c0:c1], codes[start:stop],
                                       max(min(c1, rows) - c0, 0), width)

    def _quantize_blocked(self, x, params, codes, rows, width):
        scratch = np.empty(min(self._BLOCK, x.shape[0]), np.float32)
        whole_chunks = width <= self._BLOCK  # else each chunk's parameters come first, in one pass
        if not whole_chunks:
            for c, start in enumerate(range(0, x.shape[0], width)):
                part = x[start:start + width]
                lo, hi = part.min(keepdims=True), part.max(keepdims=True)
                params[0, c:c + 1] = lo
                params[1, c:c + 1] = self._scale(np, lo, hi)
        for start, stop, chunks in self._pieces(x.shape[0], rows, width):
            k = chunks.stop - chunks.start
            part, out = x[start:stop].reshape(k, -1), codes[start:stop].reshape(k, -1)
            if whole_chunks:
                params[0, chunks] = part.min(axis=1)
                params[1, chunks] = self._scale(np, params[0, chunks], part.max(axis=1))
            self._encode(part, out, params[0, chunks], params[1, chunks], scratch)

    def _encode(self, part, out, lo, scale, scratch):
        """codes of a (chunks, width) block with per-chunk ``lo`` and ``scale``."""
        inv = self._inverse(np, scale)
        q = scratch[:part.size].reshape(part.shape)
        with np.errstate(invalid="ignore", over="ignore"):
            np.subtract(part, lo[:, None], out=q)
        finite = np.isfinite(lo).all() and np.isfinite(scale).all() and np.isfinite(inv).all()
        if not finite:  # a chunk with NaN/Inf, an overflowing or subnormal range: the reference sequence
            self._finish_codes(np, q, inv)
            out[...] = q
            return
        # Finite chunks need no clip: 0 <= fl(x - lo) <= fl(max - min) = d, and with a finite
        # 1/scale (scale not deep in the subnormals) fl(d * fl(1/fl(d/levels))) is within 4 ulp of
        # ``levels``, so q < levels + 0.5 rounds into [0, levels] (tests compare with the
        # reference sequence bit for bit).
        np.multiply(q, inv[:, None], out=q)
        np.add(q, self._ROUND_MAGIC, out=q)
        np.copyto(out, q.view(np.uint32), casting="unsafe")

    def dequantize_add(self, acc, params, codes):
        """acc += dequantized codes; chunks with non-finite params become NaN."""
        xp = array_module(acc)
        rows, width, tail = self._split(acc.shape[0])
        if xp is np:
            jit = _compiled(acc, params, codes) if acc.dtype == np.float32 else None
            if jit is not None:  # the same two float32 adds per value, in one pass
                jit.dequantize_add_chunks(acc, params, codes, width)
            else:
                self._dequantize_add_blocked(acc, params, codes, rows, width)
            return
        for i, (a, c) in enumerate(zip(self._chunks(acc, rows, width), self._chunks(codes, rows, width))):
            if a.size == 0:
                continue
            sl = slice(0, rows) if i == 0 else slice(rows, rows + 1)
            self._decode_add(xp, a, c, params[0, sl], params[1, sl])

    def _decode_add(self, xp, a, c, lo, scale, scratch=None):
        """a += c * scale + lo for a (chunks, width) block, as two adds (the same float32 roundings
        on every path); chunks with non-finite params become NaN."""
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

    def _dequantize_add_blocked(self, acc, params, codes, rows, width):
        scratch = np.empty(min(self._BLOCK, acc.shape[0]), np.float32)
        for start, stop, chunks in self._pieces(acc.shape[0], rows, width):
            k = chunks.stop - chunks.start
            self._decode_add(np, acc[start:stop].reshape(k, -1), codes[start:stop].reshape(k, -1),
                             params[0, chunks], params[1, chunks], scratch)


class QuantizePerTensor(QuantizePerChannel):
    """One scale and offset for the whole bucket: the smallest message (8 bytes of parameters),
    but one large gradient coarsens every other value in the bucket. See ``QuantizePerChannel``."""

    nan_effect = "bucket"

    def __init__(self, bits: int = 8):
        super().__init__(bits=bits, channel_size=None)
