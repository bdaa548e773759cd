"""PowerSGD (Vogels et al., NeurIPS 2019): low-rank compression with error feedback.

* ``compressor``: ``PowerSGD`` and ``BatchedPowerSGD``: parameters, which steps are compressed,
  traffic, statistics, checkpoints;
* ``local_stage``, ``ordered_stage``: the work of a compressed step's two stages, and ``work``,
  what the first hands to the second;
* ``plan``: which tensors become factors, where their P and Q blocks lie, orthogonalization;
* the products ``P = M Q``, ``Q = M^T P``, ``P Q^T`` (compiled loops or matmul) are
  ``gradcomp.kernels.products``;
* ``checkpoint``: ``state_dict`` and the checks of ``load_state_dict``.
"""
from .compressor import BatchedPowerSGD, PowerSGD
from .plan import Plan, gram_schmidt_segments, orthogonalize, should_compress

__all__ = ["PowerSGD", "BatchedPowerSGD", "Plan", "gram_schmidt_segments", "orthogonalize",
           "should_compress"]
