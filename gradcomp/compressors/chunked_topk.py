"""Chunked top-k in a few bits: the sparse exchange of SparseLoCo (Sarfi et al. 2025).

A bucket is cut into chunks of ``chunk`` consecutive values (4096 by default; the last one may be
shorter). Each chunk sends its ``k = density * chunk`` largest magnitudes, each as a ``bits``-bit
code (a sign and one of ``L = 2 ** (bits - 1)`` levels) and its position in the chunk in
``ceil(log2(chunk))`` bits, plus one float32 scale: the levels are ``(j + 1/2) * s`` for
``j < L``, with ``s`` the chunk's largest kept magnitude over ``L - 1/2``, so the largest value is
sent exactly and the others to the nearest level. At 2 bits and 64 of 4096 that is 116 bytes for
16 KiB of float32: 141x, before the local steps' own factor.

Positions differ from rank to rank, so the messages are allgathered and every rank decodes all of
them in rank order (the same bits everywhere). It is meant for local steps' outer exchange
(``gradcomp.optim.sparseloco``), under error feedback whose residual decays (SparseLoCo's
accumulator, ``ErrorFeedback(decay=)``): what a chunk does not send stays in the accumulator.

Which values a chunk keeps does not depend on the CPU: among magnitudes tied with the ``k``-th
largest, the first positions (``np.partition`` gives the ``k``-th value, which is unique; the
mask that follows is exact), and NaN counts as the largest (its chunk then decodes to NaN).
"""
from __future__ import annotations

import math

import numpy as np

from ..arrays import Array, DTypeLike, array_module
from ..comm import Workspace
from ..params import check_choice, check_float, check_int
from .codec import Codec

#: SparseLoCo's chunk and bits (64 of each 4096 values in the paper's setting)
CHUNK, BITS = 4096, 2


def pack(values: Array, bits: int, out: Array) -> None:
    """``values`` (unsigned, each below ``2 ** bits``) written into the bytes ``out``, ``bits``
    bits each, least significant first; ``out`` holds ``ceil(values.size * bits / 8)`` bytes."""
    xp = array_module(values)
    shifts = xp.arange(bits, dtype=np.uint32)
    flat = ((values.reshape(-1, 1).astype(np.uint32) >> shifts) & 1).astype(np.uint8).reshape(-1)
    padded = xp.zeros(out.shape[0] * 8, np.uint8)
    padded[:flat.shape[0]] = flat
    weights = (1 << xp.arange(8, dtype=np.uint8)).astype(np.uint8)
    out[...] = (padded.reshape(-1, 8) * weights).sum(axis=1, dtype=np.uint32).astype(np.uint8)


def unpack(packed: Array, bits: int, count: int) -> Array:
    """The ``count`` values of ``bits`` bits each that ``pack`` wrote into ``packed`` (uint32)."""
    xp = array_module(packed)
    flat = ((packed.reshape(-1, 1) >> xp.arange(8, dtype=np.uint8)) & 1).reshape(-1)[:count * bits]
    weights = (1 << xp.arange(bits, dtype=np.uint32)).astype(np.uint32)
    return (flat.reshape(count, bits).astype(np.uint32) * weights).sum(axis=1, dtype=np.uint32)


class ChunkedTopK(Codec):
    """Each chunk's ``density`` largest magnitudes in ``bits``-bit codes with their positions and
    one scale (see the module docstring); allgathered, summed in rank order."""

    collective = "allgather"
    nan_effect = "bucket"  # a NaN makes its chunk NaN, and a chunk may span tensors
    partial_update = True
    relative_error_limit = 0.995  # without error feedback: the top 1.6% of each chunk, 2 bits each

    def __init__(self, density: float = 1 / 64, chunk: int = CHUNK, bits: int = BITS):
        super().__init__()
        self.density = check_float("density", density, above=0, maximum=1)
        self.chunk = check_int("chunk", chunk, 2, 1 << 24)
        self.bits = check_choice("bits", bits, (2, 4))
        self.k = min(self.chunk, max(1, round(self.density * self.chunk)))
        self.position_bits = max(1, math.ceil(math.log2(self.chunk)))

    def compute_dtype(self, dtype: DTypeLike) -> np.dtype:
        return np.dtype(np.float32)

    def _sizes(self, n: int) -> tuple[int, int, int, int]:
        """Chunks, kept values, and the bytes of the codes and of the positions, for ``n`` values."""
        chunks = -(-n // self.chunk)
        kept = chunks * self.k
        return chunks, kept, -(-kept * self.bits // 8), -(-kept * self.position_bits // 8)

    def message_size(self, n: int) -> int:
        chunks, _, codes, positions = self._sizes(n)
        return 4 * chunks + codes + positions

    def _views(self, message: Array, n: int) -> tuple[Array, Array, Array]:
        chunks, _, codes, positions = self._sizes(n)
        return (message[:4 * chunks].view(np.float32), message[4 * chunks:4 * chunks + codes],
                message[4 * chunks + codes:4 * chunks + codes + positions])

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        n = x.shape[0]
        if not n:
            return
        xp = array_module(x)
        chunks = self._sizes(n)[0]
        scales, codes, positions = self._views(message, n)
        magnitude = workspace.array(self, "magnitude", chunks * self.chunk, np.float32, like=x)
        xp.abs(x, out=magnitude[:n])
        magnitude[n:] = -1.0  # (padding: below every value, kept only where a chunk has no more)
        magnitude[xp.isnan(magnitude)] = np.inf
        rows = magnitude.reshape(chunks, self.chunk)
        place = self._kept(rows)  # (chunks, k) positions in each chunk, ascending
        flat = place + (xp.arange(chunks, dtype=np.int64) * self.chunk)[:, None]
        inside = flat < n
        values = xp.where(inside, x[xp.minimum(flat, n - 1)], np.float32(0)).astype(np.float32)
        top = xp.abs(values).max(axis=1)  # (NaN where a kept value is)
        levels = 1 << (self.bits - 1)
        scale = (top / np.float32(levels - 0.5)).astype(np.float32)
        scales[...] = scale
        with np.errstate(invalid="ignore", divide="ignore"):
            ratio = xp.abs(values) / scale[:, None]
        level = xp.minimum(xp.floor(xp.nan_to_num(ratio, nan=0.0, posinf=0.0)), levels - 1).astype(np.uint32)
        code = level | (xp.signbit(values).astype(np.uint32) << (self.bits - 1))
        pack(code.reshape(-1), self.bits, codes)
        pack(place.reshape(-1).astype(np.uint32), self.position_bits, positions)

    def _kept(self, rows: Array) -> Array:
        """Each row's ``k`` largest, ties to the first positions: ascending positions, (rows, k)."""
        xp = array_module(rows)
        k, width = self.k, rows.shape[1]
        if k == width:
            return xp.broadcast_to(xp.arange(width), rows.shape).copy()
        kth = xp.partition(rows, width - k, axis=1)[:, width - k:width - k + 1]
        above = rows > kth
        tied = rows == kth
        room = k - above.sum(axis=1, keepdims=True)
        keep = above | (tied & (xp.cumsum(tied, axis=1) <= room))
        return xp.nonzero(keep)[1].reshape(rows.shape[0], k)

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        n = out.shape[0]
        if not add:
            out[...] = 0
        if not n:
            return
        xp = array_module(out)
        chunks, kept, _, _ = self._sizes(n)
        scales, codes, positions = self._views(message, n)
        code = unpack(codes, self.bits, kept).reshape(chunks, self.k)
        place = unpack(positions, self.position_bits, kept).reshape(chunks, self.k).astype(np.int64)
        levels = 1 << (self.bits - 1)
        magnitude = ((code & (levels - 1)).astype(np.float32) + np.float32(0.5)) * scales[:, None]
        values = xp.where((code >> (self.bits - 1)) == 1, -magnitude, magnitude).astype(out.dtype)
        flat = (place + (xp.arange(chunks, dtype=np.int64) * self.chunk)[:, None]).reshape(-1)
        inside = flat < n
        out[flat[inside]] += values.reshape(-1)[inside]
