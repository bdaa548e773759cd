"""FSDP2's parameter all-gather in int8 (or int4) chunk codes: ZeRO++'s quantized weights (qwZ).

Before each FSDP module's forward, and again before its backward when FSDP freed the full
parameters after the forward (``reshard_after_forward``, the default), FSDP all-gathers every
rank's shards into the full parameters: as many bytes as the gradients' reduce-scatter, twice
over. ``gradcomp.torch.register(model, ..., all_gather="int8")`` replaces that collective
(``FSDPModule.set_custom_all_gather``). Each rank encodes its row (its shards, laid out by FSDP)
with the two-stage codec's chunk codes (``QuantizedAllreduce.encode``: an offset and a scale per
chunk of 64 values, then one code per value), an allgather moves the messages, and every rank
decodes every row, its own included. So the full parameters that the forward and backward
compute with are the same bits on every rank.

What is rounded is only that compute copy. The shards, which the optimizer updates, stay exact,
and nothing is fed back: the rounding does not accumulate across steps, since each step encodes
the current weights afresh. There is no state to checkpoint. Only 1-D FSDP over all ranks (under
``hierarchical`` sharding inside a host the all-gather stays on the host's fast path).
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

from ..arrays import cast, is_device_array, synchronize
from ..comm import Communicator
from ..compressors.quantize import QuantizedAllreduce
from ..registry import parse_spec
from .tensors import as_array, wait_for_torch

#: the names ``all_gather=`` takes, and their code widths
BITS = {"int8": 8, "int4": 4}
#: values per chunk (one offset and scale each) unless the spec says: finer than the gradients'
#: 512, as rounded weights are what every step computes with (on the LM at 1000 steps, 64 ended
#: +0.64% on the seed where 512 ended +1.16%, for 3.56x fewer bytes instead of 3.94x)
CHUNK = 64


def gather_codec(spec: str) -> QuantizedAllreduce:
    """The codec for ``all_gather=spec``: ``"int8"`` or ``"int4"``, optionally ``:chunk=N`` (values
    per chunk with one offset and scale: a power of two from 64 to 4096, ``CHUNK`` by default)."""
    if not isinstance(spec, str):
        raise TypeError(f"gradcomp.torch.register: all_gather must be a string such as 'int8', got "
                        f"{type(spec).__name__}")
    name, kwargs = parse_spec(spec)
    if name not in BITS:
        raise ValueError(f"gradcomp.torch.register: all_gather={spec!r}: the parameter all-gather takes "
                         f"{' or '.join(map(repr, BITS))} (optionally ':chunk=N'); fp16 or bf16 parameters "
                         "come from FSDP itself (MixedPrecisionPolicy(param_dtype=...))")
    unknown = sorted(set(kwargs) - {"chunk"})
    if unknown:
        raise ValueError(f"gradcomp.torch.register: all_gather={spec!r}: unknown key(s) {unknown}; "
                         "the only key is chunk")
    return QuantizedAllreduce(BITS[name], **{"chunk": CHUNK, **kwargs})


class GatherStats:
    """The parameter all-gathers' codec (``gather_codec(spec)``), shared by every module, and their
    bytes: what each rank sent, and what FSDP's own all-gather of the same rows would have sent
    (``compression_ratio``)."""

    def __init__(self, spec: str):
        self.spec = spec
        self.codec = gather_codec(spec)
        self.calls = 0
        self.bytes_sent = 0.0
        self.bytes_uncompressed = 0.0

    def stats(self) -> dict[str, Any]:
        ratio = self.bytes_uncompressed / self.bytes_sent if self.bytes_sent else 1.0
        return {"method": self.spec, "calls": self.calls, "bytes_sent": self.bytes_sent,
                "bytes_uncompressed": self.bytes_uncompressed, "compression_ratio": ratio}


class QuantizedAllGather(AllGather):
    """One FSDP module's parameter all-gather in chunk codes (see the module docstring)."""

    def __init__(self, stats: GatherStats, comm: Callable[[], Communicator], module_name: str):
        self.codec = stats.codec
        self.comm = comm
        self.gathered = stats
        self.module_name = module_name or "<root>"

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> None:
        comm = self.comm()
        ranks = dist.get_world_size(group)
        if ranks != comm.size:
            raise ValueError(f"gradcomp.torch.fsdp: FSDP module {self.module_name!r} all-gathers over "
                             f"{ranks} ranks but gradcomp's communicator has {comm.size}")
        if input_tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"gradcomp.torch.fsdp: FSDP module {self.module_name!r} all-gathers "
                            f"{input_tensor.dtype} parameters; all_gather={self.gathered.spec!r} encodes "
                            "float32, bfloat16 or float16 ones")
        if input_tensor.is_cuda:
            wait_for_torch(input_tensor)
        codec, workspace = self.codec, comm.workspace
        mine = as_array(input_tensor)
        n = mine.shape[0]
        wide = mine
        if mine.dtype != np.float32:  # half parameters (MixedPrecisionPolicy.param_dtype): encoded from float32
            wide = cast(mine, np.float32, out=workspace.array(self, "row", n, np.float32, like=mine))
        message = workspace.array(self, "message", codec.message_size(n), np.uint8, like=mine)
        codec.encode(wide, message, workspace)
        rows = comm.allgather(message)
        out = as_array(output_tensor).reshape(ranks, n)
        for r in range(ranks):
            if out.dtype == np.float32:
                codec.decode(rows[r], out[r], workspace)
            else:  # half parameters (MixedPrecisionPolicy.param_dtype): decoded in float32, then cast
                row = workspace.array(self, "row", n, np.float32, like=mine)
                codec.decode(rows[r], row, workspace)
                cast(row, out.dtype, out=out[r])
        if is_device_array(out):
            synchronize(out)
        stats = self.gathered
        stats.calls += 1
        stats.bytes_sent += (ranks - 1) * message.nbytes
        stats.bytes_uncompressed += (ranks - 1) * n * input_tensor.element_size()
        return None
