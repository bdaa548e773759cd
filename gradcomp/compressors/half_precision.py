"""Half-precision wrappers: run any compressor on a float16 or bfloat16 copy of the bucket."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from ..arrays import Array, DTypeLike, array_module, cast, half_dtype
from ..bucket import Bucket
from ..comm import Communicator, Workspace
from .allreduce import Allreduce
from .contract import Compressor, Traffic, run_stage
from .passes import Passes, half_cast, numel
from .wrapper import Wrapper


@dataclass
class _Half:
    bucket: Bucket     # the half copy, a scratch bucket in the job's workspace
    inner: Any         # the inner compressor's prepared stage


class Cast(Wrapper):
    """Cast the bucket to a half dtype, let ``inner`` reduce it, cast the mean back.

    The inner compressor sees a bucket with the same keys and layout, so its per-tensor state
    (PowerSGD's error feedback and warm start) keeps working, in half precision. Linear inner
    methods divide by the world size before they sum (see ``Allreduce``), so the half-precision sum
    does not overflow where the mean would not; ``FP16(Allreduce())`` therefore matches PyTorch's
    ``fp16_compress_hook`` and ``FP16(PowerSGD(...))`` matches ``fp16_compress_wrapper``.

    The cast happens in the local stage, so it overlaps the previous bucket's transfer; the half
    copy lives in the pipeline's workspace and is reused for every bucket and step. ``inner``
    defaults to ``Allreduce()``.
    """

    half = "float16"

    def __init__(self, inner: Compressor | None = None):
        super().__init__(Allreduce() if inner is None else inner)

    def inner_stage(self, prepared: _Half | None) -> Any:
        return prepared.inner if prepared is not None else None

    def traffic(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
        return self.inner.traffic(shapes, ranks, 2)  # its inner method sees half-precision values

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Passes | None:
        """The inner method's passes over the half copy, between the casts in and out."""
        inner = self.inner.memory_passes(shapes, ranks, 2)
        return None if inner is None else half_cast(numel(shapes), itemsize, 2, inner)

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray | None:
        """The inner method's bound on half-precision inputs, plus the two casts."""
        hdt: Any = np.float16 if self.half == "float16" else ml_dtypes.bfloat16
        rounded = inputs.astype(hdt).astype(np.float64)
        bound = self.inner.error_bound(rounded, hdt)
        if bound is None:
            return None
        eps_h, eps = float(ml_dtypes.finfo(hdt).eps), float(ml_dtypes.finfo(dtype).eps)
        mean_abs = np.abs(inputs).sum(axis=0) / inputs.shape[0]
        tiny = float(ml_dtypes.finfo(hdt).smallest_subnormal)
        return bound + (eps_h + eps) * mean_abs + tiny

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> _Half:
        source = bucket.buffer
        dtype = half_dtype(self.half, array_module(source))
        copy = workspace.array(self, "half", bucket.numel, dtype, like=source)
        cast(source, dtype, out=copy)
        half = bucket.with_buffer(copy, scratch=True)
        return _Half(half, self.inner.prepare(half, comm, workspace))

    def finish(self, bucket: Bucket, comm: Communicator, prepared: _Half) -> Array:
        mean = run_stage(self.inner, prepared.bucket, comm, prepared.inner)
        # a scratch bucket (a DDP bucket) takes the widened mean itself: no new array per bucket
        # (a reduce-scatter's mean is one row of it: a new array)
        in_place = bucket.scratch and mean.shape == bucket.buffer.shape
        return cast(mean, bucket.dtype, out=bucket.buffer if in_place else None)


class FP16(Cast):
    """float16 on the wire: half the bytes, 11-bit mantissa, range +-65504.

    Values whose magnitude exceeds 65504 become +-inf at the cast (as in PyTorch's hooks); use
    ``BF16`` when gradients can be that large. NaN and Inf propagate element-wise.
    """

    half = "float16"


class BF16(Cast):
    """bfloat16 on the wire: half the bytes, float32's range, 8-bit mantissa.

    NumPy buckets use ml_dtypes' bfloat16; CuPy buckets use the same dtype where CuPy supports it.
    NaN and Inf propagate element-wise.
    """

    half = "bfloat16"
