"""Quantizers: affine codes per 512-value chunk, allgathered (``allgather``, as PyTorch's hooks)
or in two stages with flat traffic (``twostage``: int8, int4), and 1-bit signs with a scale per
chunk (``onebit``). Their kernels, NumPy and compiled, are ``gradcomp.kernels.affine`` and
``gradcomp.kernels.signcodes``."""
from .allgather import QuantizePerChannel, QuantizePerTensor
from .onebit import OneBit
from .twostage import QuantizedAllreduce

__all__ = ["QuantizePerChannel", "QuantizePerTensor", "QuantizedAllreduce", "OneBit"]
