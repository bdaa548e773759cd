"""Sparsifiers: top-k (allgathered) and random-k (coordinates shared by every rank, allreduced).

Both send about ``ratio`` of each bucket (1% by default) and are meant to run with error
feedback (the registered ``topk`` and ``randomk``; ``-noef`` without): what is not sent this step
is added to the next step's gradient, as in Stich et al. 2018 and GRACE's and DeepSpeed's
sparsifiers. Without it, random-k loses ``1 - ratio`` of every step.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from ..arrays import Array, DTypeLike, add_into, array_module, zero_non_finite
from ..bucket import Bucket, digest
from ..comm import Communicator, Workspace
from ..params import check_float, check_int
from ..state import reject_leftovers, take_int
from .codec import Codec


_SAMPLE = 1 << 16  # values in top-k's threshold sample
_SAMPLED_FROM = 1 << 18  # buckets of at least this many values are sampled


def _k(n: int, ratio: float) -> int:
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


class TopK(Codec):
    """Each rank sends its ``ratio`` largest-magnitude values with their positions (int32); every
    rank adds everyone's in rank order. Bytes per rank: ``(N-1) * 8k``, i.e. ``2 * ratio * (N-1)``
    of the float32 bucket. A NaN or Inf is always among the largest, so it reaches the output at
    its own position."""

    collective = "allgather"
    nan_effect = "element"
    relative_error_limit = 0.95  # without error feedback: the top 1% of a heavy-tailed signal

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        self.ratio = check_float("ratio", ratio, above=0, maximum=1)

    def compute_dtype(self, dtype: DTypeLike) -> np.dtype:
        return np.dtype(np.float32)

    def message_size(self, n: int) -> int:
        return 8 * _k(n, self.ratio)

    def _views(self, message: Array, n: int) -> tuple[Array, Array]:
        k = _k(n, self.ratio)
        return message[:4 * k].view(np.int32), message[4 * k:8 * k].view(np.float32)

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        n = x.shape[0]
        index, values = self._views(message, n)
        if n:
            index[...] = self._top(x, index.shape[0], workspace)
            values[...] = x[index]

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """``x + residual``'s top k sent, and ``residual`` left holding ``x + residual`` but zero
        where it was sent: what decoding this message misses, without decoding it."""
        if residual.dtype != np.float32 or x.dtype != np.float32:
            return False
        add_into(residual, x)
        self.encode(residual, message, workspace)
        index, _ = self._views(message, x.shape[0])
        residual[index] = 0
        zero_non_finite(residual)
        return True

    def _top(self, x: Array, k: int, workspace: Workspace) -> Array:
        """The positions of ``x``'s ``k`` largest magnitudes, ascending (NaN counts as largest).

        Instead of a full ``argpartition``, a strided sample of 1 in ``n / 65536`` estimates the magnitude that about ``1.5 k`` values reach, one pass collects
        the values at or above it (NaN included: ``not < t``), and ``argpartition`` runs on those
        only. Every value at or above the estimate is a candidate, so when at least ``k`` are, the
        candidates' top k are the bucket's top k; when fewer are (a sample that missed a heavy
        tail), or more than an eighth of the bucket (ties at the estimate: mostly zeros, NaN),
        the full ``argpartition`` decides (BENCHMARKS.md, section 5, has the speed)."""
        n = x.shape[0]
        xp = array_module(x)
        magnitude = workspace.array(self, "magnitude", n, np.float32, like=x)
        xp.abs(x, out=magnitude)
        candidates = None
        if n >= _SAMPLED_FROM and 16 * k <= n:
            sample = magnitude[::n // _SAMPLE]
            q = sample.shape[0] - 1 - int(1.5 * k * sample.shape[0] / n)
            threshold = xp.partition(sample, q)[q]
            keep = workspace.array(self, "keep", n, np.bool_, like=x)
            xp.less(magnitude, threshold, out=keep)
            xp.logical_not(keep, out=keep)
            if k <= int(xp.count_nonzero(keep)) <= n // 8:  # else a missed tail, or ties at the estimate
                candidates = xp.flatnonzero(keep)
        if candidates is None:
            top = xp.argpartition(magnitude, n - k)[n - k:]  # NaN sorts last: always selected
        else:
            m = candidates.shape[0]
            top = candidates[xp.argpartition(magnitude[candidates], m - k)[m - k:]]
        top.sort()
        return top

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        index, values = self._views(message, out.shape[0])
        if not add:
            out[...] = 0
        out[index] += values


class RandomK(Codec):
    """Every rank sends the values at the same ``ratio`` of coordinates, drawn afresh each step
    from a generator seeded by (``seed``, step, bucket layout), so no indices travel and the values
    are summed by allreduce. Bytes per rank: ``2(N-1)/N * ratio`` of the bucket. A NaN or Inf
    anywhere in a rank's bucket makes the whole bucket NaN on every rank (one flag travels with
    the values), so a loss scaler notices even when the coordinate was not drawn."""

    collective = "allreduce"
    message_dtype = None
    nan_effect = "bucket"
    relative_error_limit = 1.0  # without error feedback it drops 1 - ratio of every step

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        super().__init__()
        self.ratio = check_float("ratio", ratio, above=0, maximum=1)
        self.seed = check_int("seed", seed, 0)
        self._step = 0

    def start(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> int:
        step = self._step
        if bucket.is_last:
            self._step += 1
        n = bucket.numel
        k = _k(n, self.ratio)
        layout = digest(bucket.layout_text())
        rng = np.random.default_rng([self.seed, step, layout & 0xFFFFFFFF, layout >> 32])
        chosen = np.sort(rng.choice(n, size=k, replace=False, shuffle=False)) if k else np.zeros(0, np.int64)
        index = workspace.array(self, "index", k, np.int64, like=bucket.buffer)
        index[...] = array_module(index).asarray(chosen)
        return step

    def message_size(self, n: int) -> int:
        return _k(n, self.ratio) + 1

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        k = message.shape[0] - 1
        index = workspace.array(self, "index", k, np.int64, like=x)
        message[:k] = x[index]
        with np.errstate(all="ignore"):
            message[k] = 0 if bool(array_module(x).isfinite(x.sum())) else np.nan

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """As ``TopK``'s: ``residual`` becomes ``x + residual``, zero where sent, all zero when the
        bucket was not finite (what decoding a NaN-flagged message and settling would leave)."""
        if residual.dtype != x.dtype:
            return False
        add_into(residual, x)
        self.encode(residual, message, workspace)
        k = message.shape[0] - 1
        if bool(array_module(message).isfinite(message[k])):  # then the whole residual is finite
            residual[workspace.array(self, "index", k, np.int64, like=x)] = 0
        else:
            residual[...] = 0
        return True

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        k = message.shape[0] - 1
        index = workspace.array(self, "index", k, np.int64, like=out)
        if not add:
            out[...] = 0
        out[index] += message[:k]
        if not bool(array_module(message).isfinite(message[k])):
            out[...] = np.nan

    def agreement_state(self, bucket: Bucket, prepared: Any) -> dict[str, Any]:
        return {"step": prepared.decision if prepared is not None else self._step}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._step}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        state = dict(state)
        step = take_int(state, "step", "RandomK")
        reject_leftovers(state, "RandomK")
        self._step = step
