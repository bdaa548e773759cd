"""The divergence guard: error-feedback residuals that run away, seen before the loss says so.

Error feedback keeps what a code missed and adds it to the next gradient. When the method and the
optimizer disagree (sign codes under momentum SGD at a high learning rate, random-k's 100-step
delays), the residual grows step after step until it dominates the update and training diverges,
silently: nothing in the averages says why. The guard watches, per tensor, the residual's norm
against the gradient's, every ``every`` steps (two passes over the checked buckets: a small cost,
one step in ``every``). A tensor runs away when its residual is more than ``ratio`` times its
gradient *and* more than ``growth`` times the smallest it has been at any check (a tensor whose
gradient is exactly zero, such as FSDP's padding of a shard, is not judged: a code over chunks
leaves residuals there that say nothing about training): a residual that
is large only because the gradients have become small late in training is normal for sparse
codes, one that keeps growing is not (measured on the digits MLP: a diverging 1-bit run crosses
both bounds tens of steps before its loss turns, healthy top-k and 1-bit runs stay under them).

Each stage of a ``Schedule`` is judged on its own (``Compressor.regime``): a warm-up on 8-bit
codes, or the first levels of a sparsity ramp, leave residuals far smaller than the method's own,
and measured against them every healthy top-k and DGC run looked like a runaway (on the digits
MLP and the LM, right after the warm-up or the ramp). When the regime changes, the smallest
residual seen so far for each tensor it reduces is forgotten.

The first runaway is announced on every rank at the same bucket: each rank's flag travels in the
agreement that precedes every bucket (``agreement.agree``, no extra collective), and each rank
warns once (``RuntimeWarning``) with the method's name and the advice. Nothing is changed: the
guard reports, the user decides. ``stats()["guard"]`` holds what it saw.
"""
from __future__ import annotations

import math
import warnings
from typing import Any, Mapping

from .. import timeline
from ..arrays import Array, array_module, to_host
from ..bucket import Bucket

ADVICE = ("lower the learning rate, lengthen the exact warm-up (warmup=...), or use an optimizer "
          "that compresses its own state (gradcomp.optim.OneBitAdam for Adam, gradcomp.optim.DGC for "
          "momentum SGD)")


class RunawayResidual(RuntimeWarning):
    """An error-feedback residual is growing without bound (see ``gradcomp.compressors.guard``)."""


class Guard:
    """Per-tensor residual and gradient norms, checked every ``every`` steps (see the module)."""

    def __init__(self, every: int = 10, ratio: float = 10.0, growth: float = 10.0):
        self.every = every
        self.ratio = ratio
        self.growth = growth
        self.checks = 0
        self.flag = 0          # this rank saw a runaway, not yet announced
        self.warned = False
        self.runaway: dict[str, float] = {}  # tensor key -> residual / gradient when it ran away
        self.worst: tuple[str, float] = ("", 0.0)
        self._smallest: dict[str, tuple[Any, float]] = {}  # tensor key -> (regime, smallest residual)

    def due(self, step: int) -> bool:
        return step % self.every == self.every - 1

    def gradient_norms(self, bucket: Bucket) -> list[float]:
        """Each tensor's gradient norm (before the reduction writes the mean over it)."""
        return [_norm(v) for v in bucket.views()]

    def measure(self, bucket: Bucket, residuals: Mapping[str, Array], gradients: list[float],
                regime: Any = ()) -> None:
        """Compare each tensor's residual with its gradient; set ``flag`` on a runaway. ``regime``:
        what reduced the bucket (``Compressor.regime``); growth is judged within one regime."""
        self.checks += 1
        for key, g in zip(bucket.keys, gradients):
            r = residuals.get(key)
            if r is None:
                continue
            if g == 0:
                continue  # no gradient to compare with: FSDP's padding, a tensor that got none
            norm = _norm(r)
            ratio = norm / g
            if not math.isfinite(norm) and not math.isfinite(g):
                continue  # a non-finite step: the compressor resets that residual itself
            seen = self._smallest.get(key)
            smallest = seen[1] if seen is not None and seen[0] == regime else None  # another regime's: forgotten
            grew = smallest is not None and norm > self.growth * smallest
            if math.isfinite(norm) and (smallest is None or norm < smallest):
                self._smallest[key] = (regime, norm)
            if ratio > self.worst[1]:
                self.worst = (key, ratio)
            if ratio > self.ratio and grew and key not in self.runaway:
                self.runaway[key] = ratio
                self.flag = 1

    def announce(self, flags: Any, method: str, advice: str = ADVICE) -> None:
        """Warn once when any rank's flag is set (``flags``: every rank's, from the agreement),
        with ``advice``: the compressor's ``runaway_advice``."""
        if self.warned or not any(int(f) for f in flags):
            return
        self.warned = True
        ranks = [r for r, f in enumerate(flags) if int(f)]
        timeline.instant("runaway residual", "decision", method=method, ranks=ranks,
                         here={k: round(v, 3) for k, v in list(self.runaway.items())[:8]})
        mine = ", ".join(f"{k} ({v:.0f}x its gradient)" for k, v in list(self.runaway.items())[:3])
        warnings.warn_explicit(
            f"gradcomp: {method}: the error-feedback residual is running away on rank(s) {ranks}"
            + (f" (here: {mine})" if mine else "")
            + "; training may diverge. The averages are unchanged; to keep training: "
            + advice + ".", RunawayResidual, "gradcomp", 0)

    def stats(self) -> dict[str, Any]:
        return {"checks": self.checks, "warned": self.warned, "runaway": dict(self.runaway),
                "worst_tensor": self.worst[0], "worst_ratio": self.worst[1]}


def _norm(a: Array) -> float:
    xp = array_module(a)
    flat = a.reshape(-1)
    if flat.dtype.itemsize < 4:
        flat = flat.astype(xp.float32)
    with_host = to_host(xp.linalg.norm(flat))
    return float(with_host)
