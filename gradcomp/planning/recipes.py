"""Recipes: what a registered name means. A codec alone is not a method that trains.

A recipe is a ``Schedule`` with a name and a few declared parameters: an exact warm-up (the first
steps are plain allreduce, while gradients are large and change fast), the error-feedback form
that the measurements support, and, for top-k, a sparsity ramp (a quarter of the values, then a
sixteenth, ... down to ``ratio``, as Deep Gradient Compression warms up). Because it is a
``Schedule``, its stages and step counter are part of what ranks agree on before every bucket,
residuals are handed over from stage to stage, and ``state_dict`` checkpoints all of it.

``describe()`` is the recipe's name and parameters (``onebit(warmup=100, feedback='worker')``), so
DDP's log, checkpoints and error messages say what the user typed. Every parameter can be set in
the name (``gradcomp.make("topk:ratio=0.001,warmup=300")``); the codec-only behaviour of earlier
releases is ``warmup=0`` with the old feedback (``onebit:warmup=0,feedback='both'``).

Why each default: BENCHMARKS.md, section 6 (three seeds of a transformer LM under AdamW and the
digits MLP and CNN under momentum SGD, every choice measured). Methods that need the optimizer's
state (1-bit Adam, DGC) are in ``gradcomp.optim``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np

from ..arrays import Array, sum_of_squares
from ..bucket import Bucket
from ..comm import Communicator, Workspace
from ..compressors.allreduce import Allreduce
from ..compressors.quantize import QuantizedAllreduce
from ..compressors.contract import Compressor
from ..compressors.codec import Codec
from ..compressors.feedback import ErrorFeedback
from ..params import check_choice, check_float, check_int
from ..state import check_array, take_int
from ..schedule import Schedule
from ..settling import Settling, take_settling, with_settling

#: the error-feedback forms of a two-stage or sparse codec: the workers' residual and the slice
#: owners', the workers' only, or none
FEEDBACK = ("both", "worker", "none")

#: the sparsity ramp's kept fractions before ``ratio`` (each a quarter of the one before)
RAMP = (0.25, 0.0625, 0.015625, 0.00390625)


class Recipe(Schedule):
    """A named ``Schedule`` whose configuration is its name and parameters (see the module).

    ``settling``: the first stage is a warm-up whose end ``Settling`` decides (``warmup="auto"``).
    The later stages are laid out as if it lasted ``settling.latest`` steps, and move earlier, all
    together, when it ends. Its levels are each tensor's mean square in the warm-up's output, the
    averaged gradient, so every rank decides the same step."""

    def __init__(self, name: str, params: dict[str, Any], stages: Sequence[tuple[int, Compressor]],
                 settling: Settling | None = None):
        super().__init__(stages)
        self.name = name
        self.params = dict(params)
        self.settling = settling
        # the warm-up's levels of the step in progress, by tensor, and that step
        self._levels: dict[str, tuple[float, int]] = {}
        self._levels_step = -1

    @property
    def error_feedback_on(self) -> bool:
        """The method's own (its last stage's): an 8-bit warm-up's feedback is the warm-up's."""
        return self.compressors[-1].error_feedback_on if self.settling is not None else super().error_feedback_on

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Any:
        if self._levels and self._steps.peek(bucket) > self._levels_step:
            self._observe()  # a step whose last bucket went to another method (the governor's rungs)
        return super().prepare(bucket, comm, workspace)

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Any) -> Array:
        out = super().finish(bucket, comm, prepared)
        if self.settling is not None and self.settling.warm and prepared.stage == 0:
            # the step first: ``prepare`` of this step's next bucket, on the compute thread while
            # this runs on the wire thread, must not take these levels for a step that has ended
            self._levels_step = prepared.step
            for key, off, shape in bucket.placements():
                part = out[off:off + math.prod(shape)]
                self._levels[key] = (sum_of_squares(part) / max(part.size, 1), part.size)
            if bucket.is_last:
                self._observe()
        return out

    def _observe(self) -> None:
        """The warm-up's levels of a whole step to ``settling``, by tensor (whichever tensors this
        method reduced in it); at the warm-up's end, the later stages start at the next step."""
        assert self.settling is not None
        keys = sorted(self._levels)
        if self.settling.observe({k: self._levels[k][0] for k in keys}, {k: self._levels[k][1] for k in keys}):
            self.start_later_stages(self.settling.end)
            warm = self.compressors[0]
            for codes in warm.compressors if isinstance(warm, Schedule) else [warm]:
                if isinstance(codes, ErrorFeedback):
                    codes.drop_owner_residuals()  # the warm-up does not come back
        self._levels.clear()

    def config(self) -> dict[str, Any]:
        return {"recipe": self.name, **self.params, "stages": super().config()["stages"]}

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.params.items())
        return f"{self.name}({fields})"

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        """As ``Schedule``'s; a state with another number of stages was saved by another definition
        of the name (``int8`` gained its exact warm-up: an ``int8`` checkpoint saved before loads
        into ``int8:warmup=0``), and the error says so."""
        state = dict(state)
        self._check_warmup_codes(state)
        settling = take_settling(state, self.settling)
        levels = {k[len(PENDING):]: check_array(state.pop(k), k, "recipe", (2,), ("float64",))
                  for k in [k for k in state if k.startswith(PENDING)]}
        levels_step = take_int(state, "pending_step", "recipe", minimum=-1) if "pending_step" in state else -1
        numbers = [k.partition("/")[0][len("stage"):] for k in state if k.startswith("stage") and "/" in k]
        saved = max((int(n) + 1 for n in numbers if n.isdigit()), default=0)  # the last stateful stage
        try:
            super().load_state_dict(state, shapes)
        except ValueError as exc:
            if saved and saved != len(self.compressors):
                raise ValueError(
                    f"{self.describe()} runs {len(self.compressors)} stage(s), but this state comes from "
                    f"{saved}: another definition of {self.name!r} saved it (registered names change "
                    f"their recipes between releases, and the earlier ones stay reachable by parameter: "
                    f"'{self.name}:warmup=0' where an exact warm-up was added since). Build the "
                    f"compressor the checkpoint was saved with ({exc})") from exc
            raise
        if settling is not None:
            self.settling = settling
            self.start_later_stages(settling.end)
        self._levels = {k: (float(v[0]), int(v[1])) for k, v in levels.items()}
        self._levels_step = levels_step

    def _check_warmup_codes(self, state: Mapping[str, Any]) -> None:
        """An auto warm-up's state from the other codes (8-bit throughout, or stepping down to
        4-bit: a nested ``Schedule``, which saves its ``step``) is refused, naming the build that
        loads it."""
        if self.settling is None or not any(k.startswith("stage0/") for k in state):
            return
        stepping, saved_stepping = isinstance(self.compressors[0], Schedule), "stage0/step" in state
        if stepping != saved_stepping:
            codes = {True: "8-bit then 4-bit codes", False: "8-bit codes throughout"}
            raise ValueError(f"{self.describe()} warms up on {codes[stepping]}, but this state was saved by a "
                             f"warm-up on {codes[saved_stepping]}. Build "
                             f"'{self.name}:warmup_bits={4 if saved_stepping else 8}' to resume it")

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["recipe"] = self.describe()
        s["warmup_steps_left"] = max(self.starts[-1] - self.step, 0)
        if self.settling is not None:
            s.update(self.settling.stats())
        return s

    def state_dict(self) -> dict[str, Any]:
        """``Schedule``'s, the settling's, and the levels of a step seen without its last bucket."""
        out = with_settling(super().state_dict(), self.settling)
        if self._levels:
            out["pending_step"] = self._levels_step
            out.update({PENDING + k: np.array(v, np.float64) for k, v in sorted(self._levels.items())})
        return out


#: the keys of the pending levels in a recipe's checkpoint
PENDING = "pending/"


def with_feedback(codec: Codec, feedback: str) -> Compressor:
    """``codec`` with the error-feedback form ``feedback`` (one of ``FEEDBACK``)."""
    check_choice("feedback", feedback, FEEDBACK)
    if feedback == "none":
        return codec
    return ErrorFeedback(codec, owner_feedback=feedback == "both")


#: the bits of the auto warm-up's codes after its first ``Settling.earliest`` steps, in which they
#: are always 8 (the gradients shrink fastest there). 4 (``warmup_bits=4``) halves the warm-up's
#: bytes, but the noisier codes moved the warm-up's end, and the LM under AdamW trained worse on
#: average (docs/convergence.md, short runs). 8 it stays.
WARMUP_BITS = 8


def warmed(name: str, params: dict[str, Any], warmup: int | str, stages: Sequence[tuple[int, Compressor]],
           warmup_bits: int = WARMUP_BITS) -> Recipe:
    """A recipe: a warm-up, then ``stages`` (their steps counted from the end of the warm-up).
    ``warmup``: a number of exact allreduce steps, or ``"auto"``: two-stage codes with error
    feedback at both stages until the gradients' scale settles (``Settling``), 8-bit for the
    first ``Settling.earliest`` steps and ``warmup_bits``-bit after (a quarter and an eighth of
    fp32's bytes, which a short run cannot spend on exact steps). ``warmup_bits`` other than
    the default is shown in the recipe's parameters."""
    if isinstance(warmup, str) and warmup != "auto":
        raise ValueError(f"{name} warmup: a number of exact steps or 'auto', got {warmup!r}")
    if check_warmup_bits(name, warmup, warmup_bits) != WARMUP_BITS:
        params = {**params, "warmup_bits": warmup_bits}
    if warmup == "auto":
        settling = Settling()
        shifted = [(settling.latest + s, c) for s, c in stages]
        return Recipe(name, params, [(0, warmup_codes(settling, warmup_bits))] + shifted, settling)
    warmup = check_int(f"{name} warmup", warmup, 0)
    shifted = [(warmup + s, c) for s, c in stages]
    return Recipe(name, params, ([(0, Allreduce())] if warmup else []) + shifted)


def check_warmup_bits(name: str, warmup: int | str, bits: int) -> int:
    """``bits`` checked: 4 or 8, and other than the default only with ``warmup="auto"`` (a fixed
    warm-up is exact, it has no codes)."""
    bits = check_choice(f"{name} warmup_bits", bits, (4, 8))
    if bits != WARMUP_BITS and warmup != "auto":
        raise ValueError(f"{name}: warmup_bits={bits} is the bits of the auto warm-up's codes; "
                         f"a warm-up of {warmup!r} steps is exact")
    return bits


def warmup_codes(settling: Settling, bits: int) -> Compressor:
    """The auto warm-up's exchange: 8-bit two-stage codes, stepping down to ``bits`` (4: on a grid
    that holds zero, as ``int4``) after ``settling.earliest`` steps; residuals are handed over."""
    eight = ErrorFeedback(QuantizedAllreduce(bits=8), owner_feedback=True)
    if bits == 8:
        return eight
    four = ErrorFeedback(QuantizedAllreduce(bits=4, exact_zero=True), owner_feedback=True)
    return Schedule([(0, eight), (settling.earliest, four)])


def sparsity_ramp(ratio: float, steps: int) -> list[tuple[int, float]]:
    """``(first step, kept fraction)``: the ``RAMP`` fractions above ``ratio`` share ``steps``
    equally, then ``ratio``; no ramp when ``steps`` is 0."""
    fractions = [f for f in RAMP if f > ratio]
    if not steps or not fractions:
        return [(0, ratio)]
    stages: list[tuple[int, float]] = []
    for i, f in enumerate(fractions):
        start = steps * i // len(fractions)
        if not stages or start > stages[-1][0]:
            stages.append((start, f))
    return stages + ([(steps, ratio)] if steps > stages[-1][0] else [])


def codec_recipe(name: str, codec_factory: Any, warmup: int | str, feedback: str, shown: bool = True,
                 extra: dict[str, Any] | None = None, warmup_bits: int = WARMUP_BITS, **codec_args: Any) -> Recipe:
    """Warm-up, then one codec with ``feedback``; ``shown``: the codec's arguments are parameters
    of the recipe (False where the name fixes them: ``int8`` is 8 bits); ``extra``: parameters
    shown as well (those a user set away from their default)."""
    codec = codec_factory(**codec_args)
    params = {"warmup": warmup, "feedback": feedback, **(codec_args if shown else {}), **(extra or {})}
    return warmed(name, params, warmup, [(0, with_feedback(codec, feedback))], warmup_bits)


def sparse_recipe(name: str, codec_factory: Any, ratio: float, warmup: int | str, ramp: int, feedback: str,
                  extra: dict[str, Any] | None = None, warmup_bits: int = WARMUP_BITS, **codec_args: Any) -> Recipe:
    """Warm-up, then the sparsity ramp down to ``ratio`` over ``ramp`` steps, ``feedback`` throughout;
    ``extra``: parameters of the recipe that chose ``codec_factory`` (shown, not passed to it)."""
    ratio = check_float(f"{name} ratio", ratio, above=0, maximum=1)
    ramp = check_int(f"{name} ramp", ramp, 0)
    stages = [(s, with_feedback(codec_factory(ratio=f, **codec_args), feedback))
              for s, f in sparsity_ramp(ratio, ramp)]
    return warmed(name, {"ratio": ratio, "warmup": warmup, "ramp": ramp, "feedback": feedback,
                         **codec_args, **(extra or {})}, warmup, stages, warmup_bits)
