"""Zero-copy passage between torch tensors and gradcomp's arrays (NumPy on the CPU, CuPy on CUDA).

Compressors only ever see NumPy or CuPy arrays, so the same code serves plain NumPy training loops
and PyTorch. A CPU tensor and its NumPy view share memory (``Tensor.numpy``); a CUDA tensor and its
CuPy view share memory through DLPack. NumPy has no bfloat16, so bfloat16 tensors pass as int16
bits re-labelled with ml_dtypes' bfloat16, again without a copy.
"""
from __future__ import annotations

import numpy as np
import torch

from ..arrays import Array, array_module, dtype_name


def as_array(tensor: torch.Tensor) -> Array:
    """A NumPy (CPU) or CuPy (CUDA) array sharing ``tensor``'s memory; writes go through."""
    t = tensor.detach()
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if t.device.type == "cuda":
        import cupy

        return cupy.from_dlpack(t)
    raise TypeError(f"gradcomp: tensors on device {t.device} are not supported (CPU and CUDA are)")


def as_tensor(array: Array) -> torch.Tensor:
    """A tensor sharing ``array``'s memory (the array must be contiguous)."""
    if array_module(array) is np:
        if dtype_name(array.dtype) == "bfloat16":
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(array)
    return torch.from_dlpack(array)


def wait_for_torch(tensor: torch.Tensor) -> None:
    """Block until every kernel torch queued on ``tensor``'s current CUDA stream has finished.

    The gradients in a DDP bucket are written by torch's current stream (which need not be the
    stream CuPy uses), and the bucket is then read by another thread (the communicator's worker),
    possibly by MPI behind CUDA's back. Only a host-side wait makes that safe. No-op on the CPU.
    """
    if tensor.is_cuda:
        torch.cuda.current_stream(tensor.device).synchronize()
