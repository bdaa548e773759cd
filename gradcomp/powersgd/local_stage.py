"""PowerSGD's local stage: the residual added, the starting factor, the first message.

Runs on the compute thread, overlapping the previous bucket's transfer (``gradcomp.compressors.contract``);
no collectives. ``PowerSGD.prepare`` decides whether a bucket is compressed and calls ``_local``;
its ``Work`` goes to the ordered stage (``ordered_stage``).
"""
from __future__ import annotations

import numpy as np

from ..arrays import Array, add_into, array_module, cast, dtype_name
from ..bucket import Bucket
from ..comm import Workspace
from ..kernels.products import Products
from ..state import TensorStore
from .plan import Plan, orthogonalize
from .work import HALF, Work, residual_dtype


class LocalStage:
    """``PowerSGD``'s local stage (a base of it, not used alone): what it reads of the compressor
    is declared below."""

    error_feedback: bool
    error_dtype: str | None
    warm_start: bool
    rounds: int
    orthogonalization_epsilon: float
    _rng: np.random.RandomState
    _errors: TensorStore
    _q: TensorStore
    _p: TensorStore

    def _local(self, bucket: Bucket, workspace: Workspace, w: Work) -> None:
        """Fill ``w`` for a compressed bucket: the gradient plus its residual (``x``), that in the
        compute dtype (``mx``), the output array, this step's starting factor (``basis``) and the
        first message (``wire``: the uncompressed tensors, then ``P = M Q``, or ``Q = M^T P`` in
        the odd steps of ``rounds=1``)."""
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
            ef = w.storage if self.error_dtype is None else residual_dtype(self.error_dtype, xp)
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

    def _basis(self, bucket: Bucket, workspace: Workspace, w: Work, which: str) -> Array:
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
        return w.rounded(region)

    def _draw(self, region: Array, plan: Plan, numbers: list[int], which: str, w: Work) -> None:
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
            region[...] = w.rounded(region)

    def _round(self, a: Array, w: Work) -> Array:
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
