"""How an MPI job ends when one rank fails or leaves early (DESIGN invariant 4).

Under plain ``mpiexec``, a Python process that dies of an uncaught exception still calls
``MPI_Finalize`` at exit, and MPICH's finalize waits for every peer; the peers meanwhile wait in a
collective for the dead rank. Nobody ever returns. (``python -m mpi4py`` avoids this for uncaught
exceptions; gradcomp must not depend on users knowing that.) The ``JobGuard`` of each process, set
up by the first ``MPICommunicator``, makes every way out end the job promptly:

* **an uncaught exception** (in user code, inside a reduction, inside ``backward()`` under DDP):
  the traceback is printed and the job is aborted (``MPI_Abort``), as ``python -m mpi4py`` does;
* **exit while gradcomp work is in flight or after a failed reduction**: aborted at exit, since
  the peers can never complete the collectives this rank left;
* **any other exit** (``sys.exit(...)``, the end of the script) while peers still need this rank:
  at exit the rank tells every peer how many collectives it completed on each gradcomp
  communicator ("goodbye"). A peer that is waiting in, or later starts, a collective beyond that
  count cannot finish it: it prints which rank left and aborts the job. A peer that needs nothing
  more from the leaver (a rank evaluating while others are done) is not disturbed;
* a process that is killed is noticed by mpiexec itself, which ends the job.

The goodbye messages travel on a communicator of their own (a duplicate of ``COMM_WORLD``, so
they never match gradcomp's or the application's traffic), as fixed-size int64 buffers (no
pickling). A daemon thread polls for them a few times a second (``Request.Test``, no busy loop).
``GRADCOMP_ABORT_ON_EXCEPTION=0`` leaves uncaught exceptions to Python and MPI.
"""
from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from .. import timeline

_TAG = 7301
_MAX_COMMS = 31  # (communicator id, collectives) pairs carried per goodbye message
_POLL_S = 0.2
_ABORT_GRACE_S = 0.5  # before MPI_Abort, for the launcher to forward this rank's last output
ABORT_EXIT_S = 10.0  # after MPI_Abort, before a process it has not ended ends itself (end_job)

#: why an uncaught exception ends the whole job. This rank cannot tell whether its peers failed
#: too (each rank's hook runs alone, and every rank of a job may raise the same error), so it
#: says what holds either way: not "the other ranks would wait forever", which every rank of a
#: job that failed everywhere printed, each about peers that were failing with it
_WHY_ABORT_ON_EXCEPTION = ("this rank can take no further part in the job's collectives, so any "
                           "rank still running would wait for it forever "
                           "(set GRADCOMP_ABORT_ON_EXCEPTION=0 to leave it to MPI)")

_guard: "JobGuard | None" = None
_guard_lock = threading.Lock()


def end_job(comm, code: int) -> None:
    """``MPI_Abort`` on ``comm``, and never return: MPICH's abort can return when another rank
    aborts at the same moment (seen: a rank printing after its abort), and a rank that goes on
    after its job was ended can only mislead.

    Nor may it hang. MPICH 5 ends the aborting process with ``exit()``, which runs C++ destructors
    and exit handlers while the process's other threads still hold what they hold; once, a torch
    job under mpiexec never ended after rank 1's ``MPI_Abort`` (gloo's threads were live). So a
    watchdog that needs no Python lock (``faulthandler``'s) prints every thread's stack and
    ``_exit``s the process ``ABORT_EXIT_S`` seconds on; the launcher sees it gone and the peers'
    connections to it fail."""
    sys.stdout.flush()
    sys.stderr.flush()
    timeline.flush()  # a timeline's trace, up to here (left unclosed: its readers accept that)
    try:
        faulthandler.dump_traceback_later(ABORT_EXIT_S, exit=True, file=sys.__stderr__ or 2)
    except (ValueError, OSError, AttributeError):  # no stderr to write to: abort all the same
        pass
    try:
        comm.Abort(code)
    finally:
        os._exit(code)


def _stderr_that_survives():
    """Where to write before an abort: ``sys.stderr``, unless a hook around ours swapped it for an
    in-memory buffer to print later (``torch.distributed``'s excepthook collects the traceback in a
    ``StringIO`` to prefix it with the rank, and writes it after our hook returns, which an abort
    never does: every traceback of a torch job under mpiexec was lost). Then what the buffer holds
    goes to the process's own stderr first, and so does the rest."""
    err, real = sys.stderr, sys.__stderr__
    if err is real or real is None or not hasattr(err, "getvalue"):
        return err
    real.write(err.getvalue())
    err.seek(0)
    err.truncate()
    return real


def guard() -> "JobGuard":
    """The process's JobGuard, created on first use. Collective: every rank must reach it (the
    first ``MPICommunicator()``, or ``gradcomp.torch.init_process_group()`` under mpiexec)."""
    global _guard
    with _guard_lock:
        if _guard is None:
            _guard = JobGuard()
        return _guard


class JobGuard:
    def __init__(self):
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.comm = self.world.Dup()
        self._communicators: dict[int, weakref.ref] = {}  # id -> communicator
        self.departed: dict[int, dict[int, int]] = {}  # rank -> {communicator id: collectives done}
        self._buf = np.zeros(2 * _MAX_COMMS + 1, np.int64)
        self._stop = threading.Event()
        self._aborting = False
        self._req: Any = None  # the pending goodbye receive (an MPI.Request) while watching
        self._at_clean_exit: list[Callable[[], None]] = []
        if self.size > 1:
            self._req = self.comm.Irecv([self._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=_TAG)
            self._thread = threading.Thread(target=self._watch, name="gradcomp-guard", daemon=True)
            self._thread.start()
        if os.environ.get("GRADCOMP_ABORT_ON_EXCEPTION", "1").strip().lower() not in ("0", "false", "no", "off"):
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook
        atexit.register(self._at_exit)

    # -- registration ---------------------------------------------------------------------------------
    def at_clean_exit(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` at exit once this guard has let the process end normally (never when it
        aborts): teardown that could wait on peers must not delay an abort."""
        self._at_clean_exit.append(fn)

    def register(self, communicator, mpi_comm) -> int:
        """Watch ``communicator`` (over ``mpi_comm``); returns its id, the same on each of its ranks:
        a digest of its members' world ranks and how many watched communicators of the same
        members came before (they are created collectively, so in the same order)."""
        from ..bucket import digest

        members = tuple(mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.Get_size())),
                                                            self.world.Get_group()))
        earlier = sum(1 for ref in self._communicators.values()
                      if ref() is not None and getattr(ref(), "_members", None) == members)
        communicator._members = members
        ident = digest(repr((members, earlier))) & 0x3FFFFFFFFFFFFFFF
        self._communicators[ident] = weakref.ref(communicator)
        return ident

    def check(self, ident: int, index: int) -> None:
        """Called before a communicator starts collective ``index`` (0-based): abort if a rank that
        left completed fewer collectives than that, because it will never join this one."""
        for rank, done_by_comm in list(self.departed.items()):
            done = done_by_comm.get(ident)
            if done is not None and index >= done:
                self.abort(f"rank {rank} left the job (its process exited) after {done} collectives "
                           f"on this gradcomp communicator; this rank needs collective #{index + 1} "
                           "from it, which can never complete")

    # -- ending the job ----------------------------------------------------------------------------------
    def abort(self, why: str, code: int = 1) -> None:
        if self._aborting:
            return
        self._aborting = True
        err = _stderr_that_survives()
        err.write(f"gradcomp: rank {self.rank}: {why}. Ending the job (MPI_Abort).\n")
        err.flush()
        sys.stdout.flush()
        # MPI_Abort makes mpiexec kill every rank at once, and output this rank has written but
        # the launcher has not yet forwarded is lost with it (seen under load: a traceback cut
        # off mid-line). A moment's grace lets the launcher drain the pipes; the job is ending.
        time.sleep(_ABORT_GRACE_S)
        end_job(self.world, code)

    def _excepthook(self, kind, value, tb):
        self._previous_hook(kind, value, tb)
        if self.size > 1 and not self.MPI.Is_finalized():
            self.abort(f"uncaught {kind.__name__}: {_WHY_ABORT_ON_EXCEPTION}")

    def _live(self):
        return [(i, ref()) for i, ref in self._communicators.items() if ref() is not None]

    def _at_exit(self):
        self._say_goodbye()
        for fn in reversed(self._at_clean_exit):
            fn()

    def _say_goodbye(self):
        if self.size == 1 or self.MPI.Is_finalized():
            return
        live = self._live()
        for _, comm in live:
            if comm.broken is not None:
                self.abort("exiting after a failed reduction on a gradcomp communicator")
            if comm.busy:
                self.abort("exiting with gradcomp work still in flight (wait for every future "
                           "before the process ends)")
        counts = np.zeros_like(self._buf)
        live = live[:_MAX_COMMS]
        counts[0] = len(live)
        for k, (ident, comm) in enumerate(live):
            counts[1 + 2 * k], counts[2 + 2 * k] = ident, comm.collectives
        sends = [self.comm.Isend([counts, self.MPI.INT64_T], dest=r, tag=_TAG)
                 for r in range(self.size) if r != self.rank]
        self.MPI.Request.Waitall(sends)
        self._stop.set()
        self._thread.join(2 * _POLL_S + 1)
        if self._req is not None and not self._thread.is_alive():
            self._req.Cancel()
            self._req.Wait()
            self._req = None

    def _watch(self):
        MPI = self.MPI
        status = MPI.Status()
        while not self._stop.wait(_POLL_S):
            try:
                while self._req.Test(status):
                    n = int(self._buf[0])
                    pairs = self._buf[1:1 + 2 * n].reshape(n, 2)
                    self.departed[status.Get_source()] = {int(i): int(c) for i, c in pairs}
                    self._req = self.comm.Irecv([self._buf, MPI.INT64_T], source=MPI.ANY_SOURCE, tag=_TAG)
                    self._check_running()
            except Exception:  # MPI finalized under us: the process is ending anyway
                return

    def _check_running(self):
        for ident, comm in self._live():
            started = comm.collectives
            if comm.busy and started > 0:
                self.check(ident, started - 1)
