"""Planning: which compressor reduces which step. ``recipes`` (what a registered name means: warm-up,
error-feedback form, sparsity ramp), ``names`` (the built-in names, registered at import), ``cost``
(the cost model), ``auto`` (the measured choice) and ``measurements`` (what ``auto`` measures)."""
from .recipes import Recipe, sparsity_ramp

__all__ = ["Recipe", "sparsity_ramp"]
