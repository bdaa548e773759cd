"""A step's passes over memory: the bytes a method must read and write per step, per rank.

A method's compute on one rank is bounded below by the memory its passes cannot avoid: on a bucket
far larger than the caches, every pass over the gradient, the residual, a message or the output
costs its bytes at the machine's memory bandwidth, and a kernel that keeps each 512-value chunk in
the L1 cache while it does everything to it costs nothing more. Each method declares its passes
(``Compressor.memory_passes``) as the codec runner (``compressors.codec``) lays them out, for
``ranks`` ranks: the slice owner's stage of a two-stage code covers ``1/ranks`` of the bucket,
every rank decodes the whole result once. This module holds the typed result (``Passes``) and the
formulas the methods share; the benchmarks turn the bytes into seconds (``benchmarks/floors.py``).

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
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

#: bytes of one cache line (sparse updates touch whole lines)
LINE = 64


class Pass(NamedTuple):
    """One pass over memory: what it is for, the bytes it reads and the bytes it writes."""
    name: str
    read: float
    write: float


@dataclass(frozen=True)
class Passes:
    """Bytes read and written by a step's passes (per rank) and the passes by name, in order."""
    read: float = 0.0
    write: float = 0.0
    passes: tuple[Pass, ...] = field(default=())

    @property
    def total(self) -> float:
        return self.read + self.write

    def __add__(self, other: Passes) -> Passes:
        return Passes(self.read + other.read, self.write + other.write, self.passes + other.passes)


@dataclass(frozen=True)
class Residuals:
    """Which residuals error feedback keeps around a codec (``ErrorFeedback`` tells its codec): the
    worker's always, the slice owner's too where ``owner`` (two-stage codecs)."""
    owner: bool = False


NONE = Passes()

#: a bucket's tensor shapes, as ``Compressor.traffic`` and ``memory_passes`` take them
Shapes = Sequence[Sequence[int]]


def numel(shapes: Shapes) -> int:
    """Values in a bucket of tensors of ``shapes``."""
    return sum(math.prod(s) for s in shapes)


def one(name: str, read: float = 0.0, write: float = 0.0) -> Passes:
    """A single named pass."""
    return Passes(float(read), float(write), (Pass(name, float(read), float(write)),))


def lines(updates: float, nbytes: float) -> float:
    """Bytes of the distinct cache lines that ``updates`` uniform random positions touch in an
    array of ``nbytes`` (each line read and written: count it for both)."""
    count = nbytes / LINE
    if count <= 0 or updates <= 0:
        return 0.0
    return LINE * count * -math.expm1(-updates / count)


# -- the collectives and the runners ------------------------------------------------------------------
def allreduce(n: int, itemsize: int, ranks: int) -> Passes:
    """Exact mean of a scratch bucket: nothing on one rank (the bucket is its own mean); on more,
    the division before the sum, then the ring's reduce-scatter (each step sends a block, receives
    one and adds it) and the allgather of the sums."""
    if ranks == 1:
        return NONE
    b = n * itemsize
    block = b / ranks
    steps = ranks - 1
    return (one("divide by ranks", b, b)
            + one("ring: send, receive", steps * block, steps * block)
            + one("ring: add received block", 2 * steps * block, steps * block)
            + one("allgather of the sums", block, steps * block))


def half_cast(n: int, itemsize: int, half_itemsize: int, inner: Passes) -> Passes:
    """A half copy in, the inner method on it, the mean widened back into the bucket."""
    b, h = n * itemsize, n * half_itemsize
    return one("cast to half", b, h) + inner + one("cast back", h, b)


def two_stage(n: int, itemsize: int, compute: int, message: int, ranks: int,
              residuals: Residuals | None) -> Passes:
    """A two-stage code (int8, int4, onebit): ``message`` bytes encode the whole bucket.

    The worker encodes its bucket (with its residual: read and written), the alltoall moves every
    slice to its owner, the owner decodes the ``ranks`` messages of its slice, averages them, adds
    its residual and encodes (one pass, in cache: ``1/ranks`` of the bucket), the allgather
    returns every owner's message and every rank decodes all of them into its bucket."""
    b, w = n * itemsize, n * compute
    t = one("worker encode: gradient", b) + one("worker encode: message", 0, message)
    if residuals is not None:
        t += one("worker residual", w, w)
    t += one("alltoall", message, message)
    t += one("owner: decode the ranks' slices", message)
    if residuals is not None and residuals.owner:
        t += one("owner residual", w / ranks, w / ranks)
    t += one("owner: encode the mean", 0, message / ranks)
    t += one("allgather", message / ranks, message)
    t += one("decode the result into the bucket", message, b)
    return t


def allgathered(n: int, itemsize: int, message: int, ranks: int) -> Passes:
    """An allgathered code (the 8-bit quantizers, the values themselves): encode, allgather, and
    every rank decodes the ``ranks`` messages, summed in rank order and divided in one pass into
    the bucket."""
    b = n * itemsize
    return (one("encode", b, message) + one("allgather", message, ranks * message)
            + one("decode the ranks' messages, average", ranks * message, b))


# -- the sparsifiers (compressors.sparsifiers) -----------------------------------------------------
def _select(b: float, n: int, k: int, feedback: bool, sample: int) -> Passes:
    """top-k's selection of ``k`` of ``n`` values (``b`` bytes): the threshold's strided sample
    (each value its own line), one pass over the gradient (and the residual, added and zeroed
    where sent: k lines), the message of values and int32 positions written."""
    t = one("threshold sample", min(sample, n) * LINE * (2 if feedback else 1))
    t += one("gradient: select", b)
    if feedback:
        t += one("residual: add, select", b, b)
        zeroed = lines(k, b)
        t += one("residual zeroed where sent", zeroed, zeroed)
    return t + one("message", 0, 8 * k)


def topk(n: int, itemsize: int, k: int, ranks: int, feedback: bool, sample: int = 1 << 16) -> Passes:
    """top-k: one pass adds the residual and collects the candidates at or above a threshold
    estimated from ``sample`` strided values (each its own line); the residual is zeroed where
    sent (k lines); every rank zeroes its bucket and adds the ``ranks`` messages' values at their
    positions (their lines), divided in place."""
    b = n * itemsize
    message = 8 * k
    t = _select(b, n, k, feedback, sample) + one("allgather", message, ranks * message)
    touched = lines(ranks * k, b)
    t += one("zero the bucket", 0, b) + one("add the values at their positions",
                                            ranks * message + touched, touched)
    return t


def reduced_topk(n: int, itemsize: int, k: int, ranks: int, feedback: bool, owner_feedback: bool,
                 sample: int = 1 << 16) -> Passes:
    """top-k in two stages (``k`` values in all, ``k / ranks`` a slice): each rank selects as
    top-k does, slice by slice; the alltoall moves the slices' messages to their owners; the owner
    zeroes its slice, adds the ``ranks`` messages' values (their lines), adds its residual and
    selects the slice's top ``k / ranks`` (a pass over the slice, in cache after the adds, its
    residual zeroed where sent); the allgather returns every slice's message and every rank
    writes the bucket from them as top-k's decode does."""
    b, s = n * itemsize, n * itemsize / ranks
    message = 8 * k
    t = _select(b, n, k, feedback, sample) + one("alltoall", message, message)
    t += one("owner: zero the slice, add the ranks' values", message, s)
    if owner_feedback:
        t += one("owner residual: add, select", s, s)
    t += one("owner: message", 0, message / ranks) + one("allgather", message / ranks, message)
    touched = lines(k, b)
    t += one("zero the bucket", 0, b) + one("add the values at their positions", message + touched, touched)
    return t


def randomk(n: int, itemsize: int, k: int, ranks: int, feedback: bool) -> Passes:
    """random-k: the coordinates are known before the data moves, so one pass reads the gradient
    (and the residual, written back zero where sent), checks it for NaN and Inf (the flag that
    travels with the values) and gathers the values; the allreduce sums ``k + 1`` values; one
    pass writes the bucket: zero, and the mean at the coordinates."""
    b = n * itemsize
    values = (k + 1) * itemsize
    t = one("gradient: finite check, gather", b) + one("values", 0, values)
    if feedback:
        t += one("residual: add, zero where sent", b, b)
    if ranks > 1:
        t += allreduce(k + 1, itemsize, ranks)
    return t + one("write the bucket: zeros and the mean", values, b)
