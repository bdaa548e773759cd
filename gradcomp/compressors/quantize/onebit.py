"""1-bit allreduce: the sign of every value and one scale per 512-value chunk, in two stages.

Each value is sent as its sign (8 per byte) and each chunk of 512 as the mean magnitude of its
values, the scale that minimizes the squared error of a sign code (``scale * sign(x)``). Two
stages as ``QuantizedAllreduce``: the slice owners decode and average everyone's slice, encode the
mean the same way, and everyone decodes the same codes. Bytes per rank: ``2(N-1)/N * (1/32 +
1/512)`` of the float32 bucket. Without error feedback the signs are biased; with it (the
registered ``onebit``: both stages keep their error) this is the compressed allreduce behind
1-bit Adam (Tang et al. 2021) and error-compensated signSGD (Karimireddy et al. 2019).
"""
from __future__ import annotations

import numpy as np

from ...arrays import array_module
from ..codec import Codec
from .kernels import chunk_count

CHUNK = 512


class OneBit(Codec):
    """Sign bits plus a mean-magnitude scale per 512-value chunk, two-stage (see the module)."""

    collective = "two-stage"
    chunk = CHUNK
    nan_effect = "chunk"
    relative_error_limit = 0.95  # without error feedback, on the kit's structured signal

    def message_size(self, n):
        return 4 * chunk_count(n, CHUNK) + -(-n // 8)

    def _views(self, message, n):
        chunks = chunk_count(n, CHUNK)
        return message[:4 * chunks].view(np.float32), message[4 * chunks:4 * chunks + -(-n // 8)]

    def encode(self, x, message, workspace):
        n = x.shape[0]
        scales, bits = self._views(message, n)
        if not n:
            return
        xp = array_module(x)
        magnitude = workspace.array(self, "magnitude", n, np.float32, like=x)
        xp.abs(x, out=magnitude)
        full = n // CHUNK
        with np.errstate(all="ignore"):
            if full:
                magnitude[:full * CHUNK].reshape(full, CHUNK).mean(axis=1, out=scales[:full])
            if n > full * CHUNK:
                scales[full] = magnitude[full * CHUNK:].mean()
        positive = workspace.array(self, "positive", n, np.bool_, like=x)
        xp.greater_equal(x, 0, out=positive)
        bits[...] = xp.packbits(positive)

    def decode(self, message, out, workspace, add=False):
        n = out.shape[0]
        scales, bits = self._views(message, n)
        if not n:
            return
        xp = array_module(out)
        signs = workspace.array(self, "signs", n, np.float32, like=out)
        signs[...] = xp.unpackbits(bits, count=n)
        signs *= 2
        signs -= 1
        full = n // CHUNK
        with np.errstate(all="ignore"):
            if full:
                signs[:full * CHUNK].reshape(full, CHUNK)[...] *= scales[:full, None]
            if n > full * CHUNK:
                signs[full * CHUNK:] *= scales[full]
        if add:
            out += signs
        else:
            out[...] = signs
