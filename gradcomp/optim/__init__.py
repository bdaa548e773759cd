"""Optimizers whose compression needs the optimizer's own state: NumPy/CuPy arrays in.

A gradient hook sees one gradient at a time and cannot know what the optimizer does with it. Two
families of methods that cut bytes 25-250x need exactly that:

* ``OneBitAdam`` (Tang et al. 2021, DeepSpeed's ``OnebitAdam``): exact Adam for a warm-up, then the
  variance is frozen and the *momentum* travels through a compressed allreduce with error feedback
  at the workers and at the slice owners (``onebit``'s exchange). Adam's variance is what makes
  error feedback on raw gradients fail; frozen, Adam is a preconditioned momentum method and the
  feedback works again.
* ``DGC`` (Lin et al. 2018, Deep Gradient Compression) for momentum-SGD users: each worker keeps
  its own velocity, accumulates it, and sends the top-k of the accumulation (momentum correction);
  the momentum of what was sent is cleared (factor masking), gradients can be clipped locally, and
  the sparsity ramps up over a warm-up.

Both take the local gradients of every rank (no prior averaging) and do all communication
themselves, through a ``GradientReducer`` over the communicator, so they keep gradcomp's guarantees:
bit-identical parameters on every rank, configuration and state agreed before data moves,
checkpoints of plain arrays. ``gradcomp.torch.OneBitAdam`` / ``gradcomp.torch.DGC`` wrap them as
``torch.optim.Optimizer``.

``DiLoCo`` (Douillard et al. 2023) cuts the number of exchanges instead: each rank takes
``sync_every`` steps of its own inner optimizer, then the ranks average their pseudo-gradients
(parameters at the last sync minus now) through any compressor, error feedback kept across outer
steps, and an outer optimizer steps the synced parameters (``gradcomp.torch.DiLoCo``,
``gradcomp.jax.diloco``; docs/guides/local-steps.md).
"""
from .adam import BUDGET as ONEBITADAM_BUDGET
from .adam import WARMUP_COMPRESSOR, OneBitAdam
from .optimizer import Optimizer
from .dgc import DGC
from .dgc import WARMUP as DGC_WARMUP
from .diloco import DiLoCo
from ..planning.governor import BUDGET as GOVERNOR_BUDGET

__all__ = ["Optimizer", "OneBitAdam", "DGC", "DiLoCo"]
