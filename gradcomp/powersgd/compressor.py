"""PowerSGD: rank-r gradient compression with error feedback (Vogels et al., NeurIPS 2019).

Each gradient tensor is viewed as a matrix ``M`` of shape ``(shape[0], -1)`` and replaced by a
product ``P Q^T`` of two thin matrices found by one step of power iteration, with the previous
step's ``Q`` as the starting point (warm start). Ranks exchange only ``P`` and ``Q``. What the
approximation misses is kept locally and added to the next step's gradient (error feedback), so
nothing is lost for good, only delayed.

The semantics follow PyTorch's ``powerSGD_hook``; the differences are deliberate and listed in
``PowerSGD``'s docstring. The work is split in two stages (``gradcomp.compressors.base``): the
local stage adds the residual and computes the first factor, overlapping the previous bucket's
transfer; the ordered stage sends it, computes the second factor, sends that and reconstructs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..arrays import Array, ArrayModule, add_into, array_module, cast, dtype_name, half_dtype, subtract_into
from ..bucket import Bucket
from ..comm import Communicator, Workspace
from ..compressors.allreduce import mean_allreduce
from ..compressors.base import Compressor, Traffic
from ..params import check_bool, check_choice, check_float, check_int
from ..state import ClaimCheck, TensorStore
from .checkpoint import checked, saved
from .plan import Plan, orthogonalize
from .products import Products
from ..compressors.quantize import QuantizedAllreduce

HALF = ("float16", "bfloat16")


@dataclass
class _Work:
    """One bucket's decisions and the local stage's results, handed to the ordered stage."""
    step: int
    compress: bool
    phase: int = 0                 # rounds=1: 0 sends P (from last Q), 1 sends Q (from last P)
    plan: Plan | None = None       # set when ``compress``
    products: Any = None
    x: Any = None                  # gradient + residual (the residual region itself when kept)
    mx: Any = None                 # x in the compute dtype, padded for the batched square
    out: Any = None
    wire: Any = None               # the first message: uncompressed tensors, then P (or Q)
    basis: Any = None              # the factor the first message was projected on
    fold: bool = False             # the new residual is subtracted inside the reconstruction
    direct: bool = False           # no cast and no padding: the output is the result
    storage: Any = None
    compute: Any = None
    half: bool = False


class PowerSGD(Compressor):
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
        self._step = 0
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
        """Steps completed (``is_last`` buckets reduced), warm-up included."""
        return self._step

    nan_effect = "tensor"
    partial_update = True
    relative_error_limit = 0.5  # one power iteration on a low-rank signal (no error feedback)

    @property
    def error_feedback_on(self) -> bool:
        return self.error_feedback

    @property
    def warmup_steps(self) -> int:
        return self.start_iter

    # -- the local stage ---------------------------------------------------------------------------
    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> _Work:
        step = self._step
        if bucket.is_last:
            self._step += 1
        if step < self.start_iter:
            return _Work(step, compress=False)
        plan = self._plan(bucket)
        work = _Work(step, compress=True, plan=plan, phase=(step - self.start_iter) % 2)
        if plan.matrices:
            self._local(bucket, workspace, work)
        self._claims.saw(bucket.keys, bucket.is_last, [self._errors, self._q, self._p], type(self).__name__)
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

    def _local(self, bucket: Bucket, workspace: Workspace, w: _Work) -> None:
        g = bucket.buffer
        xp = array_module(g)
        plan = w.plan
        assert plan is not None  # compressing
        n = bucket.numel
        w.storage = g.dtype
        w.half = dtype_name(g.dtype) in HALF
        w.compute = xp.dtype(xp.float32) if w.half else g.dtype
        w.products = Products(plan, xp, w.compute)
        # 1. x = gradient + residual, written into the residual (ours) or kept as the gradient
        #    itself (read only). With the compiled products the matrices' part of the sum is done
        #    inside the first product (``pending``), saving a pass.
        direct = w.compute == w.storage and plan.padded == n  # no cast, no padding
        pending = None
        if self.error_feedback:
            ef = w.storage if self.error_dtype is None else _dtype(self.error_dtype, xp)
            x, _ = self._errors.region(bucket.placements(), n, ef, like=g)
            if w.products.fused and direct and x.dtype == w.compute:
                pending = g
                for a, b in plan.runs:
                    add_into(x[a:b], g[a:b])
            else:
                add_into(x, g if g.dtype == x.dtype else cast(g, x.dtype))
        else:
            x = g
        mx = x
        if x.dtype != w.compute or plan.padded != n:
            mx = workspace.array(self, "mx", plan.padded, w.compute, like=g)
            cast(x, w.compute, out=mx[:n])
            mx[n:] = 0
        w.x, w.mx = x, mx
        # 2. the output: a DDP bucket (scratch) takes it itself, no new array and no copy back (the
        #    bucket is read only by the first product, ``pending``, or as ``x`` before this point);
        #    with a cast or padding in between it is a reused temporary
        if direct:
            w.out = g if bucket.scratch else xp.empty(n, w.compute)
        else:
            w.out = workspace.array(self, "out", plan.padded, w.compute, like=g)
        w.direct = direct
        # 3. the new residual x - output is subtracted inside the last product where it can be
        w.fold = self.error_feedback and w.products.fused and direct and mx is x
        # 4. the first message: uncompressed tensors, then P = M Q (or Q = M^T P, rounds=1 phase 1)
        first_p = self.rounds == 2 or w.phase == 0
        w.basis = self._basis(bucket, workspace, w, "q" if first_p else "p")
        size = plan.p_size if first_p else plan.q_size
        w.wire = workspace.array(self, "wire", plan.n_unc + size, w.compute, like=g)
        pos = 0
        for a, b in plan.runs:
            w.wire[pos:pos + b - a] = mx[a:b]
            pos += b - a
        local = w.wire[plan.n_unc:]
        if first_p:
            w.products.project(mx, w.basis, local, add=pending)
        else:
            w.products.project_t(mx, w.basis, local, add=pending)

    def _basis(self, bucket: Bucket, workspace: Workspace, w: _Work, which: str) -> Array:
        """This step's orthonormal starting factor: last step's (warm start) or fresh from the
        seeded generator. A block with an all-zero column (its layer's gradient was zero) would
        stay zero for ever, so it is drawn afresh; every rank holds the same factor and makes
        the same decision."""
        plan = w.plan
        assert plan is not None  # compressing
        g = bucket.buffer
        store = self._q if which == "q" else self._p
        placements = plan.q_placements if which == "q" else plan.p_placements
        size = plan.q_size if which == "q" else plan.p_size
        groups = plan.q_groups if which == "q" else plan.p_groups
        if self.warm_start:
            memory, missing = store.region(placements, size, w.compute, like=g)
        else:
            memory, missing = None, [t.key for t in plan.matrices]
        region = workspace.array(self, "basis", size, w.compute, like=g)
        if memory is not None:
            region[...] = memory
        if missing:
            wanted = set(missing)
            self._draw(region, plan, [i for i, t in enumerate(plan.matrices) if t.key in wanted], which, w)
        dead = orthogonalize(region, groups, not w.half, self.orthogonalization_epsilon)
        if dead:
            self._draw(region, plan, sorted(dead), which, w)
            orthogonalize(region, groups, not w.half, self.orthogonalization_epsilon)
        return self._round(region, w)

    def _draw(self, region: Array, plan: Plan, numbers: list[int], which: str, w: _Work) -> None:
        """Fill the Q (or P) blocks of the given matrices from ``fresh_q`` (P: (m, n) swapped)."""
        xp = array_module(region)
        mats = [plan.matrices[k] for k in numbers]
        if which == "q":
            shapes, rows, offs = [(t.n, t.m, t.r) for t in mats], [t.m for t in mats], [t.q_off for t in mats]
        else:
            shapes, rows, offs = [(t.m, t.n, t.r) for t in mats], [t.n for t in mats], [t.p_off for t in mats]
        for t, k, off, values in zip(mats, rows, offs, self.fresh_q(shapes)):
            values = np.asarray(values, dtype=np.float64).reshape(-1)
            region[off:off + k * t.r] = xp.asarray(values).astype(region.dtype)
        if w.half:
            region[...] = self._round(region, w)

    def _round(self, a: Array, w: _Work) -> Array:
        """``a`` rounded to the bucket's half dtype (kept in float32), where PyTorch stores half."""
        return cast(cast(a, w.storage), a.dtype, out=a) if w.half else a

    def fresh_q(self, matrices: list[tuple[int, int, int]]) -> list[np.ndarray]:
        """Random starting Q for the compressed matrices ``(n, m, r)`` of one bucket, in bucket order:
        one ``(m, r)`` array each, standard normal, from this compressor's seeded generator.

        Every rank holds the same generator state and calls this at the same points, so every rank
        gets the same Q. Override it to reproduce another implementation's initial Q exactly (the
        PyTorch parity test does); the result must be the same on every rank.
        """
        return [self._rng.standard_normal((m, r)) for _, m, r in matrices]

    # -- the ordered stage ---------------------------------------------------------------------------------
    def finish(self, bucket: Bucket, comm: Communicator, work: _Work) -> Array:
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

    def _factor_numel(self, n: int, itemsize: int) -> int:
        """What ``n`` factor values cost on the wire, counted in values of ``itemsize`` bytes."""
        codec = self._factor_codec
        return n if codec is None else -(-codec.message_size(n) // itemsize)

    def _mean(self, wire: Array, comm: Communicator, w: _Work, exact: int = 0) -> Array:
        """The mean over ranks of ``wire``, returned in ``compute`` (in ``wire`` itself where it
        can be); with ``factor_bits`` its first ``exact`` values (the uncompressed tensors) go
        exactly and the rest, the factor, as quantized codes."""
        codec = self._factor_codec
        if codec is None:
            return self._exact_mean(wire, comm, w)
        if exact:
            wire[:exact] = self._exact_mean(wire[:exact], comm, w)  # a copy onto itself at most
        factor = Bucket(wire[exact:], scratch=True)
        mean = codec.finish(factor, comm, codec.prepare(factor, comm, comm.workspace))
        if mean is not factor.buffer:
            wire[exact:] = mean
        return wire

    def _exact_mean(self, wire: Array, comm: Communicator, w: _Work) -> Array:
        """Sum of ``wire / size`` over ranks, sent in the bucket's dtype, returned in ``compute``."""
        xp = array_module(wire)
        if comm.size > 1:
            xp.divide(wire, w.compute.type(comm.size), out=wire)
        if w.compute != w.storage:
            half = comm.workspace.array(self, "half-wire", wire.shape[0], w.storage, like=wire)
            summed = comm.allreduce(cast(wire, w.storage, out=half), overwrite=True)
            return cast(summed, w.compute, out=wire)
        return comm.allreduce(wire, overwrite=True)

    def _send(self, bucket: Bucket, comm: Communicator, w: _Work) -> Array:
        xp = array_module(bucket.buffer)
        plan, n = w.plan, bucket.numel
        assert plan is not None  # compressing
        summed = self._mean(w.wire, comm, w, exact=plan.n_unc)
        pos = 0
        for a, b in plan.runs:
            w.out[a:b] = summed[pos:pos + b - a]
            pos += b - a
        new = summed[plan.n_unc:]
        residual = w.x if w.fold else None
        if self.rounds == 2:
            p = new
            orthogonalize(p, plan.p_groups, not w.half, self.orthogonalization_epsilon)
            p = self._round(p, w)
            q_local = comm.workspace.array(self, "q-local", plan.q_size, w.compute, like=w.mx)
            w.products.project_t(w.mx, p, q_local)
            q = self._mean(q_local, comm, w)
            w.products.reconstruct(w.out, p, q, residual)
        else:
            p, q = (new, w.basis) if w.phase == 0 else (w.basis, new)
            w.products.reconstruct(w.out, p, q, residual)
        result = w.out
        if not w.direct:
            result = cast(w.out[:n], w.storage, out=bucket.buffer if bucket.scratch else None)
        keys = [t.key for t in plan.matrices]
        if not (bool(xp.isfinite(p).all()) and bool(xp.isfinite(q).all())):
            # identical P and Q on every rank: every rank drops the memory together
            self._errors.drop(bucket.keys)
            self._q.drop(keys)
            self._p.drop(keys)
            return result
        if self.error_feedback:
            if not w.fold:
                subtract_into(w.x, result if result.dtype == w.x.dtype else cast(result, w.x.dtype))
            for a, b in plan.runs:
                w.x[a:b] = 0
        if self.warm_start:
            self._q.region(plan.q_placements, plan.q_size, w.compute, like=w.mx)[0][...] = q
            if self.rounds == 1:
                self._p.region(plan.p_placements, plan.p_size, w.compute, like=w.mx)[0][...] = p
        return result

    def traffic(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
        n = sum(math.prod(s) for s in shapes)
        keys = [str(i) for i in range(len(shapes))]
        plan = Plan([tuple(s) for s in shapes], keys, n, self.rank, self.min_compression_rate,
                    self.batched, self.batch_same_shape, "cost")
        first = Traffic("allreduce", (plan.n_unc + plan.p_size) * itemsize)
        if self.rounds == 1:
            return first
        return Traffic("allreduce", first.message_bytes, extra=(Traffic("allreduce", plan.q_size * itemsize),))

    # -- declared state, hand-over, statistics, checkpoints ----------------------------------------------------
    def agreement_state(self, bucket: Bucket, prepared: _Work | None) -> dict[str, Any]:
        if prepared is None:
            return {"step": self._step}
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
        s["step"] = self._step
        s["compressing"] = self._step >= self.start_iter
        s["warmup_steps_left"] = max(self.start_iter - self._step, 0)
        return s

    def state_dict(self) -> dict[str, Any]:
        """Plain arrays and numbers (``numpy.savez``-able); host copies, never views of live state."""
        return saved(self.describe(), self._step, self._rng, self._counts, self._errors, self._q, self._p)

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        got = checked(type(self).__name__, self.describe(), self.rank, self._counts, state, shapes)
        # everything checked: now change
        self._step = got.step
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


def _dtype(name: str, xp: ArrayModule) -> Any:
    return half_dtype(name, xp) if name in HALF else xp.dtype(name)
