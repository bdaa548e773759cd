"""Transport: the Communicator protocol, its mpi4py implementation, and the pipeline under both.

* ``pipeline``: the two ordered threads every communicator runs its work on (local compression
  stage, then the collectives), workspaces for reused temporaries, the errors.
* ``protocol``: the protocol, the traffic model (``wire_bytes``), what implementations share.
* ``mpi``: ``MPICommunicator`` (bandwidth-optimal allreduce, half-precision sums, CUDA-aware or
  host-staged device buffers).
* ``exits``: how the job ends when a rank fails or leaves.

``gradcomp.torch.TorchCommunicator`` implements the same protocol over torch.distributed.
"""
from __future__ import annotations

import threading

from .protocol import (Communicator, OrderedCommunicator, launched_by_mpi, partition, pin_blas_threads,
                   torchrun_world, wire_bytes)
from .mpi import LARGE_ALLREDUCE_BYTES, MPICommunicator, detect_cuda_aware
from .pipeline import CollectiveError, CommunicatorBroken, Pipeline, Workspace

_default: MPICommunicator | None = None
_default_lock = threading.Lock()


def default_communicator() -> MPICommunicator:
    """The process-wide ``MPICommunicator()`` over ``COMM_WORLD``, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MPICommunicator()
        return _default


__all__ = ["Communicator", "MPICommunicator", "OrderedCommunicator", "CollectiveError",
           "CommunicatorBroken", "Pipeline", "Workspace", "default_communicator", "wire_bytes",
           "partition", "pin_blas_threads", "detect_cuda_aware",
           "launched_by_mpi", "torchrun_world", "LARGE_ALLREDUCE_BYTES"]
