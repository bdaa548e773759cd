"""A stand-in for ``torch.distributed.GradBucket`` (which Python cannot construct), so that the
benchmarks (and the parity tests) can call PyTorch's own DDP hooks on the same buckets gradcomp
reduces, outside DDP. Not used by the library itself."""
from __future__ import annotations

import numpy as np
import torch


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
