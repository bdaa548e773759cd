"""PowerSGD: rank-r gradient compression with error feedback (Vogels et al., NeurIPS 2019).

Each gradient tensor is viewed as a matrix ``M`` of shape ``(shape[0], -1)`` and replaced by a
product ``P Q^T`` of two thin matrices found by one step of power iteration, with the previous
step's ``Q`` as the starting point (warm start). Ranks exchange only ``P`` and ``Q``. What the
approximation misses is kept locally and added to the next step's gradient (error feedback), so
nothing is lost for good, only delayed.

The semantics follow PyTorch's ``powerSGD_hook``; the differences are deliberate and listed in
``PowerSGD``'s docstring. The work is split in two stages (``gradcomp.compressors.contract``): the
local stage adds the residual and computes the first factor, overlapping the previous bucket's
transfer (``local_stage``); the ordered stage sends it, computes the second factor, sends that and
reconstructs (``ordered_stage``). This module holds what decides and records a step: the
parameters, which steps and tensors are compressed, the traffic declared, statistics and
checkpoints.
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..arrays import Array
from ..bucket import Bucket, StepCount
from ..comm import Communicator, Workspace
from ..compressors import passes
from ..compressors.allreduce import mean_allreduce
from ..compressors.contract import Compressor, Traffic
from ..compressors.quantize import QuantizedAllreduce
from ..params import check_bool, check_choice, check_float, check_int
from ..state import ClaimCheck, TensorStore
from .checkpoint import checked, saved
from .local_stage import LocalStage
from .ordered_stage import OrderedStage
from .plan import Plan, should_compress
from .work import Work


class PowerSGD(LocalStage, OrderedStage, Compressor):
    """Low-rank compression with error feedback and warm start, layer by layer.

    Parameters (PyTorch's ``PowerSGDState`` names in brackets):

    ``rank`` [matrix_approximation_rank]: r, the rank of each approximation. Lower is stronger
        compression; start at 1 and double until accuracy is satisfactory (1-4 is typical).
    ``start_iter`` [start_powerSGD_iter]: steps of plain averaging before compression starts.
        Early training is sensitive to gradient error; 10% of the steps is a good first guess.
        ``stats()`` says how many warm-up steps remain. Must be > 1 when ``error_feedback`` or
        ``warm_start`` is on: PyTorch's DDP rebuilds its buckets after the first step.
    ``min_compression_rate``: a tensor is compressed only when ``(n + m) * r *
        min_compression_rate < n * m``; others (all vectors, small or near-square tensors) are
        averaged exactly in the same round as P.
    ``error_feedback`` [use_error_feedback]: keep what the approximation missed and add it to the
        next step's gradient. PowerSGD is biased; without this it usually loses accuracy.
    ``warm_start``: start each step's power iteration from the previous step's Q instead of a fresh
        random one: better approximations for the cost of keeping Q.
    ``orthogonalization_epsilon``: added to every column norm during Gram-Schmidt. Not needed to
        avoid NaN here (a zero column stays zero); 0 is most exact.
    ``seed`` [random_seed]: seeds the generator of fresh Q. Every rank holds the same generator and
        draws in the same order, so fresh Q is identical everywhere without communication.
    ``batch_same_shape`` [batch_tensors_with_same_shape]: multiply consecutive tensors of one shape
        as one batched product (one kernel launch on a GPU); never copies tensors together.
    ``rounds``: 2 (default) sends the uncompressed tensors together with P, then Q: two collective
        rounds per bucket where PyTorch needs three. 1 is the alternating variant of the reference
        implementation (epfml/powersgd): each step sends only P (even compressed steps) or only Q
        (odd ones), built from the other factor of the previous step; needs ``warm_start``.
    ``batched``: treat the whole bucket as one zero-padded square matrix, ignoring the layout (see
        ``BatchedPowerSGD``). Compressed only when the square passes ``min_compression_rate``.
    ``error_dtype``: dtype of the kept residual. None: the bucket's dtype, as PyTorch does; e.g.
        ``"float32"`` keeps the residual of a float16 bucket (``FP16(PowerSGD())``) exactly.
    ``factor_bits``: None sends P and Q in the bucket's dtype. 8 sends their mean as 8-bit codes
        per 512-value chunk through the two-stage quantized allreduce (``QuantizedAllreduce``):
        a quarter of float32's bytes, half of float16's, so rank 8 costs what rank 4 does in
        float16, and a higher rank approximates more of the gradient. The uncompressed tensors
        still go exactly, in a collective of their own. What the codes miss is not lost: the
        residual is the input less the product of the decoded factors, so error feedback keeps it.
        A NaN in one tensor then reaches every compressed tensor of its bucket (a chunk of codes
        spans several tensors' factors).

    State follows each tensor (its key, ``Bucket.keys``): the residual, Q (and P for
    ``rounds=1``) survive DDP's bucket rebuild and a resume into a fresh model. Checkpoints:
    ``state_dict``/``load_state_dict`` (checked before anything changes).

    Precision: float32 and float64 buckets are computed in their own dtype. float16 and bfloat16
    buckets (inside ``FP16``/``BF16``) are multiplied and orthogonalized in float32 and rounded to
    the bucket's dtype where PyTorch keeps a half tensor: P and Q on the wire and in memory, the
    output, and the residual (unless ``error_dtype`` says otherwise). Products on NumPy float32 and
    float64 buckets are compiled loops (``loops``), summing in another, fixed order than BLAS.

    Differences from PyTorch, on purpose: every part of the message is divided by the world size
    before the sum (keeps half precision from overflowing; bit-for-bit the same at power-of-two
    world sizes); the residual of uncompressed tensors is zero (PyTorch keeps ``local - mean``,
    whose mean over ranks is zero); ``batched`` works past the warm-up.

    Non-finite gradients: NaN or Inf in an uncompressed tensor propagate element-wise. In a
    compressed tensor they reach the averaged P (or Q), identical on every rank, and that tensor's
    output is non-finite on every rank, so a loss scaler sees it. The bucket's residual and factors
    are then dropped on every rank (the decision reads the averaged factors), so one bad step
    cannot poison the following ones. Zero gradients give zero output, never NaN, and a factor
    that became zero is drawn afresh.
    """

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2,
                 error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0,
                 batch_same_shape: bool = False, rounds: int = 2, batched: bool = False,
                 error_dtype: str | None = None, factor_bits: int | None = None):
        super().__init__()
        self.rank = check_int("PowerSGD rank", rank, 1)
        self.start_iter = check_int("PowerSGD start_iter", start_iter, 0)
        self.min_compression_rate = check_float("min_compression_rate", min_compression_rate, above=0)
        self.error_feedback = check_bool("error_feedback", error_feedback)
        self.warm_start = check_bool("warm_start", warm_start)
        self.orthogonalization_epsilon = check_float("orthogonalization_epsilon",
                                                     orthogonalization_epsilon, minimum=0)
        self.seed = check_int("seed", seed, 0)
        self.batch_same_shape = check_bool("batch_same_shape", batch_same_shape)
        self.rounds = check_int("PowerSGD rounds (1 = alternating, 2 = fused)", rounds, 1, 2)
        self.batched = check_bool("batched", batched)
        self.error_dtype = check_choice("error_dtype", error_dtype,
                                        (None, "float16", "bfloat16", "float32", "float64"))
        self.factor_bits = check_choice("PowerSGD factor_bits", factor_bits, (None, 8))
        self._factor_codec = None if self.factor_bits is None else QuantizedAllreduce(bits=self.factor_bits)
        if self._factor_codec is not None:  # a NaN's chunk of codes spans other tensors' factors
            self.nan_effect = "bucket"
        if (error_feedback or warm_start) and start_iter <= 1:
            raise ValueError(
                f"PowerSGD start_iter must be > 1 when error_feedback or warm_start is on (got "
                f"{start_iter}): buckets may be rebuilt after the first step (PyTorch DDP does). "
                "Use start_iter >= 2, or turn both error_feedback and warm_start off.")
        if rounds == 1 and not warm_start:
            raise ValueError("PowerSGD rounds=1 builds each step's factor from the previous step's "
                             "other factor, i.e. it is warm start by construction; set warm_start=True")
        self._rng = np.random.RandomState(self.seed)
        self._steps = StepCount()
        self._errors = TensorStore()
        self._claims = ClaimCheck()
        self._q = TensorStore()
        self._p = TensorStore()
        self._plans: dict[tuple, Plan] = {}
        self._counts = dict(numel_before=0, numel_after=0, compressed_steps=0, compressed_rounds=0)

    def config(self) -> dict[str, Any]:
        # factor_bits only when set: checkpoints saved before it existed still load
        out = super().config()
        if self.factor_bits is None:
            out.pop("factor_bits")
        return out

    @property
    def step(self) -> int:
        """Steps seen (``StepCount``), warm-up included."""
        return self._steps.count

    nan_effect = "tensor"
    partial_update = True
    relative_error_limit = 0.5  # one power iteration on a low-rank signal (no error feedback)

    @property
    def error_feedback_on(self) -> bool:
        return self.error_feedback

    @property
    def warmup_steps(self) -> int:
        return self.start_iter

    # -- the two stages (their work in local_stage and ordered_stage) ----------------------------
    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Work:
        step = self._steps.take(bucket)
        if step < self.start_iter:
            return Work(step, compress=False)
        plan = self._plan(bucket)
        work = Work(step, compress=True, plan=plan, phase=(step - self.start_iter) % 2)
        if plan.matrices:
            self._local(bucket, workspace, work)
        self._claims.saw(bucket, [self._errors, self._q, self._p], type(self).__name__)
        return work

    def _plan(self, bucket: Bucket) -> Plan:
        key = (bucket.layout_text(), bucket.keys)
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) > 64:  # layouts come and go (DDP's rebuild); keep the recent ones
                self._plans.clear()
            plan = self._plans[key] = Plan(bucket.shapes, bucket.keys, bucket.numel, self.rank,
                                           self.min_compression_rate, self.batched,
                                           self.batch_same_shape, f"square:{bucket.layout_key():x}")
        return plan


    def finish(self, bucket: Bucket, comm: Communicator, work: Work) -> Array:
        if not work.compress:  # warm-up: exactly Allreduce (in place if scratch)
            return mean_allreduce(bucket, comm)
        plan = work.plan
        assert plan is not None  # compressing
        c = self._counts
        c["numel_before"] += bucket.numel
        size = bucket.buffer.dtype.itemsize
        if not plan.matrices:
            c["numel_after"] += bucket.numel
        elif self.rounds == 2:
            c["numel_after"] += plan.n_unc + self._factor_numel(plan.p_size, size) + self._factor_numel(plan.q_size, size)
        else:
            c["numel_after"] += plan.n_unc + self._factor_numel(plan.q_size if work.phase else plan.p_size, size)
        c["compressed_steps"] += int(bucket.is_last)
        before = comm.collectives
        try:
            if not plan.matrices:  # nothing worth compressing: no memory to keep either
                return mean_allreduce(bucket, comm)
            return self._send(bucket, comm, work)
        finally:
            c["compressed_rounds"] += comm.collectives - before


    def traffic(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
        n = sum(math.prod(s) for s in shapes)
        keys = [str(i) for i in range(len(shapes))]
        plan = Plan([tuple(s) for s in shapes], keys, n, self.rank, self.min_compression_rate,
                    self.batched, self.batch_same_shape, "cost")
        first = Traffic("allreduce", (plan.n_unc + plan.p_size) * itemsize)
        if self.rounds == 1:
            return first
        return Traffic("allreduce", first.message_bytes, extra=(Traffic("allreduce", plan.q_size * itemsize),))

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> passes.Passes | None:
        """Per compressed matrix M (the residual), ``M += G`` and ``P = M Q`` in one pass, ``Q = M^T
        P`` after the allreduce of P (a second read: P must be summed first), ``OUT = P Q^T`` and
        ``M -= OUT`` after the allreduce of Q (a third read, and the writes); the uncompressed
        tensors travel with P (copied in and out). Factors: ``(rows + cols) * rank`` values each.
        Not declared when ``batched`` (the stacked copies of same-shape matrices are not counted)."""
        if self.batched:
            return None
        compute = 8 if itemsize == 8 else 4
        matrices, vectors = [], 0
        for s in shapes:
            size = math.prod(s)
            rows = int(s[0]) if len(s) >= 2 else 0
            if rows and should_compress(rows, size // rows, self.rank, self.min_compression_rate):
                matrices.append((rows, size // rows))
            else:
                vectors += size
        e = sum(r * c for r, c in matrices)
        factors = sum((r + c) * min(self.rank, r, c) for r, c in matrices) * compute
        one = passes.one
        t = (one("project: residual += gradient, P = M Q", e * (compute + itemsize), e * compute)
             + one("project_t: Q = M^T P", e * compute)
             + one("reconstruct: out = P Q^T, residual -= out", e * compute, e * (compute + itemsize)))
        if vectors:
            t += one("uncompressed tensors, in and out", 2 * vectors * itemsize, 2 * vectors * itemsize)
        t += one("factors", 2 * factors, 2 * factors)
        if ranks > 1:
            t += passes.allreduce(vectors + factors // compute, compute, ranks)
        return t

    # -- declared state, hand-over, statistics, checkpoints ----------------------------------------------------
    def agreement_state(self, bucket: Bucket, prepared: Work | None) -> dict[str, Any]:
        if prepared is None:
            return {"step": self.step}
        state: dict[str, Any] = {"step": prepared.step, "compressing": prepared.compress}
        if prepared.compress and self.rounds == 1:
            state["phase"] = prepared.phase
        return state

    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        """Remove and return the error-feedback residuals of ``keys`` (``Schedule``'s hand-over)."""
        return self._errors.pop(keys)

    def residuals(self, keys: Iterable[str]) -> dict[str, Array]:
        return {k: v for k in keys if (v := self._errors.view(k)) is not None}

    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numel_before, numel_after)`` over compressed buckets, like PyTorch's."""
        c = self._counts
        rate = c["numel_before"] / c["numel_after"] if c["numel_after"] else 0.0
        return rate, c["numel_before"], c["numel_after"]

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        c = self._counts
        s.update(c)
        s["compression_rate"] = self.compression_stats()[0]
        s["rounds_per_compressed_step"] = (c["compressed_rounds"] / c["compressed_steps"]
                                           if c["compressed_steps"] else 0.0)
        s["step"] = self.step
        s["compressing"] = self.step >= self.start_iter
        s["warmup_steps_left"] = max(self.start_iter - self.step, 0)
        return s

    def state_dict(self) -> dict[str, Any]:
        """Plain arrays and numbers (``numpy.savez``-able); host copies, never views of live state."""
        return saved(self.describe(), self.step, self._rng, self._counts, self._errors, self._q, self._p)

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        got = checked(type(self).__name__, self.describe(), self.rank, self._counts, state, shapes)
        # everything checked: now change
        self._steps = StepCount(got.step)
        self._rng.set_state(got.rng)
        self._counts.update(got.counts)
        self._errors.load(got.residuals)
        self._q.load(got.q)
        self._p.load(got.p)
        self._claims.loaded()


class BatchedPowerSGD(PowerSGD):
    """PowerSGD on the whole bucket as one zero-padded square matrix (``batched_powerSGD_hook``).

    Ignores the layout: the flat bucket of length L becomes a ``ceil(sqrt(L))``-sided square. Less
    computation than per-layer PowerSGD, but the square mixes unrelated layers and destroys their
    low-rank structure: it needs far more rank than per-layer PowerSGD (BENCHMARKS.md, "Convergence").
    Its warm-start factors belong to the bucket's layout (the square has no tensors), so they
    restart after DDP's bucket rebuild. Same parameters as ``PowerSGD`` (``batched`` is implied).
    """

    nan_effect = "bucket"  # the square mixes every tensor of the bucket

    def __init__(self, rank: int = 1, start_iter: int = 1000, **kwargs: Any):
        kwargs.pop("batched", None)
        super().__init__(rank=rank, start_iter=start_iter, batched=True, **kwargs)

    def config(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in ("rank", "start_iter", "min_compression_rate",
                                             "error_feedback", "warm_start",
                                             "orthogonalization_epsilon", "seed", "batch_same_shape",
                                             "rounds", "error_dtype")}
        if self.factor_bits is not None:
            out["factor_bits"] = self.factor_bits
        return out

