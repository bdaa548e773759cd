"""PyTorch adapter: every gradcomp compressor as a DDP communication hook.

    import gradcomp.torch as gt
    launch = gt.init_process_group()           # under `mpiexec -n 4 python train.py`, or torchrun
    model = DistributedDataParallel(net.to(launch.device))
    gt.register(model, gradcomp.FP16(gradcomp.Allreduce()))
    # or an FSDP2 model: fully_shard(block) for each block, fully_shard(net); gt.register(net, "int8")

Importing ``gradcomp`` never imports torch (DESIGN invariant 6); only ``import gradcomp.torch`` does.
``TorchCommunicator`` runs the compressors over torch.distributed instead of MPI (torchrun picks
it). ``HookState.state_dict()`` checkpoints a compressor as tensors (``torch.save``).

The frameworks that wrap models in DDP themselves have their own entry points, imported on their
own (each imports its framework): ``gradcomp.torch.lightning.Compression`` (a Lightning callback),
``gradcomp.torch.accelerate.register`` and ``gradcomp.torch.transformers.Compression`` (a
Trainer callback); see docs/guides/frameworks.md.

``DiLoCo`` is the other way to send less: local steps of any torch optimizer on an unwrapped
model, with a compressed outer step every ``sync_every`` steps (docs/guides/local-steps.md).
"""
from .communicator import TorchCommunicator
from .diloco import DiLoCo
from .fsdp import FSDPState
from .hook import (HookRegisteredTwice, HookState, comm_hook, default_comm, gradcomp_hook,
                   plain_ddp_stats, register)
from .launch import Launch, init_process_group
from .optim import DGC, OneBitAdam, local_hook

__all__ = ["register", "comm_hook", "init_process_group", "Launch", "TorchCommunicator",
           "HookState", "HookRegisteredTwice", "FSDPState", "gradcomp_hook", "default_comm",
           "OneBitAdam", "DGC", "local_hook", "plain_ddp_stats", "DiLoCo"]
