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

__all__ = ["Compressor", "Allreduce", "Allgather", "Cast", "FP16", "BF16", "QuantizePerTensor",
           "QuantizePerChannel", "REGISTRY", "register", "make", "agree"]
