"""Low rank: the three products of a PowerSGD step for every matrix of a plan
(``gradcomp.powersgd.plan.Plan``), with the one dispatch (``compiled``) between the compiled loops
on NumPy float32/float64 buckets (``gradcomp.kernels.lowrank``: one memory pass each, with the
gradient add and the residual subtract folded in) and a matmul per matrix (CuPy, or numba
unavailable; NumPy's reconstruction then adds the rank's terms in the loops' order)."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import array_module, load

Array = Any


def _t(a: Array) -> Array:
    return a.swapaxes(-1, -2)


def compiled(xp: Any, dtype: Any) -> Any:
    """``gradcomp.kernels.lowrank`` where its loops run here and take buckets of ``dtype`` in the
    array module ``xp`` (NumPy float32 or float64), else None: the one place the products choose
    compiled or matmul."""
    if xp is np and dtype in (np.float32, np.float64):
        return load("lowrank")
    return None


def _decompress(xp: Any, out: Array, p: Array, q: Array, scratch: tuple[Array, Array] | None) -> None:
    """``out = P Q^T``. At rank 1 an outer product by broadcasting: BLAS GEMM with an inner
    dimension of 1 is many times slower than the single multiply per element it amounts to.

    With ``scratch`` (NumPy buckets whose peers may run the compiled loops: a CPU without F16C,
    ``GRADCOMP_JIT=0``), the r products are added in the loops' order instead of BLAS's
    (``kernels.lowrank.reconstruct``: groups of four, ``((p0 q0 + p1 q1) + p2 q2) + p3 q3``, the
    groups left to right, no fused multiply-add), so that this rank's mean has its peers' bits
    (DESIGN invariant 2): P and Q are already the same on every rank, and this is the one
    product whose result is the mean."""
    r = p.shape[-1]
    if r == 1:
        xp.multiply(p, _t(q), out=out)
        return
    if scratch is None:
        xp.matmul(p, _t(q), out=out)
        return
    qt = _t(q)
    group, term = (s[:out.size].reshape(out.shape) for s in scratch)
    k = 0
    while k < r:
        width = 4 if k + 4 <= r else 1
        acc = out if k == 0 else group
        xp.multiply(p[..., k:k + 1], qt[..., k:k + 1, :], out=acc)
        for i in range(k + 1, k + width):
            xp.multiply(p[..., i:i + 1], qt[..., i:i + 1, :], out=term)
            acc += term
        if k:
            out += group
        k += width


class Products:
    """``P = M Q``, ``Q = M^T P`` and ``OUT = P Q^T`` for a plan. ``fused`` says whether the
    compiled loops run; ``add`` and ``residual`` may only be passed when it is True."""

    def __init__(self, plan: Any, xp: Any, dtype: Any):
        self.plan = plan  # a gradcomp.powersgd.plan.Plan (this layer cannot name it)
        self.loops: Any = compiled(xp, dtype)  # gradcomp.kernels.lowrank where it runs
        #: the ordered reconstruction's two scratch rows (NumPy without the loops: ``_decompress``)
        self.scratch: tuple[Array, Array] | None = None
        if self.loops is None and xp is np and dtype in (np.float32, np.float64):
            key = np.dtype(dtype)
            if key not in plan.scratch:
                largest = max((b * n * m for _, b, n, m, r, _, _ in plan.batches if r > 1), default=0)
                plan.scratch[key] = (np.empty(largest, key), np.empty(largest, key))
            self.scratch = plan.scratch[key]

    @property
    def fused(self) -> bool:
        return self.loops is not None

    def project(self, m: Array, q: Array, p: Array, add: Array | None = None) -> None:
        """``P = M Q`` (after ``M += add`` on the matrices' rows, where given)."""
        if self.loops is not None:
            self.loops.project(m, q, p, self.plan.table, add)
            return
        xp = array_module(m)
        for mm, pp, qq in self.plan.views(m, p, q):
            xp.matmul(mm, qq, out=pp)

    def project_t(self, m: Array, p: Array, q: Array, add: Array | None = None) -> None:
        """``Q = M^T P`` (after ``M += add`` on the matrices' rows, where given)."""
        if self.loops is not None:
            self.loops.project_t(m, p, q, self.plan.table, add)
            return
        xp = array_module(m)
        for mm, pp, qq in self.plan.views(m, p, q):
            xp.matmul(_t(mm), pp, out=qq)

    def reconstruct(self, out: Array, p: Array, q: Array, residual: Array | None = None) -> None:
        """``OUT = P Q^T`` on the matrices' elements (and ``residual -= OUT`` there, where given)."""
        if self.loops is not None:
            self.loops.reconstruct(out, p, q, self.plan.table, residual)
            return
        xp = array_module(out)
        for o, pp, qq in self.plan.views(out, p, q):
            _decompress(xp, o, pp, qq, self.scratch)
