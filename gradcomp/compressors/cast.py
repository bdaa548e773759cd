"""Half-precision wrappers: run any compressor on a float16 or bfloat16 copy of the bucket."""
from __future__ import annotations

import threading

from ..arrays import array_module, cast, half_dtype
from .base import Compressor


class Cast(Compressor):
    """Cast the bucket to a half dtype, let ``inner`` reduce it, cast the mean back.

    The inner compressor sees a bucket with the same index and layout, so its per-bucket state
    (PowerSGD's error feedback and Q memory) keeps working, in half precision. Linear inner methods
    divide by the world size before they sum (see ``Allreduce``), so the half-precision sum does
    not overflow where the mean would not; ``FP16(Allreduce())`` therefore matches PyTorch's
    ``fp16_compress_hook`` and ``FP16(PowerSGD(...))`` matches ``fp16_compress_wrapper``.
    """

    half = "float16"

    def __init__(self, inner: Compressor):
        super().__init__()
        if not isinstance(inner, Compressor):
            raise TypeError(f"{type(self).__name__} wraps a gradcomp Compressor, got {type(inner).__name__}")
        self.inner = inner
        self._copies = {}  # worker thread id -> the reused half copy (see _half_copy)

    def __repr__(self):
        return f"{type(self).__name__}({self.inner!r})"

    def run(self, bucket, comm):
        mean = self.inner.run(bucket.with_buffer(self._half_copy(bucket), scratch=True), comm)
        # a scratch bucket (a DDP bucket) takes the widened mean itself: no new array per bucket
        return cast(mean, bucket.dtype, out=bucket.buffer if bucket.scratch else None)

    def _half_copy(self, bucket):
        """The bucket cast to the half dtype, in one buffer that every bucket and step reuses.

        A fresh array per bucket (12 MB for a 25 MB DDP bucket) costs first-touch page faults
        each step once glibc has handed the freed memory back to the kernel (BENCHMARKS.md,
        issue 5), and one buffer for all buckets stays in the last-level cache where several
        would not. The inner compressor gets it as scratch: valid during its ``run`` only, as a
        DDP bucket is during its hook. Buckets are reduced one at a time per communicator
        thread, so there is one buffer per thread (a compressor may serve two communicators); a
        plain dict, so a compressor can still be deep-copied.
        """
        source = bucket.buffer
        xp = array_module(source)
        dtype = half_dtype(self.half, xp)
        thread = threading.get_ident()
        spare = self._copies.get(thread)
        if (spare is None or type(spare) is not type(source) or spare.dtype != dtype
                or spare.shape[0] < source.shape[0]
                or getattr(spare, "device", None) != getattr(source, "device", None)):
            spare = self._copies[thread] = xp.empty(source.shape, dtype)
        return cast(source, dtype, out=spare[:source.shape[0]])

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, state):
        self.inner.load_state_dict(state)


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
