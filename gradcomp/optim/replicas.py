"""DiLoCo's replicas: the parameters split into streaming fragments, the check that every
rank starts from the same bits (the outer step applies one averaged update to synced parameters
that must be the same everywhere), and the protocol of a coordinator of replicas that come and go."""
from __future__ import annotations

import hashlib
import itertools
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import numpy as np

from ..arrays import Array, to_host
from ..comm import CollectiveError, Communicator

if TYPE_CHECKING:
    from ..reducer import GradientReducer


def split(params: Sequence[Array], fragments: int) -> list[list[int]]:
    """Parameter positions in ``fragments`` consecutive groups of about equal size, none empty."""
    sizes = [int(p.size) for p in params]
    total, n = sum(sizes), len(sizes)
    cuts = [0]
    seen = 0
    for f in range(1, fragments):
        j = cuts[-1] + 1  # at least one parameter in the group before
        seen = sum(sizes[:j])
        while j < n - (fragments - f) and seen + sizes[j] / 2 <= total * f / fragments:
            seen += sizes[j]
            j += 1
        cuts.append(j)
    cuts.append(n)
    return [list(range(a, b)) for a, b in itertools.pairwise(cuts)]


def parameters_digest(params: Sequence[Array]) -> int:
    """64 bits of a SHA-256 over the parameters' bytes: equal where the bits are."""
    h = hashlib.sha256()
    for p in params:
        h.update(np.ascontiguousarray(to_host(p)).reshape(-1).view(np.uint8).data)
    return int(np.frombuffer(h.digest()[:8], np.int64)[0])


def check_same_start(comm: Communicator, params: Sequence[Array]) -> None:
    """``CollectiveError`` on every rank unless every rank starts from the same parameter bits:
    the outer step applies one averaged update to synced parameters that must be the same."""
    mine = np.array([parameters_digest(params)], np.int64)
    table = comm.allgather(mine)
    if (table != table[0]).any():
        groups = sorted({int(v) for v in table[:, 0]})
        who = "; ".join(f"rank {r}: digest {groups.index(int(table[r, 0]))}" for r in range(comm.size))
        raise CollectiveError(f"DiLoCo: the parameters differ across ranks at construction ({who}); "
                              "initialise them from the same seed on every rank (or broadcast rank 0's; "
                              "gradcomp.torch.DiLoCo does)")


class Coordinator(Protocol):
    """Who takes part in each outer step, and whether it counts (``gradcomp.optim.diloco``'s
    "Coordinated"; ``gradcomp.torch.ft`` has the torchft one). Called on the training thread."""

    def begin(self, outer: Any, fragments: list[int], lands_at: int,
              rates: list[float]) -> tuple[list[int], int, list[float]] | None:
        """Before the outer step of ``fragments`` takes its pseudo-gradients (landing after inner
        step ``lands_at``, at outer rates ``rates``). May load the state of a rank that fell
        behind into ``outer``: it then returns the outer step its peers are in, to run instead."""

    def start(self, outer: Any, reducer: GradientReducer) -> list[Future] | None:
        """One fragment's exchange: ``reducer.start()``, or None where no collective may run."""

    def end(self, outer: Any, fragments: list[int], error: BaseException | None) -> float | None:
        """After the exchange (``error``: why it failed here, or None): the factor to scale the
        mean by, or None to discard the outer step."""
