"""Compressors, and the names they are registered under.

A single-collective method is a codec (``codec``: one short module, see ``allgather``); a
multi-round one implements the two stages of ``contract.Compressor`` (``gradcomp.powersgd``).
Registering a name (``gradcomp.register``) makes it available to ``gradcomp.make``, the examples'
``--compressor`` options, the benchmarks and the conformance suite, with no other edit; the
built-in names are recipes (``gradcomp.planning``).
"""
from __future__ import annotations

from .allgather import Allgather
from .allreduce import Allreduce
from .contract import Compressor
from .half_precision import BF16, FP16, Cast
from .codec import Codec
from .feedback import ErrorFeedback
from .pieces import set_two_stage_pieces
from .quantize import OneBit, QuantizedAllreduce, QuantizePerChannel, QuantizePerTensor
from .sparsifiers import RandomK, ReducedTopK, TopK
from .wrapper import Wrapper


__all__ = ["Compressor", "Codec", "ErrorFeedback", "Allreduce", "Allgather", "Cast", "FP16", "BF16",
           "QuantizePerTensor", "QuantizePerChannel", "QuantizedAllreduce", "OneBit", "TopK", "ReducedTopK",
           "RandomK", "Wrapper", "set_two_stage_pieces"]
