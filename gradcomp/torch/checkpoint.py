"""Compressor state in PyTorch's checkpoint form: tensors and plain Python values only, so that
``torch.save`` / ``torch.load(weights_only=True)`` carry it (NumPy arrays would need
``weights_only=False``, i.e. unpickling arbitrary objects)."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from ..arrays import dtype_name

# NumPy dtypes torch has no tensor type for travel as int64 (their values fit exactly)
_WIDENED = ("uint32", "uint16")


def to_torch_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """NumPy arrays -> CPU tensors (bfloat16 included), NumPy text (a warm-up's reason) -> ``str``;
    numbers and strings unchanged."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            name = dtype_name(value.dtype)
            if value.dtype.kind in "US":  # torch has no text tensor
                out[key] = value.item() if value.ndim == 0 else value.tolist()
            elif name == "bfloat16":
                out[key] = torch.from_numpy(np.ascontiguousarray(value).view(np.int16).copy()).view(torch.bfloat16)
            elif name in _WIDENED:
                out[key] = torch.from_numpy(value.astype(np.int64))
            else:
                out[key] = torch.from_numpy(np.array(value, copy=True))
        elif isinstance(value, np.generic):
            out[key] = value.item()
        else:
            out[key] = value
    return out


def from_torch_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """Tensors -> NumPy arrays (bfloat16 as ml_dtypes' bfloat16); other values unchanged."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu()
            if t.dtype == torch.bfloat16:
                import ml_dtypes

                out[key] = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16).copy()
            else:
                out[key] = t.numpy().copy()
        else:
            out[key] = value
    return out
