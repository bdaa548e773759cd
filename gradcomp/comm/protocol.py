"""The Communicator protocol and what every implementation shares.

Every collective of one communicator is issued by its pipeline's wire thread, in submission order
(``gradcomp.comm.pipeline``). Compressors run on that thread and call the blocking collectives
directly; a call from any other thread is queued behind the work already submitted.
"""
from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Hashable, Iterable, Protocol, runtime_checkable

from .. import timeline
from ..arrays import Array
from .pipeline import CommunicatorBroken, Pipeline, Workspace, report_failure


@runtime_checkable
class Communicator(Protocol):
    """What compressors need from a transport (``MPICommunicator``,
    ``gradcomp.torch.TorchCommunicator``).

    The blocking collectives never modify their input unless told they may (``overwrite``) and
    return arrays of the input's array module. ``bytes_sent`` counts the bytes this rank put on the
    wire by the bandwidth-optimal algorithm of each collective (``wire_bytes``); ``collectives``
    counts the collectives started.
    """

    rank: int
    size: int
    bytes_sent: float
    collectives: int

    def submit(self, run: Callable[[Any, BaseException | None], Any],
               prepare: Callable[[Workspace], Any] | None = None,
               keys: Iterable[Hashable] = ()) -> Future[Any]: ...

    @property
    def workspace(self) -> Workspace: ...

    def partition(self, n: int, counts: list[int] | None = None) -> tuple[list[int], list[int]]: ...

    def allreduce(self, array: Array, overwrite: bool = False) -> Array: ...

    def reduce_scatter(self, array: Array, out: Array | None = None,
                       counts: list[int] | None = None, overwrite: bool = False) -> Array: ...

    def allgather_blocks(self, block: Array, out: Array, counts: list[int] | None = None) -> Array: ...

    def allgather(self, array: Array, out: Array | None = None) -> Array: ...

    def alltoall(self, array: Array, out: Array | None = None) -> Array: ...

    def broadcast(self, array: Array, root: int = 0) -> Array: ...

    def fail(self, exc: BaseException) -> None: ...


def wire_bytes(kind: str, nbytes: float, size: int) -> float:
    """Bytes one rank sends for a collective on ``nbytes`` of local data, bandwidth-optimal."""
    if size <= 1:
        return 0.0
    if kind == "allreduce":
        return 2.0 * (size - 1) / size * nbytes
    if kind == "allgather":
        return float((size - 1) * nbytes)
    if kind in ("alltoall", "broadcast", "reduce_scatter"):
        return (size - 1) / size * nbytes
    raise ValueError(f"unknown collective {kind!r}")


def partition(n: int, size: int) -> tuple[list[int], list[int]]:
    """``(counts, offsets)`` of ``size`` contiguous blocks covering ``n`` values, the first
    ``n % size`` blocks one longer: which values each rank owns in a reduce-scatter."""
    base, extra = divmod(int(n), size)
    counts = [base + (r < extra) for r in range(size)]
    offsets = [0] * size
    for r in range(1, size):
        offsets[r] = offsets[r - 1] + counts[r - 1]
    return counts, offsets


def _default_grace() -> float:
    return float(os.environ.get("GRADCOMP_ABORT_GRACE_S", "10"))


def default_depth(depth: int | None) -> int:
    """The pipeline depth: ``depth``, else ``GRADCOMP_PIPELINE_DEPTH``, else 1."""
    if depth is not None:
        return int(depth)
    return int(os.environ.get("GRADCOMP_PIPELINE_DEPTH", "1"))


def pin_blas_threads(threads: int | None) -> None:
    """Limit BLAS to ``threads`` per process (None: leave it alone).

    With N ranks on N cores, each BLAS starting N threads oversubscribes the machine N-fold and
    matrix products crawl. ``GRADCOMP_BLAS_THREADS`` overrides (``0`` or ``none`` = leave alone).
    """
    env = os.environ.get("GRADCOMP_BLAS_THREADS")
    if env not in (None, ""):
        threads = None if env.strip().lower() in ("0", "none") else int(env)
    if threads is None:
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=threads, user_api="blas")


#: per communicator, ``[bytes, collectives]`` of its counted traffic that measured the link
#: (``note_probe``); kept beside the communicators, not in them, as only ``auto`` measures
_PROBES: "weakref.WeakKeyDictionary[Any, list[float]]" = weakref.WeakKeyDictionary()


def probe_traffic(comm: Communicator) -> tuple[float, int]:
    """Bytes and collectives of ``comm``'s counters that measured the link (``note_probe``)."""
    try:
        nbytes, collectives = _PROBES.get(comm, (0.0, 0))
    except TypeError:  # a communicator that takes no weak reference has noted no probe
        return 0.0, 0
    return nbytes, int(collectives)


def method_traffic(comm: Communicator) -> tuple[float, int]:
    """Bytes and collectives ``comm`` has counted for methods: all of them but its probes'."""
    probe_bytes, probe_collectives = probe_traffic(comm)
    return comm.bytes_sent - probe_bytes, getattr(comm, "collectives", 0) - probe_collectives


def note_probe(comm: Communicator, nbytes: float, collectives: int) -> None:
    """Mark ``nbytes`` and ``collectives`` that ``comm`` just counted as a measurement of the link
    (``auto``'s probe), not a method's traffic: ``method_traffic`` leaves them out, so the
    compressor whose stage ran the probe does not count it as its own."""
    tally = _PROBES.setdefault(comm, [0.0, 0])
    tally[0] += nbytes
    tally[1] += collectives


class OrderedCommunicator:
    """The pipeline, the traffic counters and the public forms of each collective.

    A subclass sets ``rank`` and ``size``, calls ``_start``, and implements ``abort`` and the
    wire-thread methods ``_allreduce``, ``_reduce_scatter``, ``_allgather_blocks``, ``_allgather``,
    ``_alltoall`` and ``_broadcast``, each calling ``_count`` once before its collective starts.
    Arguments are checked before queueing, because an exception on the wire thread counts as a
    failure halfway through a reduction.
    """

    rank: int
    size: int
    bytes_sent: float
    collectives: int

    def _start(self, name: str, abort_grace_s: float | None, depth: int) -> None:
        self.bytes_sent = 0.0
        self.collectives = 0
        self._grace = _default_grace() if abort_grace_s is None else float(abort_grace_s)
        self._pipeline = Pipeline(name, self._on_failure, depth)

    def _count(self, kind: str, nbytes: float) -> None:
        self.collectives += 1
        self.bytes_sent += wire_bytes(kind, nbytes, self.size)

    def abort(self, code: int = 1) -> None:
        raise NotImplementedError

    def _on_failure(self, exc: BaseException) -> None:
        report_failure(exc, f"Aborting the job in {self._grace:g} s unless this process exits.")
        timer = threading.Timer(self._grace, self.abort)
        timer.daemon = True
        timer.start()

    # -- the pipeline ------------------------------------------------------------------------------
    def submit(self, run: Callable[[Any, BaseException | None], Any],
               prepare: Callable[[Workspace], Any] | None = None,
               keys: Iterable[Hashable] = ()) -> Future[Any]:
        """Queue a job (see ``Pipeline.submit``)."""
        return self._pipeline.submit(run, prepare, keys)

    @property
    def workspace(self) -> Workspace:
        """The running job's reusable temporaries (on the wire thread)."""
        return self._pipeline.current_workspace()

    @property
    def broken(self) -> BaseException | None:
        return self._pipeline.broken

    @property
    def busy(self) -> bool:
        return self._pipeline.busy

    @property
    def pipeline_depth(self) -> int:
        return self._pipeline.depth

    def fail(self, exc: BaseException) -> None:
        self._pipeline.fail(exc)

    def close(self) -> None:
        self._pipeline.close()

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if timeline.enabled:  # a wire span per collective (a timeline's: ``gradcomp.timeline``)
            with timeline.span(fn.__name__.lstrip("_"), "wire", array_bytes=int(getattr(args[0] if args else None, "nbytes", 0))):
                return self._pipeline.call(fn, *args)
        return self._pipeline.call(fn, *args)

    def partition(self, n: int, counts: list[int] | None = None) -> tuple[list[int], list[int]]:
        """``(counts, offsets)``: the block of ``n`` values each rank owns in ``reduce_scatter``
        (``counts``: given blocks, one per rank, summing to ``n``; default equal ones)."""
        if counts is None:
            return partition(n, self.size)
        counts = [int(c) for c in counts]
        if len(counts) != self.size or sum(counts) != n or min(counts, default=0) < 0:
            raise ValueError(f"block counts {counts} must be {self.size} non-negative numbers summing to {n}")
        offsets = [0] * self.size
        for r in range(1, self.size):
            offsets[r] = offsets[r - 1] + counts[r - 1]
        return counts, offsets

    # -- blocking collectives --------------------------------------------------------------------------
    def allreduce(self, array: Array, overwrite: bool = False) -> Array:
        """Element-wise sum over ranks, in the array's own dtype, bit-identical on every rank.
        ``overwrite=True``: ``array`` is the caller's scratch and receives the sum (and is
        returned) instead of a new array."""
        return self._call(self._allreduce, array, overwrite)

    def reduce_scatter(self, array: Array, out: Array | None = None, counts: list[int] | None = None,
                       overwrite: bool = False) -> Array:
        """This rank's block (``partition``, or ``counts`` values per rank) of the element-wise
        sum over ranks, in ``out`` (the block's length) or a new array. Each block is summed by
        its owner alone. ``overwrite=True``: ``array`` is the caller's scratch, which the
        exchange may use as its working buffer (no copy of it)."""
        self.partition(array.shape[0], counts)  # checked before queueing
        return self._call(self._reduce_scatter, array, out, counts, overwrite)

    def allgather_blocks(self, block: Array, out: Array, counts: list[int] | None = None) -> Array:
        """Every rank's block (``partition(len(out))``, or ``counts`` values per rank), each in
        its place in ``out``: the second half of a reduce-scatter + allgather allreduce. Returns
        ``out``."""
        self.partition(out.shape[0], counts)
        return self._call(self._allgather_blocks, block, out, counts)

    def allgather(self, array: Array, out: Array | None = None) -> Array:
        """Every rank's ``array`` (same shape everywhere), stacked: shape ``(size,) + shape``."""
        return self._call(self._allgather, array, out)

    def alltoall(self, array: Array, out: Array | None = None) -> Array:
        """Split ``array`` (length divisible by size) into ``size`` blocks, block r to rank r.
        Returns ``(size, n/size)``: row r is the block rank r sent here."""
        self._check_alltoall(array)
        return self._call(self._alltoall, array, out)

    def broadcast(self, array: Array, root: int = 0) -> Array:
        """``root``'s array, on every rank (a new array; the input is not modified)."""
        return self._call(self._broadcast, array, root)

    def _check_alltoall(self, array: Array) -> None:
        if array.ndim != 1 or array.shape[0] % self.size:
            raise ValueError(f"alltoall needs a 1-D array with a length divisible by {self.size}, "
                             f"got shape {tuple(array.shape)}")

    # -- nonblocking forms ---------------------------------------------------------------------------------
    def iallreduce(self, array: Array, overwrite: bool = False) -> Future[Array]:
        return self.submit(lambda _p, _e: self._allreduce(array, overwrite))

    def iallgather(self, array: Array) -> Future[Array]:
        return self.submit(lambda _p, _e: self._allgather(array, None))

    def ialltoall(self, array: Array) -> Future[Array]:
        self._check_alltoall(array)
        return self.submit(lambda _p, _e: self._alltoall(array, None))

    def ibroadcast(self, array: Array, root: int = 0) -> Future[Array]:
        return self.submit(lambda _p, _e: self._broadcast(array, root))

    # -- overlapped exchanges, on the wire thread ------------------------------------------------------
    def overlaps(self, like: Array) -> bool:
        """Whether ``start_alltoall`` and ``start_allgather`` take buffers like ``like``: several
        exchanges may then be in flight while the wire thread computes (the two-stage codecs' pieces)."""
        return False

    def start_alltoall(self, array: Array, out: Array) -> Any:
        """Start ``alltoall(array, out)`` (``out``: ``(size, n/size)``); returns a handle whose
        ``wait()`` ends it. Every rank starts and waits in the same order."""
        raise NotImplementedError

    def start_allgather(self, array: Array, out: Array) -> Any:
        """Start ``allgather(array, out)``; as ``start_alltoall``."""
        raise NotImplementedError

    # -- what a subclass implements: the collectives proper, on the wire thread ----------------------
    def _allreduce(self, array: Array, overwrite: bool = False) -> Array:
        raise NotImplementedError

    def _reduce_scatter(self, array: Array, out: Array | None = None, counts: list[int] | None = None,
                        overwrite: bool = False) -> Array:
        raise NotImplementedError

    def _allgather_blocks(self, block: Array, out: Array, counts: list[int] | None = None) -> Array:
        raise NotImplementedError

    def _allgather(self, array: Array, out: Array | None = None) -> Array:
        raise NotImplementedError

    def _alltoall(self, array: Array, out: Array | None = None) -> Array:
        raise NotImplementedError

    def _broadcast(self, array: Array, root: int) -> Array:
        raise NotImplementedError


#: variables an MPI launcher (MPICH's Hydra, Open MPI, a PMIx launcher) sets in the ranks it starts
MPI_LAUNCHER_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS",
                          "HYDI_CONTROL_FD")


def launched_by_mpi() -> bool:
    """True when an MPI launcher started this process (or MPI is already initialized)."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and mpi.COMM_WORLD.Get_size() > 1:
        return True
    return any(v in os.environ for v in MPI_LAUNCHER_VARIABLES)


def torchrun_world() -> int | None:
    """``WORLD_SIZE`` when torchrun (or another launcher that sets RANK/WORLD_SIZE) started this
    process and no MPI launcher did; else None."""
    if launched_by_mpi():
        return None
    if "WORLD_SIZE" in os.environ and "RANK" in os.environ:
        try:
            return int(os.environ["WORLD_SIZE"])
        except ValueError:
            return None
    return None


__all__ = ["Communicator", "CommunicatorBroken", "OrderedCommunicator", "wire_bytes", "partition",
           "pin_blas_threads", "default_depth", "launched_by_mpi", "torchrun_world"]
