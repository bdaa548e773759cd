"""Composition by step: which compressor reduces the buckets of training step k.

    Schedule([(0, Allreduce()), (500, FP16(Allreduce())), (2000, PowerSGD(rank=2, start_iter=2))])

is exact averaging for steps 0-499, float16 for 500-1999, PowerSGD from 2000 on: the composition
of communication hooks asked for in the review of PyTorch PR #50973. A Schedule is a compressor,
so it nests inside wrappers (``FP16(Schedule(...))``), inside other schedules and inside the
PyTorch adapter.

``Stages`` is what it shares with the governor's rungs (``planning.governor``): a wrapper that sends
each bucket to one of several methods, hands residuals over when a tensor's method changes
(``hand_over``, which ``auto`` uses too) and checkpoints every method's state under a prefix.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from . import timeline
from .arrays import Array, DTypeLike, cast
from .bucket import Bucket, StepCount
from .comm import Communicator, Workspace
from .compressors.contract import Compressor, run_stage
from .compressors.wrapper import Wrapper
from .state import reject_leftovers, take_int


def with_residuals(owner: Compressor, bucket: Bucket, residuals: dict[str, Array], workspace: Workspace) -> Bucket:
    """The bucket's gradient plus handed-over residuals (in place if the bucket is scratch, else
    in a copy of ``owner``'s, which the next method may not return)."""
    g = bucket.buffer
    if not bucket.scratch:
        copy = workspace.array(owner, "handover", bucket.numel, g.dtype, like=g)
        copy[...] = g
        bucket = bucket.with_buffer(copy, scratch=False)
        g = copy
    for key, off, shape in bucket.placements():
        if key in residuals:
            part = g[off:off + residuals[key].size]
            part += cast(residuals[key].reshape(-1), g.dtype)
    return bucket


def hand_over(owner: Compressor, stages: Sequence[Compressor], previous: Sequence[int], k: int,
              bucket: Bucket, workspace: Workspace) -> Bucket:
    """``bucket`` as stage ``k`` of ``stages`` takes it: with the residuals that the stage which last
    reduced each of its tensors (``previous``, one stage index per key, -1 for none yet) kept for
    it, taken out of that stage (``with_residuals``). A compressor object listed as two stages is
    one stage for the hand-over. What ``Schedule``, the governor's rungs and ``auto`` do when a
    tensor's method changes."""
    handed: dict[str, Array] = {}
    for key, before in zip(bucket.keys, previous):
        if before >= 0 and stages[before] is not stages[k]:
            handed.update(stages[before].take_residual([key]))
    return with_residuals(owner, bucket, handed, workspace) if handed else bucket


def from_last(stages: Sequence[Compressor], last: Mapping[str, int], keys: Iterable[str],
              take: bool) -> dict[str, Array]:
    """The residuals that the stage which last reduced each of ``keys`` (``last``: key -> stage
    index, -1 or missing for none yet) keeps for it, taken out of it where ``take`` (a hand-over)
    or as live views: what ``Stages`` and ``auto`` answer for their methods."""
    out: dict[str, Array] = {}
    for key in keys:
        k = last.get(key, -1)
        if k >= 0:
            stage = stages[k]
            out.update(stage.take_residual([key]) if take else stage.residuals([key]))
    return out


def stage_states(stages: Sequence[Compressor], prefix: str) -> dict[str, Any]:
    """Every stage's ``state_dict()`` under ``{prefix}{k}/``: what ``Schedule`` and the governor's
    rungs save for their stages."""
    return {f"{prefix}{k}/{key}": value for k, comp in enumerate(stages) for key, value in comp.state_dict().items()}


def take_stage_states(stages: Sequence[Compressor], state: dict[str, Any], prefix: str) -> list[dict[str, Any]]:
    """Pop each stage's part of ``state`` (saved by ``stage_states``); other keys stay, for the
    caller's own checks and ``reject_leftovers``."""
    parts: list[dict[str, Any]] = [{} for _ in stages]
    for key in list(state):
        head, sep, rest = key.partition("/")
        number = head[len(prefix):]
        if sep and head.startswith(prefix) and number.isdigit() and int(number) < len(stages):
            parts[int(number)][rest] = state.pop(key)
    return parts


def load_stage_states(stages: Sequence[Compressor], parts: Sequence[Mapping[str, Any]],
                      shapes: Mapping[str, tuple] | None) -> None:
    """Load each stage's part (``take_stage_states``); when one stage refuses its part, the stages
    loaded before it are put back as they were (each checks before it assigns) and the
    ValueError goes on."""
    saved = [comp.state_dict() for comp in stages]
    try:
        for comp, sub in zip(stages, parts):
            comp.load_state_dict(sub, shapes)
    except ValueError:
        for comp, old in zip(stages, saved):
            comp.load_state_dict(old, shapes)
        raise


@dataclass
class Routed:
    """A bucket's local stage in ``Stages``: the stage that reduces it, the bucket (with residuals
    handed over) and that stage's own local-stage result."""
    stage: int
    bucket: Bucket
    inner: Any


@dataclass
class _Stage(Routed):
    step: int


class Stages(Wrapper):
    """A wrapper that reduces each bucket through one of several methods (``stages``): a
    ``Schedule``'s stages by step, the governor's rungs by measured cost. ``inner``, whose
    declarations it takes where it says nothing else (traffic and passes over memory), is the
    method it settles on. Its local stage is a ``Routed``; subclasses say which stage last reduced
    each tensor (``last_stages``) and hand residuals over when that changes (``hand_over``).
    """

    #: the stages' NaN effects may differ: not declared
    nan_effect: str | None = None

    @property
    def stages(self) -> Sequence[Compressor]:
        raise NotImplementedError

    def last_stages(self) -> Mapping[str, int]:
        """The stage (an index of ``stages``) that last reduced each tensor, by key."""
        raise NotImplementedError

    @property
    def relative_error_limit(self) -> float:  # type: ignore[override]
        """The loosest of the stages' (the kit may check any of them)."""
        return max(c.relative_error_limit for c in self.stages)

    @property
    def scatters(self) -> bool:  # type: ignore[override]
        return all(c.scatters for c in self.stages)

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray | None:
        """None: a hand-over adds another stage's residual to a step."""
        return None

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Any) -> Array:
        return run_stage(self.stages[prepared.stage], prepared.bucket, comm, prepared.inner)

    def stage_agreement(self, prepared: Routed, prefix: str) -> dict[str, Any]:
        """The agreement state of the stage that reduces ``prepared``'s bucket, its keys prefixed."""
        inner = self.stages[prepared.stage].agreement_state(prepared.bucket, prepared.inner)
        return {f"{prefix}.{k}": v for k, v in inner.items()}

    def regime(self, prepared: Routed | None) -> tuple:
        if prepared is None:
            return ()
        return (prepared.stage,) + self.stages[prepared.stage].regime(prepared.inner)

    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        """What the stages that last reduced ``keys`` kept for them (a hand-over to an outer one)."""
        return from_last(self.stages, self.last_stages(), keys, take=True)

    def residuals(self, keys: Iterable[str]) -> dict[str, Array]:
        """The residuals of the stages that last reduced ``keys``."""
        return from_last(self.stages, self.last_stages(), keys, take=False)


class Schedule(Stages):
    """Pick the compressor by training step.

    ``stages``: ``(first_step, compressor)`` pairs; the first must start at step 0 and the steps
    must increase. Steps are counted by the Schedule itself (``StepCount``: one per ``is_last``
    bucket, or per router step where it is a method behind the governor's rungs), so all buckets
    of one step go to the same stage.

    Each stage keeps its own state and counts only the steps it has seen: a ``PowerSGD(start_iter=2)``
    stage starting at step 1000 averages exactly for steps 1000 and 1001 and compresses from 1002
    on (its warm-up then doubles as the settling period PyTorch DDP needs after rebuilding buckets).

    Hand-over: when a tensor is first reduced by a new stage, the error-feedback residual the
    previous stage kept for it (``Compressor.take_residual``: PowerSGD's and ``ErrorFeedback``'s,
    through wrappers and nested schedules) is taken out of that stage and added to the tensor's
    gradient, exactly as error feedback would have added it to the next step: nothing is lost
    silently. The residual is rounded to the bucket's dtype when they differ. Other memory
    (warm-start factors, step counters) stays with its stage; a stage used again later resumes
    from it. A compressor object listed in two adjacent stages is one stage for the hand-over.
    """

    def __init__(self, stages: Sequence[tuple[int, Compressor]]):
        stages = list(stages)
        if not stages:
            raise ValueError("Schedule needs at least one (first_step, compressor) stage")
        for i, stage in enumerate(stages):
            if not (isinstance(stage, (tuple, list)) and len(stage) == 2):
                raise TypeError(f"Schedule stage {i} must be a (first_step, compressor) pair, got {stage!r}")
            step, comp = stage
            if not isinstance(comp, Compressor):
                raise TypeError(f"Schedule stage {i}: expected a gradcomp Compressor, got {type(comp).__name__}")
            if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
                raise TypeError(f"Schedule stage {i}: first_step must be an integer, got {step!r}")
        starts = [int(s) for s, _ in stages]
        if starts[0] != 0:
            raise ValueError(f"Schedule's first stage must start at step 0 (got {starts[0]}): "
                             "something has to reduce the first steps")
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"Schedule stage steps must strictly increase, got {starts}")
        super().__init__(stages[-1][1])  # the steady state: its traffic, its passes over memory
        self.starts = starts
        self._planned = list(starts)  # as constructed: what start_later_stages moves from
        self.compressors = [c for _, c in stages]
        self._steps = StepCount()
        self._last_stage: dict[str, int] = {}  # tensor key -> stage that reduced it last

    def config(self) -> dict[str, Any]:
        return {"stages": [(s, c) for s, c in zip(self.starts, self.compressors)]}

    @property
    def stages(self) -> list[Compressor]:
        return self.compressors

    def last_stages(self) -> dict[str, int]:
        return self._last_stage

    def describe(self) -> str:
        inner = ", ".join(f"({s}, {c.describe()})" for s, c in zip(self.starts, self.compressors))
        return f"Schedule([{inner}])"

    @property
    def step(self) -> int:
        return self._steps.count

    @property
    def error_feedback_on(self) -> bool:
        return any(c.error_feedback_on for c in self.compressors)

    @property
    def warmup_steps(self) -> int:
        return self.starts[-1] + self.compressors[-1].warmup_steps

    def start_later_stages(self, step: int) -> None:
        """Move every stage after the first so that the second starts at ``step``, keeping the
        constructed gaps between them: the end of a warm-up decided while training
        (``gradcomp.settling``). Counted from the stages as constructed, so a resume can move
        them again to the same place."""
        step = int(step)
        if step < 1 or len(self._planned) < 2:
            raise ValueError(f"Schedule: cannot start stage 1 at step {step} ({len(self._planned)} stage(s))")
        self.starts = [0] + [step + s - self._planned[1] for s in self._planned[1:]]

    def stage_at(self, step: int) -> int:
        """Index of the stage that reduces training step ``step``."""
        return bisect.bisect_right(self.starts, step) - 1

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> _Stage:
        step = self._steps.take(bucket)
        k = self.stage_at(step)
        if timeline.enabled and k != self.__dict__.get("_traced_stage", 0):  # (a warm-up's end among them)
            self.__dict__["_traced_stage"] = k
            timeline.instant("stage change", "decision", step=step, stage=k, to=self.compressors[k].describe())
        bucket = hand_over(self, self.compressors, [self._last_stage.get(key, -1) for key in bucket.keys], k,
                           bucket, workspace)
        if bucket.step is not None:  # routed to it: its stages too may see only some of a step
            bucket = bucket.routed(step)
        self._last_stage.update(dict.fromkeys(bucket.keys, k))
        return _Stage(k, bucket, self.compressors[k].prepare(bucket, comm, workspace), step)

    def agreement_state(self, bucket: Bucket, prepared: _Stage | None) -> dict[str, Any]:
        if prepared is None:
            return {"step": self.step}
        return {"step": prepared.step, "stage": prepared.stage,
                **self.stage_agreement(prepared, f"stage{prepared.stage}")}

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["step"] = self.step
        s["stage"] = self.stage_at(self.step)
        return s

    def state_dict(self) -> dict[str, Any]:
        """Own step and hand-over bookkeeping plus every stage's state under ``stage{k}/``."""
        out: dict[str, Any] = {"step": self.step}
        for key, k in sorted(self._last_stage.items()):
            out[f"last_stage/{key}"] = k
        return {**out, **stage_states(self.compressors, "stage")}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        state = dict(state)
        owner = "Schedule"
        step = take_int(state, "step", owner)
        last: dict[str, int] = {}
        for name in [k for k in state if k.startswith("last_stage/")]:
            k = take_int(state, name, owner)
            if k >= len(self.compressors):
                raise ValueError(f"{owner} state: {name!r} names stage {k}, but there are "
                                 f"{len(self.compressors)}")
            last[name[len("last_stage/"):]] = k
        parts = take_stage_states(self.compressors, state, "stage")
        reject_leftovers(state, owner)
        load_stage_states(self.compressors, parts, shapes)
        self._steps = StepCount(step)
        self._last_stage = last
