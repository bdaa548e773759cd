"""The three products of a PowerSGD step for every matrix of a plan: compiled loops on NumPy
float32/float64 buckets (``kernels.lowrank``: one memory pass each, with the gradient add and the
residual subtract folded in), else a matmul per matrix (CuPy, or numba unavailable)."""
from __future__ import annotations

from typing import Any

import numpy as np

from .. import kernels
from ..arrays import Array, ArrayModule, DTypeLike, array_module
from .plan import Plan


def _t(a: Array) -> Array:
    return a.swapaxes(-1, -2)


def _decompress(xp: ArrayModule, out: Array, p: Array, q: Array) -> None:
    """``out = P Q^T``. At rank 1 an outer product by broadcasting: BLAS GEMM with an inner
    dimension of 1 is many times slower than the single multiply per element it amounts to."""
    if p.shape[-1] == 1:
        xp.multiply(p, _t(q), out=out)
    else:
        xp.matmul(p, _t(q), out=out)


class Products:
    """``P = M Q``, ``Q = M^T P`` and ``OUT = P Q^T`` for a plan. ``fused`` says whether the
    compiled loops run; ``add`` and ``residual`` may only be passed when it is True."""

    def __init__(self, plan: Plan, xp: ArrayModule, dtype: DTypeLike):
        self.plan = plan
        self.loops: Any = None  # gradcomp.kernels.lowrank where it runs
        if xp is np and dtype in (np.float32, np.float64) and kernels.available():
            from ..kernels import lowrank

            self.loops = lowrank

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
            _decompress(xp, o, pp, qq)
