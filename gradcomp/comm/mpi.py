"""MPICommunicator: the Communicator protocol over mpi4py.

Only the buffer (upper-case) mpi4py API is used: nothing received from a peer is ever unpickled
(DESIGN invariant 5).

Allreduce is bandwidth-optimal whatever MPICH's default: buffers of at least
``large_allreduce_bytes`` (256 KiB by default) are summed by a ring reduce-scatter
(``MPI_Sendrecv`` and gradcomp's own adds) and ``MPI_Allgatherv``, each rank sending ``2(N-1)/N``
of the buffer; smaller ones by ``MPI_Allreduce``, whose latency-bound algorithms win there.
MPICH's default algorithm for large buckets is slower on a slow link; the ring matches MPICH's
own ring, which only an environment variable set before MPI starts selects (BENCHMARKS.md,
"Allreduce algorithm"). The adds being gradcomp's,
float16/bfloat16 need no MPI operation, and device buffers given to a CUDA-aware MPI are summed
the same way.
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..arrays import add_into, array_module, dtype_name, is_device_array, synchronize
from . import exits
from .protocol import (
    OrderedCommunicator,
    default_depth,
    pin_blas_threads,
    torchrun_world,
)

LARGE_ALLREDUCE_BYTES = 256 * 1024


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


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as exc:
        raise ImportError(
            "gradcomp.MPICommunicator needs mpi4py and an MPI library: pip install 'gradcomp[mpi]' "
            "(mpi4py and MPICH from PyPI), or use gradcomp.torch.TorchCommunicator under "
            f"torchrun ({exc})") from None
    return MPI


class MPICommunicator(OrderedCommunicator):
    """The Communicator protocol over an mpi4py communicator (default ``COMM_WORLD``).

    ``comm`` is duplicated, so gradcomp's traffic never mixes with collectives the application runs
    on the same communicator from its own thread. Construct it on every rank (the duplication is a
    collective).

    ``cuda_aware``: None detects it (see ``detect_cuda_aware``); True hands CuPy buffers to MPI
    directly; False copies them to host memory and back. ``blas_threads``: BLAS threads per rank,
    1 by default, None to leave BLAS alone. ``abort_grace_s``: after a rank fails halfway through a
    reduction and keeps running, how long before ``MPI_Abort`` ends the job (env
    ``GRADCOMP_ABORT_GRACE_S``, 10 s); see ``gradcomp.comm.exits`` for exits and uncaught
    exceptions. ``pipeline_depth``: how many buckets the compute stage may run ahead of the
    wire (0: no overlap). ``large_allreduce_bytes``: the size from which allreduce runs as
    reduce-scatter + allgather.
    """

    def __init__(self, comm: Any = None, *, cuda_aware: bool | None = None, blas_threads: int | None = 1,
                 abort_grace_s: float | None = None, pipeline_depth: int | None = None,
                 large_allreduce_bytes: int = LARGE_ALLREDUCE_BYTES):
        MPI = _import_mpi()
        self._MPI = MPI
        base = comm if comm is not None else MPI.COMM_WORLD
        expected = torchrun_world()
        # the world only: a communicator of some ranks (auto times its candidates on COMM_SELF)
        # is one the program chose
        if expected is not None and base is MPI.COMM_WORLD and expected != base.Get_size():
            raise RuntimeError(
                f"gradcomp: this process was started by torchrun (WORLD_SIZE={expected}) but MPI "
                f"sees {base.Get_size()} rank(s): launch with `mpiexec -n {expected} python ...`, "
                "or under torchrun use gradcomp.torch.TorchCommunicator (gradcomp.torch.register "
                "picks it for you)")
        self._guard = exits.guard()
        self.comm = base.Dup()
        self.rank = self.comm.Get_rank()
        self.size = self.comm.Get_size()
        self.cuda_aware = detect_cuda_aware(cuda_aware)
        self.large_allreduce_bytes = int(large_allreduce_bytes)
        self._spin = os.environ.get("GRADCOMP_MPI_WAIT", "sleep").strip().lower() == "spin"
        self.poll_max_s = 200e-6
        self._half_ops: dict[str, Any] = {}
        self._blocks: dict[tuple, Any] = {}
        self._topology: Any = None
        self._levels: tuple | None = None
        pin_blas_threads(blas_threads)
        self._start("gradcomp-mpi", abort_grace_s, default_depth(pipeline_depth))
        self._ident = self._guard.register(self, self.comm) if self.size > 1 else None

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self.rank}, size={self.size}, cuda_aware={self.cuda_aware})"

    # -- hosts ------------------------------------------------------------------------------------
    @property
    def topology(self) -> Any:
        """Which ranks share a host (``gradcomp.comm.topology.Topology``), agreed by every rank
        on first use (collective)."""
        if self._topology is None:
            from .topology import detect

            self._topology = self._call(detect, self.comm)
        return self._topology

    def split_by_host(self) -> tuple[MPICommunicator, MPICommunicator] | None:
        """``(inside my host, across hosts with my local rank)`` as communicators of their own,
        made once (collective on every rank); None for one host or one rank per host. A topology
        whose hosts have different numbers of ranks is a ``CollectiveError`` on every rank."""
        if self._levels is None:
            self._levels = self._call(self._split_by_host)
        return self._levels or None

    def _split_by_host(self) -> tuple:
        from .pipeline import CollectiveError

        topo = self.topology
        if topo.hosts == 1 or topo.local_size == 1:
            return ()
        if not topo.regular:
            raise CollectiveError(f"gradcomp: a hierarchical schedule needs the same number of ranks on "
                                  f"every host, got {topo.describe()}: {list(map(len, topo.members))}")
        inside = self.comm.Split(topo.host, self.rank)
        across = self.comm.Split(topo.local_rank, topo.host)
        levels = tuple(MPICommunicator(c, cuda_aware=self.cuda_aware, blas_threads=None,
                                       abort_grace_s=self._grace, pipeline_depth=0,
                                       large_allreduce_bytes=self.large_allreduce_bytes)
                       for c in (inside, across))
        # Inside a host MPI moves large messages through shared memory a piece per call into its
        # progress engine, so sleeping between tests (``_wait``) stretches them several times
        # over; these exchanges are short and the peers are on the same host: MPI's own waiting.
        levels[0]._spin = True
        inside.Free()
        across.Free()
        return levels

    def abort(self, code: int = 1) -> None:
        exits.end_job(self.comm, code)

    def _count(self, kind: str, nbytes: float) -> None:
        if self._ident is not None:
            self._guard.check(self._ident, self.collectives)
        super()._count(kind, nbytes)

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

    def _finish(self, out, xp, into=None):
        if xp is np or self.cuda_aware:
            return out
        if into is not None:
            into = into.reshape(out.shape)  # a flat ``out=`` for (size, n) rows: CuPy's set() wants the shape
            into.set(out)
            return into
        return xp.asarray(out)

    def _bytes(self, a):
        """A byte view for MPI: odd dtypes (bfloat16) have no MPI datatype, and for moving data
        (not reducing it) bytes are all MPI needs."""
        return [a.reshape(-1).view(array_module(a).uint8), self._MPI.BYTE]

    def _sum_type(self, buf):
        """(buffer view, MPI datatype, MPI operation) that sum ``buf`` in its own dtype. MPI cannot
        add float16/bfloat16: they travel as 16-bit words with a user-defined operation."""
        name = dtype_name(buf.dtype)
        if name == "float32":
            return buf, self._MPI.FLOAT, self._MPI.SUM
        if name == "float64":
            return buf, self._MPI.DOUBLE, self._MPI.SUM
        return buf.view(np.uint16), self._MPI.UINT16_T, self._half_sum(buf.dtype)

    def _half_sum(self, dtype):
        """An MPI operation adding ``dtype`` (float16/bfloat16) values carried as 16-bit words.

        Commutative, so MPICH keeps its bandwidth-optimal algorithms; each partial sum is computed
        once, by one rank, and then copied, so every rank ends with the same bits.
        """
        key = dtype_name(dtype)
        if key not in self._half_ops:
            def add(inbuf, inoutbuf, datatype, dtype=dtype):
                add_into(np.frombuffer(inoutbuf, dtype=dtype), np.frombuffer(inbuf, dtype=dtype))

            self._half_ops[key] = self._MPI.Op.Create(add, commute=True)
        return self._half_ops[key]

    def _block(self, like, n):
        """This communicator's reused reduce-scatter block (wire thread only)."""
        xp = array_module(like)
        key = (xp.__name__, dtype_name(like.dtype), str(getattr(like, "device", None)))
        buf = self._blocks.get(key)
        if buf is None or buf.shape[0] < n:
            buf = self._blocks[key] = xp.empty(max(n, 1), like.dtype)
        return buf[:n]

    def _wait(self, *requests) -> None:
        """Wait for nonblocking MPI operations. MPICH's blocking calls spin a core until the data
        has arrived; with more ranks than cores (and a compute thread per rank, see the pipeline)
        that spinning takes the CPU the other ranks and this rank's next bucket need. So the
        wire thread tests the requests and sleeps between tests, briefly at first, then up to
        ``poll_max_s`` (``GRADCOMP_MPI_WAIT=spin``: MPI's own blocking wait)."""
        MPI = self._MPI
        if self._spin:
            MPI.Request.Waitall(requests)
            return
        delay = 2e-6
        while not MPI.Request.Testall(requests):
            time.sleep(delay)
            delay = min(2 * delay, self.poll_max_s)

    # -- the collectives, on the wire thread ---------------------------------------------------
    def _allreduce(self, array, overwrite=False):
        if self.size == 1:
            self._count("allreduce", 0)
            return array if overwrite else array.copy()
        buf, xp = self._prepare(array)
        scratch = overwrite or buf is not array  # the caller's scratch, or our own staging copy
        if buf.nbytes >= self.large_allreduce_bytes or not self._mpi_can_add(buf):
            out = buf if scratch else _copy(buf)
            counts, offsets = self.partition(out.shape[0])
            self._ring_reduce_scatter(out, counts, offsets)
            self._allgather_in_place(out, counts, offsets)
        else:
            out = buf if scratch else array_module(buf).empty_like(buf)
            data, mpitype, op = self._sum_type(buf)
            self._count("allreduce", buf.nbytes)
            if scratch:
                self._wait(self.comm.Iallreduce(self._MPI.IN_PLACE, [data, mpitype], op=op))
            else:
                self._wait(self.comm.Iallreduce([data, mpitype], [self._sum_type(out)[0], mpitype], op=op))
        return self._finish(out, xp, array if overwrite and xp is not np else None)

    def _mpi_can_add(self, buf) -> bool:
        """MPI adds host buffers (float16/bfloat16 with a Python operation) and device float32/64
        (CUDA-aware MPI); a Python operation cannot read device memory."""
        return not is_device_array(buf) or dtype_name(buf.dtype) in ("float32", "float64")

    def _ring_reduce_scatter(self, buf, counts, offsets):
        """In place: afterwards ``buf``'s block ``rank`` holds the sum over ranks of that block.

        A ring: at step s every rank sends one block to its right neighbour and adds the block
        arriving from its left into its own copy, so each rank sends (N-1)/N of the buffer and
        every block's sum is built once, along one chain, in a fixed order (replicas get the same
        bits after the allgather). The adds are gradcomp's own kernels, so float16/bfloat16 need
        no MPI operation, on host or device buffers. It matches MPICH's ring allreduce, and beats
        MPI_Reduce_scatter's pairwise exchange on a slow link (BENCHMARKS.md)."""
        right, left = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        incoming = self._block(buf, max(counts))
        self._count("reduce_scatter", buf.nbytes)
        for step in range(self.size - 1):
            send = (self.rank - step - 1) % self.size
            recv = (self.rank - step - 2) % self.size
            got = incoming[:counts[recv]]
            self._wait(self.comm.Irecv(self._bytes(got), left, 71),
                       self.comm.Isend(self._bytes(buf[offsets[send]:offsets[send] + counts[send]]), right, 71))
            add_into(buf[offsets[recv]:offsets[recv] + counts[recv]], got)
            synchronize(buf)  # on a GPU: the next send (or the allgather) hands this block to MPI

    def _allgather_in_place(self, out, counts, offsets):
        """Every rank's block of ``out`` (each already in its place) to every rank."""
        self._count("reduce_scatter", out.nbytes)  # (N-1)/N of the whole, like the first half
        item = out.dtype.itemsize
        self._wait(self.comm.Iallgatherv(self._MPI.IN_PLACE, [out.reshape(-1).view(array_module(out).uint8),
                                                              ([c * item for c in counts], [o * item for o in offsets]),
                                                              self._MPI.BYTE]))

    def _reduce_scatter(self, array, out=None, counts=None, overwrite=False):
        counts, offsets = self.partition(array.shape[0], counts)
        mine = slice(offsets[self.rank], offsets[self.rank] + counts[self.rank])
        buf, xp = self._prepare(array)
        work = buf if buf is not array or overwrite else _copy(buf)  # the ring works in place
        if self.size > 1:
            self._ring_reduce_scatter(work, counts, offsets)
        else:
            self._count("reduce_scatter", 0)
        block = work[mine]
        if out is None:
            return self._finish(block.copy(), xp)
        if xp is np or self.cuda_aware:
            out[...] = block
            return out
        out.set(block)
        return out

    def _allgather_blocks(self, block, out, counts=None):
        counts, offsets = self.partition(out.shape[0], counts)
        mine = slice(offsets[self.rank], offsets[self.rank] + counts[self.rank])
        if self.size == 1:
            self._count("reduce_scatter", 0)
            out[...] = block
            return out
        xp = array_module(out)
        target = out if (xp is np or self.cuda_aware) else np.empty(out.shape, out.dtype)
        target[mine] = block if xp is np or self.cuda_aware else xp.asnumpy(block)
        synchronize(target)
        self._allgather_in_place(target, counts, offsets)
        return self._finish(target, xp, out)

    def _allgather(self, array, out=None):
        buf, xp = self._prepare(array)
        shape = (self.size,) + buf.shape
        target = out if out is not None and (xp is np or self.cuda_aware) else array_module(buf).empty(shape, buf.dtype)
        self._count("allgather", buf.nbytes)
        self._wait(self.comm.Iallgather(self._bytes(buf), self._bytes(target)))
        return self._finish(target.reshape(shape), xp, out)

    def _alltoall(self, array, out=None):
        buf, xp = self._prepare(array)
        target = out if out is not None and (xp is np or self.cuda_aware) else array_module(buf).empty_like(buf)
        self._count("alltoall", buf.nbytes)
        self._wait(self.comm.Ialltoall(self._bytes(buf), self._bytes(target)))
        return self._finish(target.reshape(self.size, -1), xp, out)

    # -- overlapped exchanges (the two-stage codecs' pieces) ---------------------------------------------
    def overlaps(self, like) -> bool:
        """Host buffers, more than one rank: every send and receive of an exchange is posted at
        once, so the kernel moves the bytes while the wire thread computes the next piece."""
        return self.size > 1 and array_module(like) is np

    def start_alltoall(self, array, out):
        m = out.shape[1]
        self._count("alltoall", array.nbytes)
        return self._exchange([array[r * m:(r + 1) * m] for r in range(self.size)], out, 72)

    def start_allgather(self, array, out):
        self._count("allgather", array.nbytes)
        return self._exchange([array] * self.size, out, 73)

    def _exchange(self, sends, out, tag):
        """``sends[r]`` to rank r, rank r's into ``out[r]``: all receives, then all sends, posted
        now (point to point: an exchange of this kind between two ranks is matched in the order
        both started it)."""
        out[self.rank] = sends[self.rank]
        peers = [r for r in range(self.size) if r != self.rank]
        requests = [self.comm.Irecv(self._bytes(out[r]), r, tag) for r in peers]
        requests += [self.comm.Isend(self._bytes(sends[r]), r, tag) for r in peers]
        return _Exchange(self, requests)

    def _broadcast(self, array, root):
        buf, xp = self._prepare(array)
        out = _copy(buf)
        self._count("broadcast", buf.nbytes)
        self._wait(self.comm.Ibcast(self._bytes(out), root=root))
        return self._finish(out, xp)


class _Exchange:
    """Requests in flight; ``wait()`` ends them (sleeping between tests, as every wait here)."""

    def __init__(self, comm: MPICommunicator, requests: list):
        self.comm, self.requests = comm, requests

    def wait(self) -> None:
        self.comm._wait(*self.requests)


def _copy(buf):
    """A copy of ``buf`` that MPI may read at once (on a GPU: the copy's kernel has finished)."""
    out = array_module(buf).array(buf, copy=True)
    synchronize(out)
    return out
