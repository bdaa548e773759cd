"""Every rank's compressor state in one checkpoint, for frameworks that write it from one rank.

A compressor's state is not the same on every rank: error-feedback residuals (int8, topk, onebit,
PowerSGD's) hold what *this* rank's gradients lost to compression. PyTorch Lightning and
Accelerate call each stateful object's ``state_dict()`` on every rank but write only rank 0's
result, and every rank loads that one file. Handing them ``HookState`` itself would give every
rank rank 0's residuals after a resume: a silent error, paid back into the wrong gradients.

``gather_every_rank`` collects the ranks' ``HookState.state_dict()`` (a collective over the
default process group, which the frameworks have started) on the ranks that write; every rank
then loads its own entry with ``own_rank_state``, refused when the world size changed (residuals
of ranks that no longer exist cannot be shared out). ``EveryRankState`` wraps a ``HookState`` in
that form for ``accelerator.register_for_checkpointing``.
"""
from __future__ import annotations

from typing import Any

import torch.distributed as dist

from .hook import HookState

FORMAT = "gradcomp.torch/every-rank-1"


def gather_every_rank(state: HookState, everywhere: bool = False) -> dict[str, Any]:
    """``{"format", "world_size", "ranks": [rank 0's state_dict(), rank 1's, ...]}`` on rank 0
    (on every rank with ``everywhere``: for frameworks that write one file per node). Elsewhere
    ``"ranks"`` is None: that copy is never written. Call it on every rank, between steps."""
    mine = state.state_dict()
    if not dist.is_initialized():
        return {"format": FORMAT, "world_size": 1, "ranks": [mine]}
    size = dist.get_world_size()
    if everywhere:
        every: list[Any] = [None] * size
        dist.all_gather_object(every, mine)
        return {"format": FORMAT, "world_size": size, "ranks": every}
    held: list[Any] | None = [None] * size if dist.get_rank() == 0 else None
    dist.gather_object(mine, held, dst=0)
    return {"format": FORMAT, "world_size": size, "ranks": held}


def own_rank_state(saved: Any) -> dict[str, Any]:
    """This rank's entry of ``gather_every_rank``'s output, for ``HookState.load_state_dict``.
    Raises ValueError when ``saved`` is not that output or was saved by a job of another size."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError("gradcomp.torch: expected every rank's compressor state (the output of "
                         f"gradcomp.torch.ranks.gather_every_rank, format {FORMAT!r}), got "
                         f"{type(saved).__name__} {sorted(saved) if isinstance(saved, dict) else ''}")
    size = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    ranks = saved.get("ranks")
    if saved.get("world_size") != size:
        raise ValueError(f"gradcomp.torch: this checkpoint holds the compressor state of "
                         f"{saved.get('world_size')} ranks, but this job has {size}: error-feedback "
                         "residuals belong to the ranks that made them and cannot be shared out anew. "
                         "Resume with the same number of ranks, or start the compressor afresh "
                         "(see docs/guides/frameworks.md)")
    if not isinstance(ranks, list) or len(ranks) != size:
        raise ValueError("gradcomp.torch: this copy of the compressor state holds no rank's entries "
                         "(it was taken on a rank that does not write checkpoints)")
    return ranks[rank]


class EveryRankState:
    """``state_dict()``/``load_state_dict()`` over every rank's state of ``hook_state`` (see the
    module docstring): what ``accelerator.register_for_checkpointing`` needs. ``everywhere``:
    gather on every rank (Accelerate's ``save_on_each_node``), not on rank 0 only."""

    def __init__(self, hook_state: HookState, everywhere: bool = False):
        self.hook_state = hook_state
        self.everywhere = everywhere

    def __repr__(self) -> str:
        return f"EveryRankState({self.hook_state!r})"

    def state_dict(self) -> dict[str, Any]:
        return gather_every_rank(self.hook_state, self.everywhere)

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.hook_state.load_state_dict(own_rank_state(saved))
