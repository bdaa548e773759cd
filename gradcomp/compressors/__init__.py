"""Compressors, and the names they are registered under.

A single-collective method is a codec (``codec``: one short module, see ``allgather``); a
multi-round one implements the two stages of ``base.Compressor`` (``gradcomp.powersgd``).
Registering a name (``gradcomp.register``) makes it available to ``gradcomp.make``, the examples'
``--compressor`` options, the benchmarks and the conformance suite, with no other edit.
"""
from __future__ import annotations

from ..registry import REGISTRY, make, register
from .allgather import Allgather
from .allreduce import Allreduce
from .base import Compressor
from .cast import BF16, FP16, Cast
from .codec import Codec
from .feedback import ErrorFeedback
from .quantize import OneBit, QuantizedAllreduce, QuantizePerChannel, QuantizePerTensor
from .sparse import RandomK, TopK


def _register_builtins() -> None:
    from functools import partial

    from ..powersgd import BatchedPowerSGD, PowerSGD

    def half(wrapper, inner):
        def factory(**kwargs):
            return wrapper(inner(**kwargs))
        return factory

    register("allreduce", Allreduce)
    register("allgather", Allgather)
    register("fp16", half(FP16, Allreduce))
    register("bf16", half(BF16, Allreduce))
    register("quantize-tensor", QuantizePerTensor)
    register("quantize-channel", QuantizePerChannel)
    # PowerSGD: rank 2 after a 10-step warm-up (one epoch of the 4-rank digits demo).
    powersgd = partial(PowerSGD, rank=2, start_iter=10)
    register("powersgd", powersgd)
    register("fp16-powersgd", half(FP16, powersgd))
    register("powersgd-noef", partial(powersgd, error_feedback=False))
    # One round per step sends half the factors each step: rank 4 costs what two-round rank 2 costs.
    register("powersgd-1round", partial(PowerSGD, rank=4, start_iter=10, rounds=1))
    # The whole-bucket square mixes layers, so it needs more rank than per-layer PowerSGD.
    register("batched-powersgd", partial(BatchedPowerSGD, rank=8, start_iter=10))

    # Two-stage quantizers and sparsifiers, with error feedback (and without, to compare).
    def feedback(codec, error_feedback=True, owner_feedback=True, **kwargs):
        inner = codec(**kwargs)
        return ErrorFeedback(inner, owner_feedback) if error_feedback else inner

    for name, codec in (("int8", partial(QuantizedAllreduce, bits=8)),
                        ("int4", partial(QuantizedAllreduce, bits=4)),
                        ("onebit", OneBit), ("topk", TopK), ("randomk", RandomK)):
        register(name, partial(feedback, codec))
        register(f"{name}-noef", partial(feedback, codec, error_feedback=False))


_register_builtins()

__all__ = ["Compressor", "Codec", "ErrorFeedback", "Allreduce", "Allgather", "Cast", "FP16", "BF16",
           "QuantizePerTensor", "QuantizePerChannel", "QuantizedAllreduce", "OneBit", "TopK",
           "RandomK", "REGISTRY", "register", "make"]
