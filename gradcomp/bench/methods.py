"""What the benchmarks compare, by name: gradcomp compressors and PyTorch's own DDP hooks.

Each ``Method`` says how to build itself and which other method does the same thing
(``same_as``), so the report can put "gradcomp fp16" next to "PyTorch fp16_compress_hook".
PowerSGD runs with ``start_iter=2`` (the smallest PyTorch accepts with error feedback) and the
benchmark's warm-up steps take it past that point, so the timed steps are compressed steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..compressors import BF16, FP16, Allgather, Allreduce, QuantizePerChannel, QuantizePerTensor


@dataclass(frozen=True)
class Method:
    name: str
    kind: str  # "gradcomp" or "torch"
    build: Callable  # gradcomp: () -> Compressor; torch: (world_size) -> (state, hook)
    same_as: str | None = None  # the gradcomp method a torch hook does, or vice versa
    label: str = ""
    broken: str = ""  # why it is left out of "all" (it still runs when named)
    transport: str = "mpi"  # gradcomp methods: "mpi" (MPICommunicator) or "gloo" (TorchCommunicator)


def _powersgd(rank, fp16=False, batched=False):
    def build():
        from ..compressors.powersgd import BatchedPowerSGD, PowerSGD
        inner = (BatchedPowerSGD if batched else PowerSGD)(rank=rank, start_iter=2)
        return FP16(inner) if fp16 else inner
    return build




def _torch_hook(name, **kw):
    def build(world_size):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as dh
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ph
        from torch.distributed.algorithms.ddp_comm_hooks import quantization_hooks as qh
        if name == "allreduce":
            return None, dh.allreduce_hook
        if name == "fp16":
            return None, dh.fp16_compress_hook
        if name == "bf16":
            return None, dh.bf16_compress_hook
        if name == "quantize-tensor":
            return None, qh.quantization_pertensor_hook
        if name == "quantize-channel":
            return None, qh.quantization_perchannel_hook
        if name in ("powersgd", "fp16-powersgd", "batched-powersgd"):
            state = ph.PowerSGDState(process_group=None, matrix_approximation_rank=kw["rank"],
                                     start_powerSGD_iter=2, use_error_feedback=True, warm_start=True,
                                     random_seed=0)
            hook = ph.batched_powerSGD_hook if name == "batched-powersgd" else ph.powerSGD_hook
            if name == "fp16-powersgd":
                hook = dh.fp16_compress_wrapper(hook)
            return state, hook
        raise ValueError(name)
    return build


_GLOO_QUANTIZE = ("PyTorch 2.13 over gloo: on small buckets the hook raises IndexError in "
                  "quantize_and_allgather (it indexes the all_gather future's value as NCCL returns "
                  "it); on ResNet-50 buckets gloo aborts the process ('Received data size doesn't "
                  "match expected size')")

_ALL = [
    Method("allreduce", "gradcomp", Allreduce, "torch-allreduce", "fp32 allreduce"),
    Method("fp16", "gradcomp", lambda: FP16(Allreduce()), "torch-fp16", "fp16 allreduce"),
    Method("bf16", "gradcomp", lambda: BF16(Allreduce()), "torch-bf16", "bf16 allreduce"),
    Method("allgather", "gradcomp", Allgather, None, "fp32 allgather"),
    Method("quantize-tensor", "gradcomp", QuantizePerTensor, "torch-quantize-tensor",
           "int8 per tensor"),
    Method("quantize-channel", "gradcomp", QuantizePerChannel, "torch-quantize-channel",
           "int8 per 512-channel"),
    Method("powersgd-r1", "gradcomp", _powersgd(1), "torch-powersgd-r1", "PowerSGD rank 1"),
    Method("powersgd-r4", "gradcomp", _powersgd(4), "torch-powersgd-r4", "PowerSGD rank 4"),
    Method("fp16-powersgd-r4", "gradcomp", _powersgd(4, fp16=True), "torch-fp16-powersgd-r4",
           "fp16 PowerSGD rank 4"),
    # gradcomp over torch.distributed (gloo): the same transport as PyTorch's hooks, so the
    # comparison with them isolates the compressor from MPI-versus-gloo
    Method("gloo-allreduce", "gradcomp", Allreduce, "torch-allreduce", "fp32 allreduce over gloo",
           transport="gloo"),
    Method("gloo-fp16", "gradcomp", lambda: FP16(Allreduce()), "torch-fp16", "fp16 allreduce over gloo",
           transport="gloo"),
    Method("gloo-powersgd-r4", "gradcomp", _powersgd(4), "torch-powersgd-r4", "PowerSGD rank 4 over gloo",
           transport="gloo"),
    Method("torch-allreduce", "torch", _torch_hook("allreduce"), "allreduce", "torch allreduce_hook"),
    Method("torch-fp16", "torch", _torch_hook("fp16"), "fp16", "torch fp16_compress_hook"),
    Method("torch-bf16", "torch", _torch_hook("bf16"), "bf16", "torch bf16_compress_hook"),
    Method("torch-quantize-tensor", "torch", _torch_hook("quantize-tensor"), "quantize-tensor",
           "torch quantization_pertensor_hook", broken=_GLOO_QUANTIZE),
    Method("torch-quantize-channel", "torch", _torch_hook("quantize-channel"), "quantize-channel",
           "torch quantization_perchannel_hook", broken=_GLOO_QUANTIZE),
    Method("torch-powersgd-r1", "torch", _torch_hook("powersgd", rank=1), "powersgd-r1",
           "torch powerSGD_hook rank 1"),
    Method("torch-powersgd-r4", "torch", _torch_hook("powersgd", rank=4), "powersgd-r4",
           "torch powerSGD_hook rank 4"),
    Method("torch-fp16-powersgd-r4", "torch", _torch_hook("fp16-powersgd", rank=4), "fp16-powersgd-r4",
           "torch fp16_compress_wrapper(powerSGD_hook) rank 4",
           broken="PyTorch 2.13 on the CPU: torch.bmm of a float and a half tensor raises "
                  "'expected m1 and m2 to have the same dtype' once compression starts"),
]

METHODS = {m.name: m for m in _ALL}


def torch_available() -> bool:
    try:
        import torch  # noqa: F401
        import torch.distributed  # noqa: F401
    except ImportError:
        return False
    return True


def select(spec: str, with_torch: bool | None = None) -> list[Method]:
    """Methods named in ``spec`` (comma-separated; ``all`` = every available one that works;
    ``gradcomp`` / ``torch`` = those of one kind; ``everything`` adds the PyTorch hooks that fail
    in this PyTorch version, see ``Method.broken``). Methods that need torch, where it is missing,
    are dropped from ``all`` and rejected when named explicitly."""
    if with_torch is None:
        with_torch = torch_available()

    def usable(m):
        return (m.kind != "torch" and m.transport != "gloo") or with_torch
    out = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part in ("all", "gradcomp", "torch", "everything"):
            out += [m for m in _ALL if usable(m) and part in ("all", "everything", m.kind)
                    and (part == "everything" or not m.broken)]
        elif part in METHODS:
            if not usable(METHODS[part]):
                raise ValueError(f"method {part!r} is not available here (needs torch)")
            out.append(METHODS[part])
        else:
            raise ValueError(f"unknown method {part!r}; known: {', '.join(METHODS)}")
    seen, unique = set(), []
    for m in out:
        if m.name not in seen:
            seen.add(m.name)
            unique.append(m)
    return unique
