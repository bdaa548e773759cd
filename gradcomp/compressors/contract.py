"""The Compressor contract shared by every method.

A compressor turns one bucket on every rank into the average over ranks. ``reduce`` queues the
work on the communicator's pipeline and returns a Future at once. The work has two stages:

* ``prepare(bucket, comm, workspace)``, optional, on the pipeline's compute thread: local
  arithmetic (casting, quantizing, PowerSGD's first product) and the decisions that depend on
  step counters, in submission order. No collectives (``comm`` is there for its rank and size).
  Temporaries come from ``workspace`` (reused step to step). Its result goes to the second stage;
* ``run(bucket, comm, prepared)``, on the wire thread: the collectives and what follows them.

So the local stage of bucket k+1 overlaps the transfer of bucket k. Methods with one collective
are written as codecs (``gradcomp.compressors.codec``) and never see these stages; multi-round
methods (PowerSGD) implement them directly; a compressor that only overrides ``run(bucket,
comm)`` runs entirely on the wire thread and works unchanged.

Before any data moves, ``agreement.agree`` checks that every rank brings the same layout,
configuration (``config``) and state (``agreement_state``); a mismatch is a ``CollectiveError`` on
every rank.
"""
from __future__ import annotations

import inspect
import weakref
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import numpy as np

from .. import timeline
from ..arrays import FLOAT_DTYPES, Array, DTypeLike, is_device_array, synchronize
from ..bucket import Bucket, buffer_problem
from ..comm import Communicator, Workspace, default_communicator, wire_bytes
from ..comm.protocol import method_traffic
from .agreement import agree
from .guard import ADVICE, Guard
from .passes import Passes


def _on_device(device: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """Run ``fn`` with ``device`` current on this (pipeline) thread. Left current afterwards, so
    that done-callbacks, which run on the wire thread right after ``fn``, copy on the same GPU."""
    device.use()
    return fn(*args)


@dataclass(frozen=True)
class Traffic:
    """One bucket's communication: ``kind`` ("allreduce", "allgather" or "two-stage"), message
    bytes, collectives in sequence (what ``Compressor.traffic`` declares; the cost model,
    ``gradcomp.planning.cost``, prices it)."""
    kind: str
    message_bytes: float
    pieces: int = 1  # collectives of this kind in sequence, each with its share of the bytes
    extra: tuple["Traffic", ...] = field(default=())  # further collectives (PowerSGD's second round)


def run_stage(compressor: Compressor, bucket: Bucket, comm: Communicator, prepared: Any = None) -> Array:
    """``compressor.run`` with or without a prepared stage (a compressor that only overrides
    ``run(bucket, comm)`` has none)."""
    if prepared is None:
        return compressor.run(bucket, comm)
    return compressor.run(bucket, comm, prepared)


class Compressor:
    """Base class. Subclasses implement ``run`` (or ``prepare`` + ``finish``), declare their
    configuration through their ``__init__`` parameters (stored as attributes of the same names,
    or by overriding ``config``), and, if stateful, ``agreement_state`` and the state-dict pair.
    """

    # -- declared behaviour, checked by the conformance kit (gradcomp.conformance) ----------------
    #: what a NaN or Inf at one position of one rank's bucket does to the result: "element" (that
    #: position and nothing else), "chunk" (exactly its 512-value chunk), "tensor" (that position
    #: and possibly more of its tensor, nothing outside), "bucket" (that position and possibly
    #: anything else in the bucket), or None (not declared: the kit then only checks that replicas
    #: agree and that later steps are clean).
    nan_effect: str | None = None
    #: without an analytic ``error_bound`` and without error feedback: the largest relative error
    #: ``|out - mean| / |mean|`` allowed on the kit's structured signal (low-rank, heavy-tailed
    #: tensors plus per-rank noise). 1.0 is what returning zeros achieves.
    relative_error_limit: float = 0.9
    #: whether the divergence guard watches this compressor's residuals (``guard``); a wrapper
    #: that reduces through it (``Hierarchical``) watches instead
    watched: bool = True
    #: what the divergence guard's warning tells a user to do; an optimizer's exchange says its own
    runaway_advice: str = ADVICE
    #: whether the method sends only a sparse, low-rank or sign-only part of each gradient. Adam(W)
    #: steps every coordinate by about the same size, so at the gradient such a code delays most of
    #: the update and trains worse under AdamW; the torch adapter then points Adam users to ``OneBitAdam``, which compresses the momentum instead
    partial_update: bool = False
    #: whether the method has a reduce-scatter form: it takes a ``Bucket.scatter`` bucket (one row
    #: per rank) and returns the mean of this rank's row (FSDP's gradient reduce-scatter,
    #: ``gradcomp.torch.fsdp``). Wrappers and schedules scatter where every method inside does
    scatters: bool = False

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray | None:
        """Largest allowed ``|result - mean|`` per element of one step, given every rank's input
        (a (ranks, n) float64 array) and the bucket dtype; None when there is no analytic bound."""
        return None

    def traffic(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
        """This method's traffic on a bucket of tensors of ``shapes`` (values of ``itemsize`` bytes)
        exchanged over ``ranks``, in steady state (a recipe's last stage, PowerSGD past its
        warm-up). A ``TypeError`` where the method does not declare it (``auto``, which plans per
        bucket)."""
        raise TypeError(f"the cost model does not know {type(self).__name__}")

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Passes | None:
        """The passes over memory one step of this method makes on a bucket of tensors of
        ``shapes`` (values of ``itemsize`` bytes) at ``ranks`` ranks, per rank, in steady state:
        the bytes each reads and writes, by name (``compressors.passes``). None where the method
        does not declare them."""
        return None

    def hierarchical_pays(self) -> bool:
        """Whether the hierarchical schedule (``Hierarchical``) is the better default for this
        method on several hosts of several ranks: where it sends at least 1/8 of fp32's bytes
        (fp32, fp16, bf16, int8, int4, the allgathered 8-bit codes: the link bounds their step,
        and the hierarchy cuts what crosses it). Below (onebit, topk, randomk, PowerSGD) the CPU
        bounds the step, and the exact stages inside the host cost more than the bytes they save.
        Judged on a 1024 x 1024 float32 matrix at 2 ranks (``traffic``); a method that does not
        declare its traffic stays flat."""
        try:
            t = self.traffic([(1024, 1024)], 2)
        except TypeError:
            return False
        sent = sum(part.message_bytes for part in (t,) + t.extra)
        return sent >= 4 * 1024 * 1024 / 8 * 0.95  # (int4's codes and scales: 1/7.8)

    @property
    def error_feedback_on(self) -> bool:
        """Whether compression error is fed back into later steps: the kit then checks that the
        error accumulated over many steps stays bounded instead of the error of each step."""
        return False

    @property
    def warmup_steps(self) -> int:
        """Steps before this compressor reaches its steady-state method (a recipe's exact
        warm-up and ramp, PowerSGD's ``start_iter``): the conformance kit runs past them."""
        return 0

    def __init__(self) -> None:
        self._stats: dict[str, Any] = dict(calls=0, steps=0, input_bytes=0, bytes_sent=0.0, rounds=0,
                                           reference_bytes=0.0)
        self._comm_ref: weakref.ref | None = None
        self._guard: Guard | None = None

    def _new_guard(self) -> Guard:
        self._guard = Guard()
        return self._guard

    # -- public API ------------------------------------------------------------------------------
    def reduce(self, bucket: Bucket | Array, comm: Communicator | None = None) -> Future[Array]:
        """Average ``bucket`` (a ``Bucket`` or a 1-D array) over the ranks of ``comm``.

        Queued on the communicator's pipeline; returns a Future of the mean at once: a new array
        of the input's length and dtype, or, for a scratch bucket, the bucket's own buffer. On the
        GPU, the caller's current CUDA stream is synchronized first, so the pipeline sees finished
        values, and the pipeline threads run on the buffer's device.
        """
        comm = comm if comm is not None else default_communicator()
        self._bind(comm)
        buffer: Array = getattr(bucket, "buffer", bucket)
        problem = buffer_problem(buffer) if not isinstance(bucket, Bucket) else None
        if problem is not None:
            problem = (f"passed a buffer that cannot be a bucket: {problem} (a bucket is a 1-D "
                       f"contiguous {'/'.join(FLOAT_DTYPES)} array in the machine's byte order)")
        if problem is None and not isinstance(bucket, Bucket):
            bucket = Bucket(buffer)
        if problem is None:
            synchronize(buffer)
        prepare: Callable[[Workspace], Any] | None = None
        if self.staged:
            # A rank whose buffer cannot be a bucket still takes its local stage, on an empty
            # bucket: step counters then advance alike on every rank, and after the
            # CollectiveError every rank agrees on the state again.
            local = bucket if problem is None else Bucket(np.empty(0, np.float32))

            def prepare(workspace: Workspace, local: Bucket = local) -> Any:
                return self.prepare(local, comm, workspace)

        def run(prepared: Any, error: BaseException | None) -> Array:
            why = problem if error is None else f"its local stage failed: {error!r}"
            return self.checked_run(bucket, comm, prepared, why)

        if problem is None and is_device_array(buffer):
            device = buffer.device
            run = _wrap_device(device, run)
            prepare = None if prepare is None else _wrap_device(device, prepare)

        keys = bucket.keys if isinstance(bucket, Bucket) else ()
        last = bucket.is_last if isinstance(bucket, Bucket) else True
        step = self.__dict__.get("_submitted_steps", 0)  # the timeline's step (its own count:
        self.__dict__["_submitted_steps"] = step + int(last)  # a compressor pickled before has none)
        if timeline.enabled:
            run, prepare = _traced(self, bucket, step, last, run, prepare)
        return comm.submit(run, prepare, keys)

    def checked_run(self, bucket: Bucket | Array, comm: Communicator, prepared: Any = None,
                    problem: str | None = None) -> Array:
        """``agree``, then ``run``, recording traffic and watching residuals (on the wire thread)."""
        # the exact collective the caller would have run: an allreduce, or FSDP's reduce-scatter of
        # a ``scatter`` bucket, the one path to a method's reduce-scatter form: where it has none
        # (``scatters``), every rank refuses the bucket in the agreement
        reference = "allreduce"
        if isinstance(bucket, Bucket) and bucket.scatter:
            reference = "reduce_scatter"
            if problem is None:
                problem = scatter_problem(self, bucket, comm)
        guard = getattr(self, "_guard", None)
        if guard is None and self.error_feedback_on and getattr(self, "watched", True):
            guard = self._new_guard()
        with timeline.span("agree", "agree"):
            bucket, flags = agree(comm, bucket, self, prepared, problem, guard.flag if guard is not None else 0)
        watch = guard is not None and guard.due(self._stats["steps"])
        if guard is not None:
            guard.announce(flags, self.describe(), self.runaway_advice)
            if guard.warned:
                self.after_runaway(prepared)
            norms = guard.gradient_norms(bucket) if watch else []
        before_bytes, before_calls = method_traffic(comm)
        out = run_stage(self, bucket, comm, prepared)
        if watch and guard is not None:
            guard.measure(bucket, self.residuals(bucket.keys), norms, self.regime(prepared))
        elif not getattr(self, "watched", True):
            self.last_regime = self.regime(prepared)  # for the wrapper that watches (Hierarchical)
        s = self._stats
        s["calls"] += 1
        s["steps"] += int(bucket.is_last)
        s["input_bytes"] += bucket.buffer.nbytes
        after_bytes, after_calls = method_traffic(comm)
        s["bytes_sent"] += after_bytes - before_bytes
        s["rounds"] += after_calls - before_calls
        s["reference_bytes"] += wire_bytes(reference, bucket.buffer.nbytes, comm.size)
        return out

    @property
    def staged(self) -> bool:
        """Whether this compressor has a local stage (``prepare``)."""
        return type(self).prepare is not Compressor.prepare

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Any:
        """The local stage (see the module docstring); the default has none."""
        return None

    def run(self, bucket: Bucket, comm: Communicator, prepared: Any = None) -> Array:
        """Reduce ``bucket`` over ``comm`` on the wire thread and return the mean over ranks: a
        new array of the bucket's length and dtype, or ``bucket.buffer`` itself when the bucket
        is scratch. Must not modify a bucket that is not scratch.

        Staged compressors leave this as it is and implement ``finish``; called without a
        prepared stage (a wrapper calling its inner method directly), it runs ``prepare`` first.
        """
        if prepared is None and self.staged:
            prepared = self.prepare(bucket, comm, comm.workspace)
        return self.finish(bucket, comm, prepared)

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Any) -> Array:
        raise NotImplementedError(f"{type(self).__name__} must implement run(bucket, comm) "
                                  "or prepare + finish")

    # -- declared configuration and state ------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        """The configuration that decides this compressor's collectives and results, by name.

        Default: the ``__init__`` parameters, read back from attributes of the same names (the
        scikit-learn convention). Ranks compare it before every bucket (``agreement``).
        """
        out: dict[str, Any] = {}
        for name, param in inspect.signature(type(self).__init__).parameters.items():
            if name == "self" or param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                continue
            if not hasattr(self, name):
                raise TypeError(f"{type(self).__name__}: __init__ parameter {name!r} is not stored as "
                                f"self.{name}; store it, or override config()")
            out[name] = getattr(self, name)
        return out

    def describe(self) -> str:
        """``Name(param=value, ...)`` from ``config``, nested compressors included."""
        fields = ", ".join(f"{k}={v.describe() if isinstance(v, Compressor) else repr(v)}"
                           for k, v in self.config().items())
        return f"{type(self).__name__}({fields})"

    def __repr__(self) -> str:
        return self.describe()

    def agreement_state(self, bucket: Bucket, prepared: Any) -> dict[str, Any]:
        """State that decides this bucket's collectives (step, phase, stage, ...): it must be
        equal on every rank. ``prepared`` is this bucket's local stage result, if any."""
        return {}

    def stats(self) -> dict[str, Any]:
        """Traffic so far. ``bytes_sent``: bytes this rank put on the wire (bandwidth-optimal
        algorithms); ``compression_ratio``: what a plain allreduce of the same buckets would have
        sent divided by what was sent; ``rounds_per_step``: collectives per training step."""
        s = dict(self._stats)
        steps = max(s["steps"], 1)
        s["bytes_sent_per_step"] = s["bytes_sent"] / steps
        s["rounds_per_step"] = s["rounds"] / steps
        s["compression_ratio"] = (s["reference_bytes"] / s["bytes_sent"]) if s["bytes_sent"] else 1.0
        guard = getattr(self, "_guard", None)
        if guard is not None:
            s["guard"] = guard.stats()
        return s

    def state_dict(self) -> dict[str, Any]:
        """Plain arrays and numbers only (``numpy.savez``-able); stateless methods return {}.
        Take it between steps, when no reduction of this compressor is in flight."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        """Restore ``state_dict()``'s output. Checks everything before changing anything and raises
        ``ValueError`` naming the key at fault. ``shapes``: the tensors this compressor will
        reduce, by key, when the caller knows them (``GradientReducer``, the DDP hook)."""
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    def regime(self, prepared: Any) -> tuple:
        """What reduced a bucket whose local stage is ``prepared``, as far as its residuals'
        scale goes: the divergence guard judges their growth within one regime
        (``compressors.guard``). A ``Schedule`` names its stage; wrappers ask their inner method."""
        return ()

    def after_runaway(self, prepared: Any) -> Any:
        """The divergence guard has announced a runaway (on every rank, at the same bucket; called
        again at every later bucket): what this compressor changes in answer. Nothing, here; the
        governor steps every bucket a rung down. Wrappers pass it to their inner method."""

    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        """Hand over the error-feedback residuals kept for ``keys`` (removing them): ``Schedule``
        adds them to the gradient when another stage takes over. Default: none kept."""
        return {}

    def residuals(self, keys: Iterable[str]) -> dict[str, Array]:
        """The error-feedback residuals kept for ``keys``, as live views shaped like their
        tensors (no copy; read them between steps): the divergence guard measures them, DGC's
        momentum masking reads them. Default: none kept."""
        return {}

    # -- one communicator per compressor ----------------------------------------------------------------
    def _bind(self, comm: Communicator) -> None:
        bound = self._comm_ref() if self._comm_ref is not None else None
        if bound is None:
            self._comm_ref = weakref.ref(comm)
        elif bound is not comm:
            raise ValueError(
                f"{self.describe()} already reduces on {bound!r}; a compressor keeps step counters "
                f"and per-tensor state for one communicator, so it cannot also reduce on {comm!r}. "
                "Use one compressor per communicator (copy.deepcopy before first use).")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_comm_ref"] = None  # a communicator (threads, MPI handles) never travels
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> Compressor:
        import copy

        clone = object.__new__(type(self))
        memo[id(self)] = clone
        clone.__setstate__({key: copy.deepcopy(value, memo) for key, value in self.__getstate__().items()})
        return clone

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


def scatter_problem(compressor: Compressor, bucket: Bucket, comm: Communicator) -> str | None:
    """Why ``compressor`` cannot reduce-scatter ``bucket`` (a ``scatter`` bucket), or None."""
    if not compressor.scatters:
        return f"{compressor.describe()} has no reduce-scatter form"
    if bucket.numel % comm.size:
        return f"a reduce-scatter bucket of {bucket.numel} values does not split into {comm.size} equal rows"
    return None


def parts(compressor: Compressor) -> Iterator[Compressor]:
    """``compressor`` and every compressor its configuration holds (a wrapper's inner method, a
    schedule's stages), nested ones included, in no promised order."""
    yield compressor
    pending: list[Any] = list(compressor.config().values())
    while pending:
        v = pending.pop()
        if isinstance(v, Compressor):
            yield from parts(v)
        elif isinstance(v, (list, tuple)):
            pending.extend(v)


def sends_part(compressor: Compressor) -> bool:
    """Whether ``compressor`` (or a method it wraps or schedules) sends only part of a gradient."""
    return any(p.partial_update for p in parts(compressor))


def _traced(compressor: Compressor, bucket: Any, step: int, last: bool, run: Callable[..., Any],
            prepare: Callable[[Workspace], Any] | None) -> tuple[Callable[..., Any], Any]:
    """``reduce``'s two stages as timeline tasks (``gradcomp.timeline``): ``compress`` on the
    compute thread, ``reduce`` on the wire thread (the collectives and the decode inside it carry
    its arguments); a step's last bucket wakes the timeline's writer."""
    args = dict(bucket=getattr(bucket, "index", 0), bytes=int(getattr(bucket, "buffer", bucket).nbytes),
                step=step, method=_name(compressor))

    def traced_run(prepared: Any, error: BaseException | None) -> Array:
        with timeline.task("reduce", "reduce", **args):
            out = run(prepared, error)
        if last:
            timeline.step_done()
        return out

    def traced_prepare(workspace: Workspace) -> Any:
        assert prepare is not None
        with timeline.task("compress", "compress", **args):
            return prepare(workspace)

    return traced_run, (traced_prepare if prepare is not None else None)


def _name(compressor: Compressor) -> str:
    """``describe()``, kept on the compressor after the first traced bucket (it walks the config)."""
    name = compressor.__dict__.get("_timeline_name")
    if name is None:
        name = compressor.__dict__["_timeline_name"] = compressor.describe()
    return name


def _wrap_device(device: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        return _on_device(device, fn, *args)
    return wrapped

