"""Allgather-then-average: every rank receives every other rank's whole bucket."""
from __future__ import annotations

import numpy as np

from ..arrays import Array, DTypeLike, add_into
from ..comm import Workspace
from .codec import Codec


class Allgather(Codec):
    """Gather every rank's bucket and average locally.

    Traffic grows with the number of ranks: each rank sends ``(N-1) * B`` bytes where an allreduce
    sends ``2(N-1)/N * B``, so this loses to ``Allreduce`` from three ranks on. It exists for
    methods whose messages cannot be added on the wire, and as a reference: the local sum
    accumulates in float32 (float64 for float64 buckets) in rank order, so it is more accurate than
    an allreduce in half precision, and bit-identical on every rank.

    Non-finite values propagate element-wise.
    """

    collective = "allgather"
    message_dtype = None  # the values themselves, in the compute dtype
    nan_effect = "element"

    def compute_dtype(self, dtype: DTypeLike) -> np.dtype:
        return dtype  # sent as they are

    def message_size(self, n: int) -> int:
        return n

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        message[...] = x

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        if add:
            add_into(out, message)
        else:
            out[...] = message

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray:
        return exact_bound(inputs, dtype)


def exact_bound(inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    """Rounding of a sum of N values and one division, in ``dtype``: (N + 1) ulp of the mean of
    the magnitudes, plus the subnormal spacing."""
    import ml_dtypes
    import numpy as np

    n_ranks = inputs.shape[0]
    info = ml_dtypes.finfo(dtype)
    mean_abs = np.abs(inputs).sum(axis=0) / n_ranks
    return (n_ranks + 1) * float(info.eps) * mean_abs + n_ranks * float(info.smallest_subnormal)
