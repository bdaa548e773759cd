"""How one bucket layout is compressed by PowerSGD, worked out once per layout, and the
orthogonalization of its factors."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from ..arrays import Array, array_module, to_host


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an ``n x m`` matrix is worth sending as rank-``min(n, m, rank)`` factors: only when
    the factors are at least ``min_compression_rate`` times smaller (PyTorch's rule)."""
    r = min(n, m, rank)
    return r > 0 and (n + m) * r * min_compression_rate < n * m


def gram_schmidt_segments(a: Array, starts: Array, row_segment: Array, epsilon: float = 0.0) -> Array:
    """Orthonormalize, in place, the columns of every block of rows of ``a`` (rows x r).

    ``a`` stacks several thin matrices vertically (rows ``starts[k]`` up to the next start belong to
    matrix k; ``row_segment[i]`` is the matrix of row i), and all of them are orthogonalized at
    once: each column step is a handful of whole-array operations whatever the number of matrices,
    where a per-matrix loop would pay the interpreter once per layer.

    A column that is entirely zero (a layer whose gradient is zero) stays zero instead of becoming
    NaN: its norm is replaced by 1. (PyTorch divides by the zero norm and catches a
    ZeroDivisionError that tensor division never raises, so its guard never fires.)

    Returns a boolean array: which blocks had an all-zero column.
    """
    xp = array_module(a)
    r = a.shape[1]
    dead = xp.zeros(len(starts), dtype=bool)
    for i in range(r):
        col = a[:, i]
        norms = xp.sqrt(xp.add.reduceat(col * col, starts))
        zero = norms == 0
        dead |= zero
        if epsilon:
            norms += epsilon
        norms[zero] = 1
        col /= xp.take(norms, row_segment)
        if i + 1 < r:
            rest = a[:, i + 1:]
            dots = xp.add.reduceat(col[:, None] * rest, starts, axis=0)
            rest -= xp.take(dots, row_segment, axis=0) * col[:, None]
    return dead


@dataclass
class OrthGroup:
    """Matrices of one width ``r`` stored back to back in a P or Q region (row-major blocks)."""
    r: int
    start: int            # element offset of the first block in the region
    rows: int             # total rows of all blocks
    starts: np.ndarray    # first row of each block, relative to the group
    row_segment: np.ndarray  # block number of each row
    qr_runs: list         # (element offset, batch, rows) of consecutive blocks with equal rows
    members: list         # the blocks' matrix numbers (positions in the plan's ``matrices``)


def _orth_groups(mats: list[Matrix], order: list[int], rows_of: Callable[[Matrix], int],
                 off_attr: str) -> list[OrthGroup]:
    groups: list[OrthGroup] = []
    i = 0
    while i < len(order):
        r = mats[order[i]].r
        j = i
        while j < len(order) and mats[order[j]].r == r:
            j += 1
        members = [mats[k] for k in order[i:j]]
        rows = [rows_of(t) for t in members]
        starts = np.cumsum([0] + rows[:-1]).astype(np.intp)
        runs: list[tuple[int, int, int]] = []
        k = 0
        while k < len(members):
            e = k
            while e < len(members) and rows[e] == rows[k]:
                e += 1
            runs.append((getattr(members[k], off_attr), e - k, rows[k]))
            k = e
        groups.append(OrthGroup(r, getattr(members[0], off_attr), sum(rows), starts,
                                np.repeat(np.arange(len(rows), dtype=np.intp), rows), runs,
                                list(order[i:j])))
        i = j
    return groups


def orthogonalize(region: Array, groups: Sequence[OrthGroup], use_qr: bool,
                  epsilon: float = 0.0) -> list[int]:
    """Orthonormalize every P (or Q) block of ``region`` in place.

    Gram-Schmidt for r <= 2 and for half-precision buckets (as PyTorch does: QR has no half
    kernels), Householder QR (LAPACK, batched over blocks of equal shape) otherwise. QR of an
    all-zero block gives an orthonormal basis, never NaN; its product with the zero gradient is 0.
    Returns the matrix numbers whose block kept an all-zero column (Gram-Schmidt only).
    """
    xp = array_module(region)
    dead: list[int] = []
    for g in groups:
        if use_qr and g.r > 2:
            for start, batch, rows in g.qr_runs:
                stack = region[start:start + batch * rows * g.r].reshape(batch, rows, g.r)
                stack[...] = xp.linalg.qr(stack)[0]
        else:
            block = region[g.start:g.start + g.rows * g.r].reshape(g.rows, g.r)
            zero = gram_schmidt_segments(block, xp.asarray(g.starts), xp.asarray(g.row_segment), epsilon)
            if bool(zero.any()):
                dead.extend(g.members[k] for k in np.flatnonzero(to_host(zero)))
    return dead


@dataclass
class Matrix:
    offset: int   # first element in the (padded) input
    n: int
    m: int
    r: int
    key: str = ""   # the tensor's key (the state of its factors lives under it)
    p_off: int = 0  # first element of its P block (n x r) in the P region
    q_off: int = 0  # first element of its Q block (m x r) in the Q region


class Plan:
    """How one bucket layout is compressed.

    ``matrices``: the tensors sent as factors; ``runs``: ``(start, stop)`` ranges sent as they are
    (vectors, small or square-ish tensors), merged where adjacent. P blocks are ordered by
    ``(r, n)`` and Q blocks by ``(r, m)``, so blocks of one width form one region that is
    orthogonalized in a single pass, and blocks of one shape lie next to each other for batched QR.
    ``batches``: matrix products, consecutive same-shape matrices fused when ``batch_same_shape``.
    ``batched``: the whole bucket as one zero-padded square, keyed by ``square_key``.
    """

    def __init__(self, shapes: Sequence[Sequence[int]], keys: Sequence[str], numel: int, rank: int,
                 rate: float, batched: bool, batch_same_shape: bool, square_key: str = "square"):
        mats: list[Matrix] = []
        runs: list[tuple[int, int]] = []
        self.numel = numel
        self.padded = numel
        if batched:
            side = math.isqrt(numel - 1) + 1 if numel else 0
            if should_compress(side, side, rank, rate):
                mats.append(Matrix(0, side, side, min(side, rank), square_key))
                self.padded = side * side
            else:
                runs.append((0, numel))
        else:
            off = 0
            for shape, key in zip(shapes, keys):
                size = math.prod(shape)
                if len(shape) >= 2 and should_compress(shape[0], size // max(shape[0], 1), rank, rate):
                    n = shape[0]
                    mats.append(Matrix(off, n, size // n, min(n, size // n, rank), key))
                elif size:
                    if runs and runs[-1][1] == off:
                        runs[-1] = (runs[-1][0], off + size)
                    else:
                        runs.append((off, off + size))
                off += size
        self.matrices = mats
        self.runs = runs
        self.n_unc = sum(b - a for a, b in runs)
        p_order = sorted(range(len(mats)), key=lambda i: (mats[i].r, mats[i].n, i))
        q_order = sorted(range(len(mats)), key=lambda i: (mats[i].r, mats[i].m, i))
        self.p_size = self._place(mats, p_order, "p_off", lambda t: t.n * t.r)
        self.q_size = self._place(mats, q_order, "q_off", lambda t: t.m * t.r)
        self.p_groups = _orth_groups(mats, p_order, lambda t: t.n, "p_off")
        self.q_groups = _orth_groups(mats, q_order, lambda t: t.m, "q_off")
        # (offset, batch, n, m, r, p_off, q_off)
        self.batches: list[tuple[int, int, int, int, int, int, int]] = []
        i = 0
        while i < len(mats):
            t, j = mats[i], i + 1
            while (batch_same_shape and j < len(mats) and (mats[j].n, mats[j].m) == (t.n, t.m)
                   and mats[j].offset == mats[j - 1].offset + t.n * t.m
                   and mats[j].p_off == mats[j - 1].p_off + t.n * t.r
                   and mats[j].q_off == mats[j - 1].q_off + t.m * t.r):
                j += 1
            self.batches.append((t.offset, j - i, t.n, t.m, t.r, t.p_off, t.q_off))
            i = j
        self.numel_after = self.n_unc + sum((t.n + t.m) * t.r for t in mats)
        # the same matrices as rows (offset, n, m, r, p_off, q_off), for the compiled loops
        self.table = np.array([(t.offset, t.n, t.m, t.r, t.p_off, t.q_off) for t in mats],
                              dtype=np.int64).reshape(-1, 6)
        self.q_placements = [(t.key, t.q_off, (t.m, t.r)) for t in mats]
        self.p_placements = [(t.key, t.p_off, (t.n, t.r)) for t in mats]
        #: per dtype, the scratch rows of the ordered NumPy reconstruction (``kernels.products.Products``),
        #: made on first use and kept with the plan, so that later steps allocate nothing
        self.scratch: dict[Any, tuple[np.ndarray, np.ndarray]] = {}

    @staticmethod
    def _place(mats: list[Matrix], order: list[int], attr: str, size_of: Callable[[Matrix], int]) -> int:
        off = 0
        for i in order:
            setattr(mats[i], attr, off)
            off += size_of(mats[i])
        return off

    def views(self, x: Array, p: Array, q: Array) -> Iterator[tuple[Array, Array, Array]]:
        """(M, P, Q) views per batch: 2-D for one matrix, 3-D stacks for fused same-shape runs."""
        for off, b, n, m, r, po, qo in self.batches:
            mm = x[off:off + b * n * m]
            pp = p[po:po + b * n * r]
            qq = q[qo:qo + b * m * r]
            if b == 1:
                yield mm.reshape(n, m), pp.reshape(n, r), qq.reshape(m, r)
            else:
                yield mm.reshape(b, n, m), pp.reshape(b, n, r), qq.reshape(b, m, r)
