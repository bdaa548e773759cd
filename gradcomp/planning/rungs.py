"""The governor's rungs (``planning.governor``): the safer codes below a governed method, and each
tensor's place on them over the steps (its rung now, the one before until a decision applies,
when it tries the rung above), which a governor keeps per tensor key.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

import numpy as np

from ..compressors.contract import Compressor
from ..compressors.feedback import ErrorFeedback
from ..compressors.quantize import QuantizedAllreduce
from .cost import rank_bytes, traffic

#: steps a bucket that went over its budget stays a rung down before it tries the rung above
#: again (doubled at each failure of that try)
HOLD = 100
#: a decision applies this many steps after the step that took it (see the module; 1 where no
#: job of the next step is prepared before this one's ends: DiLoCo's outer steps)
DELAY = 2
#: the rungs: the method and the two of ``ladder()``, by name
RUNGS = ("method", "int4", "int8")
LEVELS = len(RUNGS)


def ladder() -> list[Compressor]:
    """The rungs below a governed method: 4-bit codes on a grid that holds zero, then 8-bit codes,
    two stages with error feedback at both (``int4``'s and ``int8``'s methods after a warm-up)."""
    return [ErrorFeedback(QuantizedAllreduce(bits=4, exact_zero=True), owner_feedback=True),
            ErrorFeedback(QuantizedAllreduce(bits=8), owner_feedback=True)]


def has_safer_rungs(method: Compressor) -> bool:
    """Whether ``method`` sends fewer bytes than the last rung (8-bit codes), as it declares: one
    that sends as many (``int8``, ``fp16``, the exact mean) has nowhere safer to step down to."""
    shapes, ranks = [(1024, 1024)], 4  # (a matrix: PowerSGD sends a vector exactly)
    try:
        mine = rank_bytes(traffic(method, shapes, ranks), ranks)
    except TypeError:  # (undeclared: a user's own method, left as given)
        return False
    return mine < rank_bytes(traffic(ladder()[-1], shapes, ranks), ranks)


@dataclass
class TensorRung:
    """One tensor's rung: ``level`` from step ``since`` on (``before`` until then); below the
    method, the rung above is tried again from step ``retry``."""
    level: int = 0
    since: int = 0
    before: int = 0
    retry: int = -1
    hold: int = HOLD
    last: int = -1  # the rung that last reduced it (for the hand-over; -1: none yet)
    steps: list[int] = field(default_factory=lambda: [0] * LEVELS)

    def at(self, step: int) -> int:
        if step < self.since:
            return self.before
        if self.level > 0 and 0 <= self.retry <= step:
            return self.level - 1
        return self.level

    def move(self, to: int, step: int, hold: int, delay: int = DELAY) -> None:
        """To rung ``to`` from step ``step + delay`` on, trying the rung above after ``hold``.
        Taken on the wire thread while the compute thread reads ``at`` for this step's next
        buckets: ``before``, then ``since``, are set first, so that a read between two of these
        assignments still gives the rung of now."""
        self.before = self.at(step)
        self.since = step + delay
        self.level, self.hold = to, hold
        self.retry = self.since + hold if to > 0 else -1

    def row(self) -> np.ndarray:
        return np.array([self.level, self.since, self.before, self.retry, self.hold, self.last, *self.steps],
                        np.int64)


class Rungs:
    """The tensors whose rungs a governor keeps (``ClaimCheck``: after a load, each must reach
    it at the next step; the rungs' own stores cannot tell, each seeing only its tensors)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = tensors

    def unclaimed(self) -> list[str]:
        return sorted(self.tensors)
