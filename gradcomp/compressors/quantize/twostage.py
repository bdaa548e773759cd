"""int8 / int4 allreduce in two stages: bytes per rank flat in the number of ranks.

Each rank quantizes its bucket per 512-value chunk (offset and scale per chunk, as
``QuantizePerChannel``) in N slices; an alltoall hands every rank its slice from everyone; the
slice owner dequantizes and sums them in rank order, quantizes the mean, and an allgather of those
codes returns it; every rank, the owner included, decodes the same codes, so replicas are
bit-identical (``Codec`` two-stage runner). Bytes per rank: ``2(N-1)/N`` of the message, i.e.
about ``2(N-1)/N * (bits/32 + 1/256)`` of the float32 bucket, where the allgathered quantizers
send ``(N-1)`` messages. Wrapped in ``ErrorFeedback`` (the registered ``int8``, ``int4``), both
stages keep their rounding error and send it with the next step. ``exact_zero`` puts zero on
each chunk's grid (``gradcomp.kernels.affine``'s ``zero``; the registered ``int4`` does), so
small values go as exact zeros while their error builds up, instead of as rounding noise every
step.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ...arrays import Array, DTypeLike, zero_non_finite
from ...comm import Workspace
from ...params import check_bool, check_choice
from ...kernels import affine
from ...kernels.affine import chunk_count, dequantize, pack4, quantize, quantize_compiled, redone, unpack4
from ...kernels.halfcast import half_kind
from ..codec import Codec
from .allgather import chunk_error_bound

CHUNK = 512


class QuantizedAllreduce(Codec):
    """Two-stage allreduce of ``bits``-bit (8 or 4) codes per ``chunk``-value chunk (512 by
    default; a power of two from 64 to 4096: smaller chunks follow heavy-tailed gradients more
    closely for 8 more bytes each); ``exact_zero``: a grid that holds zero (see the module)."""

    collective = "two-stage"
    nan_effect = "chunk"
    independent_chunks = True
    half_input = True

    def __init__(self, bits: int = 8, chunk: int = CHUNK, exact_zero: bool = False):
        super().__init__()
        self.bits = int(check_choice("bits", bits, (8, 4)))
        self.chunk = int(check_choice("chunk", chunk, tuple(1 << k for k in range(6, 13))))
        self.exact_zero = check_bool("exact_zero", exact_zero)
        self.levels = (1 << self.bits) - 1

    def config(self) -> dict[str, Any]:
        # chunk and exact_zero only when not the default: checkpoints saved before they existed still load
        return {"bits": self.bits, **({"chunk": self.chunk} if self.chunk != CHUNK else {}),
                **({"exact_zero": True} if self.exact_zero else {})}

    def message_size(self, n: int) -> int:
        return 8 * chunk_count(n, self.chunk) + -(-n * self.bits // 8)

    def _views(self, message: Array, n: int) -> tuple[Array, Array]:
        chunks = chunk_count(n, self.chunk)
        return message[:8 * chunks].view(np.float32).reshape(2, chunks), message[8 * chunks:]

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        params, packed = self._views(message, x.shape[0])
        jit = self._jit(x, params)
        if jit is not None:
            quantize_compiled(jit, x, params, packed, self.chunk, self.levels, self.bits == 4,
                              self._ctmp(workspace, x), self.exact_zero)
            return
        if self.bits == 8:
            quantize(x, params, packed, self.chunk, self.levels, self.exact_zero)
            return
        n = x.shape[0]
        codes = workspace.array(self, "codes", n + n % 2, np.uint8, like=x)
        codes[n:] = 0
        quantize(x, params, codes[:n], self.chunk, self.levels, self.exact_zero)
        pack4(codes, packed)

    def _jit(self, *arrays: Array):
        """The compiled kernels where they take ``arrays`` (``kernels.affine.compiled``)."""
        return affine.compiled(*arrays)

    def _ctmp(self, workspace: Workspace, like: Array) -> Array:
        """A chunk of uint8 codes (4-bit codes are packed from there)."""
        return workspace.array(self, "ctmp", self.chunk, np.uint8, like=like)

    def _tmp(self, workspace: Workspace, like: Array) -> tuple[Array, Array]:
        """A chunk of values in ``like``'s dtype, and the same memory as integers (order keys)."""
        tmp = workspace.array(self, "tmp", self.chunk, like.dtype, like=like)
        return tmp, tmp.view(np.int32 if like.dtype == np.float32 else np.int64)

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """``x + residual`` encoded and ``residual`` updated to what the codes miss, in one
        compiled pass per chunk (NumPy float32 or float64 ``x`` with a residual of its dtype, or
        float16/bfloat16 ``x`` with a float32 residual: else False, and the runner does it in
        steps)."""
        n = x.shape[0]
        params, packed = self._views(message, n)
        half = half_kind(x, residual)
        if half is None and residual.dtype != x.dtype:
            return False
        jit = self._jit(residual, x, params)
        if jit is None:
            return False
        tmp, tmp_bits = self._tmp(workspace, residual)
        redo = np.zeros(params.shape[1], np.uint8)
        kernel = jit.quantize_feedback_chunks if residual.dtype == np.float32 else jit.quantize64_feedback_chunks
        g = x if half is None else x.view(np.uint16)
        if kernel(g, residual, self.chunk, self.levels, params, packed, redo, tmp, tmp_bits, self.bits == 4,
                  self._ctmp(workspace, x), half == "bfloat16", self.exact_zero):
            # non-finite or tied chunks: NumPy's sequence, same bits
            redone(redo, n, self.chunk, self.levels, params, packed, self.bits == 4,
                   lambda part: x[part].astype(residual.dtype), residual, self.exact_zero)
        return True

    def average_with_feedback(self, rows: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """The owner's stage in one compiled pass per chunk (``quantize_owner_chunks``)."""
        return self._owner(rows, residual.shape[0], residual.dtype, residual, message, workspace)

    def average(self, rows: Array, n: int, dtype: DTypeLike, message: Array, workspace: Workspace) -> bool:
        """The owner's stage without a residual, in one compiled pass per chunk."""
        return self._owner(rows, n, np.dtype(dtype), None, message, workspace)

    def _owner(self, rows: Array, n: int, dtype: np.dtype, residual: Array | None, message: Array,
               workspace: Workspace) -> bool:
        """NumPy float32 or float64 slices of whole chunks only (else False)."""
        params, packed = self._views(message, n)
        chunks = params.shape[1]
        if dtype not in (np.float32, np.float64) or rows.shape[1] % 4 or n != chunks * self.chunk:
            return False
        like = residual if residual is not None else workspace.array(self, "like", 1, dtype, like=rows)
        jit = self._jit(like, rows, params)
        if jit is None or not n:
            return False
        tmp, tmp_bits = self._tmp(workspace, like)
        redo = np.zeros(chunks, np.uint8)
        kernel = jit.quantize_owner_chunks if like.dtype == np.float32 else jit.quantize64_owner_chunks
        e = residual if residual is not None else tmp
        if kernel(rows, rows.view(np.float32), chunks, self.chunk, self.levels, self.bits == 4, residual is not None,
                  e, params, packed, redo, tmp, tmp_bits, self._ctmp(workspace, like), self.exact_zero):
            redone(redo, n, self.chunk, self.levels, params, packed, self.bits == 4,
                   lambda part: self._mean(rows, part, like.dtype, workspace), residual, self.exact_zero)
        return True

    def _mean(self, rows: Array, part: slice, dtype: np.dtype, workspace: Workspace) -> Array:
        """The owner's slice ``part`` (whole chunks) from the rows, as the runner's steps make it:
        each row decoded into a zeroed array in rank order, divided by their number."""
        mine = np.zeros(part.stop - part.start, dtype)
        c0, c1 = part.start // self.chunk, -(-part.stop // self.chunk)
        for r in range(rows.shape[0]):
            params, packed = self._row_views(rows[r])
            codes = packed[part] if self.bits == 8 else _unpacked(packed, part)
            dequantize(mine, np.ascontiguousarray(params[:, c0:c1]), codes, self.chunk, add=True)
        if rows.shape[0] > 1:
            np.divide(mine, mine.dtype.type(rows.shape[0]), out=mine)
        return mine

    def _row_views(self, row: Array) -> tuple[Array, Array]:
        """(params, codes) of one row the owner received (whole chunks)."""
        chunks = row.shape[0] * 8 // (64 + self.chunk * self.bits)
        return row[:8 * chunks].view(np.float32).reshape(2, chunks), row[8 * chunks:]

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        params, packed = self._views(message, out.shape[0])
        jit = self._jit(out, params, packed)
        if self.bits == 4 and jit is not None:
            jit.unpack4_dequantize_chunks(out, params, packed, self.chunk, add, self._ctmp(workspace, out))
            return
        codes = packed
        if self.bits == 4:
            codes = workspace.array(self, "codes", 2 * packed.shape[0], np.uint8, like=packed)
            unpack4(packed, codes)
        dequantize(out, params, codes[:out.shape[0]], self.chunk, add)

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray:
        """Stage 1: each rank's codes are within half its chunk step; stage 2: the mean is
        requantized, within half the step of the mean's chunk range (plus float32 rounding)."""
        first = chunk_error_bound(inputs, self.chunk, self.levels, dtype, self.exact_zero)
        mean = inputs.mean(axis=0, keepdims=True)
        spread = first.max(initial=0.0)  # the decoded mean moves by up to the first error
        second = (chunk_error_bound(mean, self.chunk, self.levels, dtype, self.exact_zero)
                  + 2 * spread / (self.levels - self.exact_zero))
        return first + second



def _unpacked(packed: Array, part: slice) -> Array:
    """The 4-bit codes of values ``part`` (an even start) as one byte each."""
    count = part.stop - part.start
    codes = np.empty(count + count % 2, np.uint8)
    unpack4(packed[part.start // 2:part.start // 2 + codes.shape[0] // 2], codes)
    return codes[:count]

