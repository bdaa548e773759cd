"""int8 / int4 allreduce in two stages: bytes per rank flat in the number of ranks.

Each rank quantizes its bucket per 512-value chunk (offset and scale per chunk, as
``QuantizePerChannel``) in N slices; an alltoall hands every rank its slice from everyone; the
slice owner dequantizes and sums them in rank order, quantizes the mean, and an allgather of those
codes returns it; every rank, the owner included, decodes the same codes, so replicas are
bit-identical (``Codec`` two-stage runner). Bytes per rank: ``2(N-1)/N`` of the message, i.e.
about ``2(N-1)/N * (bits/32 + 1/256)`` of the float32 bucket, where the allgathered quantizers
send ``(N-1)`` messages. Wrapped in ``ErrorFeedback`` (the registered ``int8``, ``int4``), both
stages keep their rounding error and send it with the next step.
"""
from __future__ import annotations

import numpy as np

from ...arrays import Array, DTypeLike, zero_non_finite
from ...comm import Workspace
from ...params import check_choice
from ..codec import Codec
from .allgather import chunk_error_bound
from .kernels import _compiled, _runs, _quantize_blocked, chunk_count, dequantize, pack4, quantize, unpack4

CHUNK = 512


class QuantizedAllreduce(Codec):
    """Two-stage allreduce of ``bits``-bit (8 or 4) codes per 512-value chunk (see the module)."""

    collective = "two-stage"
    chunk = CHUNK
    nan_effect = "chunk"
    independent_chunks = True

    def __init__(self, bits: int = 8):
        super().__init__()
        self.bits = int(check_choice("bits", bits, (8, 4)))
        self.levels = (1 << self.bits) - 1

    def message_size(self, n: int) -> int:
        return 8 * chunk_count(n, CHUNK) + -(-n * self.bits // 8)

    def _views(self, message: Array, n: int) -> tuple[Array, Array]:
        chunks = chunk_count(n, CHUNK)
        return message[:8 * chunks].view(np.float32).reshape(2, chunks), message[8 * chunks:]

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        params, packed = self._views(message, x.shape[0])
        if self.bits == 8:
            quantize(x, params, packed, CHUNK, self.levels)
            return
        n = x.shape[0]
        codes = workspace.array(self, "codes", n + n % 2, np.uint8, like=x)
        codes[n:] = 0
        quantize(x, params, codes[:n], CHUNK, self.levels)
        pack4(codes, packed)

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """``x + residual`` encoded and ``residual`` updated to what the codes miss, in one
        compiled pass per chunk (float32 NumPy only: else False, and the runner does it in steps)."""
        n = x.shape[0]
        params, packed = self._views(message, n)
        jit = _compiled(x, residual, params) if x.dtype == residual.dtype == np.float32 else None
        if jit is None or n % 2:
            return False
        codes = packed if self.bits == 8 else workspace.array(self, "codes", n, np.uint8, like=x)
        tmp = workspace.array(self, "tmp", CHUNK, np.float32, like=x)
        redo = np.zeros(params.shape[1], bool)
        if jit.quantize_feedback_chunks(x, residual, CHUNK, self.levels, params, codes, redo, tmp,
                                        tmp.view(np.int32)):
            for c0, c1 in _runs(redo):  # non-finite or tied chunks: NumPy's sequence, same bits
                part = slice(c0 * CHUNK, min(c1 * CHUNK, n))
                xs = x[part] + residual[part]
                _quantize_blocked(xs, params[:, c0:c1], codes[part], CHUNK, self.levels)
                own = np.zeros_like(xs)
                dequantize(own, params[:, c0:c1], codes[part], CHUNK, add=True)
                np.subtract(xs, own, out=residual[part])
                zero_non_finite(residual[part])  # the other chunks' residuals are finite
        if self.bits == 4:
            pack4(codes, packed)
        return True

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        params, packed = self._views(message, out.shape[0])
        codes = packed
        jit = _compiled(out, params, packed) if out.dtype == np.float32 else None
        if self.bits == 4 and jit is not None and out.shape[0] % 2 == 0:
            jit.unpack4_dequantize_chunks(out, params, packed, CHUNK, add)
            return
        if self.bits == 4:
            codes = workspace.array(self, "codes", 2 * packed.shape[0], np.uint8, like=packed)
            unpack4(packed, codes)
        dequantize(out, params, codes[:out.shape[0]], CHUNK, add)

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray:
        """Stage 1: each rank's codes are within half its chunk step; stage 2: the mean is
        requantized, within half the step of the mean's chunk range (plus float32 rounding)."""
        first = chunk_error_bound(inputs, CHUNK, self.levels, dtype)
        mean = inputs.mean(axis=0, keepdims=True)
        spread = first.max(initial=0.0)  # the decoded mean moves by up to the first error
        second = chunk_error_bound(mean, CHUNK, self.levels, dtype) + 2 * spread / self.levels
        return first + second

