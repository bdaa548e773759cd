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
compressor over the manager's current quorum. With ``quorum.py`` and ``ft_diloco.py`` it is all
of gradcomp that imports torchft (docs/guides/fault-tolerance.md). What it does beyond the plain DDP hook (``hook.py``,
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

DiLoCo on torchft (``gradcomp.torch.DiLoCo(..., manager=)``) is ``ft_diloco.py``; the
communicator over the quorum and the roll-back both share are ``quorum.py``. The process group is the manager's (``process_group=`` to name it explicitly). Tested with torchft
0.2.0 on ``ProcessGroupGloo``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.nn import parallel

from ..compressors import Compressor
from ..registry import make
from ..state import own_error
from . import advice
from .hook import HookState, gradcomp_hook
from .quorum import QuorumCommunicator, StepQuorum, manager_group
from .tensors import as_array

if TYPE_CHECKING:
    from concurrent.futures import Future

    from torchft import Manager


#: the key of gradcomp's part of the manager's state dict (what a healing replica receives)
STATE_KEY = "gradcomp"


class _Exchange(StepQuorum):
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
            state["state"] = {k: v for k, v in state["state"].items() if not own_error(k)}
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


__all__ = ["DistributedDataParallel", "QuorumCommunicator", "STATE_KEY", "gradcomp_ft_hook", "manager_group"]
