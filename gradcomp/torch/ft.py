"""Compressed gradients and DiLoCo on torchft: a replica group that dies or joins does not stop the job.

    from torchft import Manager, Optimizer, ProcessGroupGloo
    import gradcomp.torch.ft as gft

    manager = Manager(pg=ProcessGroupGloo(), load_state_dict=..., state_dict=..., min_replica_size=1,
                      use_async_quorum=False)
    model = gft.DistributedDataParallel(manager, net, "int8")
    optimizer = Optimizer(manager, torch.optim.AdamW(model.parameters()))
    # the loop as torchft's: optimizer.zero_grad(); loss.backward(); optimizer.step()

``DistributedDataParallel(manager, module, compressor)`` stands in for torchft's own
``torchft.DistributedDataParallel(manager, module)`` and averages the gradients with any gradcomp
compressor over the manager's current quorum. This is the only gradcomp module that imports
torchft (docs/guides/fault-tolerance.md). What it does beyond the plain DDP hook (``hook.py``,
whose ``HookState`` and hook it reuses), and why:

* **Failures discard the step, never end the job.** gradcomp's own transports end the job when a
  rank fails halfway through a reduction (DESIGN invariant 4). Here the communicator
  (``QuorumCommunicator``) instead reports the failure to the manager (``report_error``), so that
  ``manager.should_commit()`` is False on every survivor, and the hook's Future still resolves to
  the bucket (zeroed), so ``backward()`` returns. torchft's own hook hands DDP the inner Future of
  ``manager.allreduce`` and dies on ``assert fut._fut`` when a peer is lost in the step; this one
  returns a plain torch Future the pipeline completes. The broken pipeline is replaced at the
  next step, on the quorum's newly configured process group.
* **A discarded step leaves no trace in the compressor.** The compressor's ``state_dict()`` is
  taken before the first bucket of every step. A step counts as committed when the manager's step
  advanced past it (``should_commit`` advances it only then); one that did not is rolled back
  (``load_state_dict``) before the next step and before the state is sent to a healing replica:
  residuals, step counters and warm-up stage are as if the step had never run. Its traffic stays
  in ``stats()`` (the bytes were sent).
* **A healing replica receives the compressor's state** (``manager.register_state_dict_fn``, key
  ``"gradcomp"``): step counters, warm-up stage, warm-start factors and bucket layouts, everything
  agreement compares (invariant 3). Not the error-feedback residuals: each is the error of one
  replica's own messages, and a new replica has sent none, so it starts from zero ones (a copy of
  its source's would count that error twice).
* **The synchronous quorum, required** (``Manager(use_async_quorum=False)``; torchft's default is
  the asynchronous one, refused here with an error that says so). It heals a joining replica in
  ``start_quorum``, before the forward pass, so the replica enters the exchange with the
  survivors' compressor state and its own gradients, every member of the quorum participates,
  and the healing step is committed like any other. Under the asynchronous quorum a healing
  replica receives its checkpoint only in ``should_commit``, after the exchange: its compressor
  would enter the exchange with its old state, and the state it then receives is the survivors'
  state before a step they commit, so it stays one step behind theirs and agreement (invariant 3)
  refuses every later step. Refusing the healing step everywhere instead (what a replica that is
  not participating does here) costs a step per heal, and at step 0 with ``init_sync`` (torchft
  heals every replica from one until a step commits) no step would ever commit.
* **A replica that cannot take part refuses, on every rank alike.** One whose quorum failed, or
  that is not participating, takes part in each bucket's agreement only to refuse it: every rank
  raises the same ``CollectiveError`` and every replica discards the step, promptly, instead of
  its peers waiting for collectives it never starts (invariant 1). torchft's spares
  (``WorldSizeMode.FIXED_WITH_SPARES``), which never participate, are refused at construction.
* **Buckets are never rebuilt** (``find_unused_parameters=True``, as torchft's own wrapper does):
  a restarted replica's first buckets are then laid out as the survivors' later ones.

**DiLoCo on torchft** (``gradcomp.torch.DiLoCo(model, inner, ..., manager=manager)``, coordinated
by ``OuterSteps``): every outer step is one step of the manager (quorum, exchange, commit); inner
steps need none. So a group killed between outer steps costs its peers only the wait for the
lighthouse's heartbeat timeout at their next outer step. The rest, and why:

* **A failed outer step is discarded and its pseudo-gradient sent again at the next one** (not
  skipped). Nothing of the outer state changes before ``should_commit``: the synced parameters
  and the outer momentum change only when the step lands, after the commit; the outer step
  counter and the compressor's state (residuals, counters) are put back. Each replica keeps its
  inner steps, so its next pseudo-gradient (synced parameters minus now) carries them all, 2H
  steps' worth; skipping, as torchft's own DiLoCo does (back to the synced parameters), would
  throw away H inner steps of every survivor's work for one lost exchange.
* **The mean is over the groups that contributed.** A healing group takes part in the exchange
  (the quorum's process group includes it) with a zero pseudo-gradient, and the mean is scaled
  by (quorum size / contributors), the same arithmetic on every rank, so every replica still
  holds the same bits. One small allgather before the exchange (the handshake) tells every group
  who contributes, and who refuses (a failed quorum: then every group discards the step at once).
* **A joining group heals inside the outer step its peers are in** (key ``"gradcomp.diloco"``):
  the synced parameters (which become its parameters), the outer momentum, the step counters,
  the compressor's state (not its residuals, as above) and the outer step in progress (which
  fragments, where it lands, the outer rates), which it then runs with them. The manager's own
  ``state_dict`` needs only the inner optimizer's state. At the job's start (torchft's step 0,
  whose ``init_sync`` heals every group from one) the groups check that they start from the
  same parameters and commit a step with no exchange.
* **Streaming**: each fragment's outer step is a step of the manager. torchft runs one quorum and
  one commit at a time, so ``overlap`` may be at most the inner steps between two fragments'
  outer steps (refused otherwise, with that reason).

The process group is the manager's (``process_group=`` to name it explicitly). Tested with torchft
0.2.0 on ``ProcessGroupGloo``.
"""
from __future__ import annotations

import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
import torch
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                                BroadcastOptions, ReduceOp)
from torch.nn import parallel

from ..comm import CollectiveError
from ..comm.protocol import default_depth
from ..compressors import Compressor
from ..optim.diloco import parameters_digest
from ..registry import make
from . import advice
from .checkpoint import from_torch_state, to_torch_state
from .communicator import TorchCommunicator
from .hook import HookState, gradcomp_hook
from .tensors import as_array

if TYPE_CHECKING:
    from concurrent.futures import Future

    from torchft import Manager

#: the key of gradcomp's part of the manager's state dict (what a healing replica receives)
STATE_KEY = "gradcomp"
#: DiLoCo's part (``OuterSteps``: the outer state and the outer step in progress)
DILOCO_STATE_KEY = "gradcomp.diloco"
#: compressor state entries that are one replica's own error memory (``ErrorFeedback``'s worker
#: and slice-owner residuals, PowerSGD's): not sent to a healing replica (module docstring)
_OWN_ERROR = ("residual/", "owner/")


class QuorumCommunicator(TorchCommunicator):
    """gradcomp's transport over a torchft process group (``ProcessGroupGloo``, ``ProcessGroupNCCL``).

    The collectives and the staging of buffers are ``TorchCommunicator``'s; what differs:

    * the collective calls (``_all_reduce_sum`` and the like) go to the torchft group's own
      methods (it is reconfigured for every new quorum and is not registered with
      ``torch.distributed``, so its functional API cannot address it);
    * ``renew()``, at the start of every step, reads this rank and the group's size from the
      group as the latest quorum configured it, and replaces a pipeline an earlier failure broke;
    * a failure reports the error to the manager (the step is then not committed) instead of
      ending the job (``abort`` is never called).
    """

    group: Any  # a torchft ProcessGroup

    def __init__(self, manager: Manager, process_group: Any, pipeline_depth: int | None = None):
        # (TorchCommunicator.__init__ needs torch.distributed's default group, which a torchft job
        # need not have: the fields it sets are set here)
        self.manager = manager
        self.group = process_group
        self.rank, self.size = 0, 1
        self.backend = str(process_group.getBackendName())
        self._global_ranks = [0]
        self._cuda_index = torch.cuda.current_device() if "nccl" in self.backend else None
        self._depth = default_depth(pipeline_depth)
        self._start("gradcomp-torchft", 0.0, self._depth)
        self.failures = 0  # reductions that failed (peers lost, refused agreement), this process

    def __repr__(self) -> str:
        return f"QuorumCommunicator(rank={self.rank}, size={self.size}, backend={self.backend!r})"

    def renew(self) -> None:
        """Take this rank and size from the group's current configuration; start a new pipeline if
        the old one broke. Call between steps, with no reduction in flight."""
        parent = self.group.parent  # torchft: the group the last quorum configured
        if self.broken is not None:
            traffic = (self.bytes_sent, self.collectives)
            old = self._pipeline
            self._start("gradcomp-torchft", 0.0, self._depth)
            old.close(timeout=5.0)
            self.bytes_sent, self.collectives = traffic
        self.rank, self.size = int(parent.rank()), int(parent.size())
        self._global_ranks = list(range(self.size))

    def _on_failure(self, exc: BaseException) -> None:
        self.failures += 1
        sys.stderr.write(f"gradcomp.torch.ft: a reduction failed ({exc!r}); this step is discarded "
                         "(manager.should_commit() is False) and the next quorum goes on\n")
        sys.stderr.flush()
        self.manager.report_error(exc if isinstance(exc, Exception) else RuntimeError(repr(exc)))

    def abort(self, code: int = 1) -> None:  # never: a failed step is discarded, not the job
        pass

    # torchft's own methods and ``*Options`` (the staging and counting around them are
    # TorchCommunicator's)
    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM  # type: ignore[assignment]  # (torch's stubs: RedOpType)
        self.group.allreduce([tensor], opts).wait()

    def _all_gather_into(self, gathered: torch.Tensor, tensor: torch.Tensor) -> None:
        self.group.allgather([list(gathered.chunk(self.size))], [tensor], AllgatherOptions()).wait()

    def _all_to_all(self, received: torch.Tensor, tensor: torch.Tensor) -> None:
        self.group.alltoall_base(received, tensor, [], [], AllToAllOptions()).wait()

    def _broadcast_from(self, tensor: torch.Tensor, root: int) -> None:
        opts = BroadcastOptions()
        opts.rootRank = int(root)  # the torchft group's own rank (it has no global ranks)
        self.group.broadcast([tensor], opts).wait()


def manager_group(manager: Manager, process_group: Any = None) -> Any:
    """The torchft process group gradcomp's collectives go to (``process_group``, default the
    manager's), after refusing the manager settings under which replicas cannot stay consistent."""
    from torchft.manager import WorldSizeMode

    # (torchft keeps both settings in private attributes; read defensively)
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError("gradcomp.torch.ft: construct the Manager with use_async_quorum=False. Under "
                         "the asynchronous quorum a healing replica receives gradcomp's state only "
                         "after its step's exchange, one step behind its peers' from then on "
                         "(see gradcomp.torch.ft's docstring)")
    if getattr(manager, "_replica_world_size_mode", None) == WorldSizeMode.FIXED_WITH_SPARES:
        raise ValueError("gradcomp.torch.ft: WorldSizeMode.FIXED_WITH_SPARES is not supported: a spare "
                         "never participates, and a replica that does not participate refuses "
                         "the exchange (every step would be discarded); use WorldSizeMode.DYNAMIC")
    if process_group is None:
        process_group = getattr(manager, "_pg", None)  # torchft keeps no public accessor
        if process_group is None:
            raise ValueError("gradcomp.torch.ft: this Manager has no process group gradcomp can "
                             "find; pass process_group= (the group given to the Manager)")
    return process_group


class _Quorum:
    """What one step on torchft needs between the manager's quorum and its commit, for the DDP hook
    (``_Exchange``) and DiLoCo (``OuterSteps``) alike: the communicator renewed for the quorum,
    whether this replica can take part, and the state to put back if the manager does not commit
    the step (``keep``, ``settle``)."""

    def __init__(self, manager: Manager, comm: QuorumCommunicator):
        self.manager = manager
        self.comm = comm
        self.lock = threading.Lock()
        self.quorum_error: Any = None  # this step's quorum failed on this replica
        self.usable = True             # whether this step's process group can carry anything
        # (the manager's step when the step began, the state then, how to put it back)
        self.before: tuple[int, Any, Callable[[Any], None]] | None = None
        self.rolled_back = 0  # discarded steps undone, this process

    def open(self) -> None:
        """After the quorum (with ``lock`` held): note a failed quorum, and take this rank and size
        from the group it configured (a replica without one cannot take part)."""
        self.quorum_error = self.manager.errored()
        try:
            self.comm.renew()
            self.usable = True
        except Exception as exc:  # no process group: this replica's quorum failed
            self.usable = False
            self.manager.report_error(exc)

    def keep(self, state: Any, restore: Callable[[Any], None]) -> None:
        """``restore(state)`` at ``settle`` unless the manager commits the step that begins now."""
        self.before = (self.manager.current_step(), state, restore)

    def settle(self) -> bool:
        """Undo the step begun at ``keep`` if the manager did not commit it (its step did not
        advance: ``should_commit`` advances it only then); whether it was undone."""
        undone = self.before is not None and self.manager.current_step() == self.before[0]
        if undone:
            assert self.before is not None
            self.before[2](self.before[1])
            self.rolled_back += 1
        self.before = None
        return undone

    def refusal(self) -> str | None:
        """Why this replica cannot take part in this step's exchange, or None."""
        if self.quorum_error is not None:
            return f"its quorum failed ({getattr(self.quorum_error, 'original_exception', self.quorum_error)!r})"
        if not self.manager.is_participating():
            return ("it does not participate in this quorum (healing under torchft's asynchronous "
                    "quorum?): use Manager(use_async_quorum=False)")
        return None


class _Exchange(_Quorum):
    """What the DDP hook needs across steps: the quorum's state, the hook state, and the
    compressor's state before this step (to roll a discarded step back)."""

    def __init__(self, manager: Manager, comm: QuorumCommunicator, state: HookState):
        super().__init__(manager, comm)
        self.state = state
        self.new_step = True

    # -- between steps ----------------------------------------------------------------------------
    def restore(self, saved: dict[str, Any]) -> None:
        self.state.compressor.load_state_dict(saved, self.state.shapes or None)

    def begin_step(self) -> None:
        self.manager.wait_quorum()
        with self.lock:
            self.settle()
            self.open()
            self.keep(self.state.compressor.state_dict(), self.restore)

    # -- the manager's state dict (a healing replica's) -------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self.lock:
            self.settle()  # never send a step that was not committed
            state = self.state.state_dict()
            state["state"] = {k: v for k, v in state["state"].items() if not _own_error(k)}
            return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.state.load_state_dict(state)
            self.before = None  # the loaded state is this replica's now

    # -- one bucket ----------------------------------------------------------------------------------
    def exchange(self, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        """``bucket``'s mean (a Future that never fails), or, when the step cannot be committed,
        the bucket zeroed, with the error reported to the manager. Whether a bucket takes part is
        decided alike on every rank (invariant 1): not by this rank's ``manager.errored()``, which
        an earlier bucket's failure sets at a different moment on each rank."""
        if self.new_step:
            self.begin_step()
            self.new_step = False
        if bucket.is_last():
            self.new_step = True
        tensor = bucket.buffer()
        if not self.usable or self.comm.broken is not None:
            return _done(tensor.zero_())  # a peer was lost in this step: nothing can be matched
        problem = self.refusal()
        manager = self.manager

        def settled(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            try:
                return done.value()
            except Exception as exc:  # a lost peer, a refused agreement: the step is discarded
                manager.report_error(exc)
                return tensor.zero_()

        if problem is None:
            return gradcomp_hook(self.state, bucket).then(settled)
        return self.refuse(tensor, problem).then(settled)

    def refuse(self, tensor: torch.Tensor, problem: str) -> torch.futures.Future[torch.Tensor]:
        """Take part in the bucket's agreement only to refuse it: every rank then raises the same
        ``CollectiveError`` (invariant 3), and every replica discards the step."""
        compressor, comm = self.state.compressor, self.comm
        future: torch.futures.Future[Any] = torch.futures.Future()  # (Any: torch's stubs type set_exception so)
        array = as_array(tensor)

        def answer(done: Future[Any]) -> None:
            exc = done.exception()
            future.set_exception(exc if isinstance(exc, Exception) else RuntimeError(problem))

        comm.submit(lambda _p, _e: compressor.checked_run(array, comm, None, problem)).add_done_callback(answer)
        return future


#: what each replica says before an outer step's exchange (``OuterSteps._handshake``): the kind of
#: step it is in, whether it has a pseudo-gradient of its own, whether it refuses, a digest
_JOIN, _OUTER = 1, 2


class OuterSteps(_Quorum):
    """``gradcomp.optim.DiLoCo``'s coordinator on torchft: one quorum and one commit per outer step
    (``gradcomp.torch.DiLoCo(..., manager=)`` makes it; the module docstring's DiLoCo part says
    what happens on failures and heals).

    Per outer step, on the training thread: ``begin`` (the quorum, a heal if this replica is
    behind, the state to put back, the handshake), ``start`` (each fragment's exchange, or none
    where the step is already lost), ``end`` (the buffers, ``should_commit``, then the factor
    that makes the mean one over the replicas that contributed, or None and the state put back).
    ``last`` describes the latest outer step (``quorum_s``, ``participants``, ``contributors``,
    ``healed``, ``committed``); ``heals`` and ``discarded`` count them in this process.
    """

    def __init__(self, manager: Manager, process_group: Any = None):
        super().__init__(manager, QuorumCommunicator(manager, manager_group(manager, process_group)))
        self.outer: Any = None         # the gradcomp.optim.DiLoCo
        self.buffers: list[torch.Tensor] = []
        self.round: dict[str, Any] = {"kind": "join"}  # the step in progress, sent to a healing replica
        self.received: dict[str, Any] | None = None    # a healing replica's state, until applied
        self.joined = False  # join() took the quorum of the outer step it then runs
        self.problem: str | None = None
        self.contributors = 0
        self.root = 0         # the quorum rank the buffers come from (the first that contributed)
        self.heals = 0
        self.discarded = 0
        self.last: dict[str, Any] = {}

    def attach(self, outer: Any, buffers: list[torch.Tensor]) -> None:
        """Coordinate ``outer`` (built with this as its coordinator): register its state with the
        manager (key ``"gradcomp.diloco"``) and join the job (``join``)."""
        starts = [t for t in range(1, outer.sync_every + 1) if outer.due(t)]
        gap = min(b - a for a, b in zip(starts, starts[1:] + [starts[0] + outer.sync_every]))
        if outer.overlap > gap:
            raise ValueError(f"gradcomp.torch.DiLoCo: with a torchft manager, overlap={outer.overlap} must be at "
                             f"most {gap}, the inner steps between two fragments' outer steps: torchft runs "
                             "one quorum and one commit at a time, so an exchange must land before the "
                             "next one starts")
        self.outer, self.buffers = outer, buffers
        self.manager.register_state_dict_fn(DILOCO_STATE_KEY, self._receive, self._send)
        self.join()

    # -- the state a healing replica receives -------------------------------------------------------
    def _send(self) -> dict[str, Any]:
        """On the source, in its quorum: the outer state (not its own residuals: the DDP case's
        reason) and the outer step it is about to run, which the healing replica then runs too."""
        with self.lock:
            state = {k: v for k, v in self.outer.state_dict().items() if not _own_error(k)}
            return {"outer": to_torch_state(state), "round": dict(self.round)}

    def _receive(self, state: dict[str, Any]) -> None:
        with self.lock:
            self.received = state  # applied after the quorum, over whatever else it loaded

    def _apply_received(self) -> dict[str, Any] | None:
        """A healing replica: its source's state loaded, its parameters set to the synced ones (it
        has no local progress of its own: its pseudo-gradient is zero); the source's outer step."""
        with self.lock:
            state, self.received = self.received, None
        if state is None:
            return None
        self.outer.load_state_dict(from_torch_state(state["outer"]))
        for p, synced in zip(self.outer.params, self.outer.synced):
            p[...] = synced
        self.before = None
        self.heals += 1
        return state["round"]

    # -- joining ------------------------------------------------------------------------------------
    def join(self) -> None:
        """The first quorum of this replica: healed from a running one, it takes part in the outer
        step that one is in (with no pseudo-gradient of its own); at the job's start, every
        replica checks that it starts from the same parameters and commits this step (torchft's
        step 0, whose ``init_sync`` heals all from one). Tried again until a step commits."""
        while True:
            self.round = {"kind": "join"}
            started = time.perf_counter()
            self.manager.start_quorum()
            quorum_s = time.perf_counter() - started
            joined = self._apply_received()
            if joined is not None and joined["kind"] == "outer":
                self.joined = True
                self.last = {"quorum_s": quorum_s}
                self.outer.sync([int(f) for f in joined["fragments"]], [float(r) for r in joined["rates"]],
                                int(joined["lands_at"]))
                return
            with self.lock:
                self.open()
            table = self._handshake(_JOIN, False, parameters_digest(self.outer.synced))
            if table is not None and (table[:, 0] == _JOIN).all() and not table[:, 2].any():
                if (table[:, 3] != table[0, 3]).any():
                    raise CollectiveError(
                        "gradcomp.torch.DiLoCo: the replica groups start from different parameters "
                        f"(digests by quorum rank: {[int(d) for d in table[:, 3]]}); initialise them from the "
                        "same seed, or leave torchft's init_sync=True")
            elif table is not None:
                self.manager.report_error(RuntimeError("gradcomp.torch.DiLoCo: a replica in this quorum "
                                                       "is not joining, or refuses"))
            committed = self.manager.should_commit()
            self.last = {"quorum_s": quorum_s, "participants": self.comm.size, "committed": committed}
            if committed:
                return

    # -- an outer step (the Coordinator protocol of gradcomp.optim.diloco) --------------------------
    def begin(self, outer: Any, fragments: list[int], lands_at: int,
              rates: list[float]) -> tuple[list[int], int, list[float]] | None:
        self.round = {"kind": "outer", "fragments": [int(f) for f in fragments], "lands_at": int(lands_at),
                      "rates": [float(r) for r in rates]}
        theirs = None
        if self.joined:  # join()'s quorum, in which this replica healed (join() runs their step)
            self.joined, healed = False, True
            quorum_s = self.last.get("quorum_s", 0.0)
        else:
            started = time.perf_counter()
            self.manager.start_quorum()
            quorum_s = time.perf_counter() - started
            received = self._apply_received()
            healed = received is not None
            if received is not None and received["kind"] == "outer":
                # this replica fell behind (left out of an outer step, or it failed here alone):
                # it runs the outer step its peers are in, from their state
                self.round = dict(received)
                theirs = ([int(f) for f in received["fragments"]], int(received["lands_at"]),
                          [float(r) for r in received["rates"]])
        with self.lock:
            self.open()
            self.keep(self._outer_state(self.round["fragments"]), self._restore)
        self.problem = self.refusal()
        table = self._handshake(_OUTER, not healed, 0)
        if table is None:
            self.problem = self.problem or "the handshake before the exchange failed"
        elif (table[:, 0] != _OUTER).any():
            self.problem = f"quorum rank(s) {list(np.flatnonzero(table[:, 0] != _OUTER))} are joining, not in an outer step"
        elif table[:, 2].any():
            self.problem = f"quorum rank(s) {list(np.flatnonzero(table[:, 2]))} cannot take part ({self.problem or 'theirs'})"
        elif not table[:, 1].any():
            self.problem = "no replica in the quorum has a pseudo-gradient of its own (all are healing)"
        else:
            self.contributors = int(table[:, 1].sum())
            self.root = int(np.flatnonzero(table[:, 1])[0])
        if self.problem is not None:
            self.manager.report_error(RuntimeError(f"gradcomp.torch.DiLoCo: outer step discarded: {self.problem}"))
        self.last = {"quorum_s": quorum_s, "participants": self.comm.size,
                     "contributors": self.contributors if self.problem is None else 0, "healed": healed}
        return theirs

    def start(self, outer: Any, reducer: Any) -> list[Future] | None:
        if self.problem is not None or not self.usable or self.comm.broken is not None:
            return None
        try:
            return reducer.start()
        except Exception as exc:  # the pipeline broke under an earlier bucket
            self.manager.report_error(exc)
            self.problem = f"the exchange could not start ({exc!r})"
            return None

    def end(self, outer: Any, fragments: list[int], error: BaseException | None) -> float | None:
        if error is not None:
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(repr(error)))
        values = None
        if error is None and self.problem is None:
            try:  # the buffers (BatchNorm's statistics) of one replica, as gradcomp.torch.DiLoCo's
                values = [self.comm.broadcast(as_array(b), self.root) for b in self.buffers]
            except Exception as exc:
                self.manager.report_error(exc)
        self._drain()
        committed = self.manager.should_commit()
        self.last["committed"] = committed
        with self.lock:
            if self.settle():
                self.discarded += 1
                return None
        for b, value in zip(self.buffers, values or []):
            as_array(b)[...] = value
        size = self.comm.size
        return 1.0 if self.contributors == size else size / self.contributors

    # -- helpers ---------------------------------------------------------------------------------
    def _outer_state(self, fragments: list[int]) -> dict[str, Any]:
        """What an outer step changes before it lands: the outer step counter, the compressor
        state of the fragments it exchanges (the synced parameters and the momentum change only
        when it lands, after the commit)."""
        return {"outer_steps": self.outer.outer_steps,
                "exchange": {f: self.outer.reducers[f].compressor.state_dict() for f in fragments}}

    def _restore(self, saved: dict[str, Any]) -> None:
        self.outer.outer_steps = saved["outer_steps"]
        for f, state in saved["exchange"].items():
            reducer = self.outer.reducers[f]
            reducer.compressor.load_state_dict(state, reducer.shapes)

    def _handshake(self, kind: int, contributes: bool, digest: int) -> np.ndarray | None:
        """Every quorum rank's (kind, contributes, refuses, digest), or None where it failed (the
        failure reported): one small allgather, so that every replica knows before any exchange
        who refuses and how many pseudo-gradients the mean is over."""
        if not self.usable or self.comm.broken is not None:
            return None
        mine = np.array([kind, int(contributes), int(self.refusal() is not None), digest], np.int64)
        try:
            return self.comm.allgather(mine)
        except Exception as exc:
            self.manager.report_error(exc)
            return None

    def _drain(self, timeout: float = 60.0) -> None:
        """Wait until the pipeline has no job left (one submitted before a failure ended the
        exchange's start may still run its local stage), before any state is put back."""
        deadline = time.monotonic() + timeout
        while self.comm.busy and time.monotonic() < deadline:
            time.sleep(0.001)


def _own_error(key: str) -> bool:
    return any(part in key for part in _OWN_ERROR)


def _done(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(tensor)
    return future


# ``bucket`` and the result unannotated: DDP's register_comm_hook refuses any annotation but its own
# objects (see hook.py)
def gradcomp_ft_hook(exchange: _Exchange, bucket):
    """The DDP communication hook of ``DistributedDataParallel``."""
    return exchange.exchange(bucket)


class DistributedDataParallel(parallel.DistributedDataParallel):
    """``torchft.DistributedDataParallel`` with the gradients averaged by a gradcomp compressor over
    the manager's current quorum (the module docstring says what happens on failures and heals).

    Args:
        manager: the replica group's ``torchft.Manager``, made with ``use_async_quorum=False``
            (module docstring) and the ``DYNAMIC`` world size mode (its default). Its process
            group carries the compressor's collectives.
        module: the model, identical on every replica group (the manager heals a joining one).
        compressor: a gradcomp ``Compressor`` or a registry name (``"int8"``, ``"int4"``, ...).
        process_group: the torchft process group to use; default the manager's.
        **kwargs: passed to ``torch.nn.parallel.DistributedDataParallel`` (not
            ``process_group`` or ``find_unused_parameters``, which are set here).

    ``.compressor.stats()`` reports the traffic as usual (a discarded step's bytes included);
    ``.hook_state`` is the ``HookState`` (``state_dict()`` for checkpoints); ``.comm`` the
    ``QuorumCommunicator``. Registers the compressor's state with the manager under the key
    ``"gradcomp"`` (once per manager).

    Example::

        model = DistributedDataParallel(manager, net, "int8")
        optimizer = torchft.Optimizer(manager, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in batches:
            optimizer.zero_grad()              # starts the quorum (and heals, if needed)
            loss_fn(model(x), y).backward()    # the compressed exchange
            optimizer.step()                   # steps only if the manager commits
    """

    def __init__(self, manager: Manager, module: torch.nn.Module, compressor: Compressor | str,
                 *, process_group: Any = None, **kwargs: Any):
        from torchft.process_group import ProcessGroupDummy

        if isinstance(compressor, str):
            compressor = make(compressor)
        if not isinstance(compressor, Compressor):
            raise TypeError(f"gradcomp.torch.ft: expected a gradcomp Compressor or a registry name, "
                            f"got {type(compressor).__name__}")
        process_group = manager_group(manager, process_group)
        # DDP's own collectives (its initial broadcast, buffers) go to a group of one that does
        # nothing; the gradients go through the hook
        super().__init__(module, process_group=ProcessGroupDummy(0, 1), find_unused_parameters=True,
                         **kwargs)
        named = list(module.named_parameters())
        comm = QuorumCommunicator(manager, process_group)
        state = HookState(compressor, comm, {id(p): name for name, p in named},
                          {name: tuple(p.shape) if p.dim() else (1,) for name, p in named})
        self._exchange = _Exchange(manager, comm, state)
        manager.register_state_dict_fn(STATE_KEY, self._exchange.load_state_dict,
                                       self._exchange.state_dict)
        self.register_comm_hook(self._exchange, gradcomp_ft_hook)
        advice.watch(state, module.parameters())

    @property
    def compressor(self) -> Compressor:
        return self._exchange.state.compressor

    @property
    def hook_state(self) -> HookState:
        return self._exchange.state

    @property
    def comm(self) -> QuorumCommunicator:
        return self._exchange.comm

    @property
    def steps_rolled_back(self) -> int:
        """Discarded steps undone in the compressor's state, in this process."""
        return self._exchange.rolled_back


__all__ = ["DILOCO_STATE_KEY", "DistributedDataParallel", "OuterSteps", "QuorumCommunicator", "STATE_KEY",
           "gradcomp_ft_hook", "manager_group"]
