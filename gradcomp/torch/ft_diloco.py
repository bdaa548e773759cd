"""**DiLoCo on torchft** (``gradcomp.torch.DiLoCo(model, inner, ..., manager=manager)``, coordinated
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
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..comm import CollectiveError
from ..optim.replicas import parameters_digest
from ..state import own_error
from .checkpoint import from_torch_state, to_torch_state
from .quorum import QuorumCommunicator, StepQuorum, manager_group
from .tensors import as_array

if TYPE_CHECKING:
    from concurrent.futures import Future

    from torchft import Manager

#: the key of DiLoCo's part of the manager's state dict (the outer state and the outer step in
#: progress)
DILOCO_STATE_KEY = "gradcomp.diloco"
#: what each replica says before an outer step's exchange (``OuterSteps._handshake``): the kind of
#: step it is in, whether it has a pseudo-gradient of its own, whether it refuses, a digest
_JOIN, _OUTER = 1, 2


class OuterSteps(StepQuorum):
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
            state = {k: v for k, v in self.outer.state_dict().items() if not own_error(k)}
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


__all__ = ["DILOCO_STATE_KEY", "OuterSteps"]
