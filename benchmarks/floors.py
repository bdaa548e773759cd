"""Memory-traffic floors: the bytes each method's passes must read and write per step, per rank,
and the time they take at a measured bandwidth.

Every method declares its passes over memory (``Compressor.memory_passes``: the model, what counts
and what does not, is ``gradcomp.compressors.passes``): ``floor(compressor, numel, ...)`` asks it
for them on a bucket of ``numel`` values at ``ranks`` ranks. What is the benchmarks' own is here:
``memcpy_bandwidth(seconds, nbytes)`` is the bandwidth a memcpy of ``nbytes`` measured (it reads
and writes them: ``2 * nbytes`` of traffic), ``seconds(passes, bandwidth)`` the floor in seconds at
that bandwidth, and ``memcpys(passes, nbytes)`` the floor as a multiple of that memcpy,
``Passes.total / (2 * nbytes)``.

The passes come by name (``Passes.passes``), so a report, or a cost model that picks methods per
bucket, can say what the bytes are for.
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from gradcomp.compressors.passes import NONE, Passes

__all__ = ["NONE", "Passes", "floor", "memcpy_bandwidth", "memcpys", "seconds"]


def memcpy_bandwidth(seconds: float, nbytes: float) -> float:
    """Bytes read + written per second by a memcpy of ``nbytes`` that took ``seconds``."""
    return 2 * nbytes / seconds


def seconds(passes: Passes, bandwidth: float) -> float:
    """The floor in seconds at ``bandwidth`` bytes (read + written) per second."""
    return passes.total / bandwidth


def memcpys(passes: Passes, nbytes: float) -> float:
    """The floor as a multiple of a memcpy of ``nbytes`` (which reads and writes them)."""
    return passes.total / (2 * nbytes) if nbytes else 0.0


def floor(compressor: Any, numel: int, dtype: Any = np.float32, ranks: int = 1,
          shapes: Sequence[Sequence[int]] | None = None) -> Passes | None:
    """The memory-traffic floor of one step of ``compressor`` in steady state (a recipe's last
    stage) on a bucket of ``numel`` values of ``dtype`` (with the tensor ``shapes``, which PowerSGD
    needs; default one vector), per rank at ``ranks`` ranks: the passes it declares. None for a
    compressor that declares none."""
    shapes = [(numel,)] if shapes is None else shapes
    if sum(math.prod(s) for s in shapes) != numel:
        raise ValueError(f"shapes {shapes} do not hold {numel} values")
    declared = getattr(compressor, "memory_passes", None)
    return None if declared is None else declared(shapes, ranks, np.dtype(dtype).itemsize)
