"""The ordered pipeline that every communicator runs its work on.

Each submitted job has an optional *local* stage (``prepare``: compression arithmetic, no
collectives) and an *ordered* stage (``run``: the collectives and whatever follows them). Two
daemon threads execute them:

* the compute thread runs the local stages, in submission order;
* the wire thread runs the ordered stages, in submission order.

Because both queues keep submission order and only the wire thread issues collectives, every rank
issues the same collectives in the same order (DESIGN invariant 1), while the local stage of job
k+1 overlaps the transfer of job k. Limits that keep the overlap safe:

* ``depth`` bounds how far the compute thread runs ahead of the wire thread: the local stage of
  job j starts only once job j - depth - 1 has finished. Each job owns one of ``depth + 1``
  workspaces (``Workspace``) for its temporaries, so buffers are reused step after step and the
  steady state allocates nothing.
* a job's local stage starts only once every earlier job whose ``keys`` overlap its own has
  finished, so a local stage may read (and update) the state of its own tensors without racing
  the ordered stage of an earlier job on the same tensors.

The threads are daemon threads: a process that exits while a collective waits for a peer is not
held up joining them (``gradcomp.comm.exits`` decides what happens to the job then). A process
that exits with no work in flight stops them first (``_stop_idle_pipelines``, at exit): the wire
thread may still be inside the callbacks of the last job's Future, in PyTorch's C++ code (a DDP
hook's ``torch.futures.Future.set_result``). Once the interpreter starts finalizing, such a thread
that takes the GIL again is ended by Python's ``pthread_exit``, whose unwinding through C++ frames
calls ``std::terminate``: the process aborts after a run that succeeded ("terminate called without
an active exception", exit 6).
"""
from __future__ import annotations

import atexit
import collections
import queue
import sys
import threading
import traceback
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Iterable

_STOP = object()
_STOP_WAIT_S = 30.0  # at exit, for a wire thread still running the last job's callbacks
_pipelines: "weakref.WeakSet[Pipeline]" = weakref.WeakSet()


class CommunicatorBroken(RuntimeError):
    """A rank failed halfway through a reduction; its peers may be waiting in a collective.

    Further use of the communicator would pair this rank's collectives with the wrong ones on the
    others, so it is refused. Unless the process exits first, the job is aborted after
    ``abort_grace_s`` seconds, so that no rank hangs forever.
    """


class CollectiveError(ValueError):
    """Raised identically on every rank, after every rank ran the same collectives.

    The communicator stays usable: the next bucket starts from a consistent state everywhere.
    Bad input (sizes, dtypes, layouts, configurations or state that differ across ranks, a rank
    with a buffer that cannot be a bucket) ends in this error.
    """


#: temporaries of at least this many bytes come from the pipeline's shared pool (``Workspace``):
#: a default bucket's (25 MB) are, the small ones of small buckets stay with their slot
LARGE_BYTES = 4 * 2**20


class Workspace:
    """Temporaries of one pipeline slot, reused from job to job.

    ``array(owner, name, n, dtype, like)`` returns the first ``n`` values of a buffer that belongs to
    ``(owner, name)`` for the job that asked for it, in both of its stages (asked again in the same
    job, the same buffer). Never return one to a caller: a later job overwrites it.

    Buffers under ``LARGE_BYTES`` stay with the slot (grow-only). Larger ones are lent by the
    pipeline's ``SharedBuffers`` for the job and handed back when it finishes (``release``): each
    slot and each codec (a governed name has several) keeping its own copy of every such temporary
    made the memory a multiple of the largest bucket (GPT-2's 154 MB embedding is one), whichever
    slot and codec ran it.
    """

    def __init__(self, shared: "SharedBuffers | None" = None) -> None:
        self._buffers: dict[tuple, Any] = {}
        self._shared = shared
        self._lent: dict[tuple, Any] = {}  # this job's buffers from ``shared``

    def array(self, owner: object, name: str, n: int, dtype: Any, like: Any = None) -> Any:
        from ..arrays import array_module

        xp = array_module(like) if like is not None else __import__("numpy")
        device = getattr(like, "device", None)
        dt = xp.dtype(dtype)
        key = (id(owner), name, dt.str, str(device))
        n = int(n)
        size = max(n, 1)
        for held in (self._lent.get(key), self._buffers.get(key)):  # (this job's loan first)
            if held is not None and held.shape[0] >= n:
                return held[:n]
        if self._shared is not None and n * dt.itemsize >= LARGE_BYTES:
            kind = key[2:]  # (any owner's, any name's)
            if key in self._lent:  # too small: a larger one replaces it
                self._shared.give(kind, self._lent.pop(key))
            lent = self._lent[key] = self._shared.take(kind, n, lambda: xp.empty(size, dt))
            return lent[:n]
        buf = self._buffers[key] = xp.empty(size, dt)
        return buf[:n]

    def release(self) -> None:
        """The job finished: hand its large buffers back to the pool."""
        if self._shared is not None:
            for key, buf in self._lent.items():
                self._shared.give(key[2:], buf)
        self._lent = {}

    def nbytes(self) -> int:
        return sum(int(b.nbytes) for b in self._buffers.values())


class SharedBuffers:
    """A pipeline's large temporaries, lent to one job at a time (``Workspace``) and shared by
    every owner and name of the same dtype and device: the smallest free buffer that fits is
    taken, never one over twice the size asked for (a small request does not hold the largest
    bucket's buffer). The pool keeps at most twice as many free buffers per dtype as were ever
    lent at once (the smallest go first), so steady steps allocate nothing."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[Any]] = {}
        self._on_loan: dict[tuple, int] = {}
        self._most: dict[tuple, int] = {}  # the most ever on loan at once
        self._lock = threading.Lock()

    def take(self, kind: tuple, n: int, make: Callable[[], Any]) -> Any:
        with self._lock:
            self._on_loan[kind] = self._on_loan.get(kind, 0) + 1
            self._most[kind] = max(self._most.get(kind, 0), self._on_loan[kind])
            free = self._free.get(kind, [])
            fits = [i for i, b in enumerate(free) if n <= b.shape[0] <= 2 * n]
            if fits:
                return free.pop(min(fits, key=lambda i: free[i].shape[0]))
        return make()

    def give(self, kind: tuple, buf: Any) -> None:
        with self._lock:
            self._on_loan[kind] -= 1
            free = self._free.setdefault(kind, [])
            free.append(buf)
            while len(free) > 2 * self._most[kind]:
                free.pop(min(range(len(free)), key=lambda i: free[i].shape[0]))  # (arrays: by place)

    def nbytes(self) -> int:
        with self._lock:
            return sum(int(b.nbytes) for free in self._free.values() for b in free)


class _Job:
    __slots__ = ("prepare", "run", "future", "keys", "slot", "prepared", "error", "number")

    def __init__(self, prepare: Callable[[Workspace], Any] | None,
                 run: Callable[[Any, BaseException | None], Any], keys: Iterable[Hashable],
                 number: int, slot: int):
        self.prepare, self.run = prepare, run
        self.keys = frozenset(keys)
        self.future: Future = Future()
        self.number, self.slot = number, slot
        self.prepared: Any = None
        self.error: BaseException | None = None


class Pipeline:
    """Two ordered daemon threads (see the module docstring) and the failure bookkeeping.

    ``on_failure(exc)`` is called once when an ordered stage fails with anything but a
    ``CollectiveError``: the communicator is then broken (see ``CommunicatorBroken``).
    """

    def __init__(self, name: str, on_failure: Callable[[BaseException], None], depth: int = 1):
        if depth < 0:
            raise ValueError(f"pipeline depth must be >= 0, got {depth}")
        self.depth = depth
        self.shared = SharedBuffers()
        self.workspaces = [Workspace(self.shared) for _ in range(depth + 1)]
        self.broken: BaseException | None = None
        self._on_failure = on_failure
        self._lock = threading.Condition()
        self._submitted = 0
        self._finished = 0
        self._inflight: collections.OrderedDict[int, _Job] = collections.OrderedDict()
        self._submitter: int | None = None
        self._compute_q: queue.SimpleQueue = queue.SimpleQueue()
        self._wire_q: queue.SimpleQueue = queue.SimpleQueue()
        self._compute = threading.Thread(target=self._compute_loop, name=f"{name}-compute", daemon=True)
        self._wire = threading.Thread(target=self._wire_loop, name=f"{name}-wire", daemon=True)
        self._closed = False
        self._compute.start()
        self._wire.start()
        _pipelines.add(self)

    # -- submission -------------------------------------------------------------------------------
    def on_wire(self) -> bool:
        return threading.current_thread() is self._wire

    def on_compute(self) -> bool:
        return threading.current_thread() is self._compute

    @property
    def busy(self) -> bool:
        """Whether submitted work has not finished yet."""
        return self._submitted != self._finished

    def submit(self, run: Callable[[Any, BaseException | None], Any],
               prepare: Callable[[Workspace], Any] | None = None,
               keys: Iterable[Hashable] = ()) -> Future[Any]:
        """Queue a job; its Future resolves to ``run(prepared, prepare_error)``.

        ``prepare(workspace)`` runs first on the compute thread (its exception is handed to ``run``
        instead of raised, so that ``run`` can report it to every rank); ``run`` runs on the wire
        thread. Both get the job's workspace; ``run`` reads it through ``current_workspace``.
        """
        if self.broken is not None:
            raise CommunicatorBroken(f"communicator unusable after an earlier failure: {self.broken!r}")
        if self._closed:
            raise RuntimeError("gradcomp: this communicator was closed (or its process is exiting)")
        if self.on_compute():
            raise RuntimeError("gradcomp: a compressor's local stage (prepare) may not call "
                               "collectives; move them to its ordered stage (run)")
        me = threading.get_ident()
        with self._lock:
            if self.busy and self._submitter not in (None, me):
                raise RuntimeError(
                    "gradcomp: two threads submitted work to one communicator while earlier work "
                    "was in flight. Every rank must issue the same collectives in the same order, "
                    "so a communicator takes work from one thread at a time (wait for the "
                    "futures before another thread submits, or give each thread its own "
                    "communicator)")
            self._submitter = me
            number = self._submitted
            self._submitted += 1
            job = _Job(prepare, run, keys, number, number % len(self.workspaces))
            self._inflight[number] = job
        self._compute_q.put(job)
        return job.future

    def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` now if we are the wire thread, else queue it and wait for its result."""
        if self.on_wire():
            return fn(*args, **kwargs)
        return self.submit(lambda _p, _e: fn(*args, **kwargs)).result()

    def current_workspace(self) -> Workspace:
        """The workspace of the job the wire thread is running."""
        return self.workspaces[self._running_slot]

    # -- the threads --------------------------------------------------------------------------------
    def _may_prepare(self, job: _Job) -> bool:
        for number, other in self._inflight.items():
            if number >= job.number:
                return True
            if number <= job.number - len(self.workspaces) or (other.keys & job.keys):
                return False
        return True

    # Neither loop keeps a job in its frame while it waits for the next one: a job holds its
    # bucket (through its stages and its Future's result and callbacks), and between steps that
    # would keep the last bucket of the step alive, DDP's first-step bucket (every gradient) past
    # DDP's rebuild of its buckets.
    def _compute_loop(self) -> None:
        while True:
            job = self._compute_q.get()
            if job is _STOP:
                self._wire_q.put(_STOP)
                return
            self._prepare(job)
            self._wire_q.put(job)
            del job

    def _prepare(self, job: _Job) -> None:
        if job.prepare is not None:
            with self._lock:
                self._lock.wait_for(lambda: self._may_prepare(job))
            try:
                job.prepared = job.prepare(self.workspaces[job.slot])
            except BaseException as exc:  # handed to the ordered stage, which tells every rank
                job.error = exc

    def _wire_loop(self) -> None:
        self._running_slot = 0
        while True:
            job = self._wire_q.get()
            if job is _STOP:
                return
            self._run(job)
            del job

    def _run(self, job: _Job) -> None:
        self._running_slot = job.slot
        try:
            if self.broken is not None:
                raise CommunicatorBroken(
                    f"communicator unusable after an earlier failure: {self.broken!r}")
            result = job.run(job.prepared, job.error)
        except CollectiveError as exc:
            self._finish(job)
            job.future.set_exception(exc)
        except BaseException as exc:
            self.fail(exc)
            self._finish(job)
            job.future.set_exception(exc)
        else:
            self._finish(job)
            job.future.set_result(result)
        finally:
            job.prepared = None

    def _finish(self, job: _Job) -> None:
        with self._lock:  # (the slot's next job waits for this: its workspace is free after it)
            self.workspaces[job.slot].release()
            self._inflight.pop(job.number, None)
            self._finished += 1
            self._lock.notify_all()

    def fail(self, exc: BaseException) -> None:
        """Mark the pipeline broken (once) and tell the owner."""
        if self.broken is not None:
            return
        self.broken = exc
        self._on_failure(exc)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued work, then stop both threads (waiting at most ``timeout`` seconds
        for them). Later submissions are refused."""
        if not self._closed:
            self._closed = True
            self._compute_q.put(_STOP)
        if not (self.on_wire() or self.on_compute()):
            self._wire.join(timeout)


@atexit.register
def _stop_idle_pipelines() -> None:
    """At exit, while the interpreter is whole: stop the threads of every pipeline with nothing
    in flight, so that none is still in a Future's callbacks when finalization starts (see the
    module docstring). A pipeline with work in flight or broken is left to ``gradcomp.comm.exits``."""
    for pipeline in list(_pipelines):
        if not pipeline.busy and pipeline.broken is None:
            pipeline.close(timeout=_STOP_WAIT_S)


def report_failure(exc: BaseException, consequence: str) -> None:
    """Print a one-rank failure and what happens next to stderr."""
    sys.stderr.write(f"gradcomp: a reduction failed on this rank ({exc!r}); its peers may be "
                     f"blocked in a collective. {consequence}\n")
    sys.stderr.write("".join(traceback.format_exception(exc)))
    sys.stderr.flush()
