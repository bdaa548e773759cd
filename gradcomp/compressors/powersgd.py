"""PowerSGD: rank-r gradient compression with error feedback (Vogels et al., NeurIPS 2019).

Each gradient tensor is viewed as a matrix ``M`` of shape ``(shape[0], -1)`` and replaced by a
product ``P Q^T`` of two thin matrices found by one step of power iteration, with the previous
step's ``Q`` as the starting point (warm start). Ranks exchange only ``P`` and ``Q``. What the
approximation misses is kept locally and added to the next step's gradient (error feedback), so
nothing is lost for good, only delayed.

The semantics follow PyTorch's ``powerSGD_hook`` (``torch/distributed/algorithms/ddp_comm_hooks/
powerSGD_hook.py``); the differences are deliberate and listed in ``PowerSGD``'s docstring.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from ..arrays import add_into, array_module, cast, dtype_name, half_dtype, subtract_into, to_host
from ..bucket import Bucket
from ..comm import Communicator
from .allreduce import mean_allreduce
from .base import Compressor

HALF = ("float16", "bfloat16")


def should_compress(n: int, m: int, rank: int, min_compression_rate: float) -> bool:
    """Whether an ``n x m`` matrix is worth sending as rank-``min(n, m, rank)`` factors: only when
    the factors are at least ``min_compression_rate`` times smaller (PyTorch's rule)."""
    r = min(n, m, rank)
    return r > 0 and (n + m) * r * min_compression_rate < n * m


# ---------------------------------------------------------------------------------------------
# Orthogonalization
# ---------------------------------------------------------------------------------------------
def gram_schmidt_segments(a, starts, row_segment, epsilon: float = 0.0):
    """Orthonormalize, in place, the columns of every block of rows of ``a`` (rows x r).

    ``a`` stacks several thin matrices vertically (rows ``starts[k]`` up to the next start belong to
    matrix k; ``row_segment[i]`` is the matrix of row i), and all of them are orthogonalized at
    once: each column step is a handful of whole-array operations whatever the number of matrices,
    where a per-matrix loop would pay the interpreter once per layer.

    A column that is entirely zero (a layer whose gradient is zero) stays zero instead of becoming
    NaN: its norm is replaced by 1. PyTorch divides by the zero norm and tries to catch a
    ZeroDivisionError that tensor division never raises, so its guard never fires.

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
class _OrthGroup:
    """Matrices of one width ``r`` stored back to back in a P or Q region (row-major blocks)."""
    r: int
    start: int            # element offset of the first block in the region
    rows: int             # total rows of all blocks
    starts: np.ndarray    # first row of each block, relative to the group
    row_segment: np.ndarray  # block number of each row
    qr_runs: list         # (element offset, batch, rows) of consecutive blocks with equal rows
    members: list         # the blocks' matrix numbers (positions in the plan's ``matrices``)


def _orth_groups(mats, order, rows_of, off_attr):
    groups, i = [], 0
    while i < len(order):
        r = mats[order[i]].r
        j = i
        while j < len(order) and mats[order[j]].r == r:
            j += 1
        members = [mats[k] for k in order[i:j]]
        rows = [rows_of(t) for t in members]
        starts = np.cumsum([0] + rows[:-1]).astype(np.intp)
        runs, k = [], 0
        while k < len(members):
            e = k
            while e < len(members) and rows[e] == rows[k]:
                e += 1
            runs.append((getattr(members[k], off_attr), e - k, rows[k]))
            k = e
        groups.append(_OrthGroup(r, getattr(members[0], off_attr), sum(rows), starts,
                                 np.repeat(np.arange(len(rows), dtype=np.intp), rows), runs,
                                 list(order[i:j])))
        i = j
    return groups


def orthogonalize(region, groups, use_qr: bool, epsilon: float = 0.0) -> list[int]:
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


# ---------------------------------------------------------------------------------------------
# Per-layout plan
# ---------------------------------------------------------------------------------------------
@dataclass
class _Matrix:
    offset: int   # first element in the (padded) input
    n: int
    m: int
    r: int
    p_off: int = 0  # first element of its P block (n x r) in the P region
    q_off: int = 0  # first element of its Q block (m x r) in the Q region


class _Plan:
    """How one bucket layout is compressed, worked out once per layout.

    ``matrices``: the tensors sent as factors; ``runs``: ``(start, stop)`` ranges sent as they are
    (vectors, small or square-ish tensors), merged where adjacent. P blocks are ordered by
    ``(r, n)`` and Q blocks by ``(r, m)``, so blocks of one width form one region that is
    orthogonalized in a single pass, and blocks of one shape lie next to each other for batched QR.
    ``batches``: matrix products, consecutive same-shape matrices fused when ``batch_same_shape``.
    """

    def __init__(self, shapes, numel: int, rank: int, rate: float, batched: bool,
                 batch_same_shape: bool):
        mats, runs = [], []
        self.numel = numel
        self.padded = numel
        if batched:
            side = math.isqrt(numel - 1) + 1 if numel else 0
            if should_compress(side, side, rank, rate):
                mats.append(_Matrix(0, side, side, min(side, rank)))
                self.padded = side * side
            else:
                runs.append((0, numel))
        else:
            off = 0
            for shape in shapes:
                size = math.prod(shape)
                if len(shape) >= 2 and should_compress(shape[0], size // max(shape[0], 1), rank, rate):
                    n = shape[0]
                    mats.append(_Matrix(off, n, size // n, min(n, size // n, rank)))
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
        self.batches = []  # (offset, batch, n, m, r, p_off, q_off)
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
        # the same matrices as rows (offset, n, m, r, p_off, q_off), for gradcomp.lowrank
        self.table = np.array([(t.offset, t.n, t.m, t.r, t.p_off, t.q_off) for t in mats],
                              dtype=np.int64).reshape(-1, 6)

    @staticmethod
    def _place(mats, order, attr, size_of) -> int:
        off = 0
        for i in order:
            setattr(mats[i], attr, off)
            off += size_of(mats[i])
        return off

    def views(self, x, p, q):
        """(M, P, Q) views per batch: 2-D for one matrix, 3-D stacks for fused same-shape runs."""
        for off, b, n, m, r, po, qo in self.batches:
            mm = x[off:off + b * n * m]
            pp = p[po:po + b * n * r]
            qq = q[qo:qo + b * m * r]
            if b == 1:
                yield mm.reshape(n, m), pp.reshape(n, r), qq.reshape(m, r)
            else:
                yield mm.reshape(b, n, m), pp.reshape(b, n, r), qq.reshape(b, m, r)


def _t(a):
    return a.swapaxes(-1, -2)


def _decompress(xp, out, p, q) -> None:
    """``out = P Q^T``. At rank 1 an outer product by broadcasting: BLAS GEMM with an inner
    dimension of 1 is many times slower than the single multiply per element it amounts to."""
    if p.shape[-1] == 1:
        xp.multiply(p, _t(q), out=out)
    else:
        xp.matmul(p, _t(q), out=out)


class _Products:
    """The three products of a step, ``P = M Q``, ``Q = M^T P`` and ``OUT = P Q^T``, for every
    matrix of a plan: the compiled loops of ``gradcomp.lowrank`` on NumPy float32/float64 (one
    memory pass each, and they fold in adding the gradient and subtracting the approximation),
    else a matmul per matrix (CuPy, or numba unavailable). ``fused`` says which; ``add`` and
    ``residual`` may only be passed when it is True."""

    def __init__(self, plan: _Plan, xp, dtype):
        self.plan = plan
        self.loops = None
        if xp is np and dtype in (np.float32, np.float64):
            from .. import lowrank

            self.loops = lowrank if lowrank.available() else None

    @property
    def fused(self) -> bool:
        return self.loops is not None

    def project(self, m, q, p, add=None):
        """``P = M Q`` (after ``M += add`` on the matrices' rows, where given)."""
        if self.fused:
            self.loops.project(m, q, p, self.plan.table, add)
            return
        xp = array_module(m)
        for mm, pp, qq in self.plan.views(m, p, q):
            xp.matmul(mm, qq, out=pp)

    def project_t(self, m, p, q, add=None):
        """``Q = M^T P`` (after ``M += add`` on the matrices' rows, where given)."""
        if self.fused:
            self.loops.project_t(m, p, q, self.plan.table, add)
            return
        xp = array_module(m)
        for mm, pp, qq in self.plan.views(m, p, q):
            xp.matmul(_t(mm), pp, out=qq)

    def reconstruct(self, out, p, q, residual=None):
        """``OUT = P Q^T`` on the matrices' elements (and ``residual -= OUT`` there, where given)."""
        if self.fused:
            self.loops.reconstruct(out, p, q, self.plan.table, residual)
            return
        xp = array_module(out)
        for o, pp, qq in self.plan.views(out, p, q):
            _decompress(xp, o, pp, qq)


@dataclass
class _BucketState:
    """Memory of one bucket index: reset whenever that index arrives with another layout."""
    layout_key: int
    shape_key: int         # the layout without the dtype (matches through FP16/BF16 wrappers)
    plan: _Plan | None = None
    error: object = None   # residual of the last compressed step, in the error dtype
    p: object = None       # P of the last step (one-round variant only: P is its memory too)
    q: object = None       # mean Q of the last step (the warm start)
    phase: int = 0         # one-round variant: 0 = this step computes P, 1 = computes Q


def _shape_key(bucket: Bucket) -> int:
    text = repr((bucket.numel, bucket.shapes)).encode()
    return zlib.crc32(text) | (zlib.adler32(text) << 31)


# ---------------------------------------------------------------------------------------------
# The compressor
# ---------------------------------------------------------------------------------------------
class PowerSGD(Compressor):
    """Low-rank compression with error feedback and warm start, layer by layer.

    Parameters (PyTorch's ``PowerSGDState`` names in brackets):

    ``rank`` [matrix_approximation_rank]: r, the rank of each approximation. Lower is stronger
        compression; start at 1 and double until accuracy is satisfactory (1-4 is typical).
    ``start_iter`` [start_powerSGD_iter]: steps of plain averaging before compression starts.
        Early training is sensitive to gradient error; 10% of the steps is a good first guess.
        (The built-in case of ``Schedule([(0, Allreduce()), (start_iter, ...)])``.)
        Must be > 1 when ``error_feedback`` or ``warm_start`` is on: PyTorch's DDP rebuilds its
        buckets after the first step, and memory kept for the old buckets would not fit the new.
    ``min_compression_rate``: a tensor is compressed only when ``(n + m) * r *
        min_compression_rate < n * m``; others (all vectors, small or near-square tensors) are
        averaged exactly in the same round as P.
    ``error_feedback`` [use_error_feedback]: keep what the approximation missed and add it to the
        next step's gradient. PowerSGD is biased; without this it usually loses accuracy.
    ``warm_start``: start each step's power iteration from the previous step's Q instead of a fresh
        random one: better approximations for the cost of keeping Q.
    ``orthogonalization_epsilon``: added to every column norm during Gram-Schmidt. Not needed to
        avoid NaN here (a zero column stays zero, see ``gram_schmidt_segments``); 0 is most exact.
    ``seed`` [random_seed]: seeds the generator of fresh Q. Every rank holds the same generator and
        draws in the same order, so fresh Q is identical everywhere without communication.
    ``batch_same_shape`` [batch_tensors_with_same_shape]: multiply consecutive tensors of one shape
        as one batched product (one kernel launch on a GPU). Unlike PyTorch this never stacks
        (copies) tensors that are apart in the bucket. Orthogonalization is always batched.
    ``rounds``: 2 (default) sends the uncompressed tensors together with P, then Q: two collective
        rounds per bucket where PyTorch needs three. 1 is the alternating variant of the reference
        implementation (epfml/powersgd; also ACP-SGD): each step sends only P (even steps) or only Q
        (odd steps), built from the other factor of the previous step; needs ``warm_start``.
    ``batched``: treat the whole bucket as one zero-padded square matrix, ignoring the layout (see
        ``BatchedPowerSGD``). Compressed only when the square passes ``min_compression_rate``.
    ``error_dtype``: dtype of the kept residual. None: the bucket's dtype, as PyTorch does; e.g.
        ``"float32"`` keeps the residual of a float16 bucket (``FP16(PowerSGD())``) exactly.

    Precision: float32 and float64 buckets are computed in their own dtype. float16 and bfloat16
    buckets (inside ``FP16``/``BF16``) are multiplied and orthogonalized in float32, which NumPy
    does fast and accurately, and rounded to the bucket's dtype where PyTorch keeps a half tensor:
    P and Q on the wire and in memory, the output, and the residual (unless ``error_dtype`` says
    otherwise).

    Differences from PyTorch, on purpose: every part of the message is divided by the world size
    before the sum (PyTorch divides Q and the uncompressed tensors after it), which keeps half
    precision from overflowing and is bit-for-bit the same at power-of-two world sizes; the residual of
    uncompressed tensors is zero (PyTorch stores ``local - mean`` for them, whose mean over ranks is
    zero, so it only carries rounding noise); ``batched`` works past the warm-up and does not keep
    a residual for the padding.

    Non-finite gradients: NaN or Inf in an uncompressed tensor propagate element-wise. In a
    compressed tensor they reach the averaged P (or Q), identical on every rank, and that tensor's
    output is non-finite on every rank (all of it with ``rounds=2``), so a loss scaler sees it. The
    bucket's residual and warm-start memory are then dropped on every rank (the decision reads the
    averaged factors), so one bad step cannot poison the following ones and the ranks stay in
    step; PyTorch keeps the NaN for ever.

    Zero gradients: an all-zero layer gives zero output, never NaN (see
    ``gram_schmidt_segments``), and its warm-start factor, which would be zero from then on, is
    drawn afresh at the next step.

    State (``state_dict``): step counter, generator state, and per bucket index the residual,
    warm-start Q (and P for ``rounds=1``) and the layout they belong to. ``stats()`` adds
    ``numel_before``/``numel_after``/``compression_rate`` over compressed buckets (as PyTorch's
    ``compression_stats()``) and ``rounds_per_compressed_step``.
    """

    def __init__(self, rank: int = 1, start_iter: int = 1000, min_compression_rate: float = 2,
                 error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0,
                 batch_same_shape: bool = False, rounds: int = 2, batched: bool = False,
                 error_dtype: str | None = None):
        super().__init__()
        if int(rank) != rank or rank < 1:
            raise ValueError(f"PowerSGD rank must be a positive integer, got {rank!r}")
        if int(start_iter) != start_iter or start_iter < 0:
            raise ValueError(f"PowerSGD start_iter must be an integer >= 0, got {start_iter!r}")
        if (error_feedback or warm_start) and start_iter <= 1:
            raise ValueError(
                f"PowerSGD start_iter must be > 1 when error_feedback or warm_start is on (got "
                f"{start_iter}): buckets may be rebuilt after the first step (PyTorch DDP does), and "
                "a residual or Q remembered for the old buckets would not fit the new ones. Use "
                "start_iter >= 2, or turn both error_feedback and warm_start off.")
        if not min_compression_rate > 0:
            raise ValueError(f"min_compression_rate must be > 0, got {min_compression_rate!r}")
        if rounds not in (1, 2):
            raise ValueError(f"PowerSGD rounds must be 1 (alternating) or 2 (fused), got {rounds!r}")
        if rounds == 1 and not warm_start:
            raise ValueError("PowerSGD rounds=1 builds each step's factor from the previous step's "
                             "other factor, i.e. it is warm start by construction; set warm_start=True")
        if not orthogonalization_epsilon >= 0:
            raise ValueError(f"orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon!r}")
        if error_dtype is not None and error_dtype not in ("float16", "bfloat16", "float32", "float64"):
            raise ValueError(f"error_dtype must be None or a float dtype name, got {error_dtype!r}")
        self.rank = int(rank)
        self.start_iter = int(start_iter)
        self.min_compression_rate = min_compression_rate
        self.error_feedback = bool(error_feedback)
        self.warm_start = bool(warm_start)
        self.orthogonalization_epsilon = float(orthogonalization_epsilon)
        self.seed = int(seed)
        self.batch_same_shape = bool(batch_same_shape)
        self.rounds = int(rounds)
        self.batched = bool(batched)
        self.error_dtype = error_dtype
        self._rng = np.random.RandomState(self.seed)
        self._step = 0
        self._buckets: dict[int, _BucketState] = {}
        self._counts = dict(numel_before=0, numel_after=0, compressed_steps=0, compressed_rounds=0)

    def _config(self) -> dict:
        return dict(rank=self.rank, start_iter=self.start_iter,
                    min_compression_rate=self.min_compression_rate,
                    error_feedback=self.error_feedback, warm_start=self.warm_start,
                    orthogonalization_epsilon=self.orthogonalization_epsilon, seed=self.seed,
                    batch_same_shape=self.batch_same_shape, rounds=self.rounds,
                    batched=self.batched, error_dtype=self.error_dtype)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self._config().items())
        return f"{type(self).__name__}({fields})"

    @property
    def step(self) -> int:
        """Steps completed (``is_last`` buckets reduced), warm-up included."""
        return self._step

    # -- reduction -------------------------------------------------------------------------------
    def run(self, bucket: Bucket, comm: Communicator):
        try:
            if self._step < self.start_iter:  # warm-up: exactly Allreduce (in place if scratch)
                return mean_allreduce(bucket, comm)
            return self._compressed(bucket, comm)
        finally:
            if bucket.is_last:
                self._step += 1

    def _state(self, bucket: Bucket) -> _BucketState:
        key = bucket.layout_key()
        st = self._buckets.get(bucket.index)
        if st is None or st.layout_key != key:
            st = _BucketState(key, _shape_key(bucket))
            self._buckets[bucket.index] = st
        if st.plan is None:
            st.plan = _Plan(bucket.shapes, bucket.numel, self.rank, self.min_compression_rate,
                            self.batched, self.batch_same_shape)
        return st

    def _compressed(self, bucket: Bucket, comm: Communicator):
        st = self._state(bucket)
        plan = st.plan
        self._counts["numel_before"] += bucket.numel
        if not plan.matrices:
            self._counts["numel_after"] += bucket.numel
        elif self.rounds == 2:
            self._counts["numel_after"] += plan.numel_after
        else:  # one factor per step: P on even steps, Q on odd ones
            self._counts["numel_after"] += plan.n_unc + (plan.q_size if st.phase else plan.p_size)
        self._counts["compressed_steps"] += int(bucket.is_last)
        before = getattr(comm, "collectives", 0)
        try:
            if not plan.matrices:  # nothing worth compressing: no memory to keep either
                return mean_allreduce(bucket, comm)
            return self._compress(bucket, st, comm)
        finally:
            self._counts["compressed_rounds"] += getattr(comm, "collectives", 0) - before

    def _compress(self, bucket: Bucket, st: _BucketState, comm: Communicator):
        xp = array_module(bucket.buffer)
        plan = st.plan
        storage = bucket.dtype
        half = dtype_name(storage) in HALF
        compute = xp.dtype(xp.float32) if half else storage
        g = bucket.buffer
        n = bucket.numel

        # 1. x = gradient + residual, in the error dtype, written over the old residual (which is
        #    ours) or into a new array: the input stays untouched. With the compiled products the
        #    matrices' part of the sum is done inside the first product (``pending``), saving a pass.
        products = _Products(plan, xp, compute)
        direct = compute == storage and plan.padded == n  # no cast, no padding: x, g, out alike
        pending = None
        if self.error_feedback:
            ef = storage if self.error_dtype is None else _dtype(self.error_dtype, xp)
            if st.error is None:
                x = cast(g, ef)
            else:
                x, st.error = _on(xp, st.error), None
                if products.fused and direct and x.dtype == compute:
                    pending = g
                    for a, b in plan.runs:
                        add_into(x[a:b], g[a:b])
                else:
                    add_into(x, g)
        else:
            x = g
        mx = x if x.dtype == compute else cast(x, compute)
        if plan.padded != n:
            padded = xp.zeros(plan.padded, compute)
            padded[:n] = mx
            mx = padded

        # 2. the output: a DDP bucket (scratch) takes it itself, no new array and no copy back; the
        #    bucket is read only by the first product (``pending``) or as ``x`` before any write
        out = g if bucket.scratch and direct else xp.empty(plan.padded, compute)
        # 3. the new residual x - output is subtracted inside the last product where it can be
        fold = self.error_feedback and products.fused and direct and mx is x
        work = (mx, st, out, comm, storage, compute, half, products, pending, x if fold else None)
        p, q = self._two_rounds(*work) if self.rounds == 2 else self._one_round(*work)

        result = out[:n] if plan.padded != n else out
        if compute != storage:
            result = cast(result, storage, out=g if bucket.scratch else None)
        elif plan.padded != n:
            result = result.copy()

        finite = bool(xp.isfinite(p).all()) and bool(xp.isfinite(q).all())
        if not finite:  # identical P and Q on every rank: every rank drops the memory together
            st.error, st.p, st.q, st.phase = None, None, None, 0
            return result
        if self.error_feedback:
            if not fold:
                subtract_into(x, result)
            for a, b in plan.runs:
                x[a:b] = 0
            st.error = x
        if not self.warm_start:
            st.p, st.q = None, None
        return result

    def _allreduce_mean(self, wire, comm, storage, compute):
        """Sum of ``wire / size`` over ranks, sent in the bucket's dtype, returned in ``compute``."""
        xp = array_module(wire)
        if comm.size > 1:
            xp.divide(wire, compute.type(comm.size), out=wire)
        if compute != storage:
            return cast(comm.allreduce(cast(wire, storage)), compute)
        return comm.allreduce(wire)

    def _round(self, a, storage, half):
        """``a`` rounded to the bucket's half dtype (kept in float32), where PyTorch stores half."""
        return cast(cast(a, storage), a.dtype) if half else a

    def _fill_uncompressed(self, wire, mx, plan):
        pos = 0
        for a, b in plan.runs:
            wire[pos:pos + b - a] = mx[a:b]
            pos += b - a

    def _scatter_uncompressed(self, out, mean, plan):
        pos = 0
        for a, b in plan.runs:
            out[a:b] = mean[pos:pos + b - a]
            pos += b - a

    def _starting_q(self, st, plan, xp, compute, storage, half):
        """This step's orthonormal Q: the warm-start memory, or fresh from the seeded generator."""
        if st.q is None:
            q = xp.empty(plan.q_size, compute)
            self._draw(q, plan, range(len(plan.matrices)), "q", storage, half)
        else:
            q = _on(xp, st.q).astype(compute, copy=True)
        return self._orthonormal_basis(q, plan, "q", storage, half)

    def _orthonormal_basis(self, region, plan, which, storage, half):
        """Orthogonalize a remembered factor. A block with an all-zero column (its layer's gradient
        was zero last step) would stay zero for ever, so it is drawn afresh; every rank holds the
        same factor and makes the same decision."""
        groups = plan.q_groups if which == "q" else plan.p_groups
        dead = self._orthogonalize(region, groups, half)
        if dead:
            self._draw(region, plan, sorted(dead), which, storage, half)
            self._orthogonalize(region, groups, half)
        return self._round(region, storage, half)

    def _draw(self, region, plan, numbers, which, storage, half):
        """Fill the Q (or P) blocks of the given matrices from ``fresh_q`` (P: (m, n) swapped)."""
        xp = array_module(region)
        mats = [plan.matrices[k] for k in numbers]
        if which == "q":
            shapes, rows, offs = [(t.n, t.m, t.r) for t in mats], [t.m for t in mats], [t.q_off for t in mats]
        else:
            shapes, rows, offs = [(t.m, t.n, t.r) for t in mats], [t.n for t in mats], [t.p_off for t in mats]
        for t, k, off, values in zip(mats, rows, offs, self.fresh_q(shapes)):
            values = np.asarray(values, dtype=np.float64).reshape(-1)
            region[off:off + k * t.r] = xp.asarray(values).astype(region.dtype)
        if half:
            region[...] = self._round(region, storage, half)

    def _orthogonalize(self, region, groups, half):
        return orthogonalize(region, groups, use_qr=not half, epsilon=self.orthogonalization_epsilon)

    def _two_rounds(self, mx, st, out, comm, storage, compute, half, products, pending, residual):
        """Round 1: uncompressed tensors and P = M Q. Round 2: Q = M^T P. Output P Q^T (and the
        residual ``mx - output`` where ``residual`` is given; ``pending`` is added to ``mx``
        before the first product)."""
        xp = array_module(mx)
        plan = st.plan
        q = self._starting_q(st, plan, xp, compute, storage, half)
        wire = xp.empty(plan.n_unc + plan.p_size, compute)
        self._fill_uncompressed(wire, mx, plan)
        products.project(mx, q, wire[plan.n_unc:], add=pending)
        summed = self._allreduce_mean(wire, comm, storage, compute)
        self._scatter_uncompressed(out, summed, plan)
        p = summed[plan.n_unc:]
        self._orthogonalize(p, plan.p_groups, half)
        p = self._round(p, storage, half)
        q_local = xp.empty(plan.q_size, compute)
        products.project_t(mx, p, q_local)
        q = self._allreduce_mean(q_local, comm, storage, compute)
        products.reconstruct(out, p, q, residual)
        st.q = q  # P is recomputed from Q every step: only Q is memory here
        return p, q

    def _one_round(self, mx, st, out, comm, storage, compute, half, products, pending, residual):
        """Even steps send P = M Q (Q from the last step), odd steps Q = M^T P; one round each."""
        xp = array_module(mx)
        plan = st.plan
        if st.phase == 0:
            basis = self._starting_q(st, plan, xp, compute, storage, half)
            size = plan.p_size
        else:
            basis = self._orthonormal_basis(_on(xp, st.p).astype(compute, copy=True), plan, "p",
                                            storage, half)
            size = plan.q_size
        wire = xp.empty(plan.n_unc + size, compute)
        self._fill_uncompressed(wire, mx, plan)
        local = wire[plan.n_unc:]
        if st.phase == 0:
            products.project(mx, basis, local, add=pending)
        else:
            products.project_t(mx, basis, local, add=pending)
        summed = self._allreduce_mean(wire, comm, storage, compute)
        self._scatter_uncompressed(out, summed, plan)
        new = summed[plan.n_unc:]
        p, q = (new, basis) if st.phase == 0 else (basis, new)
        products.reconstruct(out, p, q, residual)
        st.p, st.q, st.phase = p, q, 1 - st.phase
        return p, q

    def fresh_q(self, matrices: list[tuple[int, int, int]]) -> list[np.ndarray]:
        """Random starting Q for the compressed matrices ``(n, m, r)`` of one bucket, in bucket order:
        one ``(m, r)`` array each, standard normal, from this compressor's seeded generator.

        Every rank holds the same generator state and calls this at the same points, so every rank
        gets the same Q. Override it to reproduce another implementation's initial Q exactly (the
        PyTorch parity test does); the result must be the same on every rank.
        """
        return [self._rng.standard_normal((m, r)) for _, m, r in matrices]

    # -- hand-over (Schedule) --------------------------------------------------------------------
    def take_residual(self, bucket: Bucket):
        """Remove and return this bucket's error-feedback residual (None if there is none or it
        belongs to another layout). ``Schedule`` calls it when it hands the bucket to another stage,
        so the residual is sent with the next gradient instead of vanishing."""
        st = self._buckets.get(bucket.index)
        if st is None or st.error is None or st.shape_key != _shape_key(bucket):
            return None
        residual, st.error = st.error, None
        return residual

    # -- statistics --------------------------------------------------------------------------------
    def compression_stats(self) -> tuple[float, int, int]:
        """``(rate, numel_before, numel_after)`` over compressed buckets, like PyTorch's."""
        c = self._counts
        rate = c["numel_before"] / c["numel_after"] if c["numel_after"] else 0.0
        return rate, c["numel_before"], c["numel_after"]

    def stats(self) -> dict:
        s = super().stats()
        c = self._counts
        s.update(c)
        s["compression_rate"] = self.compression_stats()[0]
        s["rounds_per_compressed_step"] = (c["compressed_rounds"] / c["compressed_steps"]
                                           if c["compressed_steps"] else 0.0)
        s["step"] = self._step
        return s

    # -- checkpoint --------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """Plain arrays and numbers (``numpy.savez``-able); host copies, never views of live state.
        Take it between steps, when no reduction of this compressor is in flight."""
        kind, keys, pos, has_gauss, gauss = self._rng.get_state()
        out = {
            "config_digest": _config_digest(self),
            "step": self._step,
            "rng_keys": np.array(keys, dtype=np.uint32),
            "rng_pos": int(pos), "rng_has_gauss": int(has_gauss), "rng_gauss": float(gauss),
        }
        for k, v in self._counts.items():
            out[k] = int(v)
        for index, st in sorted(self._buckets.items()):
            pre = f"bucket{index}."
            out[pre + "layout_key"] = int(st.layout_key)
            out[pre + "shape_key"] = int(st.shape_key)
            out[pre + "phase"] = int(st.phase)
            for name in ("error", "p", "q"):
                value = getattr(st, name)
                if value is not None:
                    out[pre + name] = np.array(to_host(value), copy=True)
        return out

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        digest = int(state.pop("config_digest"))
        if digest != _config_digest(self):
            raise ValueError(f"this state was saved by a PowerSGD with another configuration; "
                             f"this one is {self!r}")
        self._step = int(state.pop("step"))
        self._rng.set_state(("MT19937", np.asarray(state.pop("rng_keys"), dtype=np.uint32),
                             int(state.pop("rng_pos")), int(state.pop("rng_has_gauss")),
                             float(state.pop("rng_gauss"))))
        for k in self._counts:
            self._counts[k] = int(state.pop(k, 0))
        buckets: dict[int, _BucketState] = {}
        for key in sorted(k for k in state if k.endswith(".layout_key")):
            pre = key[:-len("layout_key")]
            index = int(pre[len("bucket"):-1])
            st = _BucketState(int(state.pop(key)), int(state.pop(pre + "shape_key")),
                              phase=int(state.pop(pre + "phase")))
            for name in ("error", "p", "q"):
                if pre + name in state:
                    setattr(st, name, np.array(state.pop(pre + name), copy=True))
            buckets[index] = st
        if state:
            raise ValueError(f"unexpected PowerSGD state keys: {sorted(state)}")
        self._buckets = buckets


class BatchedPowerSGD(PowerSGD):
    """PowerSGD on the whole bucket as one zero-padded square matrix (``batched_powerSGD_hook``).

    Ignores the layout: the flat bucket of length L becomes a ``ceil(sqrt(L))``-sided square. Less
    computation than per-layer PowerSGD, but the square mixes unrelated layers and destroys their
    low-rank structure. PyTorch advises rank 1; on the digits examples rank 1 lost 9 (NumPy MLP) to
    80 (CNN) points of test accuracy while rank 8 stayed within 0.3 of plain allreduce, so measure.
    Unlike PyTorch 2.13, whose batched hook fails as soon as compression starts, it works past the
    warm-up. Same parameters as ``PowerSGD`` (``batched`` is implied).
    """

    def __init__(self, rank: int = 1, start_iter: int = 1000, **kwargs):
        kwargs.pop("batched", None)
        super().__init__(rank=rank, start_iter=start_iter, batched=True, **kwargs)

    def __repr__(self):
        fields = ", ".join(f"{k}={v!r}" for k, v in self._config().items() if k != "batched")
        return f"BatchedPowerSGD({fields})"


def _dtype(name: str, xp):
    return half_dtype(name, xp) if name in HALF else xp.dtype(name)


def _on(xp, a):
    """``a`` in the array module ``xp`` (a checkpoint loads as NumPy; a CuPy run wants it on the GPU)."""
    return a if array_module(a) is xp else xp.asarray(a)


def _config_digest(comp: PowerSGD) -> int:
    text = repr(sorted(comp._config().items())).encode()
    return zlib.crc32(text)
