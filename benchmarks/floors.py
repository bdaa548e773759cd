"""Memory-traffic floors: the bytes each method's passes must read and write per step, per rank.

A method's compute on one rank is bounded below by the memory its passes cannot avoid: on a bucket
far larger than the caches, every pass over the gradient, the residual, a message or the output
costs its bytes at the machine's memory bandwidth, and a kernel that keeps each 512-value chunk in
the L1 cache while it does everything to it costs nothing more. ``floor(compressor, numel, ...)``
returns those bytes (``Traffic``) for the methods gradcomp ships, as their passes are laid out by
the codec runner (``compressors.codec``), for ``ranks`` ranks: the slice owner's stage of a
two-stage code covers ``1/ranks`` of the bucket, every rank decodes the whole result once.
``Traffic.seconds(bandwidth)`` turns them into time; ``memcpy_bandwidth(seconds, nbytes)`` is the
bandwidth a memcpy of ``nbytes`` measured (it reads and writes them: ``2 * nbytes`` of traffic), so
``floor / memcpy`` is ``Traffic.total / (2 * nbytes)``.

What counts (every figure per rank, per step, for a bucket of ``n`` values):

* every read of an operand and write of a result by a pass, once, whatever its dtype;
* the collectives' copies of the messages (on one rank MPI's copy from send to receive buffer, on
  more the bytes the transport reads to send and writes on receipt): the runner hands every
  collective its own buffers, so these are part of the method as shipped;
* sparse updates (top-k's scatter, its residual zeroed where sent) as the cache lines they touch
  (64 bytes read and written each, the expected number of distinct lines).

What does not: the factors, scales, indices and other O(k) or O(chunks) arrays beyond the
message itself, arithmetic (a kernel that is compute-bound shows as a ratio above 1), and writes
costing more than reads (a store to a line not in cache reads it first, where ``memcpy`` of large
buffers uses streaming stores: a write-only pass can take up to twice its bytes' share).

Every function returns the passes by name too (``Traffic.passes``), so a report, or a cost model
that picks methods per bucket, can say what the bytes are for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

#: bytes of one cache line (sparse updates touch whole lines)
LINE = 64


@dataclass(frozen=True)
class Traffic:
    """Bytes read and written by a method's passes (per rank, per step) and what they are."""
    read: float = 0.0
    write: float = 0.0
    passes: tuple[tuple[str, float, float], ...] = field(default=())

    @property
    def total(self) -> float:
        return self.read + self.write

    def __add__(self, other: Traffic) -> Traffic:
        return Traffic(self.read + other.read, self.write + other.write, self.passes + other.passes)

    def seconds(self, bandwidth: float) -> float:
        """The floor in seconds at ``bandwidth`` bytes (read + written) per second."""
        return self.total / bandwidth

    def memcpys(self, nbytes: float) -> float:
        """The floor as a multiple of a memcpy of ``nbytes`` (which reads and writes them)."""
        return self.total / (2 * nbytes) if nbytes else 0.0


def memcpy_bandwidth(seconds: float, nbytes: float) -> float:
    """Bytes read + written per second by a memcpy of ``nbytes`` that took ``seconds``."""
    return 2 * nbytes / seconds


def _pass(name: str, read: float = 0.0, write: float = 0.0) -> Traffic:
    return Traffic(float(read), float(write), ((name, float(read), float(write)),))


NONE = Traffic()


def _lines(updates: float, nbytes: float) -> float:
    """Bytes of the distinct cache lines that ``updates`` uniform random positions touch in an
    array of ``nbytes`` (each line read and written: count it for both)."""
    lines = nbytes / LINE
    if lines <= 0 or updates <= 0:
        return 0.0
    return LINE * lines * -math.expm1(-updates / lines)


# -- the methods -------------------------------------------------------------------------------------
def allreduce(n: int, itemsize: int, ranks: int) -> Traffic:
    """Exact mean of a scratch bucket: nothing on one rank (the bucket is its own mean); on more,
    the division before the sum, then the ring's reduce-scatter (each step sends a block, receives
    one and adds it) and the allgather of the sums."""
    if ranks == 1:
        return NONE
    b = n * itemsize
    block = b / ranks
    steps = ranks - 1
    return (_pass("divide by ranks", b, b)
            + _pass("ring: send, receive", steps * block, steps * block)
            + _pass("ring: add received block", 2 * steps * block, steps * block)
            + _pass("allgather of the sums", block, steps * block))


def cast(n: int, itemsize: int, half_itemsize: int, inner: Traffic) -> Traffic:
    """A half copy in, the inner method on it, the mean widened back into the bucket."""
    b, h = n * itemsize, n * half_itemsize
    return _pass("cast to half", b, h) + inner + _pass("cast back", h, b)


def two_stage(n: int, itemsize: int, compute: int, message: int, ranks: int,
              worker_feedback: bool, owner_feedback: bool) -> Traffic:
    """A two-stage code (int8, int4, onebit): ``message`` bytes encode the whole bucket.

    The worker encodes its bucket (with its residual: read and written), the alltoall moves every
    slice to its owner, the owner decodes the ``ranks`` messages of its slice, averages them, adds
    its residual and encodes (one pass, in cache: ``1/ranks`` of the bucket), the allgather
    returns every owner's message and every rank decodes all of them into its bucket."""
    b, w = n * itemsize, n * compute
    t = _pass("worker encode: gradient", b) + _pass("worker encode: message", 0, message)
    if worker_feedback:
        t += _pass("worker residual", w, w)
    t += _pass("alltoall", message, message)
    t += _pass("owner: decode the ranks' slices", message)
    if owner_feedback:
        t += _pass("owner residual", w / ranks, w / ranks)
    t += _pass("owner: encode the mean", 0, message / ranks)
    t += _pass("allgather", message / ranks, message)
    t += _pass("decode the result into the bucket", message, b)
    return t


def allgather_codec(n: int, itemsize: int, message: int, ranks: int) -> Traffic:
    """An allgathered code (the 8-bit quantizers): encode, allgather, and every rank decodes the
    ``ranks`` messages, summed in rank order and divided in one pass into the bucket."""
    b = n * itemsize
    return (_pass("encode", b, message) + _pass("allgather", message, ranks * message)
            + _pass("decode the ranks' messages, average", ranks * message, b))


def per_tensor(n: int, itemsize: int, message: int, ranks: int) -> Traffic:
    """Per-tensor quantization: the range of the whole bucket must be known before the first code
    is written, and the bucket is far larger than the caches: two reads of it."""
    return _pass("range of the bucket", n * itemsize) + allgather_codec(n, itemsize, message, ranks)


def _select(b: float, n: int, k: int, feedback: bool, sample: int) -> Traffic:
    """top-k's selection of ``k`` of ``n`` values (``b`` bytes): the threshold's strided sample
    (each value its own line), one pass over the gradient (and the residual, added and zeroed
    where sent: k lines), the message of values and int32 positions written."""
    t = _pass("threshold sample", min(sample, n) * LINE * (2 if feedback else 1))
    t += _pass("gradient: select", b)
    if feedback:
        t += _pass("residual: add, select", b, b)
        zeroed = _lines(k, b)
        t += _pass("residual zeroed where sent", zeroed, zeroed)
    return t + _pass("message", 0, 8 * k)


def topk(n: int, itemsize: int, k: int, ranks: int, feedback: bool, sample: int = 1 << 16) -> Traffic:
    """top-k: one pass adds the residual and collects the candidates at or above a threshold
    estimated from ``sample`` strided values (each its own line); the residual is zeroed where
    sent (k lines); every rank zeroes its bucket and adds the ``ranks`` messages' values at their
    positions (their lines), divided in place."""
    b = n * itemsize
    message = 8 * k
    t = _select(b, n, k, feedback, sample) + _pass("allgather", message, ranks * message)
    touched = _lines(ranks * k, b)
    t += _pass("zero the bucket", 0, b) + _pass("add the values at their positions",
                                                 ranks * message + touched, touched)
    return t


def reduced_topk(n: int, itemsize: int, k: int, ranks: int, feedback: bool, owner_feedback: bool,
                 sample: int = 1 << 16) -> Traffic:
    """top-k in two stages (``k`` values in all, ``k / ranks`` a slice): each rank selects as
    top-k does, slice by slice; the alltoall moves the slices' messages to their owners; the owner
    zeroes its slice, adds the ``ranks`` messages' values (their lines), adds its residual and
    selects the slice's top ``k / ranks`` (a pass over the slice, in cache after the adds, its
    residual zeroed where sent); the allgather returns every slice's message and every rank
    writes the bucket from them as top-k's decode does."""
    b, s = n * itemsize, n * itemsize / ranks
    message = 8 * k
    t = _select(b, n, k, feedback, sample) + _pass("alltoall", message, message)
    t += _pass("owner: zero the slice, add the ranks' values", message, s)
    if owner_feedback:
        t += _pass("owner residual: add, select", s, s)
    t += _pass("owner: message", 0, message / ranks) + _pass("allgather", message / ranks, message)
    touched = _lines(k, b)
    t += _pass("zero the bucket", 0, b) + _pass("add the values at their positions", message + touched, touched)
    return t


def randomk(n: int, itemsize: int, k: int, ranks: int, feedback: bool) -> Traffic:
    """random-k: the coordinates are known before the data moves, so one pass reads the gradient
    (and the residual, written back zero where sent), checks it for NaN and Inf (the flag that
    travels with the values) and gathers the values; the allreduce sums ``k + 1`` values; one
    pass writes the bucket: zero, and the mean at the coordinates."""
    b = n * itemsize
    values = (k + 1) * itemsize
    t = _pass("gradient: finite check, gather", b) + _pass("values", 0, values)
    if feedback:
        t += _pass("residual: add, zero where sent", b, b)
    if ranks > 1:
        t += allreduce(k + 1, itemsize, ranks)
    return t + _pass("write the bucket: zeros and the mean", values, b)


def powersgd(matrices: Sequence[tuple[int, int]], vectors: int, itemsize: int, compute: int,
             ranks: int, rank: int) -> Traffic:
    """PowerSGD: per compressed matrix M (the residual), ``M += G`` and ``P = M Q`` in one pass,
    ``Q = M^T P`` after the allreduce of P (a second read: P must be summed first), ``OUT = P Q^T``
    and ``M -= OUT`` after the allreduce of Q (a third read, and the writes); the uncompressed
    tensors travel with P (copied in and out). Factors: ``(rows + cols) * rank`` values each."""
    e = sum(r * c for r, c in matrices)
    factors = sum((r + c) * min(rank, r, c) for r, c in matrices) * compute
    t = (_pass("project: residual += gradient, P = M Q", e * (compute + itemsize), e * compute)
         + _pass("project_t: Q = M^T P", e * compute)
         + _pass("reconstruct: out = P Q^T, residual -= out", e * compute, e * (compute + itemsize)))
    if vectors:
        t += _pass("uncompressed tensors, in and out", 2 * vectors * itemsize, 2 * vectors * itemsize)
    t += _pass("factors", 2 * factors, 2 * factors)
    if ranks > 1:
        t += allreduce(vectors + factors // compute, compute, ranks)
    return t


# -- from a compressor -------------------------------------------------------------------------------
def _matrices(shapes: Sequence[Sequence[int]], rank: int, min_rate: float) -> tuple[list[tuple[int, int]], int]:
    from gradcomp.powersgd.plan import should_compress

    mats, vectors = [], 0
    for s in shapes:
        size = int(np.prod(s)) if len(s) else 1
        if len(s) >= 2:
            rows = int(s[0])
            cols = size // rows if rows else 0
            if should_compress(rows, cols, rank, min_rate):
                mats.append((rows, cols))
                continue
        vectors += size
    return mats, vectors


def floor(compressor: Any, numel: int, dtype: Any = np.float32, ranks: int = 1,
          shapes: Sequence[Sequence[int]] | None = None) -> Traffic | None:
    """The memory-traffic floor of one step of ``compressor`` on a bucket of ``numel`` values of
    ``dtype`` (with the tensor ``shapes``, which PowerSGD needs; default one vector), per rank at
    ``ranks`` ranks. None for a compressor this model does not know (a recipe or schedule: ask it
    for the stage it runs)."""
    from gradcomp.compressors import BF16, FP16, Allgather, Allreduce
    from gradcomp.compressors.feedback import ErrorFeedback
    from gradcomp.compressors.quantize import OneBit, QuantizedAllreduce, QuantizePerChannel, QuantizePerTensor
    from gradcomp.compressors.sparse import RandomK, ReducedTopK, TopK, kept
    from gradcomp.powersgd import PowerSGD

    item = np.dtype(dtype).itemsize
    shapes = [(numel,)] if shapes is None else shapes
    if isinstance(compressor, (FP16, BF16)):
        inner = floor(compressor.inner, numel, np.float16, ranks, shapes)
        return None if inner is None else cast(numel, item, 2, inner)
    if isinstance(compressor, Allreduce):
        return allreduce(numel, item, ranks)
    if isinstance(compressor, Allgather):  # the bucket itself is the message
        return allgather_codec(numel, item, numel * item, ranks)
    if isinstance(compressor, PowerSGD):
        if getattr(compressor, "batched", False):
            return None
        compute = 8 if item == 8 else 4
        mats, vectors = _matrices(shapes, compressor.rank, compressor.min_compression_rate)
        return powersgd(mats, vectors, item, compute, ranks, compressor.rank)
    feedback = isinstance(compressor, ErrorFeedback)
    codec = compressor.inner if feedback else compressor
    owner = feedback and bool(getattr(compressor, "owner_feedback", False))
    if isinstance(codec, (QuantizedAllreduce, OneBit)):
        compute = np.dtype(codec.compute_dtype(np.dtype(dtype))).itemsize
        chunk = codec.chunk
        per_slice = -(-(-(-numel // chunk)) // ranks) * chunk
        message = ranks * codec.message_size(per_slice)
        return two_stage(numel, item, compute, message, ranks, feedback, owner)
    if isinstance(codec, QuantizePerTensor) and not feedback:
        return per_tensor(numel, item, codec.message_size(numel), ranks)
    if isinstance(codec, QuantizePerChannel) and not feedback:
        return allgather_codec(numel, item, codec.message_size(numel), ranks)
    if isinstance(codec, ReducedTopK):
        per_slice = -(-numel // ranks)
        return reduced_topk(numel, item, ranks * kept(per_slice, codec.ratio), ranks, feedback, owner)
    if isinstance(codec, TopK):
        return topk(numel, item, kept(numel, codec.ratio), ranks, feedback)
    if isinstance(codec, RandomK):
        return randomk(numel, item, kept(numel, codec.ratio), ranks, feedback)
    return None
