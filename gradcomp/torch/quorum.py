"""One step on torchft, as gradcomp's torchft modules run it: the communicator over the manager's
current quorum (``QuorumCommunicator``: a failure is reported to the manager, which then does not
commit the step, instead of ending the job), the manager settings refused (``manager_group``),
and the state a step that is not committed puts back (``StepQuorum``). Shared by the DDP drop-in
(``ft.py``) and DiLoCo's outer steps (``ft_diloco.py``); why each piece is so: ``ft.py``'s
docstring."""
from __future__ import annotations

import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.distributed.distributed_c10d import (AllgatherOptions, AllreduceOptions, AllToAllOptions,
                                                BroadcastOptions, ReduceOp)

from .. import timeline
from ..comm.protocol import default_depth
from ..state import OWN_ERROR, own_error
from .communicator import TorchCommunicator

if TYPE_CHECKING:

    from torchft import Manager


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
    #: replica groups join and leave with each quorum: no fixed hosts (``auto`` takes each
    #: replica group for a host of its own)
    topology = None

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


class StepQuorum:
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
        if timeline.enabled:
            timeline.instant("quorum", "decision", step=self.manager.current_step(), usable=self.usable,
                             rank=self.comm.rank if self.usable else -1, size=self.comm.size if self.usable else 0,
                             error=None if self.quorum_error is None else repr(self.quorum_error))

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
            timeline.instant("step discarded", "decision", step=self.before[0], rolled_back=self.rolled_back)
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


__all__ = ["OWN_ERROR", "QuorumCommunicator", "StepQuorum", "manager_group", "own_error"]
