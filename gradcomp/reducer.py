"""The entry point for training loops without PyTorch: average a list of gradient arrays.

``GradientReducer`` is gradcomp's fusion buffer (as Horovod's): built once from the gradient
arrays, it keeps their bucket plan and flat buffers from step to step, copies the gradients in,
reduces every bucket as scratch (the compressors write the means into the buffers themselves and
reuse their temporaries), and copies the means back into the arrays. After the first step, a step
allocates nothing; with glibc's defaults, fresh allocations of tens of MB are handed back to the
kernel and cost first-touch page faults every step (BENCHMARKS.md, "Memory").
"""
from __future__ import annotations

import weakref
from concurrent.futures import Future, wait
from typing import Any, Mapping, Sequence

import numpy as np

from . import timeline
from .arrays import Array, ArrayModule, dtype_name
from .bucket import Bucket, digest, group
from .comm import CollectiveError, Communicator, default_communicator
from .compressors.agreement import gather_texts
from .compressors.contract import Compressor
from .compressors.hierarchical import scheduled
from .params import check_int
from .state import check_saved_here, saved_by, take_saved_by


class GradientReducer:
    """Average ``arrays`` (NumPy or CuPy, any shapes) over all ranks with ``compressor``, in place.

        reducer = GradientReducer(grads, gradcomp.FP16(gradcomp.Allreduce()), comm)
        for step in range(steps):
            compute_gradients_into(grads)      # refill the same arrays
            reducer.step()                     # grads now hold the means, on every rank

    Faster: let the gradients live in the reducer's buffers (as DDP's
    ``gradient_as_bucket_view``): ``grads = reducer.gradients`` gives arrays of the same shapes
    that are views into them; fill those in place and ``step()`` copies nothing in or out.

    ``hierarchical``: on a job of several hosts with several ranks each (``MPICommunicator.topology``),
    average exactly inside each host and run the compressor across hosts only
    (``gradcomp.compressors.hierarchical``); None (default) does so wherever the topology has more
    than one host and more than one rank per host and the method is one the hierarchy was
    measured to speed up (``Compressor.hierarchical_pays``: at most 8x compression),
    False never, True insists. ``compressor`` is
    then ``self.compressor.inner``.

    The arrays are grouped into buckets of about ``bucket_cap_mb`` MiB (consecutive arrays of one
    dtype), every bucket is queued at once (the compression of one overlaps the transfer of the
    one before) and the means are written back into the arrays. The compressor keeps its state per
    array, keyed by position in the list, so ``state_dict``/``load_state_dict`` resume exactly.
    Every rank must pass the same shapes and dtypes in the same order; if one does not, every rank
    raises ``CollectiveError`` at construction. ``step(arrays)`` may pass a new list of arrays
    with the same shapes and dtypes.

    ``buckets``: a bucket plan of your own instead of ``bucket_cap_mb``'s: lists of positions in
    ``arrays``, every position once, each bucket's arrays of one dtype; e.g. DDP's layout, which
    fills its buckets from the last parameter backwards. Every rank must pass the same plan (a
    different one is a ``CollectiveError`` at the first step, as any layout mismatch).

    ``window``: keep flat buffers for that many buckets only, taken in turn (bucket ``b`` in
    buffer ``b % window``; a bucket waits for the one ``window`` before it): memory of ``window``
    buckets instead of the whole model's, for a caller whose arrays are its only copy (the
    optimizers average the gradients where they lie). Every ``step`` then passes its arrays
    (``step(arrays)``), and ``gradients``, ``start`` and ``finish`` are refused.
    """

    def __init__(self, arrays: Sequence[Array], compressor: Compressor, comm: Communicator | None = None,
                 bucket_cap_mb: float = 25.0, hierarchical: bool | None = None,
                 buckets: Sequence[Sequence[int]] | None = None, window: int | None = None,
                 _groups: list[list[int]] | None = None):
        if not isinstance(compressor, Compressor):
            raise TypeError(f"expected a gradcomp Compressor, got {type(compressor).__name__} "
                            "(gradcomp.make(name) builds one by name)")
        self.comm = comm if comm is not None else default_communicator()
        self.compressor = scheduled(compressor, self.comm, hierarchical)
        self.arrays = list(arrays)
        self.bucket_cap_mb = bucket_cap_mb
        groups = check_arrays(self.comm, self.arrays, bucket_cap_mb) if _groups is None else _groups
        if buckets is not None:
            groups = _plan(buckets, self.arrays)
        self.window = None if window is None else check_int("window", window, 1)
        shapes = [[self.arrays[i].shape if self.arrays[i].ndim else (1,) for i in members] for members in groups]
        sizes = [sum(int(np.prod(s)) for s in bucket) for bucket in shapes]
        kinds = [self.arrays[members[0]].dtype.newbyteorder("=") for members in groups]
        flats = ([_module(self.arrays[m[0]]).empty(n, k) for m, n, k in zip(groups, sizes, kinds)]
                 if self.window is None else _ring(self.window, groups, sizes, kinds, self.arrays))
        self.buckets: list[tuple[Bucket, list[int]]] = []
        for b, (members, flat) in enumerate(zip(groups, flats)):
            bucket = Bucket(flat, b, shapes[b], is_last=b == len(groups) - 1, scratch=True,
                            keys=[str(i) for i in members])
            self.buckets.append((bucket, members))
        self._views: list[Array] = [None] * len(self.arrays)
        for bucket, members in self.buckets:
            for view, i in zip(bucket.views(), members):
                self._views[i] = view.reshape(self.arrays[i].shape)

    @property
    def gradients(self) -> list[Array]:
        """Arrays shaped like the gradients, living in the reducer's flat buffers (see the class).
        From then on ``step()`` without arguments reduces these arrays where they are: refilling
        them and then copying in the arrays given at construction would silently average stale
        values."""
        self._refuse_in_window("gradients")
        self.arrays = list(self._views)
        return list(self._views)

    @property
    def shapes(self) -> dict[str, tuple]:
        """The shape of every array, by the key the compressor keeps its state under."""
        return {str(i): tuple(a.shape) if a.ndim else (1,) for i, a in enumerate(self.arrays)}

    def step(self, arrays: Sequence[Array] | None = None) -> list[Array]:
        """Average the arrays (``arrays``, or those given at construction) in place; return them."""
        if arrays is None:
            self._refuse_in_window("step() without arrays")
        else:
            given = arrays if isinstance(arrays, list) else list(arrays)
            if [(a.shape, a.dtype) for a in given] != [(a.shape, a.dtype) for a in self.arrays]:
                raise ValueError("GradientReducer.step: the arrays must have the shapes and dtypes "
                                 "the reducer was built with")
            if self.window is not None:
                return self._in_window(given)
            self.arrays = given
        return self.finish(self.start())

    def start(self) -> list[Future]:
        """Queue every bucket's reduction of the arrays given at construction (or at the last
        ``step``) on the communicator's pipeline and return at once; ``finish`` waits for them.
        Between the two the arrays may change: their values were taken here."""
        self._refuse_in_window("start")
        return [self._submit(bucket, members, self.arrays) for bucket, members in self.buckets]

    def finish(self, futures: list[Future]) -> list[Array]:
        """Wait for ``start``'s reductions and write the means into the arrays; return them."""
        self._refuse_in_window("finish")
        for (bucket, members), future in zip(self.buckets, futures):
            self._land(bucket, members, future, self.arrays)
        return self.arrays

    def _in_window(self, arrays: list[Array]) -> list[Array]:
        """``step(arrays)`` through ``window`` buffers: bucket ``b`` is submitted once bucket
        ``b - window``, which shares its buffer, has landed."""
        flying: list[tuple[Bucket, list[int], Future]] = []
        try:
            for bucket, members in self.buckets:
                if len(flying) == self.window:
                    self._land(*flying.pop(0), arrays)
                flying.append((bucket, members, self._submit(bucket, members, arrays)))
            while flying:
                self._land(*flying.pop(0), arrays)
        except BaseException:
            wait([future for _, _, future in flying])  # none left running in a buffer a next step reuses
            raise
        return arrays

    def _submit(self, bucket: Bucket, members: list[int], arrays: list[Array]) -> Future:
        for i in members:
            if not _same_memory(arrays[i], self._views[i]):
                self._views[i][...] = arrays[i]
        return self.compressor.reduce(bucket, self.comm)

    def _land(self, bucket: Bucket, members: list[int], future: Future, arrays: list[Array]) -> None:
        """Wait for ``bucket``'s mean and write it into ``arrays``."""
        step = self.compressor.__dict__.get("_submitted_steps", 1) - 1  # the timeline's (``Compressor.reduce``)
        with timeline.span("wait", "wait", bucket=bucket.index, step=step):
            mean = future.result()
        for view, i in zip(bucket.views(mean), members):
            if mean is bucket.buffer and _same_memory(arrays[i], self._views[i]):
                continue  # reduced where it lives
            arrays[i][...] = view.reshape(arrays[i].shape)

    def _refuse_in_window(self, what: str) -> None:
        if self.window is not None:
            raise ValueError(f"GradientReducer.{what}: not with a window (its buffers are shared "
                             "between buckets); use step(arrays)")

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (per array, by position) and the rank and job size that saved
        it: ``numpy.savez``-able. Residuals are this rank's own: each rank saves and loads its own."""
        return {**self.compressor.state_dict(), **saved_by(self.comm)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output, checked against these arrays' shapes, and against
        this rank, first."""
        state = dict(state)
        rank, size = take_saved_by(state)
        check_saved_here(state, rank, size, self.comm.rank, self.comm.size, "gradcomp",
                         "Save reducer.state_dict() on every rank, to a file of its own: "
                         "docs/guides/checkpoints.md")
        self.compressor.load_state_dict(state, self.shapes)


def check_arrays(comm: Communicator, arrays: Sequence[Array], bucket_cap_mb: float) -> list[list[int]]:
    """Group ``arrays`` into buckets after checking, collectively, that every rank can and that
    all ranks pass the same shapes and dtypes; else ``CollectiveError`` on every rank."""
    groups: list[list[int]]
    try:
        groups, problem = group(arrays, bucket_cap_mb), ""
    except (TypeError, ValueError) as exc:
        groups, problem = [], str(exc)
    described = [_describe(a) for a in arrays]
    layout = "; ".join(described)
    mine = np.array([int(bool(problem)), len(groups), digest(layout)], dtype=np.int64)
    table = comm.allgather(mine)
    bad = [r for r in range(comm.size) if table[r, 0]]
    if bad:
        here = f" (here: {problem})" if problem else ""
        raise CollectiveError(f"gradcomp: rank(s) {bad} passed gradients that cannot be bucketed{here}")
    if (table[:, 1:] != table[0, 1:]).any():
        everyone = [text.split("; ") for text in gather_texts(comm, layout)]
        for i in range(max(len(e) for e in everyone)):
            seen = [e[i] if i < len(e) else "(none)" for e in everyone]
            if len(set(seen)) > 1:
                per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
                raise CollectiveError(f"gradcomp: gradient array {i} differs across ranks ({per_rank}); "
                                      "every rank must pass the same shapes and dtypes in the same order")
    return groups


_reducers: "weakref.WeakKeyDictionary[Compressor, GradientReducer]" = weakref.WeakKeyDictionary()


def allreduce_gradients(arrays: Sequence[Array], compressor: Compressor, comm: Communicator | None = None,
                        bucket_cap_mb: float = 25.0, hierarchical: bool | None = None) -> list[Array]:
    """Average ``arrays`` over all ranks with ``compressor``, in place; returns ``arrays``.

    The one-call form of ``GradientReducer``: the reducer (its flat buffers and bucket plan) is
    kept with the compressor and reused while the arrays keep their shapes and dtypes, so calling
    this every step allocates nothing after the first. Every call still checks, collectively,
    that all ranks pass the same shapes and dtypes.
    """
    comm = comm if comm is not None else default_communicator()
    given = list(arrays) if not isinstance(arrays, list) else arrays
    groups = check_arrays(comm, given, bucket_cap_mb)
    reducer = _reducers.get(compressor)
    same = (reducer is not None and reducer.comm is comm and reducer.bucket_cap_mb == bucket_cap_mb
            and [(a.shape, a.dtype) for a in reducer.arrays] == [(a.shape, a.dtype) for a in given])
    if reducer is None or not same:
        reducer = GradientReducer(given, compressor, comm, bucket_cap_mb, hierarchical, _groups=groups)
        _reducers[compressor] = reducer
    reducer.step(given)
    return given


def _plan(buckets: Sequence[Sequence[int]], arrays: list[Array]) -> list[list[int]]:
    """``buckets`` as lists, checked: every array's position once, one dtype per bucket, none empty
    (a ValueError naming what is wrong)."""
    plan = [[int(i) for i in members] for members in buckets]
    seen = sorted(i for members in plan for i in members)
    if seen != list(range(len(arrays))):
        missing = sorted(set(range(len(arrays))) - set(seen))
        extra = sorted({i for i in seen if seen.count(i) > 1 or not 0 <= i < len(arrays)})
        raise ValueError(f"GradientReducer: buckets must hold every array's position 0..{len(arrays) - 1} "
                         f"once; missing {missing[:5]}, repeated or out of range {extra[:5]}")
    for b, members in enumerate(plan):
        if not members:
            raise ValueError(f"GradientReducer: bucket {b} of buckets is empty")
        kinds = {dtype_name(arrays[i].dtype) for i in members}
        if len(kinds) > 1:
            raise ValueError(f"GradientReducer: bucket {b} of buckets mixes dtypes ({', '.join(sorted(kinds))}); "
                             "a bucket holds one")
    return plan


def _ring(window: int, groups: list[list[int]], sizes: list[int], kinds: list[Any],
          arrays: list[Array]) -> list[Array]:
    """Each bucket's flat buffer for a reducer with a ``window``: bucket ``b`` gets the front of
    buffer ``b % window`` of its dtype, each buffer as long as its longest bucket."""
    longest: dict[tuple[int, Any], int] = {}
    for b, (size, kind) in enumerate(zip(sizes, kinds)):
        longest[(b % window, kind)] = max(longest.get((b % window, kind), 0), size)
    xp = _module(arrays[groups[0][0]]) if groups else np
    buffers = {key: xp.empty(n, key[1]) for key, n in longest.items()}
    return [buffers[(b % window, kind)][:size] for b, (size, kind) in enumerate(zip(sizes, kinds))]


def _same_memory(a: Array, b: Array) -> bool:
    """Whether ``a`` is ``b`` or a view of exactly the same memory and layout."""
    if a is b:
        return True
    if type(a) is not type(b) or a.shape != b.shape or a.strides != b.strides or a.dtype != b.dtype:
        return False
    if type(a) is np.ndarray:
        return a.__array_interface__["data"][0] == b.__array_interface__["data"][0]
    return a.data.ptr == b.data.ptr


def _describe(array: Any) -> str:
    try:
        return f"{dtype_name(array.dtype)} {tuple(array.shape)}"
    except (AttributeError, TypeError):
        return type(array).__name__


def _module(array: Array) -> ArrayModule:
    from .arrays import array_module

    return array_module(array)
