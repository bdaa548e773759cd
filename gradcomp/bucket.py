"""Buckets: one flat, 1-D, contiguous float buffer plus the layout of the tensors packed in it.

A bucket is what DDP hands a communication hook and what a compressor reduces. ``shapes`` lets
PowerSGD see matrices again; ``keys`` name the tensors, and compressors keep their state
(error-feedback residuals, warm-start factors) per key, so it follows each tensor through DDP's
bucket rebuild and into a resumed model; ``is_last`` marks the end of a training step (step
counters advance there); ``index`` is the bucket's position in the step; ``step`` is set where a
router (the governor's rungs, ``auto``) may hand a compressor some of a step's buckets and not the
last (``StepCount``). A ``scatter`` bucket asks
for a reduce-scatter instead of an allreduce (FSDP's gradients leave that way): its buffer is
``size`` equal rows, row r bound for rank r, and the result is the mean of this rank's row only.
"""
from __future__ import annotations

import math
import zlib
from typing import Any, Sequence

from .arrays import FLOAT_DTYPES, Array, array_module, dtype_name


def digest(text: str) -> int:
    """A stable 63-bit digest of ``text``, the same on every rank and run."""
    data = text.encode()
    return zlib.crc32(data) | (zlib.adler32(data) << 31)


def buffer_problem(buffer: Any) -> str | None:
    """Why ``buffer`` cannot be a bucket's buffer, or None when it can."""
    if not hasattr(buffer, "dtype") or not hasattr(buffer, "shape"):
        return f"expected a NumPy or CuPy array, got {type(buffer).__name__}"
    if buffer.ndim != 1:
        return f"bucket buffer must be 1-D, got shape {tuple(buffer.shape)}"
    if dtype_name(buffer.dtype) not in FLOAT_DTYPES:
        return f"bucket buffer must be one of {', '.join(FLOAT_DTYPES)}, got {dtype_name(buffer.dtype)}"
    if not buffer.flags.c_contiguous:
        return "bucket buffer must be contiguous (got a strided view; pass a copy)"
    if not buffer.dtype.isnative:
        return (f"bucket buffer must be in the machine's byte order, got {buffer.dtype.str!r} "
                "(pass x.astype(x.dtype.newbyteorder('=')))")
    return None


class Bucket:
    """A flat gradient buffer and its layout.

    ``buffer``: 1-D, contiguous, native byte order, float16/bfloat16/float32/float64, NumPy or CuPy.
    ``index``: which bucket of the step this is. ``shapes``: the shapes of the tensors packed back
    to back in ``buffer`` (default: one vector spanning it). ``keys``: a name per tensor, the same
    on every rank, under which compressors keep that tensor's state (default
    ``"<index>.<position>"``: state then follows the bucket index, as in PyTorch's hooks; the
    DDP hook passes parameter names, ``GradientReducer`` array positions). ``is_last``: True for
    the last bucket of a step. ``scratch``: the buffer
    may be overwritten by the compressor: a temporary of gradcomp's own (a wrapper's cast copy) or
    a DDP bucket, which DDP lets hooks overwrite (PyTorch's own hooks divide it in place). Buffers
    passed to ``reduce`` / ``allreduce_gradients`` are never scratch (DESIGN invariant 7). ``scatter``:
    the buffer holds one equal row per rank (row r for rank r, tensors may straddle rows) and the
    compressor returns the mean over ranks of this rank's row, ``numel / size`` values (the only
    exception to "output has the input's length"); only compressors that declare ``scatters`` take
    such a bucket. ``step``: None, or the step of a router that may send this compressor only
    some of a step's buckets (``routed``, read by ``StepCount``).
    """

    __slots__ = ("buffer", "index", "shapes", "keys", "is_last", "scratch", "scatter", "step")

    buffer: Array
    index: int
    shapes: list[tuple[int, ...]]
    keys: tuple[str, ...]
    is_last: bool
    scratch: bool
    scatter: bool
    step: int | None

    def __init__(self, buffer: Array, index: int = 0, shapes: Sequence[Sequence[int]] | None = None,
                 is_last: bool = True, scratch: bool = False, keys: Sequence[str] | None = None,
                 scatter: bool = False, step: int | None = None):
        problem = buffer_problem(buffer)
        if problem:
            raise ValueError(problem)
        if shapes is None:
            shapes = [(buffer.shape[0],)]
        dims = [tuple(int(d) for d in s) for s in shapes]
        total = sum(math.prod(s) for s in dims)
        if total != buffer.shape[0]:
            raise ValueError(f"shapes {dims} hold {total} values but the buffer has {buffer.shape[0]}")
        if isinstance(index, bool) or int(index) != index or index < 0:
            raise ValueError(f"bucket index must be an integer >= 0, got {index!r}")
        if keys is None:
            names = tuple(f"{int(index)}.{i}" for i in range(len(dims)))
        else:
            names = tuple(str(k) for k in keys)
            if len(names) != len(dims) or len(set(names)) != len(names):
                raise ValueError(f"keys must name each of the {len(dims)} tensors once, got {names!r}")
        self.buffer = buffer
        self.index = int(index)
        self.shapes = dims
        self.keys = names
        self.is_last = bool(is_last)
        self.scratch = bool(scratch)
        self.scatter = bool(scatter)
        self.step = None if step is None else int(step)

    def __repr__(self) -> str:
        return (f"Bucket(numel={self.numel}, dtype={dtype_name(self.dtype)}, index={self.index}, "
                f"tensors={len(self.shapes)}, is_last={self.is_last})")

    @property
    def numel(self) -> int:
        return int(self.buffer.shape[0])

    @property
    def dtype(self) -> Any:
        return self.buffer.dtype

    def offsets(self) -> list[int]:
        """Start of each tensor in the buffer (plus the end)."""
        out = [0]
        for s in self.shapes:
            out.append(out[-1] + math.prod(s))
        return out

    def views(self, buffer: Array | None = None) -> list[Array]:
        """Each tensor as a reshaped view into ``buffer`` (default: this bucket's buffer)."""
        buffer = self.buffer if buffer is None else buffer
        off = self.offsets()
        return [buffer[off[i]:off[i + 1]].reshape(s) for i, s in enumerate(self.shapes)]

    def placements(self) -> list[tuple[str, int, tuple[int, ...]]]:
        """``(key, offset, shape)`` of each tensor."""
        off = self.offsets()
        return [(k, off[i], s) for i, (k, s) in enumerate(zip(self.keys, self.shapes))]

    def layout_text(self) -> str:
        """The layout in words (for error messages): length, dtype and each tensor's key and shape."""
        tensors = ", ".join(f"{k}:{'x'.join(map(str, s)) or 'scalar'}" for k, s in zip(self.keys, self.shapes))
        rows = " in rows (reduce-scatter)" if self.scatter else ""
        return f"{self.numel} x {dtype_name(self.dtype)}{rows} [{tensors}]"

    def layout_key(self) -> int:
        """A stable 63-bit digest of the layout, equal on every rank for equal layouts."""
        return digest(self.layout_text())

    def with_buffer(self, buffer: Array, scratch: bool = False) -> Bucket:
        """The same layout over another buffer (a cast copy, say; ``scratch``: see the class)."""
        return Bucket(buffer, self.index, self.shapes, self.is_last, scratch, self.keys, self.scatter, self.step)

    def routed(self, step: int) -> Bucket:
        """This bucket as a router hands it on, stamped with the router's ``step``: the compressor
        that gets it may see only some of that step's buckets (``StepCount``)."""
        return Bucket(self.buffer, self.index, self.shapes, self.is_last, self.scratch, self.keys, self.scatter,
                      step)


class StepCount:
    """A compressor's own count of training steps: those in which it reduced at least one bucket.

    Straight from a caller, every bucket of a step arrives and the step ends at its ``is_last``
    bucket. Behind a router that moves tensors between methods on its own (the governor's
    rungs, ``auto``), a method may get some of a step's buckets and not the last: the router
    stamps each bucket with its own step (``Bucket.routed``), and a new stamp ends the step that
    was open. ``take`` gives each bucket its step number; ``count`` is the steps seen, the one in
    progress included (what a checkpoint taken between steps saves)."""

    def __init__(self, count: int = 0):
        self.done = int(count)
        self._open: int | None = None  # the router's stamp of a step seen without its last bucket

    @property
    def count(self) -> int:
        return self.done + (self._open is not None)

    def peek(self, bucket: Bucket) -> int:
        """The step ``take`` would give ``bucket``, counting nothing."""
        return self.done + (self._open is not None and bucket.step != self._open)

    def take(self, bucket: Bucket) -> int:
        """``bucket``'s step in this count (see the class)."""
        step = self.peek(bucket)
        self.done = step + bucket.is_last
        self._open = None if bucket.is_last else bucket.step
        return step


def group(arrays: Sequence[Array], bucket_cap_mb: float = 25.0) -> list[list[int]]:
    """Which arrays share a bucket: consecutive arrays of one dtype and array module, at most
    ``bucket_cap_mb`` MiB each (an array larger than the cap gets a bucket of its own)."""
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be > 0, got {bucket_cap_mb!r}")
    cap = bucket_cap_mb * 2**20
    groups: list[list[int]] = []
    size = 0
    key: tuple[str, str] | None = None
    for i, a in enumerate(arrays):
        if type(a).__module__.split(".")[0] == "torch":
            raise TypeError(f"array {i}: got a torch tensor: use gradcomp.torch (a DDP hook), or pass "
                            "NumPy views of CPU tensors (tensor.numpy())")
        if not hasattr(a, "dtype") or not hasattr(a, "shape"):
            raise TypeError(f"array {i}: expected a NumPy or CuPy array, got {type(a).__name__}")
        if dtype_name(a.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"array {i}: gradients must be float16/bfloat16/float32/float64, "
                            f"got {dtype_name(a.dtype)}")
        k = (dtype_name(a.dtype), array_module(a).__name__)
        if groups and k == key and size + a.nbytes <= cap:
            groups[-1].append(i)
            size += a.nbytes
        else:
            groups.append([i])
            size = a.nbytes
            key = k
    return groups


def pack(arrays: Sequence[Array], bucket_cap_mb: float = 25.0) -> list[tuple[Bucket, list[int]]]:
    """``arrays`` copied into new buckets (see ``group``), keyed by array position, in the
    machine's byte order. Returns ``(bucket, indices of the arrays it holds)`` pairs, the last
    bucket flagged ``is_last``. ``GradientReducer`` keeps such buckets from step to step."""
    groups = group(arrays, bucket_cap_mb)
    out: list[tuple[Bucket, list[int]]] = []
    for b, members in enumerate(groups):
        first = arrays[members[0]]
        xp = array_module(first)
        shapes = [arrays[i].shape if arrays[i].ndim else (1,) for i in members]
        flat = xp.empty(sum(math.prod(s) for s in shapes), first.dtype.newbyteorder("="))
        bucket = Bucket(flat, b, shapes, is_last=b == len(groups) - 1, keys=[str(i) for i in members])
        copy_in(bucket, arrays, members)
        out.append((bucket, members))
    return out


def copy_in(bucket: Bucket, arrays: Sequence[Array], members: Sequence[int]) -> None:
    """Copy ``arrays[members]`` into the bucket's buffer, back to back."""
    for view, i in zip(bucket.views(), members):
        view[...] = arrays[i].reshape(view.shape)


def unpack(result: Array, bucket: Bucket, arrays: Sequence[Array], members: Sequence[int]) -> None:
    """Write a reduced flat ``result`` back into the original ``arrays``, in place."""
    for view, i in zip(bucket.views(result), members):
        arrays[i][...] = view.reshape(arrays[i].shape)
