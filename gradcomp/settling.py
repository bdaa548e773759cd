"""When to start compressing: a warm-up that ends when the gradients' scale has settled.

A fixed warm-up (``warmup=100``) asks the user to guess a fraction of a run whose length the library
never sees: too short and the compressed phase starts while the gradients still shrink fast (a
frozen Adam variance then keeps the early, large scale; error feedback carries stale large
residuals), too long and a short run spends its bytes on exact steps. ``Settling`` watches what
the method itself depends on and ends the warm-up when it stops moving, in the spirit of
Accordion (Agarwal et al., MLSys 2021: the gradient norm's rate of change marks the critical
regimes) and 0/1 Adam (Lu et al., 2022: the variance freezes when it is stable).

The caller gives one *level* per tensor each step, the mean square of each tensor's averaged
gradient (``OneBitAdam`` in its warm-up, the registry recipes in theirs). Levels
are averaged over windows of ``window`` steps; at the end of each window its *drift* from the
window before is ``sum_i n_i |log(a_i / b_i)| / sum_i n_i``, the typical factor by which a
coordinate's scale moved (``n_i``: the tensor's size). The warm-up ends at the first window end at
or after ``earliest`` steps that closes ``patience`` windows in a row with a drift below
``tolerance``, and at ``latest`` steps in any case.

The levels come from averaged quantities, the same bits on every rank, so every rank decides the
same step without a message; the owner puts the decision into the state its ranks agree on before
every bucket (a disagreement is a ``CollectiveError``), into its checkpoint (``state_dict``), and
into ``stats()`` (when, and why).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from .params import check_float, check_int
from .state import check_array, reject_leftovers, take_int

#: what ``warmup="auto"`` means where a method does not say otherwise
#: (patience 2 held the warm-up to step 220-300 of 400 on the noisy digits MLP, whose window means
#: rarely agree within 10% twice, and cost the run half its saving; patience 1 ended it at about
#: 100 there, a little later on the language model, and both trained as well as exact averaging)
WINDOW, TOLERANCE, PATIENCE, EARLIEST, LATEST = 10, 0.1, 1, 30, 300


class Settling:
    """Decides, from per-tensor levels seen each step, the step at which a warm-up ends."""

    def __init__(self, window: int = WINDOW, tolerance: float = TOLERANCE, earliest: int = EARLIEST,
                 latest: int = LATEST, patience: int = PATIENCE):
        self.window = check_int("settling window", window, 1)
        self.tolerance = check_float("settling tolerance", tolerance, above=0)
        self.patience = check_int("settling patience", patience, 1)
        self._calm = 0  # windows in a row under the tolerance
        self.earliest = check_int("settling earliest", earliest, 1)
        self.latest = check_int("settling latest", latest, self.earliest)
        self.ended_at: int | None = None  # the first step after the warm-up
        self.reason = ""
        self.drift: float | None = None  # the last window's
        self._steps = 0
        self._sum: np.ndarray | None = None
        self._before: np.ndarray | None = None
        self._sizes: np.ndarray | None = None

    @property
    def warm(self) -> bool:
        """Whether the warm-up is still on (for the step about to be taken)."""
        return self.ended_at is None

    @property
    def end(self) -> int:
        """The first step after the warm-up: decided, or ``latest`` while it is not."""
        return self.latest if self.ended_at is None else self.ended_at

    def observe(self, levels: Sequence[float], sizes: Sequence[int]) -> bool:
        """One step's levels (one per tensor) and the tensors' sizes; True when this step was the
        warm-up's last."""
        if self.ended_at is not None:
            return False
        levels_ = np.asarray(levels, dtype=np.float64)
        if self._sum is None:
            self._sum = np.zeros_like(levels_)
            self._sizes = np.asarray(sizes, dtype=np.float64)
        if levels_.shape != self._sum.shape:
            raise ValueError(f"Settling: got {levels_.size} levels, {self._sum.size} before")
        self._sum += levels_
        self._steps += 1
        if self._steps % self.window == 0:
            mean = self._sum / self.window
            if self._before is not None and self._sizes is not None:
                self.drift = drift(mean, self._before, self._sizes)
                self._calm = self._calm + 1 if self.drift < self.tolerance else 0
                if self._steps >= self.earliest and self._calm >= self.patience:
                    return self._end(f"the gradients' scale settled: it moved {self.drift:.1%} over the "
                                     f"last {self.window} steps, under {self.tolerance:.0%} for "
                                     f"{self._calm * self.window} steps")
            self._before = mean
            self._sum[...] = 0
        if self._steps >= self.latest:
            moved = "" if self.drift is None else f" (it last moved {self.drift:.1%} in {self.window} steps)"
            return self._end(f"reached latest={self.latest} before the gradients' scale settled{moved}")
        return False

    def _end(self, reason: str) -> bool:
        self.ended_at = self._steps
        self.reason = reason
        self._sum = self._before = self._sizes = None
        return True

    def stats(self) -> dict[str, Any]:
        return {"warmup": "auto", "warmup_ended_at": self.ended_at, "warmup_reason": self.reason or
                f"warming up: the gradients' scale moved {'?' if self.drift is None else f'{self.drift:.1%}'} "
                f"over the last {self.window} steps (ends below {self.tolerance:.0%}, at {self.earliest} "
                f"steps at the earliest and {self.latest} at the latest)"}

    # -- checkpoints ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": self._steps, "ended_at": -1 if self.ended_at is None else self.ended_at,
                               "calm": self._calm, "reason": np.array(self.reason)}
        for name in ("sum", "before", "sizes"):
            value = getattr(self, f"_{name}")
            if value is not None:
                out[name] = value.copy()
        if self.drift is not None:
            out["drift"] = np.float64(self.drift)
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        owner = "Settling"
        steps = take_int(state, "steps", owner)
        ended = take_int(state, "ended_at", owner, minimum=-1)
        calm = take_int(state, "calm", owner)
        reason = str(np.asarray(state.pop("reason", "")))
        arrays = {}
        for name in ("sum", "before", "sizes"):
            if name in state:
                arrays[name] = check_array(state.pop(name), name, owner, None, ("float64",))
        drift_ = state.pop("drift", None)
        reject_leftovers(state, owner)
        lengths = {name: a.shape for name, a in arrays.items()}
        if len(set(lengths.values())) > 1 or any(len(shape) != 1 for shape in lengths.values()):
            raise ValueError(f"{owner} state: sum, before and sizes must be 1-D, one value per tensor; "
                             f"got shapes {lengths}")
        if ended < 0 and ("sum" in arrays) != ("sizes" in arrays):
            raise ValueError(f"{owner} state: a warm-up in progress needs both 'sum' and 'sizes'")
        if ended >= 0 and ended > steps:
            raise ValueError(f"{owner} state: ended_at={ended} is after the {steps} steps seen")
        self._steps = steps
        self._calm = calm
        self.ended_at = None if ended < 0 else ended
        self.reason = reason
        self._sum, self._before, self._sizes = (arrays.get("sum"), arrays.get("before"), arrays.get("sizes"))
        self.drift = None if drift_ is None else float(np.asarray(drift_))


PREFIX = "settling/"  # its keys in an owner's checkpoint


def with_settling(out: dict[str, Any], settling: Settling | None) -> dict[str, Any]:
    """An owner's ``state_dict`` with ``settling``'s state added under ``PREFIX``."""
    if settling is not None:
        out.update({PREFIX + k: v for k, v in settling.state_dict().items()})
    return out


def take_settling(state: dict[str, Any], settling: Settling | None) -> Settling | None:
    """Pop ``PREFIX`` keys from an owner's ``state`` into a new ``Settling`` configured as
    ``settling`` (checked, ``ValueError`` when damaged); None where the owner has none."""
    if settling is None:
        return None
    loaded = Settling(settling.window, settling.tolerance, settling.earliest, settling.latest, settling.patience)
    loaded.load_state_dict({k[len(PREFIX):]: state.pop(k) for k in list(state) if k.startswith(PREFIX)})
    return loaded


def drift(now: np.ndarray, before: np.ndarray, sizes: np.ndarray) -> float:
    """``sum_i n_i |log(now_i / before_i)| / sum_i n_i`` over tensors whose levels are positive in
    both (a tensor with no gradient yet has no scale to settle); 0 when there is none."""
    live = (now > 0) & (before > 0) & np.isfinite(now) & np.isfinite(before)
    if not live.any():
        return 0.0 if not (~np.isfinite(now)).any() else math.inf
    w = sizes[live]
    return float((w * np.abs(np.log(now[live] / before[live]))).sum() / w.sum())
