"""8-bit (or fewer) affine quantization per tensor or per 512-value channel, allgathered.

Each rank quantizes its own bucket with its own parameters, so nothing needs agreeing on before
the data moves. One allgather carries every rank's message, ``[offset, scale per chunk (float32)
| codes (uint8)]``; every rank dequantizes every sender's codes with that sender's parameters and
averages them in float32, in rank order, so all ranks hold the same bits. This is what PyTorch's
quantization hooks do; its traffic grows with the number of ranks (``twostage`` does not).
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from ...arrays import Array, DTypeLike
from ...comm import Workspace
from ...kernels import affine, stream
from ...kernels.affine import chunk_count, dequantize, quantize
from ...params import check_int
from ..codec import Codec
from .. import passes

#: the longest chunk decoded through a chunk-sized buffer to be streamed (``kernels.stream``)
_STREAM_CHUNK = 1 << 14


class QuantizePerChannel(Codec):
    """Quantize each run of ``channel_size`` consecutive values with its own scale and offset.

    One outlier then only coarsens its own 512 values instead of the whole bucket, which is why
    per-channel error is far lower on heavy-tailed gradients. A bucket whose length is not a
    multiple of ``channel_size`` gets one shorter last chunk. Costs ``8 / channel_size`` extra bytes
    per value for the parameters (1.6% at 512). Traffic: ``(N-1) * (n + 8 * chunks)`` bytes per rank.
    """

    collective = "allgather"
    nan_effect = "chunk"

    def __init__(self, bits: int = 8, channel_size: int | None = 512):
        super().__init__()
        self.bits = check_int("bits", bits, 1, 8)
        self.channel_size = None if channel_size is None else check_int("channel_size", channel_size, 1)
        self.levels = (1 << self.bits) - 1

    def _width(self, n: int) -> int:
        return self.channel_size if self.channel_size is not None else max(n, 1)

    def message_size(self, n: int) -> int:
        return 8 * chunk_count(n, self._width(n)) + n

    def _views(self, message: Array, n: int) -> tuple[Array, Array]:
        chunks = chunk_count(n, self._width(n))
        return message[:8 * chunks].view(np.float32).reshape(2, chunks), message[8 * chunks:]

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        params, codes = self._views(message, x.shape[0])
        quantize(x, params, codes, self._width(x.shape[0]), self.levels)

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        params, codes = self._views(message, out.shape[0])
        dequantize(out, params, codes, self._width(out.shape[0]), add)

    def decode_mean(self, rows: Array, out: Array, workspace: Workspace) -> bool:
        """Every rank's codes decoded, summed in rank order and averaged a chunk at a time, in one
        write of ``out`` (``kernels.quantize.dequantize_rows_chunks``): NumPy float32/float64 only."""
        n = out.shape[0]
        width = self._width(n)
        chunks = chunk_count(n, width)
        jit = affine.compiled(out, rows) if n else None
        if jit is None:
            return False
        size = rows.shape[0]
        params = workspace.array(self, "row-params", size * 2 * chunks, np.float32, like=out).reshape(size, 2, chunks)
        for r in range(size):
            params[r] = rows[r, :8 * chunks].view(np.float32).reshape(2, chunks)
        if stream(out) and width <= _STREAM_CHUNK:  # (per tensor: one chunk, the whole bucket)
            tmp = workspace.array(self, "chunk", width, out.dtype, like=out)
            jit.dequantize_rows_chunks_streamed(rows, params, 8 * chunks, width, out, out.dtype.type(size), tmp)
        else:
            jit.dequantize_rows_chunks(rows, params, 8 * chunks, width, out, out.dtype.type(size))
        return True

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray:
        """Each code is within half a step of its value: the mean over senders of half their
        chunk's step, plus float32 rounding of the offsets and the sum."""
        width = self._width(inputs.shape[1])
        return chunk_error_bound(inputs, width, self.levels, dtype)


def chunk_error_bound(inputs: np.ndarray, width: int, levels: int, dtype: DTypeLike,
                      zero: bool = False) -> np.ndarray:
    n = inputs.shape[1]
    half_steps = np.zeros(n)
    for start in range(0, n, width):
        part = inputs[:, start:start + width].astype(np.float32)
        hi, lo = part.max(axis=1), part.min(axis=1)
        if zero:  # the grid's range holds zero, and has one step fewer
            hi, lo = np.maximum(hi, 0), np.minimum(lo, 0)
        step = (hi - lo).astype(np.float64) / (levels - zero)
        half_steps[start:start + width] = step.mean() / 2
    peak = np.abs(inputs).max(initial=0.0)
    eps32 = float(np.finfo(np.float32).eps)
    return (half_steps * 1.001 + 8 * eps32 * peak
            + float(ml_dtypes.finfo(dtype).eps) * np.abs(inputs.mean(axis=0)))


class QuantizePerTensor(QuantizePerChannel):
    """One scale and offset for the whole bucket: the smallest message (8 bytes of parameters),
    but one large gradient coarsens every other value in the bucket. See ``QuantizePerChannel``."""

    nan_effect = "bucket"

    def __init__(self, bits: int = 8):
        super().__init__(bits=bits, channel_size=None)

    def memory_passes(self, shapes: passes.Shapes, ranks: int = 1, itemsize: int = 4,
                      residuals: passes.Residuals | None = None) -> passes.Passes | None:
        """The range of the whole bucket must be known before the first code is written, and the
        bucket is far larger than the caches: a read of it before the allgathered code's passes."""
        inner = super().memory_passes(shapes, ranks, itemsize, residuals)
        return None if inner is None else passes.one("range of the bucket", passes.numel(shapes) * itemsize) + inner
