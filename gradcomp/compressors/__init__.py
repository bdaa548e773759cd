"""Compressors and the registry that names them.

A new method is one module here plus one ``register`` line; the conformance tests and the
``--compressor NAME`` options of the examples and benchmarks pick it up from ``REGISTRY``.
"""
from __future__ import annotations

from typing import Callable

from .allgather import Allgather
from .allreduce import Allreduce
from .base import Compressor, agree
from .cast import BF16, FP16, Cast
from .powersgd import BatchedPowerSGD, PowerSGD
from .quantize import QuantizePerChannel, QuantizePerTensor

#: name -> factory building a compressor with the defaults a user would start from.
REGISTRY: dict[str, Callable[[], Compressor]] = {}


def register(name: str, factory: Callable[[], Compressor]) -> None:
    if name in REGISTRY:
        raise ValueError(f"compressor name {name!r} is already registered")
    REGISTRY[name] = factory


def make(name: str) -> Compressor:
    """A fresh compressor by registry name (see ``REGISTRY`` for the names)."""
    try:
        return REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown compressor {name!r}; known: {', '.join(REGISTRY)}") from None


register("allreduce", Allreduce)
register("allgather", Allgather)
register("fp16", lambda: FP16(Allreduce()))
register("bf16", lambda: BF16(Allreduce()))
register("quantize-tensor", QuantizePerTensor)
register("quantize-channel", QuantizePerChannel)
# PowerSGD: rank 2 after a 10-step warm-up (one epoch of the 4-rank digits demo).
register("powersgd", lambda: PowerSGD(rank=2, start_iter=10))
register("fp16-powersgd", lambda: FP16(PowerSGD(rank=2, start_iter=10)))
register("powersgd-noef", lambda: PowerSGD(rank=2, start_iter=10, error_feedback=False))
# One round per step sends half the factors each step: rank 4 costs what two-round rank 2 costs.
# The whole-bucket square mixes layers, so it needs more rank (rank 1 lost 9 points on digits).
register("powersgd-1round", lambda: PowerSGD(rank=4, start_iter=10, rounds=1))
register("batched-powersgd", lambda: BatchedPowerSGD(rank=8, start_iter=10))

__all__ = ["Compressor", "Allreduce", "Allgather", "Cast", "FP16", "BF16", "QuantizePerTensor",
           "QuantizePerChannel", "PowerSGD", "BatchedPowerSGD", "REGISTRY", "register", "make", "agree"]
