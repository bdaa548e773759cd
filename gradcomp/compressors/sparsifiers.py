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
from ..bucket import Bucket, StepCount, digest
from ..comm import Communicator, Workspace
from ..kernels import selection
from ..kernels.selection import BLOCK, scatter, sum_is_finite
from ..params import check_float, check_int
from ..state import reject_leftovers, take_int
from .codec import Codec
from . import passes


_SAMPLE = 1 << 16  # values in top-k's threshold sample
_SAMPLED_FROM = 1 << 18  # buckets of at least this many values are sampled


def kept(n: int, ratio: float) -> int:
    """How many of a bucket's ``n`` values a sparsifier with ``ratio`` sends (``TopK``,
    ``RandomK``; ``ReducedTopK`` per slice): ``ceil(ratio * n)``, at least 1 and at most ``n``
    (0 for an empty bucket). Public so that code outside the codecs can count what they move
    without re-deriving the rounding (the sparsifiers' memory passes, the benchmarks)."""
    return min(n, max(1, math.ceil(ratio * n))) if n else 0


def largest(magnitude: Array, k: int) -> Array:
    """The positions of ``magnitude``'s ``k`` largest values (NaN the largest), in no order;
    among values tied with the ``k``-th largest, the first positions. ``argpartition`` alone
    leaves that choice to the SIMD form NumPy picked for the CPU (AVX-512, AVX2, its baseline:
    other ties kept, so other bits on another CPU, DESIGN.md "Same bits on any CPU")."""
    xp = array_module(magnitude)
    n = magnitude.shape[0]
    if not 0 < k < n:
        return xp.arange(n)[n - k:]
    part = xp.argpartition(magnitude, n - k)
    top = part[n - k:]
    kth = magnitude[part[n - k]]
    tied = xp.isnan(magnitude) if bool(xp.isnan(kth)) else magnitude == kth
    inside = int(xp.count_nonzero(tied[top]))
    if inside == int(xp.count_nonzero(tied)):  # every tie kept: nothing left to the order
        return top
    return xp.concatenate([top[~tied[top]], xp.flatnonzero(tied)[:inside]])


class TopK(Codec):
    """Each rank sends its ``ratio`` largest-magnitude values with their positions (int32); every
    rank adds everyone's in rank order. Bytes per rank: ``(N-1) * 8k``, i.e. ``2 * ratio * (N-1)``
    of the float32 bucket. A NaN or Inf is always among the largest, so it reaches the output at
    its own position."""

    collective = "allgather"
    nan_effect = "element"
    partial_update = True
    relative_error_limit = 0.95  # without error feedback: the top 1% of a heavy-tailed signal

    def __init__(self, ratio: float = 0.01):
        super().__init__()
        self.ratio = check_float("ratio", ratio, above=0, maximum=1)

    def compute_dtype(self, dtype: DTypeLike) -> np.dtype:
        return np.dtype(np.float32)

    def message_size(self, n: int) -> int:
        return 8 * kept(n, self.ratio)

    def _views(self, message: Array, n: int) -> tuple[Array, Array]:
        k = kept(n, self.ratio)
        return message[:4 * k].view(np.int32), message[4 * k:8 * k].view(np.float32)

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        n = x.shape[0]
        index, values = self._views(message, n)
        if not n:
            return
        if self._compiled_select(x, None, index, values, workspace):
            return
        index[...] = self._top(x, index.shape[0], workspace)
        values[...] = x[index]

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """``x + residual``'s top k sent, and ``residual`` left holding ``x + residual`` but zero
        where it was sent: what decoding this message misses, without decoding it."""
        if residual.dtype != np.float32 or x.dtype != np.float32:
            return False
        index, values = self._views(message, x.shape[0])
        if x.shape[0] and self._compiled_select(x, residual, index, values, workspace):
            return True
        add_into(residual, x)
        self.encode(residual, message, workspace)
        residual[index] = 0
        zero_non_finite(residual)
        return True

    def _compiled_select(self, x: Array, residual: Array | None, index: Array, values: Array,
                         workspace: Workspace) -> bool:
        """``encode`` (with ``residual``: ``encode_with_feedback``) with the residual added, the
        threshold's candidates collected and (with ``residual``) its NaN and Inf zeroed in one
        pass over the bucket (``jit.topk_candidates``): the selection of ``_top``'s sampled
        path, the same ``argpartition`` on the same candidates, so the same bits. False, having
        changed nothing, where that path does not apply (small buckets, no kernels)."""
        n, k = x.shape[0], index.shape[0]
        jit = selection.compiled(x, *(() if residual is None else (residual,)))
        if jit is None or x.dtype != np.float32 or not (n >= _SAMPLED_FROM and 16 * k <= n):
            return False
        feedback = residual is not None
        e: Array = residual if residual is not None else x
        stride = n // _SAMPLE
        sample = workspace.array(self, "sample", -(-n // stride), np.float32, like=x)
        jit.topk_sample(x, e, feedback, stride, sample)
        q = sample.shape[0] - 1 - int(1.5 * k * sample.shape[0] / n)
        threshold = np.partition(sample, q)[q]
        cap = min(n // 8, 4 * k + 4096)
        cand = workspace.array(self, "candidates", cap, np.int64, like=x)
        mags = workspace.array(self, "candidate-magnitudes", cap, np.float32, like=x)
        vals = workspace.array(self, "candidate-values", cap, np.float32, like=x)
        masks = workspace.array(self, "masks", BLOCK // 8, np.uint8, like=x)
        count = jit.topk_candidates(x, e, feedback, threshold, cand, mags, vals, masks)  # (the residual is added now)
        if k <= count <= cap:
            picked = workspace.array(self, "picked", count, np.bool_, like=x)
            picked[...] = False
            picked[largest(mags[:count], k)] = True
            # the picked positions ascending (as the candidates: what sorting the selection gives)
            # and their values from the candidates' own; the residual zeroed there, and at the
            # other candidates' NaN and Inf (every one is a candidate: never below a threshold)
            jit.topk_take(cand[:count], vals[:count], picked, index, values, e, feedback)
            return True
        # a missed tail, ties at the estimate, or more candidates than kept: _top decides
        top = self._top(e, k, workspace)
        index[...] = top
        values[...] = e[top]
        if feedback:
            e[top] = 0
            zero_non_finite(e)
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
            top = largest(magnitude, k)
        else:
            top = candidates[largest(magnitude[candidates], k)]
        top.sort()
        return top

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        index, values = self._views(message, out.shape[0])
        if scatter(out, index, values, add):
            return
        if not add:
            out[...] = 0
        out[index] += values

    def decode_mean(self, rows: Array, out: Array, workspace: Workspace) -> bool:
        """The rows decoded into ``out`` in rank order (the first one writing the zeros, in the
        same pass), divided by their number."""
        size = rows.shape[0]
        for r in range(size):
            self.decode(rows[r], out, workspace, add=r > 0)
        if size > 1:
            np.divide(out, out.dtype.type(size), out=out)
        return True

    def memory_passes(self, shapes: passes.Shapes, ranks: int = 1, itemsize: int = 4,
                      residuals: passes.Residuals | None = None) -> passes.Passes | None:
        n = passes.numel(shapes)
        return passes.topk(n, itemsize, kept(n, self.ratio), ranks, residuals is not None)


class ReducedTopK(TopK):
    """Top-k reduced in two stages, as int8's codes are: each rank sends the ``ratio`` largest of
    every slice to the slice's owner (an alltoall), the owner sums them in rank order and sends
    the ``ratio`` largest of the mean back to everyone (an allgather). Bytes per rank:
    ``2(N-1)/N * 8k`` for ``k = ratio * n``, i.e. ``4 * ratio * (N-1)/N`` of the float32 bucket,
    flat in N where the allgathered ``TopK`` grows with it (25x fewer than fp32 allreduce at 2%,
    at any N). Both stages drop what they do not send: run it with error feedback at both
    (``ErrorFeedback(ReducedTopK(r))``, the registered ``topk:stages=2``)."""

    collective = "two-stage"

    def memory_passes(self, shapes: passes.Shapes, ranks: int = 1, itemsize: int = 4,
                      residuals: passes.Residuals | None = None) -> passes.Passes | None:
        n = passes.numel(shapes)
        k = ranks * kept(-(-n // ranks), self.ratio)  # k a slice
        return passes.reduced_topk(n, itemsize, k, ranks, residuals is not None,
                                   residuals is not None and residuals.owner)


class RandomK(Codec):
    """Every rank sends the values at the same ``ratio`` of coordinates, drawn afresh each step
    from a generator seeded by (``seed``, step, bucket layout), so no indices travel and the values
    are summed by allreduce. Bytes per rank: ``2(N-1)/N * ratio`` of the bucket. A NaN or Inf
    anywhere in a rank's bucket makes the whole bucket NaN on every rank (one flag travels with
    the values), so a loss scaler notices even when the coordinate was not drawn."""

    collective = "allreduce"
    partial_update = True
    message_dtype = None
    nan_effect = "bucket"
    relative_error_limit = 1.0  # without error feedback it drops 1 - ratio of every step

    def __init__(self, ratio: float = 0.01, seed: int = 0):
        super().__init__()
        self.ratio = check_float("ratio", ratio, above=0, maximum=1)
        self.seed = check_int("seed", seed, 0)
        self._steps = StepCount()
        self._draws = selection.Draws()

    def start(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> int:
        step = self._steps.take(bucket)
        n = bucket.numel
        k = kept(n, self.ratio)
        layout = digest(bucket.layout_text())
        index = workspace.array(self, "index", k, np.int64, like=bucket.buffer)
        self._choose(np.random.default_rng([self.seed, step, layout & 0xFFFFFFFF, layout >> 32]), n, k, index)
        return step

    def _choose(self, rng: np.random.Generator, n: int, k: int, index: Array) -> None:
        """``k`` of ``n`` positions, ascending, into ``index`` (``kernels.selection.Draws``)."""
        self._draws.choose(rng, n, k, index)

    def message_size(self, n: int) -> int:
        return kept(n, self.ratio) + 1

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        k = message.shape[0] - 1
        index = workspace.array(self, "index", k, np.int64, like=x)
        jit = selection.compiled(x, message, index)
        if jit is not None:
            top = jit.randomk_gather(x, x, False, index, message[:k], BLOCK)
            finite = sum_is_finite(top, x.shape[0], x.dtype)
            if finite is not None:
                message[k] = 0 if finite else np.nan
                return
        message[:k] = x[index]
        with np.errstate(all="ignore"):
            message[k] = 0 if bool(array_module(x).isfinite(x.sum())) else np.nan

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """As ``TopK``'s: ``residual`` becomes ``x + residual``, zero where sent, all zero when the
        bucket was not finite (what decoding a NaN-flagged message and settling would leave); the
        add, the NaN check and the gather in one pass where the kernels take the arrays."""
        if residual.dtype != x.dtype:
            return False
        k = message.shape[0] - 1
        index = workspace.array(self, "index", k, np.int64, like=x)
        jit = selection.compiled(x, residual, message, index)
        if jit is not None:
            top = jit.randomk_gather(x, residual, True, index, message[:k], BLOCK)  # zero where sent
            finite = sum_is_finite(top, x.shape[0], x.dtype)
            if finite is None:  # only the sum of the values (before zeroing) can tell
                residual[index] = message[:k]
                with np.errstate(all="ignore"):
                    finite = bool(np.isfinite(residual.sum()))
                residual[index] = 0
            message[k] = 0 if finite else np.nan
            if not finite:
                residual[...] = 0
            return True
        add_into(residual, x)
        self.encode(residual, message, workspace)
        if bool(array_module(message).isfinite(message[k])):  # then the whole residual is finite
            residual[index] = 0
        else:
            residual[...] = 0
        return True

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        k = message.shape[0] - 1
        index = workspace.array(self, "index", k, np.int64, like=out)
        if not bool(array_module(message).isfinite(message[k])):
            out[...] = np.nan
            return
        if scatter(out, index, message[:k], add):
            return
        if not add:
            out[...] = 0
        out[index] += message[:k]

    def agreement_state(self, bucket: Bucket, prepared: Any) -> dict[str, Any]:
        return {"step": prepared.decision if prepared is not None else self._steps.count}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self._steps.count}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        state = dict(state)
        step = take_int(state, "step", "RandomK")
        reject_leftovers(state, "RandomK")
        self._steps = StepCount(step)

    def memory_passes(self, shapes: passes.Shapes, ranks: int = 1, itemsize: int = 4,
                      residuals: passes.Residuals | None = None) -> passes.Passes | None:
        n = passes.numel(shapes)
        return passes.randomk(n, itemsize, kept(n, self.ratio), ranks, residuals is not None)
