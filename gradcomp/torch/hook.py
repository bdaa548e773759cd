"""Any gradcomp compressor as a DDP communication hook.

What DDP's hook contract asks for, and how it is met here (so users never meet it):

* DDP inspects the hook's signature: the second parameter must be named ``bucket``, and the hook's
  ``__qualname__`` is logged, so a callable object without one is rejected. The hook is a plain
  module-level function, ``gradcomp_hook(state, bucket)``; everything it needs travels in ``state``.
* The returned ``torch.futures.Future`` must resolve to ONE tensor with the bucket's length (a list
  or a shorter tensor is rejected). The compressor's ``concurrent.futures.Future`` is bridged to a
  torch Future that resolves to the bucket's own buffer, after the averaged values were copied into
  it in place. Writing into the buffer DDP handed us in *this* call, rather than into anything
  remembered from an earlier call, keeps gradients right on every iteration: DDP replaces its
  buckets after the first synced step (and whenever it rebuilds them), and stale bucket views were
  the cause of the loss=nan of PyTorch issue #43307.
* After the first synced step DDP rebuilds its buckets, and with ``find_unused_parameters=False``
  or ``static_graph=True`` iteration 0 has a single bucket holding every parameter. Each call
  therefore describes its bucket afresh (``index``, ``is_last`` and the shapes of
  ``bucket.gradients()``), so a compressor that keys state by bucket index sees the layout change
  and resets that state (PowerSGD does) instead of applying iteration 0's state to a new bucket.

Errors: if the compressor raises on one rank, the torch Future fails and ``loss.backward()`` raises
a RuntimeError on that rank whose message carries the original exception's type and message
("Got the following error when running the callback: ArithmeticError: ..."). Its peers may be blocked in a collective
that rank will never join; the communicator then ends the whole job after ``abort_grace_s`` seconds
(``GRADCOMP_ABORT_GRACE_S``, default 10) unless the failing process exits first, so no rank hangs.
Errors that every rank detects together (``CollectiveError``: mismatched buckets or compressors)
raise from ``backward()`` on every rank and leave the communicator usable.
"""
from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from ..arrays import is_device_array, synchronize
from ..bucket import Bucket
from ..comm import Communicator
from ..compressors import Compressor, make
from .tensors import as_array, wait_for_torch


class HookState:
    """What DDP hands back to ``gradcomp_hook`` on every call: the compressor and the communicator.

    ``buckets_reduced`` counts hook calls on this rank (useful when checking that a run actually
    went through gradcomp).
    """

    def __init__(self, compressor: Compressor, comm: Communicator):
        self.compressor = compressor
        self.comm = comm
        self.buckets_reduced = 0

    def __repr__(self):
        return f"HookState({self.compressor!r}, {self.comm!r})"


def gradcomp_hook(state: HookState, bucket):
    """The DDP communication hook: average ``bucket`` over ranks with ``state.compressor``.

    Returns a ``torch.futures.Future`` resolving to the bucket's buffer, overwritten with the mean.
    """
    tensor = bucket.buffer()
    future = torch.futures.Future(devices=[tensor.device] if tensor.is_cuda else None)
    # DDP reads the Future from C++; Future.set_exception only stores the exception as a value for
    # Python's wait() to raise, which DDP would report as "Unable to cast ... to Tensor". A then()
    # callback that re-raises turns it into a real error carrying the original type and message.
    result = future.then(_value)
    try:
        array = as_array(tensor)
        shapes = [tuple(g.shape) for g in bucket.gradients()]
        # scratch: DDP lets a hook overwrite its bucket (PyTorch's own hooks divide it in place),
        # so a compressor may reduce into it instead of allocating a second 25 MB per bucket
        wrapped = Bucket(array, bucket.index(), shapes, bucket.is_last(), scratch=True)
        if tensor.is_cuda:
            wait_for_torch(tensor)  # the worker thread (and MPI) must see finished gradients
        pending = state.compressor.reduce(wrapped, state.comm)
    except BaseException as exc:  # surfaces from backward(), like an error inside the compressor
        _fail(future, exc)
        return result
    state.buckets_reduced += 1

    def write_back(done):
        try:
            mean = done.result()
            if mean is not array:  # already in place when the compressor reduced into the bucket
                array[...] = mean
            if is_device_array(array):
                synchronize(array)  # the copy must be finished before DDP reads the buffer
            future.set_result(tensor)
        except BaseException as exc:
            _fail(future, exc)

    pending.add_done_callback(write_back)
    return result


def _value(done):
    return done.value()


def _fail(future, exc: BaseException) -> None:
    """Fail ``future`` with ``exc`` (torch Futures take Exceptions only, so wrap the others)."""
    if not isinstance(exc, Exception):
        exc = RuntimeError(f"gradcomp: reduction interrupted by {exc!r}")
    future.set_exception(exc)


def comm_hook(compressor, comm: Communicator | None = None) -> tuple[HookState, object]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``compressor``: a gradcomp ``Compressor`` or a registry name (``"fp16"``, ...). ``comm``: any
    gradcomp Communicator; None picks one as ``register`` does for a model on the default group.
    """
    if isinstance(compressor, str):
        compressor = make(compressor)
    if not isinstance(compressor, Compressor):
        raise TypeError(f"gradcomp.torch: expected a gradcomp Compressor or a registry name, "
                        f"got {type(compressor).__name__}")
    if comm is None:
        comm = default_comm()
    return HookState(compressor, comm), gradcomp_hook


def register(ddp_model, compressor, comm: Communicator | None = None) -> HookState:
    """Make ``ddp_model`` (a ``DistributedDataParallel``) average its gradients with ``compressor``.

    Call it on every rank, before the first ``backward()``, once per model (DDP's rule).
    ``comm=None`` chooses the transport: MPI (gradcomp's default ``MPICommunicator``, CUDA-aware
    where the MPI library is) when the job was launched by mpiexec with one MPI rank per DDP rank,
    otherwise a ``TorchCommunicator`` on a dedicated copy of the default process group. A model on
    a process group other than the default one needs an explicit ``comm``.

    Returns the hook state, whose ``compressor`` holds the statistics (``compressor.stats()``).
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"gradcomp.torch.register expects a DistributedDataParallel model, got "
                        f"{type(ddp_model).__name__}; wrap it first: DistributedDataParallel(model)")
    if comm is None:
        group = getattr(ddp_model, "process_group", None)
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("gradcomp.torch.register: this model runs on a process group other than "
                             "the default one; pass comm=TorchCommunicator(<a group dedicated to "
                             "gradcomp with the same ranks>)")
    state, hook = comm_hook(compressor, comm)
    ddp_model.register_comm_hook(state, hook)
    return state


_MPI_LAUNCH_VARS = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")


def launched_by_mpi() -> bool:
    """True when this process was started by an MPI launcher (or MPI is already running)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        return True
    return any(v in os.environ for v in _MPI_LAUNCH_VARS)


def default_comm() -> Communicator:
    """MPI when mpiexec started one MPI rank per torch rank, torch.distributed otherwise."""
    if launched_by_mpi():
        from ..comm import default_communicator

        comm = default_communicator()
        if not dist.is_initialized() or comm.size == dist.get_world_size():
            return comm
    from .communicator import TorchCommunicator

    return TorchCommunicator()
