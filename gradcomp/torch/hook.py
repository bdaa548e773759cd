"""Any gradcomp compressor as a DDP communication hook.

What DDP's hook contract asks for, and how it is met here (so users never meet it):

* DDP inspects the hook's signature: the second parameter must be named ``bucket``, and logs the
  hook's ``__qualname__``. Each ``register`` makes a hook named after its compressor
  (``gradcomp_hook[FP16(inner=Allreduce())]``, a ``NamedHook``), so DDP's logs say which method
  ran.
* The returned ``torch.futures.Future`` must resolve to ONE tensor with the bucket's length. The
  compressor's ``concurrent.futures.Future`` is bridged to a torch Future that resolves to the
  bucket's own buffer, the mean written into it in place. Writing into the buffer DDP handed over
  in *this* call keeps gradients right on every iteration: DDP replaces its buckets after the
  first synced step (stale bucket views were the loss=nan of PyTorch issue #43307).
* After the first synced step DDP rebuilds its buckets. Each call describes its bucket afresh
  (``index``, ``is_last``, shapes) and names its tensors by parameter name (``register``), so
  compressor state (residuals, warm-start factors) follows each parameter through the rebuild and
  into a resumed run of a freshly built model. A code over a bucket's chunks (int8, topk, ...)
  also depends on which tensors share a bucket, and a fresh model's first step puts them all in
  one: so the hook state records the last step's bucket layouts, and after a resume the first
  step's buckets are cut back into them (``layouts.replay_parts``), which makes the resumed run equal the
  uninterrupted one bit for bit.
* PyTorch's hook-pickling flow (``torch.save`` the compressor, ``torch.load`` it, attach it to a
  fresh model with ``register_comm_hook(*comm_hook(restored))``) hands the hook no model, and DDP's
  ``GradBucket`` names no parameter. A compressor ``register`` attached carries what it knew of the
  model (``ModelRecord``: parameter names and shapes, the last layouts), so such a hook finds its
  model once (``naming.names_from_model``) and keys tensors by name as ``register`` did.
* Sparse gradients (``nn.Embedding(sparse=True)``) arrive as a bucket of their own; ``Allreduce``
  and ``Allgather`` average them as PyTorch's allreduce does (``sparse_grads``), other compressors
  raise an error that says so on every rank.

Errors: if the compressor raises on one rank, the torch Future fails and ``loss.backward()`` raises
a RuntimeError on that rank carrying the original type and message; unless caught, it ends the job
(``gradcomp.comm.exits``). Errors that every rank detects together (``CollectiveError``) raise
from ``backward()`` on every rank and leave the communicator usable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from .. import timeline
from ..arrays import array_module, is_device_array, synchronize
from ..bucket import Bucket
from ..comm import Communicator
from ..compressors import Compressor
from ..compressors.hierarchical import Hierarchical, scheduled, wrap
from ..metrics import Meter
from ..registry import make
from ..state import check_saved_here
from . import advice
from .checkpoint import from_torch_state, to_torch_state
from .communicator import default_comm
from . import layouts
from .naming import RECORD, HookRegisteredTwice, adopt, names_from_model, record_of
from .sparse_grads import reduce_sparse
from .tensors import as_array, wait_for_torch

if TYPE_CHECKING:
    from concurrent.futures import Future

    from torch.nn.parallel import DistributedDataParallel


class HookState:
    """What DDP hands back to the hook on every call: the compressor, the communicator and the
    names of the model's parameters (the keys of per-tensor state).

    ``state_dict()``/``load_state_dict()`` checkpoint the compressor in PyTorch's way: tensors and
    plain values only, so ``torch.save`` and ``torch.load`` (``weights_only=True``) work. Pickling
    the whole state (``torch.save(state)``), or the compressor alone (``ModelRecord``), drops the
    communicator, as PyTorch's ``PowerSGDState`` drops its process group; a loaded state picks the
    default transport at its first bucket.
    ``buckets_reduced`` counts hook calls on this rank. ``metrics()``: the compressor's figures as
    flat scalars for a logger.
    """

    def __init__(self, compressor: Compressor, comm: Communicator | None,
                 names: dict[int, str] | None = None, shapes: dict[str, tuple] | None = None):
        self.compressor = compressor
        self.comm = comm
        self.names = names or {}     # id(parameter) -> name (rebuilt after unpickling)
        self.shapes = shapes or {}   # name -> shape
        self.buckets_reduced = 0
        self.layouts: list[tuple[str, ...]] = []  # the last whole step's buckets' keys, by index
        self.replay: list[tuple[str, ...]] = []   # loaded layouts the next step's buckets are cut into
        self._step_layouts: list[tuple[str, ...]] = []  # this step's so far

    def __repr__(self) -> str:
        return f"HookState({self.compressor!r}, {self.comm!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["comm"] = None   # threads and MPI handles never travel
        state["names"] = {}    # ids mean nothing in another process; re-made by register()
        state.pop("_meter", None)  # a loaded state's recent figures start at its load
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        # loaded, like load_state_dict: a fresh model's first bucket is cut into the last layouts
        self.layouts = list(state.get("layouts", []))  # (absent from states pickled before)
        self.replay, self._step_layouts = list(self.layouts), []

    def _rank_and_size(self) -> tuple[int, int]:
        if self.comm is not None:
            return self.comm.rank, self.comm.size
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1

    def metrics(self) -> dict[str, float]:
        """``gradcomp.metrics`` of the compressor's ``stats()`` with the ``recent_*`` figures since
        the previous call (``meter``): ``writer.add_scalar(name, value, step)`` for each item, at a
        logging step. ``meter.events``: the back-off lines since the previous call."""
        return self.meter.update(self.compressor.stats())

    @property
    def meter(self) -> Meter:
        """The ``gradcomp.Meter`` that ``metrics()`` reads through."""
        return self.__dict__.setdefault("_meter", Meter())

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state as tensors and plain values (``torch.save``-able), and the last
        step's bucket layouts (lists of parameter names)."""
        rank, size = self._rank_and_size()
        return {"compressor": self.compressor.describe(),
                "state": to_torch_state(self.compressor.state_dict()),
                "layouts": [list(keys) for keys in self.layouts],
                "rank": rank, "world_size": size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; checked against this model's parameters first."""
        if not isinstance(state, dict) or "state" not in state:
            raise ValueError("gradcomp.torch: expected the output of HookState.state_dict() "
                             "(a dict with 'compressor' and 'state')")
        saved = state.get("compressor")
        if saved != self.compressor.describe():
            raise ValueError(f"gradcomp.torch: this checkpoint was saved by {saved}, but this hook "
                             f"runs {self.compressor.describe()}")
        rank, size = self._rank_and_size()
        check_saved_here(state["state"], state.get("rank"), state.get("world_size"), rank, size,
                         "gradcomp.torch", "Save state.state_dict() on every rank, to a file of its "
                         "own, or gather every rank's into one file (gradcomp.torch.ranks."
                         "gather_every_rank, then own_rank_state): docs/guides/checkpoints.md")
        layouts = state.get("layouts", [])  # absent from checkpoints saved before they were kept
        if not (isinstance(layouts, list) and all(isinstance(keys, list) and all(isinstance(k, str) for k in keys)
                                                  for keys in layouts)):
            raise ValueError("gradcomp.torch: 'layouts' must be a list of lists of parameter names")
        self.compressor.load_state_dict(from_torch_state(state["state"]), self.shapes or None)
        self.layouts = self.replay = [tuple(keys) for keys in layouts]
        self._step_layouts = []
        record = record_of(self.compressor)
        if record is not None:
            record.layouts = self.layouts


# ``bucket`` (a ``torch.distributed.GradBucket``) and the returned ``torch.futures.Future`` are
# left unannotated on purpose: DDP's ``register_comm_hook`` inspects the hook's annotations and
# refuses any but the exact objects ``dist.GradBucket`` and ``Future[Tensor]``, and postponed
# annotations (``from __future__ import annotations``) would hand it strings.
def _hook(state: HookState, bucket):
    """Average ``bucket`` over ranks with ``state.compressor``; a Future of the bucket's buffer,
    overwritten with the mean."""
    called = timeline.now() if timeline.enabled else None
    tensor = bucket.buffer()
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future(
        devices=[tensor.device] if tensor.is_cuda else None)
    # DDP reads the Future from C++; Future.set_exception only stores the exception as a value for
    # Python's wait() to raise, which DDP would report as "Unable to cast ... to Tensor". A then()
    # callback that re-raises turns it into a real error carrying the original type and message.
    result = future.then(_value)
    if state.comm is None:
        state.comm = default_comm()
    try:
        if tensor.is_sparse:
            pending = reduce_sparse(state.compressor, state.comm, tensor)
            array, earlier, last = None, [], None
        else:
            array = as_array(tensor)
            params = bucket.parameters()
            if not state.names and record_of(state.compressor) is not None:
                names_from_model(state, params)  # comm_hook() of a compressor register attached
            found = [state.names.get(id(p)) for p in params]
            keys: list[Any] | None = found
            if None in found or len(found) != len(set(found)):
                keys = None  # comm_hook() without a model: state follows the bucket index
            shapes = [tuple(g.shape) for g in bucket.gradients()]
            if tensor.is_cuda:
                wait_for_torch(tensor)  # the pipeline's threads (and MPI) must see finished gradients
            parts = layouts.replay_parts(state, keys) if keys is not None else None
            if parts is None and keys is not None and bucket.index() == 0 and bucket.is_last() \
                    and array.nbytes > 2 * layouts.PIECE_BYTES:
                parts = layouts.pieces(keys, shapes, array.itemsize)  # DDP's first step: every parameter in one
            if parts is None:
                # scratch: DDP lets a hook overwrite its bucket (PyTorch's own hooks divide it in
                # place), so a compressor may reduce into it instead of allocating another 25 MB
                wrapped = Bucket(array, bucket.index(), shapes, bucket.is_last(), scratch=True, keys=keys)
                jobs = [(None, state.compressor.reduce(wrapped, state.comm))]
                parts = [(bucket.index(), tuple(keys))] if keys is not None else []
            else:
                jobs = layouts.reduce_parts(state, array, keys, shapes, parts, bucket.is_last())  # type: ignore[arg-type]
            layouts.record_layouts(state, [p for _, p in parts], bucket.is_last())
            pending = jobs[-1][1]
            # what ``write_back`` holds: the earlier parts, and the last one's place only, as it is
            # handed the last Future; holding that Future too would make a reference cycle (the
            # Future keeps its callbacks) that keeps this bucket alive until Python's cycle collector
            # runs, DDP's first-step bucket (every gradient) alongside the buckets it rebuilds
            earlier, last = jobs[:-1], jobs[-1][0]
            del jobs
    except BaseException as exc:  # surfaces from backward(), like an error inside the compressor
        _fail(future, exc)
        return result
    state.buckets_reduced += 1
    waited = _traced_call(state, bucket, called) if called is not None else None

    def write_back(done: Future[Any]) -> None:
        try:
            mean = done.result()
            if array is None:  # sparse: a new tensor
                future.set_result(mean)
                return
            for where, part in [*earlier, (last, done)]:  # the pipeline is ordered: the earlier parts are done
                mean = part.result()
                if where is None:
                    if mean is not array:  # already in place when the compressor reduced into the bucket
                        array[...] = mean
                    continue
                if len(where) == 1 and mean.size == where[0][1] and layouts.same_place(mean, array, where[0][0]):
                    continue  # reduced in place, into its view of the bucket
                at = 0
                for start, size in where:
                    array[start:start + size] = mean[at:at + size]
                    at += size
            if is_device_array(array):
                synchronize(array)  # the copy must be finished before DDP reads the buffer
            if waited is not None:  # the training thread waited for the step's means since then
                timeline.complete("wait", "wait", waited[0], timeline.now(), waited[1], step=waited[2])
            future.set_result(tensor)
        except BaseException as exc:
            _fail(future, exc)

    pending.add_done_callback(write_back)
    return result


def _traced_call(state: HookState, bucket: Any, called: float) -> tuple[float, int | None, int] | None:
    """The timeline's ``hook`` span of this call, on the training thread; for a step's last
    bucket, when the training thread starts to wait for the means, its track and the step."""
    tid = timeline.thread_id()
    last = bucket.is_last()
    step = state.compressor.__dict__.get("_submitted_steps", 0) - int(last)  # (``Compressor.reduce`` counts)
    ended = timeline.now()
    timeline.complete("hook", "hook", called, ended, tid, bucket=bucket.index(), step=step)
    return (ended, tid, step) if last else None


class NamedHook:
    """``_hook`` under the compressor's name: DDP logs the hook's ``__qualname__``. A callable
    object rather than a renamed function, so that it pickles (by its class, with its name), as
    PyTorch's hook-pickling flow saves the hook beside its state; DDP reads the signature of
    ``__call__``: ``bucket`` unannotated (see ``_hook``)."""

    def __init__(self, name: str) -> None:
        self.__name__ = self.__qualname__ = name
        self.__doc__ = _hook.__doc__

    def __call__(self, state: HookState, bucket):
        return _hook(state, bucket)

    def __repr__(self) -> str:
        return f"<gradcomp hook {self.__qualname__}>"


def _named_hook(compressor: Compressor) -> Callable[..., Any]:
    return NamedHook(f"gradcomp_hook[{compressor.describe()}]")


def gradcomp_hook(state: HookState, bucket):  # bucket and result unannotated: see ``_hook``
    """The DDP communication hook (see ``_hook``); ``register`` uses a copy named per compressor."""
    return _hook(state, bucket)


def _value(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    return done.value()


def _fail(future: torch.futures.Future[Any], exc: BaseException) -> None:
    """Fail ``future`` with ``exc`` (torch Futures take Exceptions only, so wrap the others)."""
    if not isinstance(exc, Exception):
        exc = RuntimeError(f"gradcomp: reduction interrupted by {exc!r}")
    future.set_exception(exc)


def comm_hook(compressor: Compressor | str,
              comm: Communicator | None = None) -> tuple[HookState, Callable[..., Any]]:
    """``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    ``compressor``: a gradcomp ``Compressor`` or a registry name (``"fp16"``, ...). ``comm``: any
    gradcomp Communicator; None picks one as ``register`` does. Without the model, compressor
    state follows bucket indices (as PyTorch's hooks'); ``register`` keys it by parameter name. A
    compressor ``register`` attached before (PyTorch's flow: ``torch.save`` it, ``torch.load`` it,
    ``register_comm_hook(*comm_hook(restored))`` on a fresh model) keeps that: its state follows
    the parameters by name (see ``naming.names_from_model``), in ``Hierarchical`` again where
    ``register`` ran it there (its state is kept per host group), and a resumed run equals the
    uninterrupted one.
    """
    if isinstance(compressor, str):
        compressor = make(compressor)
    if not isinstance(compressor, Compressor):
        raise TypeError(f"gradcomp.torch: expected a gradcomp Compressor or a registry name, "
                        f"got {type(compressor).__name__}")
    if comm is None:
        comm = default_comm()
    record = record_of(compressor)
    if record is not None and record.hierarchical:  # its state is keyed by register's host groups
        compressor = wrap(compressor, comm, None)
        setattr(compressor, RECORD, record)
    state = HookState(compressor, comm)
    if record is not None:  # register attached it before (a pickled one): as after load_state_dict
        state.layouts, state.replay = list(record.layouts), list(record.layouts)
    return state, _named_hook(compressor)


def register(ddp_model: DistributedDataParallel, compressor: Compressor | str | None,
             comm: Communicator | None = None, state: Any = None,
             hierarchical: bool | None = None, allow_partial: bool = False,
             all_gather: str | None = None) -> Any:
    """Make ``ddp_model`` (a ``DistributedDataParallel``) average its gradients with ``compressor``;
    or, given the root of an FSDP2 model (``fully_shard``), make every FSDP module reduce-scatter
    its gradients with it (``gradcomp.torch.fsdp.register``, which returns an ``FSDPState``).

    Call it on every rank, before the first ``backward()``, once per model (DDP's rule; a second
    call raises ``HookRegisteredTwice``, a ``RuntimeError`` as DDP's own refusal).
    ``comm=None`` chooses the transport: MPI (gradcomp's default ``MPICommunicator``, CUDA-aware
    where the MPI library is) when mpiexec launched the job, a ``TorchCommunicator`` on a dedicated
    copy of the default process group otherwise (torchrun). A model on a process group other than
    the default one needs an explicit ``comm``. ``state``: a ``HookState`` to reuse (e.g. one
    loaded with ``torch.load``); its compressor is used and ``compressor`` may be None.
    ``hierarchical``: exact inside each host, the compressor across hosts (as
    ``GradientReducer``'s: None, the default, wherever the topology has several hosts of several
    ranks and the method is one it speeds up; ``state.compressor`` is then the ``Hierarchical``
    wrapper). ``allow_partial`` (FSDP2 only): run a method that sends only part of each gradient,
    which ``gradcomp.torch.fsdp.register`` refuses by default. ``all_gather`` (FSDP2 only): send
    FSDP's parameter all-gathers in ``"int8"`` (or ``"int4"``) chunk codes as well.

    Returns the hook state: ``state.compressor.stats()`` holds the traffic figures, and
    ``state.state_dict()`` / ``load_state_dict()`` checkpoint the compressor. A method that sends
    only part of each gradient (onebit, topk, randomk, PowerSGD) warns once at the first step of an
    Adam-like optimizer over the model, pointing to ``OneBitAdam`` (``gradcomp.torch.advice``).
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(ddp_model, FSDPModule):
        from . import fsdp

        if hierarchical:
            raise ValueError("gradcomp.torch.register: hierarchical=True is for DDP models; an FSDP2 model "
                             "reduce-scatters over its 1-D mesh")
        return fsdp.register(ddp_model, compressor, comm, state, allow_partial=allow_partial,
                             all_gather=all_gather)
    if all_gather is not None:
        raise ValueError("gradcomp.torch.register: all_gather is for FSDP2 models (fully_shard); DDP "
                         "all-gathers no parameters")
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"gradcomp.torch.register expects a DistributedDataParallel model or the root of an "
                        f"FSDP2 model (fully_shard), got {type(ddp_model).__name__}; wrap it first: "
                        "DistributedDataParallel(model), or fully_shard(model)")
    _check_no_hook_yet(ddp_model)
    if comm is None:
        group = getattr(ddp_model, "process_group", None)
        if group is not None and dist.get_world_size(group) != dist.get_world_size():
            raise ValueError("gradcomp.torch.register: this model runs on a process group other than "
                             "the default one; pass comm=TorchCommunicator(<a group dedicated to "
                             "gradcomp with the same ranks>)")
    if state is None:
        # (compressor None without a state: comm_hook raises the TypeError that says so)
        state, hook = comm_hook(compressor, comm)  # type: ignore[arg-type]
        assert state.comm is not None  # comm_hook picks one
        state.compressor = scheduled(state.compressor, state.comm, hierarchical)
        hook = _named_hook(state.compressor)
    else:
        if comm is not None or state.comm is None:
            state.comm = comm if comm is not None else default_comm()
        hook = _named_hook(state.compressor)
    adopt(state, list(ddp_model.module.named_parameters()), compressor)
    record_of(state.compressor).hierarchical = isinstance(state.compressor, Hierarchical)  # type: ignore[union-attr]
    ddp_model.register_comm_hook(state, hook)
    ddp_model._gradcomp_state = state  # what a second register names
    advice.watch(state, ddp_model.module.parameters())
    return state


def _check_no_hook_yet(ddp_model: DistributedDataParallel) -> None:
    """Refuse, before anything changes, a second communication hook on ``ddp_model`` where DDP
    would with its bare RuntimeError: the same type (``HookRegisteredTwice``), saying what to do."""
    earlier = getattr(ddp_model, "_gradcomp_state", None)
    if earlier is not None:
        raise HookRegisteredTwice(
            f"gradcomp.torch.register: this DistributedDataParallel model already has gradcomp's hook "
            f"({earlier.compressor.describe()}), and DDP takes one communication hook per model. Keep "
            "the HookState the first register returned (restore a checkpoint with its load_state_dict), "
            "or wrap the module in a new DistributedDataParallel to use another compressor")
    if getattr(ddp_model, "_comm_hooks", None):
        raise HookRegisteredTwice(
            "gradcomp.torch.register: this DistributedDataParallel model already has a communication "
            "hook (register_comm_hook was called on it), and DDP takes one per model; register gradcomp "
            "on a DistributedDataParallel model without one")


def plain_ddp_stats(ddp_model: DistributedDataParallel, steps: int) -> dict[str, Any]:
    """The traffic of DDP's own fp32 allreduce (no gradcomp hook: an example's ``--compressor
    none``) over ``steps`` synced steps, in the units of a compressor's ``stats()``: the bytes
    this rank put on the wire, bandwidth-optimal (``wire_bytes``), for every gradient DDP
    averages; what an ``allreduce`` hook counts for the same model, so the two compare. (DDP's
    broadcast of buffers, off in ``broadcast_buffers=False``, is not counted: nor is it by a
    hook.)"""
    from ..comm.protocol import wire_bytes

    group = getattr(ddp_model, "process_group", None)
    size = dist.get_world_size(group) if dist.is_initialized() else 1
    grads = sum(p.numel() * p.element_size() for p in ddp_model.parameters() if p.requires_grad)
    per_step = wire_bytes("allreduce", float(grads), size)
    return dict(steps=steps, bytes_sent=per_step * steps, reference_bytes=per_step * steps,
                bytes_sent_per_step=per_step, compression_ratio=1.0)
