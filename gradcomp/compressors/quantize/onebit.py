"""1-bit allreduce: the sign of every value and one scale per 512-value chunk, in two stages.

Each value is sent as its sign (8 per byte, 1 = not negative) and each chunk of 512 as the mean
magnitude of its values, the scale that minimizes the squared error of a sign code. Two stages as
``QuantizedAllreduce``: the slice owners decode and average everyone's slice, encode the mean the
same way, and everyone decodes the same codes. Bytes per rank: ``2(N-1)/N * (1/32 + 1/512)`` of
the float32 bucket. Without error feedback the signs are biased; with it (the registered
``onebit``: both stages keep their error) this is the compressed allreduce behind 1-bit Adam
(Tang et al. 2021) and error-compensated signSGD (Karimireddy et al. 2019).

The scale is summed in float64 in index order on every path (compiled loop or NumPy's
``cumsum``), so every rank computes the same bits whichever kernel it has.
"""
from __future__ import annotations

import numpy as np

from ...arrays import Array, ArrayModule, array_module, zero_non_finite
from ...comm import Workspace
from ..codec import Codec
from .kernels import _compiled, chunk_count

CHUNK = 512


class OneBit(Codec):
    """Sign bits plus a mean-magnitude scale per 512-value chunk, two-stage (see the module)."""

    collective = "two-stage"
    chunk = CHUNK
    nan_effect = "chunk"
    independent_chunks = True
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
        jit = _compiled(x, scales, bits, *(() if residual is None else (residual,)))
        if jit is not None and x.dtype == np.float32:
            tmp, flags = self._chunk_temporaries(workspace, x)
            bad = jit.onebit_encode_chunks(x, residual if feedback else x, CHUNK, scales, bits, feedback,
                                           tmp, flags)
            if bad and residual is not None:
                zero_non_finite(residual)  # a non-finite scale: that chunk's residual is NaN or Inf
            return True
        if feedback:
            return False  # the runner adds the residual and keeps the error itself
        xp = array_module(x)
        full = n // CHUNK
        wide = workspace.array(self, "wide", n, np.float64, like=x)
        xp.abs(x, out=wide)
        with np.errstate(all="ignore"):
            if full:
                scales[:full] = _lane_sums(xp, wide[:full * CHUNK].reshape(full, CHUNK)) / CHUNK
            if n > full * CHUNK:
                scales[full] = _lane_sums(xp, wide[full * CHUNK:].reshape(1, -1))[0] / (n - full * CHUNK)
        positive = workspace.array(self, "positive", n, np.bool_, like=x)
        xp.greater_equal(x, 0, out=positive)
        bits[...] = xp.packbits(positive, bitorder="little")
        return True

    def average_with_feedback(self, rows: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """The owner's stage in one compiled pass per chunk (``onebit_owner_chunks``): float32
        NumPy only, else False."""
        n = residual.shape[0]
        scales, bits = self._views(message, n)
        jit = _compiled(rows, residual, scales, bits) if residual.dtype == np.float32 else None
        if jit is None or not n:
            return False
        tmp, flags = self._chunk_temporaries(workspace, residual)
        if jit.onebit_owner_chunks(rows, scales.shape[0], CHUNK, n, residual, scales, bits, tmp, flags):
            zero_non_finite(residual)
        return True

    def _chunk_temporaries(self, workspace: Workspace, like: Array) -> tuple[Array, Array]:
        """One chunk of float32 values and one of uint8 sign flags, for the compiled kernels."""
        return (workspace.array(self, "tmp", CHUNK, np.float32, like=like),
                workspace.array(self, "flags", CHUNK, np.uint8, like=like))

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        n = out.shape[0]
        scales, bits = self._views(message, n)
        if not n:
            return
        jit = _compiled(out, scales, bits) if out.dtype == np.float32 else None
        if jit is not None:
            jit.onebit_decode_chunks(scales, bits, out, CHUNK, add)
            return
        xp = array_module(out)
        signs = workspace.array(self, "signs", n, out.dtype, like=out)
        signs[...] = xp.unpackbits(bits, count=n, bitorder="little")
        signs *= 2
        signs -= 1
        full = n // CHUNK
        with np.errstate(all="ignore"):
            if full:
                signs[:full * CHUNK].reshape(full, CHUNK)[...] *= scales[:full, None]
            if n > full * CHUNK:
                signs[full * CHUNK:] *= scales[full]
            lost = xp.isnan(scales)  # one NaN for every path (a NaN product's sign is not portable)
            if bool(lost.any()):
                for c in xp.flatnonzero(lost).tolist():
                    signs[c * CHUNK:(c + 1) * CHUNK] = np.nan
        if add:
            out += signs
        else:
            out[...] = signs


def _lane_sums(xp: ArrayModule, rows: Array) -> Array:
    """Per row, the float64 sum of the compiled loop's order: eight lanes (lane k adds values
    8j + k in order), then the lanes in order. Rows have a multiple of 8 values."""
    lanes = xp.cumsum(rows.reshape(rows.shape[0], -1, 8), axis=1)[:, -1, :]
    return xp.cumsum(lanes, axis=1)[:, -1]
