"""Composition by step: which compressor reduces the buckets of training step k.

    Schedule([(0, Allreduce()), (500, FP16(Allreduce())), (2000, PowerSGD(rank=2, start_iter=2))])

is exact averaging for steps 0-499, float16 for 500-1999, PowerSGD from 2000 on: the composition
of communication hooks asked for in the review of PyTorch PR #50973. A Schedule is a compressor,
so it nests inside wrappers (``FP16(Schedule(...))``), inside other schedules and inside the
PyTorch adapter.
"""
from __future__ import annotations

import bisect
from typing import Sequence

import numpy as np

from .arrays import cast
from .bucket import Bucket
from .compressors.base import Compressor


def take_residual(compressor: Compressor, bucket: Bucket):
    """The error-feedback residual ``compressor`` keeps for ``bucket`` (removed from it), looking
    through wrappers (``FP16(PowerSGD())``) via their ``inner``; None when it keeps none."""
    seen = compressor
    while seen is not None and not hasattr(seen, "take_residual"):
        seen = getattr(seen, "inner", None)
    return None if seen is None else seen.take_residual(bucket)


class Schedule(Compressor):
    """Pick the compressor by training step.

    ``stages``: ``(first_step, compressor)`` pairs; the first must start at step 0 and the steps
    must increase. Steps are counted by the Schedule itself, one per ``is_last`` bucket, so all
    buckets of one step go to the same stage.

    Each stage keeps its own state and counts only the steps it has seen: a ``PowerSGD(start_iter=2)``
    stage starting at step 1000 averages exactly for steps 1000 and 1001 and compresses from 1002
    on (its warm-up then doubles as the settling period PyTorch DDP needs after rebuilding buckets).

    Hand-over: when bucket index i is first reduced by a new stage, the residual the previous stage
    kept for it (PowerSGD's error feedback, found through FP16/BF16 wrappers and nested schedules)
    is taken out of that stage and added to the bucket's gradient, exactly as error feedback would
    have added it to the next step. Nothing is lost silently: the residual is sent with the next
    gradient. The residual is rounded to the bucket's dtype when they differ. Other memory (warm-start
    Q, step counters) stays with its stage; a stage used again later resumes from it. A compressor
    object listed in two adjacent stages is one stage as far as hand-over is concerned.
    """

    def __init__(self, stages: Sequence[tuple[int, Compressor]]):
        super().__init__()
        stages = list(stages)
        if not stages:
            raise ValueError("Schedule needs at least one (first_step, compressor) stage")
        for i, stage in enumerate(stages):
            if not (isinstance(stage, (tuple, list)) and len(stage) == 2):
                raise TypeError(f"Schedule stage {i} must be a (first_step, compressor) pair, got {stage!r}")
            step, comp = stage
            if not isinstance(comp, Compressor):
                raise TypeError(f"Schedule stage {i}: expected a gradcomp Compressor, got {type(comp).__name__}")
            if isinstance(step, bool) or int(step) != step:
                raise TypeError(f"Schedule stage {i}: first_step must be an integer, got {step!r}")
        starts = [int(s) for s, _ in stages]
        if starts[0] != 0:
            raise ValueError(f"Schedule's first stage must start at step 0 (got {starts[0]}): "
                             "something has to reduce the first steps")
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"Schedule stage steps must strictly increase, got {starts}")
        self.starts = starts
        self.compressors = [c for _, c in stages]
        self._step = 0
        self._last_stage: dict[int, int] = {}  # bucket index -> stage that reduced it last

    def __repr__(self):
        inner = ", ".join(f"({s}, {c!r})" for s, c in zip(self.starts, self.compressors))
        return f"Schedule([{inner}])"

    @property
    def step(self) -> int:
        return self._step

    def stage_at(self, step: int) -> int:
        """Index of the stage that reduces training step ``step``."""
        return bisect.bisect_right(self.starts, step) - 1

    def run(self, bucket: Bucket, comm):
        k = self.stage_at(self._step)
        stage = self.compressors[k]
        before = self._last_stage.get(bucket.index)
        if before is not None and self.compressors[before] is not stage:
            residual = take_residual(self.compressors[before], bucket)
            if residual is not None:
                bucket = bucket.with_buffer(bucket.buffer + cast(residual, bucket.dtype))
        self._last_stage[bucket.index] = k
        try:
            return stage.run(bucket, comm)
        finally:
            if bucket.is_last:
                self._step += 1

    def take_residual(self, bucket: Bucket):
        """What the stage that last reduced ``bucket`` kept for it (for a Schedule in a Schedule)."""
        k = self._last_stage.get(bucket.index)
        return None if k is None else take_residual(self.compressors[k], bucket)

    def stats(self) -> dict:
        s = super().stats()
        s["step"] = self._step
        s["stage"] = self.stage_at(self._step)
        return s

    def state_dict(self) -> dict:
        """Own step and hand-over bookkeeping plus every stage's state under ``stage{k}.``."""
        indices = sorted(self._last_stage)
        out = {"step": self._step,
               "last_stage_index": np.array(indices, dtype=np.int64),
               "last_stage_stage": np.array([self._last_stage[i] for i in indices], dtype=np.int64)}
        for k, comp in enumerate(self.compressors):
            for key, value in comp.state_dict().items():
                out[f"stage{k}.{key}"] = value
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        try:
            step = int(state.pop("step"))
            index = [int(i) for i in np.asarray(state.pop("last_stage_index"))]
            stage = [int(s) for s in np.asarray(state.pop("last_stage_stage"))]
        except KeyError as exc:
            raise ValueError(f"not a Schedule state: missing {exc}") from None
        per_stage: list[dict] = [{} for _ in self.compressors]
        for key, value in state.items():
            head, _, rest = key.partition(".")
            k = int(head[len("stage"):]) if head.startswith("stage") and head[5:].isdigit() else -1
            if not 0 <= k < len(self.compressors) or not rest:
                raise ValueError(f"unexpected Schedule state key {key!r} for {len(self.compressors)} stages")
            per_stage[k][rest] = value
        for comp, sub in zip(self.compressors, per_stage):
            comp.load_state_dict(sub)
        self._step = step
        self._last_stage = dict(zip(index, stage))
