"""PyTorch adapter: every gradcomp compressor as a DDP communication hook.

    import gradcomp.torch as gt
    launch = gt.init_process_group()           # under `mpiexec -n 4 python train.py`, or torchrun
    model = DistributedDataParallel(net.to(launch.device))
    gt.register(model, gradcomp.FP16(gradcomp.Allreduce()))

Importing ``gradcomp`` never imports torch (DESIGN invariant 6); only ``import gradcomp.torch`` does.
``TorchCommunicator`` runs the compressors over torch.distributed instead of MPI (torchrun picks
it). ``HookState.state_dict()`` checkpoints a compressor as tensors (``torch.save``).
"""
from .communicator import TorchCommunicator
from .hook import HookState, comm_hook, default_comm, gradcomp_hook, plain_ddp_stats, register
from .launch import Launch, init_process_group
from .optim import DGC, OneBitAdam, local_hook

__all__ = ["register", "comm_hook", "init_process_group", "Launch", "TorchCommunicator",
           "HookState", "gradcomp_hook", "default_comm", "OneBitAdam", "DGC", "local_hook",
           "plain_ddp_stats"]
