"""Conformance-kit targets whose buckets travel through JAX arrays, as a ``TreeReducer``'s do.

    python -m gradcomp.conformance gradcomp.jax.kit:int8 --ranks 2,3
    python -m gradcomp.conformance "gradcomp.jax.kit:topk:warmup=0"

Any attribute of this module is a factory: ``gradcomp.jax.kit:SPEC`` builds
``ThroughJax(gradcomp.make(SPEC))``. ``ThroughJax`` runs every bucket the way the JAX path does:
each tensor of the bucket becomes a JAX array (a gradient as ``jax.grad`` returns it), is read back
through a host view into a bucket of the same layout and keys, reduced there by the compressor,
and the means come back out as JAX arrays (``OutputPool``) before they reach the kit. So the kit's
promises (declared error bounds, every float dtype, bit-identical replicas, NaN effects,
checkpoints, mismatch errors, schedule hand-over) are checked on the values a JAX user gets.

Importing this module turns on ``jax_enable_x64``: the kit checks float64 buckets, which JAX
would otherwise hold as float32.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from ..arrays import Array
from ..bucket import Bucket
from ..comm import Communicator
from ..compressors.contract import Compressor
from ..compressors.wrapper import Wrapper
from ..registry import make
from .tree import OutputPool, host_view

jax.config.update("jax_enable_x64", True)


class ThroughJax(Wrapper):
    """``inner``, with each bucket's tensors handed over as JAX arrays and its means returned as
    JAX arrays (then copied into the kit's NumPy output). Configuration, state and promises are
    ``inner``'s (``Wrapper``), but for the reduce-scatter form, which the per-tensor round trip
    does not have."""

    scatters = False

    def __init__(self, inner: Compressor):
        super().__init__(inner)
        self._pools: dict[tuple, OutputPool] = {}

    def run(self, bucket: Bucket, comm: Communicator, prepared: Any = None) -> Array:
        leaves = [jnp.asarray(v) for v in bucket.views()]          # what jax.grad would hand over
        flat = np.empty(bucket.numel, bucket.dtype)
        for (_, offset, shape), leaf in zip(bucket.placements(), leaves):
            host = host_view(leaf).reshape(-1)
            flat[offset:offset + host.size] = host
        mean = self.inner.run(bucket.with_buffer(flat, scratch=True), comm)
        key = (bucket.index, tuple(map(tuple, bucket.shapes)), np.dtype(bucket.dtype).str)
        pool = self._pools.setdefault(key, OutputPool([(s, np.dtype(bucket.dtype)) for s in bucket.shapes]))
        means = pool.to_jax(bucket.views(mean))
        out = bucket.buffer if bucket.scratch else np.empty_like(bucket.buffer)
        for view, m in zip(bucket.views(out), means):
            view[...] = host_view(m)
        return out


def __getattr__(spec: str) -> Callable[[], ThroughJax]:
    """``gradcomp.jax.kit:SPEC``: a factory of ``ThroughJax(gradcomp.make(SPEC))``."""
    if spec.startswith("__"):
        raise AttributeError(spec)
    make(spec)  # an unknown name fails here, at import, not on every rank later
    return lambda: ThroughJax(make(spec))
