"""Allgather-then-average: every rank receives every other rank's whole bucket."""
from __future__ import annotations

import numpy as np

from ..arrays import array_module
from .base import Compressor


class Allgather(Compressor):
    """Gather every rank's bucket and average locally.

    Traffic grows with the number of ranks: each rank sends ``(N-1) * B`` bytes where an allreduce
    sends ``2(N-1)/N * B``, so this loses to ``Allreduce`` from three ranks on. It exists for
    methods whose messages cannot be added on the wire, and as a reference: the local sum
    accumulates in float32 (float64 for float64 buckets) in rank order, so it is more accurate than
    an allreduce in half precision, and bit-identical on every rank.

    Non-finite values propagate element-wise.
    """

    def run(self, bucket, comm):
        xp = array_module(bucket.buffer)
        rows = comm.allgather(bucket.buffer)
        acc = np.float64 if bucket.dtype == np.float64 else np.float32
        total = rows.sum(axis=0, dtype=acc)
        total /= comm.size
        return total.astype(bucket.dtype) if total.dtype != bucket.dtype else xp.ascontiguousarray(total)
