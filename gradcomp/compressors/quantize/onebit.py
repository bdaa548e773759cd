"""1-bit allreduce: the sign of every value and one scale per 512-value chunk, in two stages.

Each value is sent as its sign (8 per byte, 1 = not negative) and each chunk of 512 as the mean
magnitude of its values, the scale that minimizes the squared error of a sign code. Two stages as
``QuantizedAllreduce``: the slice owners decode and average everyone's slice, encode the mean the
same way, and everyone decodes the same codes. Bytes per rank: ``2(N-1)/N * (1/32 + 1/512)`` of
the float32 bucket. Without error feedback the signs are biased; with it (the registered
``onebit``: both stages keep their error) this is the compressed allreduce behind 1-bit Adam
(Tang et al. 2021) and error-compensated signSGD (Karimireddy et al. 2019).

The kernels, NumPy and compiled, and the choice between them are ``gradcomp.kernels.signcodes``;
the scale is summed in float64 in index order on every path, so every rank computes the same
bits whichever kernels it has.
"""
from __future__ import annotations

import numpy as np

from ...arrays import Array, DTypeLike, zero_non_finite
from ...comm import Workspace
from ...kernels import signcodes, stream
from ...kernels.affine import chunk_count
from ...kernels.halfcast import half_kind
from ..codec import Codec

CHUNK = 512


class OneBit(Codec):
    """Sign bits plus a mean-magnitude scale per 512-value chunk, two-stage (see the module)."""

    collective = "two-stage"
    chunk = CHUNK
    nan_effect = "chunk"
    independent_chunks = True
    half_input = True
    partial_update = True
    relative_error_limit = 0.95  # without error feedback, on the kit's structured signal

    def message_size(self, n: int) -> int:
        return 4 * chunk_count(n, CHUNK) + -(-n // 8)

    def _views(self, message: Array, n: int) -> tuple[Array, Array]:
        chunks = chunk_count(n, CHUNK)
        return message[:4 * chunks].view(np.float32), message[4 * chunks:4 * chunks + -(-n // 8)]

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        self._encode(x, None, message, workspace)

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        return self._encode(x, residual, message, workspace)

    def _encode(self, x: Array, residual: Array | None, message: Array, workspace: Workspace) -> bool:
        n = x.shape[0]
        scales, bits = self._views(message, n)
        if not n:
            return True
        feedback = residual is not None
        half = None if residual is None else half_kind(x, residual)
        jit = self._jit(x if half is None else residual, x, scales, bits, *(() if residual is None else (residual,)))
        if jit is not None and (residual is None or residual.dtype == x.dtype or half is not None):
            g = x if half is None else x.view(np.uint16)
            compute = x.dtype if residual is None or half is None else residual.dtype
            bad = jit.onebit_encode_chunks(g, residual if feedback else x, CHUNK, scales, bits, feedback,
                                           self._chunk(workspace, x, compute), half == "bfloat16")
            if bad and residual is not None:
                zero_non_finite(residual)  # a non-finite scale: that chunk's residual is NaN or Inf
            return True
        if feedback:
            return False  # the runner adds the residual and keeps the error itself
        signcodes.encode(x, scales, bits, CHUNK, workspace.array(self, "wide", n, np.float64, like=x),
                         workspace.array(self, "positive", n, np.bool_, like=x))
        return True

    def _jit(self, *arrays: Array):
        """``gradcomp.kernels.onebit`` where the compiled kernels take ``arrays``, else None
        (``kernels.signcodes.compiled``)."""
        return signcodes.compiled(*arrays)

    def average_with_feedback(self, rows: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """The owner's stage in one compiled pass per chunk (``onebit_owner_chunks``): NumPy
        float32 or float64 only, else False."""
        return self._owner(rows, residual.shape[0], residual.dtype, residual, message, workspace)

    def average(self, rows: Array, n: int, dtype: DTypeLike, message: Array, workspace: Workspace) -> bool:
        """The owner's stage without a residual, in one compiled pass per chunk."""
        return self._owner(rows, n, np.dtype(dtype), None, message, workspace)

    def _owner(self, rows: Array, n: int, dtype: np.dtype, residual: Array | None, message: Array,
               workspace: Workspace) -> bool:
        scales, bits = self._views(message, n)
        if dtype not in (np.float32, np.float64) or rows.shape[1] % 4 or not n:
            return False
        tmp = self._chunk(workspace, rows, dtype)
        jit = self._jit(tmp, rows, scales, bits, *(() if residual is None else (residual,)))
        if jit is None:
            return False
        e = residual if residual is not None else tmp
        if jit.onebit_owner_chunks(rows, rows.view(np.float32), scales.shape[0], CHUNK, n, dtype.type(rows.shape[0]),
                                   residual is not None, e, scales, bits, tmp) and residual is not None:
            zero_non_finite(residual)
        return True

    def _chunk(self, workspace: Workspace, like: Array, dtype: DTypeLike) -> Array:
        """A block of chunks of values of ``dtype``, for the compiled kernels (whose chunks'
        sums run side by side: ``kernels.signcodes.BLOCK_CHUNKS``; in the L1 cache)."""
        return workspace.array(self, "tmp", signcodes.BLOCK_CHUNKS * CHUNK, dtype, like=like)

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        n = out.shape[0]
        scales, bits = self._views(message, n)
        if not n:
            return
        jit = self._jit(out, scales, bits)
        if jit is not None:
            if not add and stream(out):
                jit.onebit_decode_chunks_streamed(scales, bits, out, CHUNK, self._chunk(workspace, out, out.dtype))
            else:
                jit.onebit_decode_chunks(scales, bits, out, CHUNK, add)
            return
        signcodes.decode(scales, bits, out, CHUNK, workspace.array(self, "signs", n, out.dtype, like=out), add)
