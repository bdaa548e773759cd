"""The governor's audit (``planning.governor``): which coordinates of a bucket also travel exactly,
when a bucket is audited, the sums of an audit window, and the cost they add up to.

The cost is judged per tensor: each audited tensor's ``|D|^2 / E`` (``D``: the compressed mean
minus the exact mean, summed over the window; ``E``: the exact mean's variance there), and the
window's is its worst tensor's."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..bucket import Bucket
from ..exact import fsum, sums

#: the fewest coordinates of each tensor audited (all of a smaller one): the cost is judged per
#: tensor, and a small tensor (a norm's gain, a bias) is where one scale per bucket errs most
PER_TENSOR = 8
#: a tensor whose exact mean's noise per coordinate is under this share of its bucket's is not
#: judged (its gradient is next to nothing: a bias that a norm right after it cancels)
QUIET = 1e-3


def tensor_costs(d: np.ndarray, e: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Each audited tensor's cost from a window's sums: ``|d|^2 / e``, what compression added
    against the exact mean's noise there (``starts``: where each tensor's coordinates start in
    ``d``, plus the end). A tensor whose noise per coordinate is under ``QUIET`` of the bucket's
    has no say (0): a gradient that is nothing (a bias under a norm) moves nothing, whatever the
    codes do to it. Every rank computes it alone from agreed sums, so its sums are exactly
    rounded (``gradcomp.exact``): the same bits, and the same rungs, on any CPU."""
    d2 = sums(d * d, starts) if d.size else np.zeros_like(e)
    counts = np.diff(starts)
    typical = fsum(e.tolist()) / max(int(counts.sum()), 1)
    heard = e > QUIET * typical * counts
    with np.errstate(divide="ignore", invalid="ignore"):
        each = np.where(heard, d2 / np.where(heard, e, 1.0), np.where((d2 == 0) | (typical > 0), 0.0, np.inf))
    return each


def window_cost(each: np.ndarray) -> tuple[float, int]:
    """A window's cost from its tensors' (``tensor_costs``): the worst one's, and which it is (-1:
    none audited). On the zoo's tuning half the worst tensor kept the methods within their
    quality where the whole bucket's ratio, or the tensors' mean, did not."""
    if not each.size:
        return 0.0, -1
    worst = int(np.argmax(each))
    return float(each[worst]), worst


@dataclass
class Sample:
    """A bucket's audited coordinates: ``where`` (ascending), and where each audited tensor's
    share of them starts (``starts``, plus the end)."""
    where: np.ndarray
    starts: np.ndarray
    tensors: np.ndarray  # the index in the bucket of each audited tensor

    @classmethod
    def of(cls, bucket: Bucket, count: int) -> Sample:
        """About ``count`` coordinates of ``bucket``, evenly spaced within each tensor, at least
        ``PER_TENSOR`` of each (all of a smaller one): the same on every rank (a function of the
        layout alone)."""
        n = bucket.numel
        parts, starts, tensors = [], [0], []
        offsets = bucket.offsets()
        for i, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            size = hi - lo
            if not size:
                continue
            take = min(size, max(PER_TENSOR, count * size // n))
            parts.append(lo + (np.arange(take, dtype=np.int64) * size + size // 2) // take)
            starts.append(starts[-1] + take)
            tensors.append(i)
        return cls(np.concatenate(parts) if parts else np.zeros(0, np.int64), np.array(starts, np.int64),
                   np.array(tensors, np.int64))


@dataclass
class Window:
    """One bucket's audit sums so far: ``d`` (compressed minus exact mean, on the sample) and
    ``e`` (the exact mean's variance, per audited tensor), over ``steps`` steps."""
    keys: tuple[str, ...]
    d: np.ndarray
    e: np.ndarray
    steps: int = 0


@dataclass
class Plan:
    """When a bucket is audited: the next window opens at step ``opens``; ``seen`` steps of the
    open one are audited so far (0: none open); ``regime`` is a digest of what reduced it last
    (-1: nothing yet). A new regime (a warm-up's end, another rung) opens a window at once."""
    opens: int
    seen: int = 0
    regime: int = -1

    def row(self) -> np.ndarray:
        return np.array([self.opens, self.seen, self.regime], np.int64)
