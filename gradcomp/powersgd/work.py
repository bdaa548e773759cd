"""One bucket's work in flight: what PowerSGD's local stage decided and computed, handed to its
ordered stage (``local_stage``, ``ordered_stage``), and the dtypes both stages share."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arrays import Array, ArrayModule, cast, half_dtype
from .plan import Plan

#: the bucket dtypes computed in float32 and rounded back where PyTorch keeps a half tensor
HALF = ("float16", "bfloat16")


@dataclass
class Work:
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
    storage: Any = None            # the bucket's dtype
    compute: Any = None            # the dtype products are computed in (float32 for half buckets)
    half: bool = False             # the bucket's dtype is one of ``HALF``

    def rounded(self, a: Array) -> Array:
        """``a`` rounded to the bucket's half dtype in place (kept in float32), where PyTorch
        stores half; ``a`` itself for other buckets."""
        return cast(cast(a, self.storage), a.dtype, out=a) if self.half else a


def residual_dtype(name: str, xp: ArrayModule) -> Any:
    """The dtype ``name`` (``PowerSGD``'s ``error_dtype``) of array module ``xp``."""
    return half_dtype(name, xp) if name in HALF else xp.dtype(name)
