"""Hierarchical schedules: exact inside each host, any method across hosts, exact back inside.

On a multi-host job a flat ring sends every rank's compressed bucket over its host's one slow
link, so a host of L ranks pushes up to L times the bytes it needs to. ``Hierarchical(inner)``
instead, per bucket (with H hosts of L ranks each, ``gradcomp.comm.topology``):

1. **reduce-scatter inside the host**, exact (the host's fast path): the bucket's tensors are cut
   into L contiguous groups of whole tensors, balanced by size, and local rank l receives the sum
   of group l over its host, divided by L: the host's mean of its group;
2. **``inner`` across hosts**: local rank l reduces its group with ``inner`` over the ranks with
   local rank l on every host (L such H-rank exchanges run in parallel, as NCCL's do). ``inner``
   is any compressor, unchanged: its state (residuals, PowerSGD's factors) follows its tensors as
   everywhere, because a group holds whole tensors with their keys and shapes; when a tensor's
   group moves to another local rank (DDP's rebuilt buckets), the residual left behind is added to
   the old owner's gradient, and so reaches the new owner through the host's sum;
3. **allgather inside the host**: every rank gets every group's mean over all ranks.

Bytes through a host's link: what ``inner`` sends for a 1/L group, times L ranks, on an H-rank
exchange, instead of L ranks each sending ``inner``'s bytes for the whole bucket on an N-rank one
(``gradcomp.planning.cost`` has the formulas). Each rank encodes about 1/L of the bucket. Every
rank ends with the same bits: groups are summed once, by their owner, in a fixed order; ``inner``
gives bit-identical results over its exchange; the allgather copies.

``stats()``: ``bytes_sent`` counts what this rank sent across hosts, ``local_bytes_sent`` inside
its host. A bucket whose one tensor is larger than the others together goes to one local rank
(tensors are not split): correct, but that rank does the encoding alone.
"""
from __future__ import annotations

import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from ..arrays import Array, array_module, cast, divide, dtype_name
from ..bucket import Bucket
from ..comm import Communicator
from .contract import Compressor
from .passes import Passes
from .wrapper import Wrapper


def wrap(compressor: Compressor, comm: Communicator, hierarchical: bool | None) -> Compressor:
    """``compressor``, in ``Hierarchical`` where ``hierarchical`` says so: True (an error where
    ``comm`` has no hosts to tell apart), False, or None: wherever ``comm``'s topology has more
    than one host and more than one rank on each (collective: every rank calls it)."""
    if isinstance(compressor, Hierarchical) or hierarchical is False:
        return compressor
    split = getattr(comm, "split_by_host", None)
    if split is None:
        if hierarchical:
            raise ValueError(f"hierarchical=True needs a communicator that knows its hosts; {comm!r} "
                             "does not (MPICommunicator does)")
        return compressor
    if split() is None:
        if hierarchical:
            raise ValueError(f"hierarchical=True: {comm!r} has one host, or one rank per host "
                             f"({getattr(comm, 'topology', None)}); set GRADCOMP_RANKS_PER_HOST to "
                             "simulate hosts")
        return compressor
    return Hierarchical(compressor)


def scheduled(compressor: Compressor, comm: Communicator, hierarchical: bool | None) -> Compressor:
    """``compressor`` in the schedule it runs in on ``comm`` (the one place the reducer and the
    DDP hook decide it): ``Hierarchical`` where ``hierarchical`` is True, or, by default (None),
    where the topology has several hosts of several ranks and the method says a hierarchy pays
    (``Compressor.hierarchical_pays``); flat otherwise (``wrap``)."""
    if hierarchical is None and not compressor.hierarchical_pays():
        hierarchical = False
    return wrap(compressor, comm, hierarchical)


def groups(bucket: Bucket, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous ranges ``(first tensor, end tensor)`` of ``bucket``'s tensors, each
    ending at the tensor boundary nearest to an equal share of the values (some may be empty)."""
    offsets = bucket.offsets()
    n = offsets[-1]
    cuts = [0]
    for p in range(1, parts):
        target = n * p / parts
        best = min(range(cuts[-1], len(offsets)), key=lambda i: abs(offsets[i] - target))
        cuts.append(best)
    cuts.append(len(bucket.shapes))
    return [(cuts[p], cuts[p + 1]) for p in range(parts)]


class Hierarchical(Wrapper):
    """Exact inside each host, ``inner`` across hosts (see the module docstring).

    ``inner``: any gradcomp compressor (a registry name's recipe, ``PowerSGD``, ...), used on the
    cross-host exchanges only. The hierarchy comes from the communicator's topology
    (``MPICommunicator.topology``); with one host, or one rank per host, ``Hierarchical`` is
    ``inner`` on the whole communicator.
    """

    def __init__(self, inner: Compressor):
        super().__init__(inner)
        inner.watched = False  # the guard watches here, where every rank sees every rank's flag
        self._levels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._local_bytes = 0.0

    # what it declares is the inner method's (``Wrapper``: its traffic is what crosses the hosts,
    # its step state is agreed by every rank here and again on each cross-host exchange), but:
    #: a group of whole tensors is no row of the bucket: no reduce-scatter form
    scatters = False

    def inner_stage(self, prepared: Any) -> None:
        return None  # no local stage: the inner method's stages run inside ``run``, on a group

    @property
    def nan_effect(self) -> str | None:  # type: ignore[override]
        # a group starts at a tensor boundary, so the inner method's 512-value chunks are counted
        # from there, not from the bucket's start: "chunk" is then a chunk of the group
        effect = self.inner.nan_effect
        return "bucket" if effect == "chunk" else effect

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Passes | None:
        """None: the passes of the exact stages inside the host are not declared."""
        return None

    def levels(self, comm: Communicator) -> tuple[Communicator, Communicator] | None:
        """``(inside the host, across hosts)`` communicators of ``comm``, made on first use (a
        collective on every rank); None when there is one host or one rank per host."""
        if comm in self._levels:
            return self._levels[comm]
        split = getattr(comm, "split_by_host", None)
        if split is None:
            raise TypeError(f"Hierarchical needs a communicator that knows its hosts (split_by_host); "
                            f"{comm!r} does not")
        levels = split()
        self._levels[comm] = levels
        return levels

    def reduce(self, bucket: Bucket | Array, comm: Communicator | None = None) -> Any:
        from ..comm import default_communicator

        comm = comm if comm is not None else default_communicator()
        self.levels(comm)  # the split is a collective: made here, in submission order, not mid-bucket
        return super().reduce(bucket, comm)

    def run(self, bucket: Bucket, comm: Communicator, prepared: Any = None) -> Array:
        levels = self.levels(comm)
        if levels is None:
            return self.inner.run(bucket, comm)
        local, cross = levels
        L, l = local.size, local.rank
        ranges = groups(bucket, L)
        offsets = bucket.offsets()
        counts = [offsets[b] - offsets[a] for a, b in ranges]
        g = bucket.buffer
        xp = array_module(g)
        wide = dtype_name(g.dtype) in ("float16", "bfloat16")  # summed in float32 inside the host
        work = cast(g, np.float32) if wide else g
        first, end = ranges[l]
        handed = self._moved_here(bucket, first, end)
        if handed and work is g and not bucket.scratch:
            work = g.copy()  # (the caller's buffer stays as it was)
        for at, value in handed:
            segment = work[at:at + value.size]
            segment += cast(value.reshape(-1), segment.dtype)
        ws = comm.workspace
        mine = ws.array(self, "group", counts[l], work.dtype, like=g)
        before = local.bytes_sent
        # the bucket's own buffer is the ring's working space where it is scratch (it receives the
        # means at the end anyway), or the half-precision bucket's float32 copy
        local.reduce_scatter(work, out=mine, counts=counts, overwrite=bucket.scratch or work is not g)
        divide(mine, L, out=mine)
        shapes = bucket.shapes[first:end] or [(0,)]
        keys = bucket.keys[first:end] or (f"{bucket.index}.empty{l}",)
        if wide:
            mine = cast(mine, g.dtype)
        part = Bucket(mine, bucket.index, shapes, bucket.is_last, scratch=True, keys=keys, step=bucket.step)
        sent = self.inner._stats["bytes_sent"]  # (the inner's count leaves its agreement out)
        reduced = self.inner.reduce(part, cross).result()
        comm.bytes_sent += self.inner._stats["bytes_sent"] - sent  # the main counter: bytes across hosts
        out = g if bucket.scratch else xp.empty_like(g)
        local.allgather_blocks(reduced, out, counts=counts)
        self._local_bytes += local.bytes_sent - before
        return out

    def _moved_here(self, bucket: Bucket, first: int, end: int) -> list[tuple[int, Array]]:
        """(offset, value) of the residuals the inner method keeps for tensors of ``bucket`` outside
        this rank's group ``[first, end)``: a tensor whose group moved to another local rank (DDP's
        rebuilt buckets, a resume's layouts). Taken out of it and added to this rank's gradient
        (``take_residual``: L times them), they reach the tensor's new owner through the host's
        sum, so a tensor's error feedback follows it and no rank keeps state no step claims."""
        others = [k for i, k in enumerate(bucket.keys) if not first <= i < end]
        kept = self.inner.residuals(others) if others else {}
        if not kept:
            return []
        offsets = bucket.offsets()
        where = {k: offsets[i] for i, k in enumerate(bucket.keys)}
        return [(where[k], value) for k, value in self.take_residual(list(kept)).items()]

    # -- state: the inner method's --------------------------------------------------------------
    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        """The inner method's residuals, in this rank's units: they are kept for the host's mean
        of the group, by one rank of the host, so L times them added to this rank's gradient
        carries their weight into a flat average over every rank (``Schedule``'s hand-over)."""
        handed = self.inner.take_residual(keys)
        for comm, levels in list(self._levels.items()):
            if levels is not None:
                for value in handed.values():
                    value *= value.dtype.type(levels[0].size)
                break
        return handed

    def regime(self, prepared: Any) -> tuple:
        """The inner method's, for the bucket it just reduced across hosts (``run`` waits for it)."""
        return getattr(self.inner, "last_regime", ())

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["local_bytes_sent"] = self._local_bytes
        s["inner"] = self.inner.stats()
        return s

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_levels")  # (per-communicator levels never travel; a WeakKeyDictionary cannot)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._levels = weakref.WeakKeyDictionary()
