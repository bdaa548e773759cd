"""Where each rank's slice, and each piece of it, sits in a two-stage codec's message.

The two-stage runner (``codec``) gives every rank one chunk-aligned slice of the bucket; where the
codec's chunks are independent and the communicator can keep several exchanges in flight, a large
slice goes in up to ``MAX_PIECES`` pieces, so that the owner stage of one piece runs while the next
one's alltoall is on the wire (the same bits as whole slices). ``layout`` decides the pieces,
``Layout`` finds them in the message.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..arrays import Array
from ..comm import Communicator


#: a two-stage slice is cut into at most this many pieces (1: whole slices, the schedule before
#: pieces; the same bits either way), of at least ``PIECE_CHUNKS`` chunks
MAX_PIECES = 4
PIECE_CHUNKS = 128


def set_two_stage_pieces(pieces: int) -> int:
    """The pieces ablation: cut a two-stage slice (``int8``, ``int4``, ...) into at most ``pieces``
    pieces from now on, in this process (1: whole slices, the schedule before pieces; the same
    bits either way, only the overlap changes). Returns the previous limit, to put back. Every rank
    must set the same (a different one changes the collectives). The benchmarks' worker sets it
    from ``GRADCOMP_TWO_STAGE_PIECES``; the library reads no such variable."""
    from ..params import check_int

    global MAX_PIECES
    previous, MAX_PIECES = MAX_PIECES, check_int("pieces", pieces, 1)
    return previous


@dataclass
class Layout:
    """Where each piece of each rank's slice sits in the two-stage message.

    Every rank owns one slice of ``slice_len`` values; each slice is cut into the same pieces
    (``bounds[p]``: values ``lo:hi`` of the slice, chunk-aligned) and the message holds piece
    after piece, each piece as ``size`` codec messages of ``sizes[p]`` units, owner after owner,
    from ``offsets[p]``: one alltoall and one allgather per piece. One piece is the plain layout
    (slice after slice)."""
    slice_len: int
    bounds: list[tuple[int, int]]
    sizes: list[int]
    offsets: list[int]

    def part(self, message: Array, p: int, r: int) -> Array:
        start = self.offsets[p] + r * self.sizes[p]
        return message[start:start + self.sizes[p]]

    def block(self, message: Array, p: int, size: int) -> Array:
        return message[self.offsets[p]:self.offsets[p] + size * self.sizes[p]]

    def owner_message(self, buffer: Array, p: int) -> Array:
        """Piece ``p``'s place in ``buffer``, which holds one message per piece back to back (the
        owner's: the allgather of piece p-1 may still be reading its own while p is encoded)."""
        start = sum(self.sizes[:p])
        return buffer[start:start + self.sizes[p]]


def layout(codec: Any, n: int, comm: Communicator, like: Array) -> Layout:
    chunks = -(-n // codec.chunk)
    per_slice = -(-chunks // comm.size)
    slice_len = per_slice * codec.chunk
    pieces = 1
    overlaps = getattr(comm, "overlaps", None)  # (a Communicator need not offer it)
    if codec.independent_chunks and overlaps is not None and overlaps(like):
        pieces = max(1, min(MAX_PIECES, per_slice // PIECE_CHUNKS))
    bounds, sizes, offsets, at = [], [], [], 0
    for p in range(pieces):
        lo, hi = (per_slice * p // pieces) * codec.chunk, (per_slice * (p + 1) // pieces) * codec.chunk
        bounds.append((lo, hi))
        sizes.append(codec.message_size(hi - lo))
        offsets.append(at)
        at += comm.size * sizes[-1]
    return Layout(slice_len, bounds, sizes, offsets)
