"""Zero-copy passage between torch tensors and gradcomp's arrays (NumPy on the CPU, CuPy on CUDA).

Compressors only ever see NumPy or CuPy arrays, so the same code serves plain NumPy training loops
and PyTorch. A CPU tensor and its NumPy view share memory (``Tensor.numpy``); a CUDA tensor and its
CuPy view share memory through DLPack. NumPy has no bfloat16, so bfloat16 tensors pass as int16
bits re-labelled with ml_dtypes' bfloat16, again without a copy.
"""
from __future__ import annotations

import numpy as np
import torch

from ..arrays import array_module, dtype_name


def as_array(tensor: torch.Tensor):
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


def as_tensor(array) -> torch.Tensor:
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


class HookBucket:
    """What PyTorch's own DDP hooks read from a ``dist.GradBucket``, which Python cannot construct.

    Lets parity tests and benchmarks call ``powerSGD_hook``, ``fp16_compress_hook`` and friends on
    the same buckets gradcomp reduces, outside DDP. ``tensor`` is the flat bucket; ``shapes`` the
    gradients packed in it, back to back.
    """

    def __init__(self, tensor: torch.Tensor, index: int, shapes, is_last: bool):
        self._tensor, self._index, self._is_last = tensor, index, is_last
        self._shapes = [tuple(s) for s in shapes]

    def buffer(self) -> torch.Tensor:
        return self._tensor

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def gradients(self) -> list:
        out, off = [], 0
        for s in self._shapes:
            n = int(np.prod(s))
            out.append(self._tensor[off:off + n].view(s))
            off += n
        return out

    parameters = gradients  # the hooks only need their shapes
