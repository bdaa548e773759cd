"""Transport: the Communicator protocol and its mpi4py implementation.

Every collective of one communicator runs on a single worker thread, in submission order
(DESIGN invariant 1). A caller may submit many buckets and wait later; because all ranks submit in
the same order, all ranks issue the same collectives in the same order. Compressors run *on* that
worker and call the blocking collectives directly; calls from any other thread are queued behind
the work already submitted, so nothing can overtake it.

Only the buffer (upper-case) mpi4py API is used: nothing received from a peer is ever unpickled
(invariant 4).
"""
from __future__ import annotations

import os
import sys
import threading
import traceback
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Protocol, runtime_checkable

import numpy as np

from .arrays import add_into, array_module, dtype_name, is_device_array, synchronize


class CollectiveError(ValueError):
    """Raised identically on every rank, after every rank ran the same collectives.

    The communicator stays usable: the next bucket starts from a consistent state everywhere.
    Bad input (sizes, dtypes or layouts that differ across ranks, a rank with a non-float
    buffer, non-finite values a compressor cannot carry) ends in this error.
    """


class CommunicatorBroken(RuntimeError):
    """A rank failed halfway through a reduction; its peers may be waiting in a collective.

    Further use of the communicator would pair this rank's collectives with the wrong ones on the
    others, so it is refused. Unless the process exits first, the job is aborted after
    ``abort_grace_s`` seconds, so that no rank hangs forever.
    """


@runtime_checkable
class Communicator(Protocol):
    """What compressors need from a transport. ``MPICommunicator`` and
    ``gradcomp.torch.TorchCommunicator`` implement it.

    The blocking collectives return new arrays and never modify their input. ``bytes_sent`` is a
    running count of the bytes this rank put on the wire, by the bandwidth-optimal algorithm of each
    collective (ring allreduce ``2(N-1)/N*B``, allgather ``(N-1)*B``, alltoall ``(N-1)/N*B``);
    ``collectives`` counts the collectives issued.
    """

    rank: int
    size: int
    bytes_sent: float
    collectives: int

    def submit(self, fn: Callable, *args, **kwargs) -> Future: ...

    def allreduce(self, array, overwrite: bool = False): ...  # element-wise sum over ranks

    def allgather(self, array): ...  # (size, n) stack of every rank's array

    def alltoall(self, array): ...  # (size, n/size): row r is what rank r sent to me

    def broadcast(self, array, root: int = 0): ...

    def fail(self, exc: BaseException) -> None: ...


def wire_bytes(kind: str, nbytes: int, size: int) -> float:
    """Bytes one rank sends for a collective on ``nbytes`` of local data, bandwidth-optimal."""
    if size <= 1:
        return 0.0
    if kind == "allreduce":
        return 2.0 * (size - 1) / size * nbytes
    if kind == "allgather":
        return float((size - 1) * nbytes)
    if kind == "alltoall":
        return (size - 1) / size * nbytes
    if kind == "broadcast":
        return (size - 1) / size * nbytes
    raise ValueError(f"unknown collective {kind!r}")


class OrderedWorker:
    """One thread that runs submitted callables in submission order.

    Shared by every Communicator implementation: the order of collectives is the order of
    submission, identical on every rank.
    """

    def __init__(self, name: str, abort: Callable[[], None], abort_grace_s: float):
        self._ident = None
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix=name, initializer=self._remember_thread
        )
        self._abort = abort
        self._abort_grace_s = abort_grace_s
        self.broken: BaseException | None = None

    def _remember_thread(self):
        self._ident = threading.get_ident()

    def on_worker(self) -> bool:
        return threading.get_ident() == self._ident

    def submit(self, fn, *args, **kwargs) -> Future:
        if self.broken is not None:
            raise CommunicatorBroken(f"communicator unusable after an earlier failure: {self.broken!r}")
        return self._executor.submit(self._guarded, fn, *args, **kwargs)

    def call(self, fn, *args, **kwargs):
        """Run ``fn`` now if we are the worker, else queue it and wait."""
        if self.on_worker():
            return fn(*args, **kwargs)
        return self.submit(fn, *args, **kwargs).result()

    def _guarded(self, fn, *args, **kwargs):
        if self.broken is not None:
            raise CommunicatorBroken(f"communicator unusable after an earlier failure: {self.broken!r}")
        try:
            return fn(*args, **kwargs)
        except CollectiveError:
            raise
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        """Mark the worker broken and arm the abort timer (see ``CommunicatorBroken``)."""
        if self.broken is not None:
            return
        self.broken = exc
        sys.stderr.write(
            f"gradcomp: a reduction failed on this rank ({exc!r}); its peers may be blocked in a "
            f"collective. Aborting the job in {self._abort_grace_s:g} s unless this process exits.\n"
        )
        sys.stderr.write("".join(traceback.format_exception(exc)))
        sys.stderr.flush()
        timer = threading.Timer(self._abort_grace_s, self._abort)
        timer.daemon = True
        timer.start()

    def shutdown(self):
        self._executor.shutdown(wait=True)


def _default_grace() -> float:
    return float(os.environ.get("GRADCOMP_ABORT_GRACE_S", "10"))


def detect_cuda_aware(override: bool | None = None) -> bool:
    """Whether device buffers may go straight to MPI.

    Order: the explicit ``override``; the ``GRADCOMP_CUDA_AWARE`` environment variable (0/1); the
    MPI library's own answer (``MPIX_Query_cuda_support``, exposed by mpi4py >= 4 as
    ``MPI.Query_cuda_support``); otherwise False, i.e. stage through host memory.
    """
    if override is not None:
        return bool(override)
    env = os.environ.get("GRADCOMP_CUDA_AWARE")
    if env not in (None, ""):
        return env.strip().lower() in ("1", "true", "yes", "on")
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is None:
        return False
    try:
        return bool(query())
    except Exception:  # the MPI library does not implement the extension
        return False


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


class OrderedCommunicator:
    """What every Communicator implementation shares: the ordered worker, the traffic counters,
    and the public blocking and nonblocking forms of each collective.

    A subclass sets ``rank`` and ``size``, calls ``_start_worker``, and implements ``abort`` and the
    worker-side ``_allreduce``, ``_allgather``, ``_alltoall`` and ``_broadcast`` (which call
    ``_count`` once per collective). Blocking calls made off the worker are queued behind the work
    already submitted, so nothing overtakes it; arguments are checked before queueing, because an
    exception on the worker counts as a failure halfway through a reduction.
    """

    rank: int
    size: int

    def _start_worker(self, name: str, abort_grace_s: float | None) -> None:
        self.bytes_sent = 0.0
        self.collectives = 0
        grace = _default_grace() if abort_grace_s is None else abort_grace_s
        self._worker = OrderedWorker(name, self.abort, grace)

    def _count(self, kind: str, nbytes: int) -> None:
        self.collectives += 1
        self.bytes_sent += wire_bytes(kind, nbytes, self.size)

    def abort(self, code: int = 1) -> None:
        raise NotImplementedError

    # -- ordering ---------------------------------------------------------------------------
    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)`` on the ordered worker."""
        return self._worker.submit(fn, *args, **kwargs)

    def fail(self, exc: BaseException) -> None:
        self._worker.fail(exc)

    def close(self) -> None:
        self._worker.shutdown()

    # -- blocking collectives ----------------------------------------------------------------
    def allreduce(self, array, overwrite: bool = False):
        """Element-wise sum over ranks, in the array's own dtype. ``overwrite=True``: ``array`` is
        the caller's scratch, and the sum may be written into it (and returned) instead of into
        a new array; a compressor's own temporaries then cost no second buffer per bucket."""
        return self._worker.call(self._allreduce, array, overwrite)

    def allgather(self, array):
        """Every rank's ``array`` (same shape everywhere), stacked: shape ``(size,) + shape``."""
        return self._worker.call(self._allgather, array)

    def alltoall(self, array):
        """Split ``array`` (length divisible by size) into ``size`` blocks, block r to rank r.
        Returns ``(size, n/size)``: row r is the block rank r sent here."""
        self._check_alltoall(array)
        return self._worker.call(self._alltoall, array)

    def broadcast(self, array, root: int = 0):
        """``root``'s array, on every rank (a new array; the input is not modified)."""
        return self._worker.call(self._broadcast, array, root)

    def _check_alltoall(self, array):
        if array.ndim != 1 or array.shape[0] % self.size:
            raise ValueError(f"alltoall needs a 1-D array with a length divisible by {self.size}, "
                             f"got shape {tuple(array.shape)}")

    # -- nonblocking forms -------------------------------------------------------------------
    def iallreduce(self, array, overwrite: bool = False) -> Future:
        return self.submit(self._allreduce, array, overwrite)

    def iallgather(self, array) -> Future:
        return self.submit(self._allgather, array)

    def ialltoall(self, array) -> Future:
        self._check_alltoall(array)
        return self.submit(self._alltoall, array)

    def ibroadcast(self, array, root: int = 0) -> Future:
        return self.submit(self._broadcast, array, root)


class MPICommunicator(OrderedCommunicator):
    """The Communicator protocol over an mpi4py communicator (default ``COMM_WORLD``).

    ``comm`` is duplicated, so gradcomp's traffic never mixes with collectives the application runs
    on the same communicator from its own thread. Construct it on every rank (the duplication is a
    collective).

    ``cuda_aware``: None detects it (see ``detect_cuda_aware``); True hands CuPy buffers to MPI
    directly; False copies them to host memory and back. ``blas_threads``: BLAS threads per rank,
    1 by default, None to leave BLAS alone. ``abort_grace_s``: after a rank fails halfway through a
    reduction, how long before ``MPI_Abort`` ends the job (env ``GRADCOMP_ABORT_GRACE_S``).
    """

    def __init__(self, comm=None, *, cuda_aware: bool | None = None, blas_threads: int | None = 1,
                 abort_grace_s: float | None = None):
        from mpi4py import MPI

        self._MPI = MPI
        self.comm = (comm if comm is not None else MPI.COMM_WORLD).Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = detect_cuda_aware(cuda_aware)
        self._half_ops = {}
        pin_blas_threads(blas_threads)
        self._start_worker("gradcomp-mpi", abort_grace_s)

    def __repr__(self):
        return f"MPICommunicator(rank={self.rank}, size={self.size}, cuda_aware={self.cuda_aware})"

    def abort(self, code: int = 1) -> None:
        self.comm.Abort(code)

    # -- buffers -----------------------------------------------------------------------------
    def _prepare(self, array):
        """(buffer to hand MPI, array module to return results in)."""
        xp = array_module(array)
        if xp is np:
            return np.ascontiguousarray(array), np
        if self.cuda_aware:
            synchronize(array)
            return xp.ascontiguousarray(array), xp
        return xp.asnumpy(array), xp  # asnumpy waits for the stream

    def _finish(self, out, xp):
        if xp is np or self.cuda_aware:
            return out
        return xp.asarray(out)

    def _bytes(self, a):
        """A byte view for MPI: odd dtypes (bfloat16) have no MPI datatype, and for moving data
        (not reducing it) bytes are all MPI needs."""
        return [a.reshape(-1).view(array_module(a).uint8), self._MPI.BYTE]

    # -- the collectives, on the worker --------------------------------------------------------
    def _allreduce(self, array, overwrite=False):
        """float32/float64 use MPI's own reduction. float16 and bfloat16, which MPI cannot add, use
        a user-defined MPI operation on host buffers (so MPI's own allreduce algorithms carry half
        the bytes) and ``sum_by_alltoall`` on device buffers given to a CUDA-aware MPI, where a
        Python operation cannot read the memory."""
        name = dtype_name(array.dtype)
        half = name not in ("float32", "float64")
        if half and is_device_array(array) and self.cuda_aware:
            return sum_by_alltoall(self, array)
        buf, xp = self._prepare(array)
        scratch = overwrite or buf is not array  # the caller's scratch, or our own copy
        if half:
            mpitype, op = self._MPI.UINT16_T, self._half_sum(buf.dtype)
            buf = buf.view(np.uint16)
        else:
            mpitype = self._MPI.FLOAT if name == "float32" else self._MPI.DOUBLE
            op = self._MPI.SUM
        if scratch:
            self.comm.Allreduce(self._MPI.IN_PLACE, [buf, mpitype], op=op)
            out = buf
        else:
            out = array_module(buf).empty_like(buf)
            self.comm.Allreduce([buf, mpitype], [out, mpitype], op=op)
        out = out.view(array.dtype) if half else out
        self._count("allreduce", buf.nbytes)
        return self._finish(out, xp)

    def _half_sum(self, dtype):
        """An MPI operation adding ``dtype`` (float16/bfloat16) values carried as 16-bit words.

        Commutative, so MPICH keeps its bandwidth-optimal algorithms; each partial sum is computed
        once, by one rank, and then copied, so every rank still ends with the same bits (the
        conformance tests check it at 1-4 ranks).
        """
        key = dtype_name(dtype)
        if key not in self._half_ops:
            def add(inbuf, inoutbuf, datatype, dtype=dtype):
                acc = np.frombuffer(inoutbuf, dtype=dtype)
                add_into(acc, np.frombuffer(inbuf, dtype=dtype))

            self._half_ops[key] = self._MPI.Op.Create(add, commute=True)
        return self._half_ops[key]

    def _allgather(self, array):
        buf, xp = self._prepare(array)
        out = array_module(buf).empty((self.size,) + buf.shape, dtype=buf.dtype)
        self.comm.Allgather(self._bytes(buf), self._bytes(out))
        self._count("allgather", buf.nbytes)
        return self._finish(out, xp)

    def _alltoall(self, array):
        buf, xp = self._prepare(array)
        out = array_module(buf).empty_like(buf)
        self.comm.Alltoall(self._bytes(buf), self._bytes(out))
        self._count("alltoall", buf.nbytes)
        return self._finish(out.reshape(self.size, -1), xp)

    def _broadcast(self, array, root):
        buf, xp = self._prepare(array)
        out = buf.copy()
        self.comm.Bcast(self._bytes(out), root=root)
        self._count("broadcast", buf.nbytes)
        return self._finish(out, xp)


def sum_by_alltoall(comm: Communicator, array):
    """Sum over ranks for dtypes MPI cannot add (float16, bfloat16), with no custom MPI op: used
    for device buffers handed to a CUDA-aware MPI, which a Python operation cannot read.

    Reduce-scatter by alltoall, add the ``size`` blocks in rank order in the array's own dtype,
    allgather the sums: the same bytes on the wire as a ring allreduce, works on device buffers
    through plain byte collectives, and every rank gets bit-identical, reproducible sums because
    each block is added once, by one owner, in a fixed order.
    """
    xp = array_module(array)
    n = array.shape[0]
    size = comm.size
    if size == 1:
        return array.copy()
    block = -(-n // size)
    padded = xp.zeros(block * size, dtype=array.dtype)
    padded[:n] = array
    blocks = comm.alltoall(padded)
    total = blocks[0].copy()
    for r in range(1, size):
        add_into(total, blocks[r])
    return comm.allgather(total).reshape(-1)[:n]


_default = None
_default_lock = threading.Lock()


def default_communicator() -> MPICommunicator:
    """The process-wide ``MPICommunicator()`` over ``COMM_WORLD``, created on first use."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MPICommunicator()
        return _default

