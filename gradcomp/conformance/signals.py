"""Inputs and measures the conformance checks share."""
from __future__ import annotations

import hashlib
import io
import math

import ml_dtypes
import numpy as np

LAYOUT = [(24, 16), (16,), (6, 5, 4), (1, 9), (40, 12)]
LENGTHS = [0, 1, 511, 512, 513, 1009]


def numel(layout) -> int:
    return sum(math.prod(s) for s in layout)


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def structured(layout, shared: np.random.Generator, own: np.random.Generator, noise: float = 0.1) -> np.ndarray:
    """A gradient with structure real ones have: every matrix a rank-1 product of heavy-tailed
    factors, vectors heavy-tailed, the same on every rank (``shared``), plus ``noise`` times its
    RMS of per-rank noise (``own``). Compressors that exploit low rank or sparsity capture most of
    it; returning zeros captures none."""
    parts = []
    for shape in layout:
        if len(shape) >= 2 and shape[0] > 1:
            n, m = shape[0], math.prod(shape[1:])
            part = np.outer(shared.standard_t(3, n), shared.standard_t(3, m)).ravel()
        else:
            part = shared.standard_t(3, math.prod(shape))
        rms = float(np.sqrt(np.mean(part ** 2))) if part.size else 0.0
        parts.append(part + noise * rms * own.standard_normal(part.size))
    return np.concatenate(parts) if parts else np.zeros(0)


def relative_error(out, mean) -> float:
    mean = np.asarray(mean, dtype=np.float64)
    norm = float(np.linalg.norm(mean))
    return float(np.linalg.norm(np.asarray(out, dtype=np.float64) - mean)) / norm if norm else 0.0


def tensor_of(layout, position: int) -> slice:
    """The slice of the flat bucket holding the tensor that contains ``position``."""
    start = 0
    for shape in layout:
        stop = start + math.prod(shape)
        if start <= position < stop:
            return slice(start, stop)
        start = stop
    raise IndexError(position)


def eps(dtype) -> float:
    return float(ml_dtypes.finfo(dtype).eps)


def savez_round_trip(state: dict) -> dict:
    """``state`` through ``numpy.savez`` and back without pickling, after checking it holds only
    plain arrays and numbers."""
    for key, value in state.items():
        assert isinstance(key, str), f"state key {key!r} is not a string"
        assert isinstance(value, (np.ndarray, np.generic, int, float, str)) and not isinstance(value, bool) \
            or isinstance(value, (np.ndarray, np.generic)), f"state {key!r} is not a plain array or number: {type(value)}"
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        return {k: (f[k].item() if f[k].shape == () and f[k].dtype.kind in "iufU" else f[k]) for k in f.files}
