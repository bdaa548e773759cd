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
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from . import timeline
from .params import check_float, check_int
from .state import check_array, reject_leftovers, take_int

#: what ``warmup="auto"`` means where a method does not say otherwise
#: (patience 2 held the warm-up to step 220-300 of 400 on the noisy digits MLP, whose window means
#: rarely agree within 10% twice, and cost the run half its saving; patience 1 ended it at about
#: 100 there, a little later on the language model, and both trained as well as exact averaging)
WINDOW, TOLERANCE, PATIENCE, EARLIEST, LATEST = 10, 0.1, 1, 30, 300


class Settling:
    """Decides, from per-tensor levels seen each step, the step at which a warm-up ends.

    Levels are keyed by tensor (a mapping, or a sequence: keyed by position), and the tensors
    seen may change from step to step (the governor moves tensors between rungs on their own,
    DDP rebuilds its buckets): a window's mean of a tensor is over the steps it was seen in, and
    the drift is taken over the tensors seen in both windows, in the order first seen."""

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
        self._sum: dict[str, float] = {}     # this window's, per tensor
        self._seen: dict[str, int] = {}      # this window's steps per tensor
        self._before: dict[str, float] = {}  # the last window's means
        self._sizes: dict[str, int] = {}
        self._unkeyed: dict[str, np.ndarray] | None = None  # a checkpoint's from before the keys

    @property
    def warm(self) -> bool:
        """Whether the warm-up is still on (for the step about to be taken)."""
        return self.ended_at is None

    @property
    def end(self) -> int:
        """The first step after the warm-up: decided, or ``latest`` while it is not."""
        return self.latest if self.ended_at is None else self.ended_at

    def observe(self, levels: Mapping[str, float] | Sequence[float], sizes: Mapping[str, int] | Sequence[int]) -> bool:
        """One step's levels and the tensors' sizes (one each per tensor seen this step); True
        when this step was the warm-up's last."""
        if self.ended_at is not None:
            return False
        levels_, sizes_ = _keyed(levels), _keyed(sizes)
        if levels_.keys() != sizes_.keys():
            raise ValueError(f"Settling: levels for {sorted(levels_)[:4]}..., sizes for {sorted(sizes_)[:4]}...")
        if self._unkeyed is not None:
            self._adopt(list(levels_))
        for key, level in levels_.items():
            self._sum[key] = self._sum.get(key, 0.0) + float(level)
            self._seen[key] = self._seen.get(key, 0) + 1
            self._sizes[key] = int(sizes_[key])
        self._steps += 1
        if self._steps % self.window == 0:
            mean = {k: v / self._seen[k] for k, v in self._sum.items()}
            shared = [k for k in mean if k in self._before]
            if shared:
                self.drift = drift(np.array([mean[k] for k in shared]), np.array([self._before[k] for k in shared]),
                                   np.array([self._sizes[k] for k in shared], np.float64))
                self._calm = self._calm + 1 if self.drift < self.tolerance else 0
                if self._steps >= self.earliest and self._calm >= self.patience:
                    return self._end(f"the gradients' scale settled: it moved {self.drift:.1%} over the "
                                     f"last {self.window} steps, under {self.tolerance:.0%} for "
                                     f"{self._calm * self.window} steps")
            self._before = mean
            self._sum, self._seen = {}, {}
        if self._steps >= self.latest:
            moved = "" if self.drift is None else f" (it last moved {self.drift:.1%} in {self.window} steps)"
            return self._end(f"reached latest={self.latest} before the gradients' scale settled{moved}")
        return False

    def _adopt(self, keys: list[str]) -> None:
        """A checkpoint from before levels were keyed held one value per tensor in the order the
        owner passed them: keyed now by the first step's tensors, in that order, when there are as
        many; otherwise the window restarts (said in a warning)."""
        arrays, self._unkeyed = self._unkeyed or {}, None
        if any(a.size != len(keys) for a in arrays.values()):
            warnings.warn(f"Settling: the loaded warm-up window holds {next(iter(arrays.values())).size} tensors' "
                          f"levels without their names, and {len(keys)} tensors reach it now: its window "
                          "starts again", RuntimeWarning, stacklevel=3)
            return
        seen = self._steps % self.window
        if "sum" in arrays and seen:
            self._sum = dict(zip(keys, map(float, arrays["sum"])))
            self._seen = dict.fromkeys(keys, seen)
        if "before" in arrays:
            self._before = dict(zip(keys, map(float, arrays["before"])))
        if "sizes" in arrays:
            self._sizes = dict(zip(keys, map(int, arrays["sizes"])))

    def _end(self, reason: str) -> bool:
        self.ended_at = self._steps
        self.reason = reason
        timeline.instant("warm-up end", "decision", step=self._steps, reason=reason, drift=self.drift)
        self._sum, self._seen, self._before, self._sizes = {}, {}, {}, {}
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
        if self._unkeyed is not None:  # (loaded, not yet adopted: saved as it came)
            out.update({name: a.copy() for name, a in self._unkeyed.items()})
        elif self._sizes:
            keys = list(self._sizes)
            out["keys"] = np.array("\n".join(keys))
            out["sizes"] = np.array([self._sizes[k] for k in keys], np.int64)
            out["sum"] = np.array([self._sum.get(k, 0.0) for k in keys], np.float64)
            out["seen"] = np.array([self._seen.get(k, 0) for k in keys], np.int64)
            out["before"] = np.array([self._before.get(k, math.nan) for k in keys], np.float64)
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
        keys = str(np.asarray(state.pop("keys"))).split("\n") if "keys" in state else None
        arrays = {}
        for name, dtypes in (("sum", ("float64",)), ("before", ("float64",)), ("sizes", ("float64", "int64")),
                             ("seen", ("int64",))):
            if name in state:
                arrays[name] = check_array(state.pop(name), name, owner, None, dtypes)
        drift_ = state.pop("drift", None)
        reject_leftovers(state, owner)
        lengths = {name: a.shape for name, a in arrays.items()}
        if len(set(lengths.values())) > 1 or any(len(shape) != 1 for shape in lengths.values()):
            raise ValueError(f"{owner} state: sum, before, sizes and seen must be 1-D, one value per tensor; "
                             f"got shapes {lengths}")
        if keys is not None and (set(arrays) != {"sum", "before", "sizes", "seen"} or
                                 arrays["sizes"].size != len(keys) or len(set(keys)) != len(keys)):
            raise ValueError(f"{owner} state: 'keys' names {len(keys)} tensors; sum, before, sizes and seen "
                             f"must each hold one value per tensor (got {lengths})")
        if keys is None and "seen" in arrays:
            raise ValueError(f"{owner} state: 'seen' without the 'keys' it counts for")
        if ended < 0 and keys is None and ("sum" in arrays) != ("sizes" in arrays):
            raise ValueError(f"{owner} state: a warm-up in progress needs both 'sum' and 'sizes'")
        if ended >= 0 and ended > steps:
            raise ValueError(f"{owner} state: ended_at={ended} is after the {steps} steps seen")
        self._steps = steps
        self._calm = calm
        self.ended_at = None if ended < 0 else ended
        self.reason = reason
        self._sum, self._seen, self._before, self._sizes, self._unkeyed = {}, {}, {}, {}, None
        if keys is not None:
            for i, key in enumerate(keys):
                self._sizes[key] = int(arrays["sizes"][i])
                if arrays["seen"][i] > 0:
                    self._sum[key], self._seen[key] = float(arrays["sum"][i]), int(arrays["seen"][i])
                if not math.isnan(arrays["before"][i]):
                    self._before[key] = float(arrays["before"][i])
        elif arrays:
            self._unkeyed = {name: np.asarray(a).copy() for name, a in arrays.items()}
        self.drift = None if drift_ is None else float(np.asarray(drift_))


def _keyed(values: Mapping[str, Any] | Sequence[Any]) -> dict[str, Any]:
    """``values`` by tensor key: a mapping as it is, a sequence by position."""
    if isinstance(values, Mapping):
        return {str(k): v for k, v in values.items()}
    return {str(i): v for i, v in enumerate(values)}


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
    both (a tensor with no gradient yet has no scale to settle); 0 when there is none. Every rank
    takes it alone from agreed levels, so its log and sums are ``gradcomp.exact``'s: the same
    bits on any CPU (NumPy's log is the CPU's: another SIMD form, other last bits)."""
    from .exact import fsum, log

    live = (now > 0) & (before > 0) & np.isfinite(now) & np.isfinite(before)
    if not live.any():
        return 0.0 if not (~np.isfinite(now)).any() else math.inf
    w = sizes[live].tolist()
    moved = [n * abs(log(a / b)) for n, a, b in zip(w, now[live].tolist(), before[live].tolist())]
    return fsum(moved) / fsum(w)
