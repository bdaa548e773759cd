"""Start torch.distributed under ``mpiexec`` (no torchrun, no environment variables) or torchrun.

Under mpiexec, rank and world size come from MPI. Rank 0 opens torch's TCPStore on a free port (the operating
system picks it, so two jobs on one host never collide) and sends the port and its host name to
the other ranks over MPI, as bytes (the buffer API: nothing is unpickled). Everyone then joins the
process group through that store. Under torchrun (``RANK``/``WORLD_SIZE`` set and no MPI
launcher), the process group starts from torchrun's environment (``env://``) and compressors talk
torch.distributed; the job is never split into one-rank jobs.
"""
from __future__ import annotations

import atexit
import datetime
import os
import socket
import threading
import time
import warnings
import weakref
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from ..comm import launched_by_mpi, torchrun_world


class Launch(NamedTuple):
    rank: int  # this process's rank in the job
    size: int  # number of processes in the job
    local_rank: int  # rank among the processes on this host (picks the GPU)
    device: torch.device  # where this rank should put its model: cuda:<local GPU> or cpu
    backend: str  # the torch.distributed backend in use


def _bcast_bytes(comm: Any, data: bytes | None, root: int = 0) -> bytes:
    length = np.array([len(data) if data is not None else 0], dtype=np.int64)
    comm.Bcast(length, root=root)
    buf = np.frombuffer(data, dtype=np.uint8).copy() if data is not None else np.empty(int(length[0]), np.uint8)
    comm.Bcast(buf, root=root)
    return buf.tobytes()


def init_process_group(backend: str | None = None, timeout: datetime.timedelta | None = None) -> Launch:
    """Initialize torch.distributed's default process group on every rank of ``MPI.COMM_WORLD``.

    ``backend``: None picks nccl when CUDA is available and gloo otherwise. With CUDA, each rank
    is bound to GPU ``local_rank % device_count`` first. ``timeout``: the process group's timeout
    for collectives (torch's default when None). The rendezvous host is ``MASTER_ADDR`` if set,
    127.0.0.1 when all ranks share one host, else rank 0's host name.

    If torch.distributed is already initialized, nothing is started; the sizes must agree. A
    group started here is destroyed at exit unless the program did it first, and the process
    then ends with its exit status past PyTorch's C++ teardown, which can abort a job that
    trained correctly (``_end_at_exit``).
    Under mpiexec, also sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``
    where unset, for code that reads torchrun's variables, and arms ``gradcomp.comm.exits`` (an
    uncaught exception on one rank ends the job instead of hanging it). Under torchrun, starts
    from its environment. Returns a ``Launch`` (rank, size, local_rank, device, backend). Must be
    called on every rank (it is collective).
    """
    if torchrun_world() is not None:
        return _from_torchrun(backend, timeout)
    if not launched_by_mpi():
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            raise RuntimeError("gradcomp.torch.init_process_group: RANK/WORLD_SIZE are set only in "
                               "part; start with torchrun, or with mpiexec")
    from mpi4py import MPI

    from ..comm import exits

    world = MPI.COMM_WORLD
    env_size = os.environ.get("WORLD_SIZE")
    if env_size is not None and env_size.isdigit() and int(env_size) != world.Get_size():
        raise RuntimeError(f"gradcomp.torch.init_process_group: WORLD_SIZE={env_size} in the "
                           f"environment but MPI has {world.Get_size()} rank(s); unset it, or do "
                           "not mix torchrun and mpiexec")
    exits.guard()
    rank, size = world.Get_rank(), world.Get_size()
    local = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    backend, device = _backend_and_device(backend, local_rank)
    for name, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank),
                        ("LOCAL_WORLD_SIZE", local_size)):
        os.environ.setdefault(name, str(value))

    if dist.is_initialized():
        return _already_started(rank, size, local_rank, device, "MPI")
    if size == 1 and not launched_by_mpi():
        _say_one_rank()

    smallest_host = np.array([local_size], dtype=np.int64)
    world.Allreduce(MPI.IN_PLACE, smallest_host, op=MPI.MIN)
    all_local = int(smallest_host[0]) == size
    host = os.environ.get("MASTER_ADDR") or ("127.0.0.1" if all_local else socket.gethostname())
    store_timeout = timeout or datetime.timedelta(seconds=300)
    if rank == 0:
        listen = int(os.environ.get("GRADCOMP_STORE_PORT", "0"))  # 0: let the OS pick a free port
        store = dist.TCPStore(host, listen, size, is_master=True, timeout=store_timeout,
                              wait_for_workers=False)
        address = f"{host}\n{store.port}".encode()
    else:
        address = None
    host, port = _bcast_bytes(world, address).decode().split("\n")
    if rank != 0:
        store = dist.TCPStore(host, int(port), size, is_master=False, timeout=store_timeout)
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, **kwargs)
    keep_at_exit(dist.group.WORLD)
    exits.guard().at_clean_exit(_destroy_process_group)
    return Launch(rank, size, local_rank, device, backend)


_SAID_ONE_RANK = False
_GROUPS: "weakref.WeakSet[dist.ProcessGroup]" = weakref.WeakSet()  # started or used here (``keep_at_exit``)


def keep_at_exit(group: dist.ProcessGroup | None) -> None:
    """Have the exit of a job started here keep ``group`` past finalization, like the groups
    still registered then (``_destroy_process_group``): also after the program destroyed them."""
    if group is None:
        return
    try:
        _GROUPS.add(group)
    except TypeError:  # a group object that takes no weak reference: left as before
        pass


def _say_one_rank() -> None:
    """Once per process: plain ``python train.py`` is a one-rank job, which is easy to start by
    mistake (nothing fails, nothing is averaged)."""
    global _SAID_ONE_RANK
    if not _SAID_ONE_RANK:
        _SAID_ONE_RANK = True
        warnings.warn("gradcomp.torch.init_process_group: no launcher started this process (plain "
                      "python), so the job is one rank and nothing travels between processes; for N "
                      "ranks start it with 'mpiexec -n N python ...' or 'torchrun --nproc_per_node N ...'",
                      stacklevel=3)


def _from_torchrun(backend: str | None, timeout: datetime.timedelta | None) -> Launch:
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    backend, device = _backend_and_device(backend, local_rank)
    if dist.is_initialized():
        return _already_started(rank, size, local_rank, device, "torchrun")
    kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
    dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size, **kwargs)
    keep_at_exit(dist.group.WORLD)
    atexit.register(_destroy_process_group)
    return Launch(rank, size, local_rank, device, backend)


def _destroy_process_group() -> None:
    """At exit, destroy the process groups while the interpreter is whole, keep their C++ objects
    until the process ends, and end it past the C++ teardown (``_end_at_exit``).

    Destroying a group only unregisters it: its C++ object, with gloo's threads, lives on while
    anything holds it (DDP's reducer holds the default group, a ``TorchCommunicator`` its own).
    Those holders are freed during the interpreter's finalization, and with them the groups (seen
    under gdb), where a gloo thread that takes the GIL is ended by ``pthread_exit`` through C++
    frames and the process aborts after a clean run ("terminate called without an active
    exception", exit 6: seen in CI after every check had passed). Kept
    (``_keep_past_finalization``), their threads stay idle until the process ends. Under mpiexec
    this runs after ``gradcomp.comm.exits`` has let the process end normally, never before an
    abort; also when the program destroyed the group itself."""
    native = os.environ.get("GRADCOMP_NATIVE_TEARDOWN", "0").strip().lower() not in ("0", "", "false", "no", "off")
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    groups = [] if native else list(registry or ()) + list(_GROUPS)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not native:
        _keep_past_finalization(groups)
        _let_threads_settle()
        _end_at_exit()


def _let_threads_settle(limit_s: float = 2.0, quiet_checks: int = 3, every_s: float = 0.005) -> None:
    """Give up the GIL until no other thread of this process is running (``quiet_checks`` looks
    in a row, at most ``limit_s`` seconds), so that finalization never starts under a thread that
    is about to take the GIL.

    A gloo worker marks a collective done, then frees its work object; when the work held the last
    reference to a tensor whose Python object the program already dropped (``all_gather_object``'s
    buffers, for one), freeing it takes the GIL. On a loaded machine the worker can be preempted
    between the two for longer than the program needs to reach its exit; once finalization has
    begun, Python ends a thread that takes the GIL with ``pthread_exit``, whose unwinding through
    the C++ destructor calls ``std::terminate`` (seen under gdb in a core of the exit-6 abort: a
    gloo ``runLoop`` freeing an ``AsyncAllgatherWork`` while the main thread collected garbage in
    ``Py_FinalizeEx``). Threads asleep (idle workers, epoll loops) are quiet; the wait is a few
    milliseconds when all are. Reads ``/proc``; elsewhere it returns at once."""
    me = str(threading.get_native_id())
    deadline = time.monotonic() + limit_s
    quiet = 0
    while quiet < quiet_checks and time.monotonic() < deadline:
        time.sleep(every_s)
        quiet = quiet + 1 if not _others_running(me) else 0


def _others_running(me: str) -> bool:
    """Whether a thread of this process other than ``me`` (a native id) is running or runnable."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return False
    for tid in tids:
        if tid == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                state = stat.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # it ended
        if state == "R":
            return True
    return False


def _keep_past_finalization(objects: list[Any]) -> None:
    """Hold a reference to each of ``objects`` that nothing releases, so that finalization, which
    frees what holds them, never runs their destructors (``_destroy_process_group``)."""
    import ctypes

    for obj in objects:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def _end_at_exit() -> None:
    """Have the C library end the process with its exit status as soon as ``exit()`` is called,
    after Python's finalization (its atexit functions, mpi4py's ``MPI_Finalize``, the flush of
    ``sys.stdout``/``stderr``), before the C++ destructors of static objects and the libraries'
    own teardown, where a ``std::thread`` left unjoined would call ``std::terminate``. (The
    abort after clean runs that CI met, "terminate called without an active exception", came
    from earlier, from a thread still in PyTorch's callbacks when finalization began: the
    pipelines are stopped at exit for that, ``gradcomp.comm.pipeline``.)

    glibc's ``on_exit`` passes the status ``exit()`` was given, so ``sys.exit(code)``, ``raise
    SystemExit(code)`` and an uncaught exception (1) keep their codes; it runs its functions in
    reverse order of registration, so ``_exit`` registered now, at Python's exit, comes first.
    C's own stdio buffers are flushed here (``_exit`` does not). Where there is no ``on_exit``
    (not glibc) the teardown runs as before. ``GRADCOMP_NATIVE_TEARDOWN=1`` keeps it (a tool
    that writes its results from C++ destructors at exit, e.g. a coverage or sanitizer runtime)."""
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        on_exit, end, flush = libc.on_exit, libc._exit, libc.fflush
    except (OSError, AttributeError):
        return
    on_exit.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    on_exit.restype = ctypes.c_int
    flush.argtypes = [ctypes.c_void_p]
    flush(None)
    # _exit(int) called as a handler of (int status, void *arg): the extra argument is ignored
    # by the C calling conventions glibc runs on
    on_exit(ctypes.cast(end, ctypes.c_void_p), None)


def _backend_and_device(backend: str | None, local_rank: int) -> tuple[str, torch.device]:
    """nccl and GPU ``local_rank % device_count`` (made current) with CUDA, else gloo and the CPU."""
    if not torch.cuda.is_available():
        return backend or "gloo", torch.device("cpu")
    device = torch.device("cuda", local_rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return backend or "nccl", device


def _already_started(rank: int, size: int, local_rank: int, device: torch.device, by: str) -> Launch:
    if dist.get_world_size() != size or dist.get_rank() != rank:
        raise RuntimeError(f"gradcomp.torch.init_process_group: torch.distributed is already "
                           f"initialized as rank {dist.get_rank()} of {dist.get_world_size()}, "
                           f"but {by} says rank {rank} of {size}")
    return Launch(rank, size, local_rank, device, str(dist.get_backend()))
