"""Buckets: one flat, 1-D, contiguous float buffer plus the layout of the tensors packed in it.

A bucket is what DDP hands a communication hook and what a compressor reduces. ``index`` keys a
compressor's per-bucket state (error feedback, warm-start Q); ``is_last`` marks the end of a
training step (the step counter advances there); ``shapes`` lets PowerSGD see matrices again.
"""
from __future__ import annotations

import math
import zlib
from typing import Sequence

from .arrays import FLOAT_DTYPES, array_module, dtype_name


def buffer_problem(buffer) -> str | None:
    """Why ``buffer`` cannot be a bucket's buffer, or None when it can."""
    if not hasattr(buffer, "dtype") or not hasattr(buffer, "shape"):
        return f"expected a NumPy or CuPy array, got {type(buffer).__name__}"
    if buffer.ndim != 1:
        return f"bucket buffer must be 1-D, got shape {tuple(buffer.shape)}"
    if dtype_name(buffer.dtype) not in FLOAT_DTYPES:
        return f"bucket buffer must be one of {', '.join(FLOAT_DTYPES)}, got {dtype_name(buffer.dtype)}"
    if not buffer.flags.c_contiguous:
        return "bucket buffer must be contiguous (got a strided view; pass a copy)"
    return None


class Bucket:
    """A flat gradient buffer and its layout.

    ``buffer``: 1-D, contiguous, float16/bfloat16/float32/float64, NumPy or CuPy.
    ``index``: which bucket of the step this is; compressors key their state by it.
    ``shapes``: the shapes of the tensors packed back to back in ``buffer`` (default: one
    vector spanning it). ``is_last``: True for the last bucket of a step. ``scratch``: the buffer
    may be overwritten by the compressor: a temporary of gradcomp's own (a wrapper's cast copy) or
    a DDP bucket, which DDP lets hooks overwrite (PyTorch's own hooks divide it in place). Buffers
    passed to ``reduce`` / ``allreduce_gradients`` are never scratch (invariant 5).
    """

    __slots__ = ("buffer", "index", "shapes", "is_last", "scratch")

    def __init__(self, buffer, index: int = 0, shapes: Sequence[Sequence[int]] | None = None,
                 is_last: bool = True, scratch: bool = False):
        problem = buffer_problem(buffer)
        if problem:
            raise ValueError(problem)
        if shapes is None:
            shapes = [(buffer.shape[0],)]
        shapes = [tuple(int(d) for d in s) for s in shapes]
        total = sum(math.prod(s) for s in shapes)
        if total != buffer.shape[0]:
            raise ValueError(f"shapes {shapes} hold {total} values but the buffer has {buffer.shape[0]}")
        if int(index) < 0:
            raise ValueError(f"bucket index must be >= 0, got {index}")
        self.buffer = buffer
        self.index = int(index)
        self.shapes = shapes
        self.is_last = bool(is_last)
        self.scratch = bool(scratch)

    def __repr__(self):
        return (f"Bucket(numel={self.numel}, dtype={dtype_name(self.dtype)}, index={self.index}, "
                f"tensors={len(self.shapes)}, is_last={self.is_last})")

    @property
    def numel(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def dtype(self):
        return self.buffer.dtype

    def offsets(self) -> list[int]:
        """Start of each tensor in the buffer (plus the end)."""
        out = [0]
        for s in self.shapes:
            out.append(out[-1] + math.prod(s))
        return out

    def views(self, buffer=None) -> list:
        """Each tensor as a reshaped view into ``buffer`` (default: this bucket's buffer)."""
        buffer = self.buffer if buffer is None else buffer
        off = self.offsets()
        return [buffer[off[i]:off[i + 1]].reshape(s) for i, s in enumerate(self.shapes)]

    def layout_key(self) -> int:
        """A stable 63-bit digest of the layout, equal on every rank for equal layouts."""
        text = repr((self.numel, dtype_name(self.dtype), self.shapes)).encode()
        return zlib.crc32(text) | (zlib.adler32(text) << 31)

    def with_buffer(self, buffer, scratch: bool = False) -> "Bucket":
        """The same layout over another buffer (a cast copy, say; ``scratch``: see the class)."""
        return Bucket(buffer, self.index, self.shapes, self.is_last, scratch)


def pack(arrays: Sequence, bucket_cap_mb: float = 25.0) -> list[tuple[Bucket, list[int]]]:
    """Pack ``arrays`` into buckets of at most ``bucket_cap_mb`` MiB (an array larger than the
    cap gets a bucket of its own; a change of dtype or array module starts a new bucket).

    Returns ``(bucket, indices of the arrays it holds)`` pairs, buckets numbered in order, the last
    one flagged ``is_last``.
    """
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb}")
    cap = bucket_cap_mb * 2**20
    groups: list[list[int]] = []
    size = 0
    key = None
    for i, a in enumerate(arrays):
        if not hasattr(a, "dtype"):
            raise TypeError(f"array {i}: expected a NumPy or CuPy array, got {type(a).__name__}")
        k = (dtype_name(a.dtype), array_module(a).__name__)
        if groups and k == key and size + a.nbytes <= cap:
            groups[-1].append(i)
            size += a.nbytes
        else:
            groups.append([i])
            size = a.nbytes
            key = k
    out = []
    for b, members in enumerate(groups):
        first = arrays[members[0]]
        xp = array_module(first)
        flat = xp.concatenate([arrays[i].reshape(-1) for i in members]) if members else None
        shapes = [arrays[i].shape if arrays[i].ndim else (1,) for i in members]
        out.append((Bucket(flat, b, shapes, is_last=b == len(groups) - 1), members))
    return out


def unpack(result, bucket: Bucket, arrays: Sequence, members: Sequence[int]) -> None:
    """Write a reduced flat ``result`` back into the original ``arrays``, in place."""
    for view, i in zip(bucket.views(result), members):
        arrays[i][...] = view.reshape(arrays[i].shape)
