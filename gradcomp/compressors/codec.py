"""Codecs: single-collective compression methods, and the one runner they all share.

A codec says how to turn a vector into a message and back:

* ``message_size(n)``: the message's length (in ``message_dtype`` units) for ``n`` values;
* ``encode(x, message, workspace)``: write ``x``'s message;
* ``decode(message, out, workspace, add)``: write (or add) the message's reconstruction into
  ``out``;

and declares which collective carries it (``collective``):

* ``"allreduce"``: messages are summed element-wise on the wire, so ``decode`` must be linear
  (random-k's shared coordinates);
* ``"allgather"``: every rank's message goes to every rank, which decodes and sums them in rank
  order (top-k, the allgather quantizers);
* ``"two-stage"``: each rank encodes its bucket in ``size`` chunk-aligned slices; an alltoall hands
  every slice to its owner, which decodes and sums the ``size`` messages in rank order, encodes the
  mean, and an allgather of those messages returns it; every rank, the owner included, decodes the
  same messages, so replicas are bit-identical (int8/int4/1-bit allreduce). Bytes per rank:
  ``2(N-1)/N`` messages, flat in N. Where chunks are independent and the communicator can keep
  several exchanges in flight, a large slice goes in up to four pieces, and the owner stage of
  one runs while the next one's alltoall is on the wire (``piece_layout.Layout``; the same bits).

Any codec whose messages are decoded one by one (every collective but ``"allreduce"``, whose
coordinates are chosen per bucket) also reduce-scatters (``Bucket.scatter``, FSDP's gradients):
each rank encodes its row for each destination as one message, an alltoall hands every rank the
messages of its row, and the owner decodes and sums them in rank order and divides: the first stage
of the two-stage runner, with the rows the caller laid out and no second stage.

plus what it promises: ``error_bound`` (per element, against the exact mean, for the conformance
kit) and ``nan_effect``; its traffic (``traffic``, what the cost model prices) follows from the
collective and ``message_size``. The runner (``Codec.prepare``/``finish``) does everything else once:
widening half buckets to the codec's compute dtype, temporaries from the pipeline's workspace,
the collective, the averaging, writing into a scratch bucket, and error feedback
through the runner's ``Feedback`` interface (``ErrorFeedback``) when a codec is wrapped in it. A
new codec is one short module.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, Sequence

import numpy as np

from .. import timeline
from ..arrays import Array, DTypeLike, add_into, array_module, cast, dtype_name
from ..bucket import Bucket
from ..comm import Communicator, Workspace
from . import passes
from . import pieces as piece_layout
from .contract import Compressor, Traffic


class Feedback(Protocol):
    """What the runner asks of error feedback (``ErrorFeedback`` is the one kind): the residual
    store of the workers and of the slice owners, and how to settle what a message missed."""

    owner_feedback: bool

    def residual(self, bucket: Bucket, dtype: DTypeLike, like: Array) -> Array: ...

    def add_residual(self, bucket: Bucket, x: Array) -> None: ...

    def keep_residual(self, bucket: Bucket, x: Array, own: Array) -> None: ...

    def keep(self, flat: Array, x: Array, own: Array) -> None: ...

    def owner_residual(self, bucket: Bucket, comm: Communicator, slice_len: int, dtype: DTypeLike,
                       like: Array) -> Array: ...


class Codec(Compressor):
    """Base class of single-collective methods (see the module docstring)."""

    collective: ClassVar[str] = "allgather"
    #: the message's dtype; None: the compute dtype
    message_dtype: ClassVar[Any] = np.uint8
    #: two-stage slices hold whole multiples of this many values (the codec's chunk)
    chunk: int = 1  # a class default; a codec may set its own per instance (QuantizedAllreduce)
    #: whether each chunk is encoded on its own (no parameter spans two chunks): the two-stage
    #: runner may then cut a slice into pieces and overlap one piece's owner stage with the next
    #: piece's transfer, with the same bits as whole slices (``_layout``)
    independent_chunks: ClassVar[bool] = False
    #: whether ``encode_with_feedback`` takes a float16/bfloat16 ``x`` (the bucket itself) with a
    #: float32 residual, widening in its own pass: the runner then skips its widened copy
    half_input: ClassVar[bool] = False

    # -- the codec proper ---------------------------------------------------------------------------
    @property
    def scatters(self) -> bool:  # type: ignore[override]
        return self.collective != "allreduce"

    def message_size(self, n: int) -> int:
        raise NotImplementedError

    def encode(self, x: Array, message: Array, workspace: Workspace) -> None:
        raise NotImplementedError

    def decode(self, message: Array, out: Array, workspace: Workspace, add: bool = False) -> None:
        raise NotImplementedError

    def start(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Any:
        """Called first, in submission order, for each bucket: decisions that depend on step
        counters (random-k's coordinates). Its result is ``prepared.decision`` (see
        ``agreement_state``); default none."""
        return None

    def encode_with_feedback(self, x: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """Optional: encode ``x + residual`` and leave in ``residual`` what the message misses, in
        one pass (``ErrorFeedback`` calls it where it can), its NaN and Inf entries zeroed
        (``zero_non_finite``: a kernel that knows there are none skips that look, a pass over the
        residual). Return False, having changed nothing, where this codec or these arrays
        cannot; the runner then does it in steps."""
        return False

    def average_with_feedback(self, rows: Array, residual: Array, message: Array, workspace: Workspace) -> bool:
        """Optional, two-stage codecs: the slice owner's stage in one pass. ``rows`` holds one
        message of this slice per rank, in rank order; decode them into a zeroed slice in that
        order, divide by their number, then do what ``encode_with_feedback`` does with
        ``residual`` into ``message``, with the same bits as those steps. Return False, having
        changed nothing, where this codec or these arrays cannot; the runner then does the steps."""
        return False

    def average(self, rows: Array, n: int, dtype: DTypeLike, message: Array, workspace: Workspace) -> bool:
        """Optional, two-stage codecs: the slice owner's stage without a residual in one pass:
        decode ``rows`` (one message of the slice per rank, in rank order) into a zeroed slice of
        ``n`` values of ``dtype`` in that order, divide by their number and encode it into
        ``message``, with the bits of those steps. Return False, having changed nothing, where this
        codec or these arrays cannot; the runner then does the steps."""
        return False

    def decode_mean(self, rows: Array, out: Array, workspace: Workspace) -> bool:
        """Optional, allgathered codecs: ``out`` = the mean of the ``rows`` (every rank's message,
        in rank order) in one pass: decoded and summed into zeros in rank order, divided by their
        number, with the bits of those steps. Return False, having changed nothing, where this
        codec or these arrays cannot; the runner then does the steps."""
        return False

    def compute_dtype(self, dtype: DTypeLike) -> np.dtype:
        """The dtype ``encode`` sees: float64 buckets stay float64, others are widened to float32."""
        return np.dtype(np.float64) if dtype_name(dtype) == "float64" else np.dtype(np.float32)

    def accumulator_dtype(self, compute: DTypeLike) -> np.dtype:
        """The dtype messages are decoded and summed in (allgather and two-stage)."""
        return np.dtype(np.float64) if dtype_name(compute) == "float64" else np.dtype(np.float32)

    def traffic(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
        n = sum(math.prod(s) for s in shapes)
        unit = itemsize if self.message_dtype is None else np.dtype(self.message_dtype).itemsize
        if self.collective == "two-stage":  # one message per rank's slice of whole chunks
            chunks = -(-(-(-n // self.chunk)) // max(ranks, 1))
            pieces = max(1, min(piece_layout.MAX_PIECES, chunks // piece_layout.PIECE_CHUNKS)) if self.independent_chunks else 1
            return Traffic("two-stage", max(ranks, 1) * self.message_size(chunks * self.chunk) * unit, pieces)
        return Traffic(self.collective, self.message_size(n) * unit)

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4,
                      residuals: passes.Residuals | None = None) -> passes.Passes | None:
        """The runner's passes (``compressors.passes``) for this codec's collective and
        ``message_size``, with the ``residuals`` error feedback keeps (``ErrorFeedback`` says
        which): two-stage codes with or without them, allgathered ones without (an allreduced
        code, or an allgathered one with feedback, declares its own). Override it where ``encode``
        or ``decode`` makes passes of its own."""
        n = passes.numel(shapes)
        message = int(self.traffic(shapes, ranks, itemsize).message_bytes)  # what the runner sends
        if self.collective == "two-stage":
            compute = self.compute_dtype(np.dtype(f"f{itemsize}")).itemsize
            return passes.two_stage(n, itemsize, compute, message, ranks, residuals)
        if self.collective == "allgather" and residuals is None:
            return passes.allgathered(n, itemsize, message, ranks)
        return None

    # -- the runner -----------------------------------------------------------------------------------
    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace,
                feedback: Feedback | None = None) -> Prepared:
        """The local stage: widen, encode (with ``feedback``'s residual where given)."""
        return _prepare(self, bucket, comm, workspace, feedback)

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Prepared,
               feedback: Feedback | None = None) -> Array:
        """The ordered stage: the collective, the owners' stage (with ``feedback``'s owner
        residual where given), the mean."""
        return _finish(self, bucket, comm, prepared, feedback)


@dataclass
class Prepared:
    """A codec's local stage, handed to its ordered stage."""
    x: Any               # the (widened, error-corrected) vector that was encoded
    message: Any         # this rank's message (two-stage: see ``piece_layout.Layout``)
    decision: Any = None  # what ``Codec.start`` returned
    layout: Any = None   # two-stage: the ``piece_layout.Layout``


def _prepare(codec: Codec, bucket: Bucket, comm: Communicator, workspace: Workspace,
             feedback: Feedback | None) -> Prepared:
    g = bucket.buffer
    n = bucket.numel
    decision = codec.start(bucket, comm, workspace)
    compute = codec.compute_dtype(g.dtype)
    mtype = compute if codec.message_dtype is None else codec.message_dtype
    layout = None
    if bucket.scatter:  # one message per destination row (see the module docstring)
        slice_len, padded = n // comm.size, n
        size = codec.message_size(slice_len)
        message = workspace.array(codec, "message", comm.size * size, mtype, like=g)
        pieces = [(r * slice_len, (r + 1) * slice_len, message[r * size:(r + 1) * size]) for r in range(comm.size)]
    elif codec.collective == "two-stage":
        layout = piece_layout.layout(codec, n, comm, g)
        slice_len = layout.slice_len
        padded = slice_len * comm.size
        message = workspace.array(codec, "message", comm.size * sum(layout.sizes), mtype, like=g)
        pieces = [(r * slice_len + lo, r * slice_len + hi, layout.part(message, p, r))
                  for p, (lo, hi) in enumerate(layout.bounds) for r in range(comm.size)]
    else:
        slice_len = padded = n
        message = workspace.array(codec, "message", codec.message_size(n), mtype, like=g)
        pieces = [(0, n, message)]
    direct = g.dtype == compute or (codec.half_input and compute == np.float32
                                    and dtype_name(g.dtype) in ("float16", "bfloat16"))
    if feedback is not None and direct and _fused(codec, bucket, pieces, workspace, feedback, compute):
        return Prepared(g, message, decision, layout)
    if feedback is None and g.dtype == compute and padded == n:
        x = g  # read only
    else:
        x = workspace.array(codec, "x", padded, compute, like=g)
        cast(g, compute, out=x[:n])
        x[n:] = 0
    if feedback is not None:
        feedback.add_residual(bucket, x[:n])
    for start, stop, part in pieces:
        codec.encode(x[start:stop], part, workspace)
    if feedback is not None:
        own = workspace.array(codec, "own", padded, compute, like=g)
        for start, stop, part in pieces:
            codec.decode(part, own[start:stop], workspace)
        feedback.keep_residual(bucket, x[:n], own[:n])
    return Prepared(x, message, decision, layout)


def _fused(codec: Codec, bucket: Bucket, pieces: list[tuple[int, int, Array]], workspace: Workspace,
           feedback: Feedback, compute: DTypeLike) -> bool:
    """Encode with the residual in one pass where the codec can (``encode_with_feedback``),
    straight from the bucket and the residual store (of the ``compute`` dtype, as the steps keep
    it); False (and nothing changed) where not."""
    g = bucket.buffer
    n = bucket.numel
    residual = feedback.residual(bucket, compute, like=g)
    for k, (start, stop, part) in enumerate(pieces):
        if stop <= n:
            done = codec.encode_with_feedback(g[start:stop], residual[start:stop], part, workspace)
        else:  # the last slice runs past the bucket: padded copies (the padding's error is dropped)
            tail_g = workspace.array(codec, "tail-g", stop - start, g.dtype, like=g)
            tail_e = workspace.array(codec, "tail-e", stop - start, residual.dtype, like=g)
            tail_g[...] = 0
            tail_e[...] = 0
            if start < n:
                tail_g[:n - start] = g[start:n]
                tail_e[:n - start] = residual[start:n]
            done = codec.encode_with_feedback(tail_g, tail_e, part, workspace)
            if done and start < n:
                residual[start:n] = tail_e[:n - start]
        if not done:
            if k:
                raise RuntimeError(f"{codec.describe()}: encode_with_feedback took some slices only")
            return False
    return True


def _output(bucket: Bucket, dtype: DTypeLike) -> Array:
    """Where the mean goes: a scratch bucket of that dtype takes it itself."""
    g = bucket.buffer
    if bucket.scratch and g.dtype == dtype:
        return g
    return array_module(g).empty(bucket.numel, dtype)


def _narrow(bucket: Bucket, mean: Array) -> Array:
    g = bucket.buffer
    if mean.dtype == g.dtype:
        return mean
    return cast(mean, g.dtype, out=g if bucket.scratch else None)


def _finish(codec: Codec, bucket: Bucket, comm: Communicator, prepared: Prepared,
            feedback: Feedback | None) -> Array:
    g = bucket.buffer
    n = bucket.numel
    xp = array_module(g)
    ws = comm.workspace
    compute = codec.accumulator_dtype(prepared.x.dtype)
    size = comm.size
    message = prepared.message
    if bucket.scatter:
        return _scatter_finish(codec, bucket, comm, message, compute)
    if codec.collective == "allreduce":
        if size > 1:
            xp.divide(message, message.dtype.type(size), out=message)
        summed = comm.allreduce(message, overwrite=True)
        out = _output(bucket, compute)
        with timeline.span("decode", "decode"):
            codec.decode(summed, out, ws)
        return _narrow(bucket, out)
    if codec.collective == "allgather":
        rows = comm.allgather(message, out=ws.array(codec, "rows", size * message.shape[0],
                                                    message.dtype, like=g))
        acc = _output(bucket, compute)
        with timeline.span("decode", "decode"):
            _mean_of_rows(codec, rows, acc, ws)
        return _narrow(bucket, acc)
    # two-stage
    layout = prepared.layout
    residual = None
    if feedback is not None and feedback.owner_feedback:
        residual = feedback.owner_residual(bucket, comm, layout.slice_len, compute, like=g)
    rows = ws.array(codec, "rows", message.shape[0], message.dtype, like=g)
    gathered = ws.array(codec, "gathered", message.shape[0], message.dtype, like=g)
    out = _output(bucket, compute)
    pieces = len(layout.bounds)
    if pieces == 1:  # (the timeline's wire spans are the communicator's)
        got = comm.alltoall(message, out=rows)
        with timeline.span("owner", "decode"):
            second = _owner_stage(codec, comm, feedback, residual, got, compute, layout, 0)
        back = comm.allgather(second, out=gathered)
        with timeline.span("decode", "decode"):
            _decode_piece(codec, layout, 0, back, out, n, ws)
        return _narrow(bucket, out)
    # Piece p's owner stage runs while piece p+1's alltoall and piece p-1's allgather are on the
    # wire; every rank starts them in the same order: A0, A1, G0, A2, G1, ...
    got = [layout.block(rows, p, size).reshape(size, -1) for p in range(pieces)]
    back = [layout.block(gathered, p, size).reshape(size, -1) for p in range(pieces)]
    wire: Any = comm  # (``_layout`` cut pieces: it offers the overlapped exchanges)
    exchange = wire.start_alltoall(layout.block(message, 0, size), got[0])
    gathering = []
    for p in range(pieces):
        with timeline.span("alltoall", "wire", piece=p):
            exchange.wait()
        if p + 1 < pieces:
            exchange = wire.start_alltoall(layout.block(message, p + 1, size), got[p + 1])
        with timeline.span("owner", "decode", piece=p):
            second = _owner_stage(codec, comm, feedback, residual, got[p], compute, layout, p)
        gathering.append(wire.start_allgather(second, back[p]))
        if p:
            _gathered(codec, layout, p - 1, gathering[p - 1], back[p - 1], out, n, ws)
    _gathered(codec, layout, pieces - 1, gathering[-1], back[-1], out, n, ws)
    return _narrow(bucket, out)


def _gathered(codec: Codec, layout: piece_layout.Layout, p: int, gathering: Any, back: Array, out: Array,
              n: int, ws: Workspace) -> None:
    """Piece ``p``'s allgather ended, and its messages decoded into ``out``."""
    with timeline.span("allgather", "wire", piece=p):
        gathering.wait()
    with timeline.span("decode", "decode", piece=p):
        _decode_piece(codec, layout, p, back, out, n, ws)


def _mean_of_rows(codec: Codec, rows: Array, acc: Array, ws: Workspace) -> None:
    """``acc`` = the mean of the ``rows`` (every rank's message, in rank order): decoded and summed
    in rank order, divided by their number; in one pass where the codec can (``decode_mean``)."""
    if not codec.decode_mean(rows, acc, ws):
        acc[...] = 0
        for r in range(rows.shape[0]):
            codec.decode(rows[r], acc, ws, add=True)
        if rows.shape[0] > 1:
            array_module(acc).divide(acc, acc.dtype.type(rows.shape[0]), out=acc)


def _scatter_finish(codec: Codec, bucket: Bucket, comm: Communicator, message: Array,
                    compute: DTypeLike) -> Array:
    """A reduce-scatter's second half: every rank's message of this rank's row, decoded and summed
    in rank order, divided by their number; a new array of the row's length."""
    g = bucket.buffer
    ws = comm.workspace
    xp = array_module(g)
    rows = comm.alltoall(message, out=ws.array(codec, "rows", message.shape[0], message.dtype, like=g))
    acc = xp.empty(bucket.numel // comm.size, compute)
    with timeline.span("decode", "decode"):
        _mean_of_rows(codec, rows, acc, ws)
    return acc if acc.dtype == g.dtype else cast(acc, g.dtype)


def _decode_piece(codec: Codec, layout: piece_layout.Layout, p: int, gathered: Array, out: Array, n: int,
                  ws: Workspace) -> None:
    """Every owner's message of piece ``p`` straight into its place in ``out``; a piece past the
    bucket's end via a copy."""
    lo, hi = layout.bounds[p]
    for r in range(gathered.shape[0]):
        start, stop = r * layout.slice_len + lo, r * layout.slice_len + hi
        if stop <= n:
            codec.decode(gathered[r], out[start:stop], ws)
        elif start < n:
            tail = ws.array(codec, "tail", hi - lo, out.dtype, like=out)
            codec.decode(gathered[r], tail, ws)
            out[start:n] = tail[:n - start]


def _owner_stage(codec: Codec, comm: Communicator, feedback: Feedback | None, residual: Array | None,
                 rows: Array, compute: DTypeLike, layout: piece_layout.Layout, p: int) -> Array:
    """The slice owner's message for piece ``p``: the rows decoded and summed in rank order,
    divided by their number, encoded (with the owner's ``residual`` where it keeps one), in one
    pass where the codec can (``average_with_feedback``, ``average``), else in those steps."""
    ws = comm.workspace
    lo, hi = layout.bounds[p]

    def message() -> Array:
        return layout.owner_message(ws.array(codec, "second", sum(layout.sizes), rows.dtype, like=rows), p)

    second = message()
    if residual is not None:
        if codec.average_with_feedback(rows, residual[lo:hi], second, ws):
            return second
    elif codec.average(rows, hi - lo, compute, second, ws):
        return second
    mine = ws.array(codec, "slice", hi - lo, compute, like=rows)
    mine[...] = 0
    for r in range(comm.size):
        codec.decode(rows[r], mine, ws, add=True)
    if comm.size > 1:
        array_module(mine).divide(mine, mine.dtype.type(comm.size), out=mine)
    if residual is not None and feedback is not None:
        _encode_owner(codec, comm, feedback, residual[lo:hi], mine, second)
    else:
        codec.encode(mine, second, ws)
    return second


def _encode_owner(codec: Codec, comm: Communicator, feedback: Feedback, residual: Array,
                  mine: Array, second: Array) -> None:
    """The slice owner's error feedback: encode ``mine`` plus the owner's ``residual`` into
    ``second`` and keep what the codes miss, in one pass where the codec can
    (``encode_with_feedback``), else in steps (same bits)."""
    ws = comm.workspace
    if not codec.encode_with_feedback(mine, residual, second, ws):
        add_into(mine, residual)
        codec.encode(mine, second, ws)
        own = ws.array(codec, "own2", mine.shape[0], mine.dtype, like=mine)
        codec.decode(second, own, ws)
        feedback.keep(residual, mine, own)
