"""Plain averaging allreduce: the exact baseline every other method is measured against."""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from ..arrays import Array, DTypeLike, divide
from ..bucket import Bucket
from ..comm import Communicator
from .allgather import exact_bound
from .contract import Compressor, Traffic
from .passes import Passes, allreduce, numel


class Allreduce(Compressor):
    """Mean over ranks by a sum-allreduce.

    Each rank divides its copy by the world size *before* the sum, as PyTorch's ``allreduce_hook``
    and ``fp16_compress_hook`` do: inside a half-precision wrapper this keeps the running sum from
    overflowing, and it gives the same bits as those hooks. float16/bfloat16 buckets are summed by
    the communicator in their own dtype (see ``MPICommunicator``). The quotient is a new array (or,
    for a scratch bucket, the bucket itself), which the sum then overwrites: nothing else is
    allocated, so under ``GradientReducer`` and the DDP hook a step allocates nothing.

    Non-finite values propagate element-wise, exactly as in a plain allreduce: a NaN at position
    i on any rank makes position i NaN on every rank and touches nothing else.
    """

    nan_effect = "element"
    scatters = True

    def run(self, bucket: Bucket, comm: Communicator, prepared: Any = None) -> Array:
        if bucket.scatter:
            return mean_reduce_scatter(bucket, comm)
        return mean_allreduce(bucket, comm)

    def traffic(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
        return Traffic("allreduce", sum(math.prod(s) for s in shapes) * itemsize)

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Passes | None:
        return allreduce(numel(shapes), itemsize, ranks)

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray:
        return exact_bound(inputs, dtype)


def mean_allreduce(bucket: Bucket, comm: Communicator) -> Array:
    """``Allreduce``'s arithmetic, for the compressors that fall back to it (PowerSGD's warm-up)."""
    if comm.size == 1:
        return comm.allreduce(bucket.buffer, overwrite=bucket.scratch)
    # the quotient is our own array: the sum may overwrite it (one buffer per bucket, not two);
    # a scratch bucket (a wrapper's cast copy, a DDP bucket) is divided in place as well
    x = divide(bucket.buffer, comm.size, out=bucket.buffer if bucket.scratch else None)
    return comm.allreduce(x, overwrite=True)


def mean_reduce_scatter(bucket: Bucket, comm: Communicator) -> Array:
    """This rank's row of the mean of a ``scatter`` bucket: divided by the world size before the
    sum, as ``mean_allreduce``, then one reduce-scatter of equal rows."""
    if comm.size == 1:
        return bucket.buffer if bucket.scratch else bucket.buffer.copy()
    x = divide(bucket.buffer, comm.size, out=bucket.buffer if bucket.scratch else None)
    rows = [bucket.numel // comm.size] * comm.size
    return comm.reduce_scatter(x, counts=rows, overwrite=True)
