"""How the DDP hook cuts a DDP bucket into the buckets it reduces, and keeps each step's layouts:
a fresh model's first bucket cut into the loaded layouts (a resume), DDP's first step (every
parameter in one bucket) cut into bucket-sized pieces, and a consecutive part reduced in place.
"""
from __future__ import annotations

import math
from typing import Any

from ..arrays import array_module, is_device_array
from ..bucket import Bucket
from .naming import HookParts, record_of


#: the size of the pieces the hook reduces where DDP hands it every parameter in one bucket (its
#: first step, before it rebuilds its buckets by ``bucket_cap_mb``): DDP's default cap, so that what
#: a compressor allocates per bucket stays bucket-sized, not model-sized
PIECE_BYTES = 25 * 2**20


def pieces(keys: list[str], shapes: list[tuple], itemsize: int) -> list[tuple[int, tuple[str, ...]]]:
    """The bucket's tensors in consecutive pieces, as (index, keys) parts for ``reduce_parts``,
    cut from the last tensor back and closed once a piece reaches ``PIECE_BYTES``, as DDP fills
    its rebuilt buckets (in the order gradients arrive, the last layers first): so each piece's
    residuals move into one rebuilt bucket, and its store's region is freed at once."""
    parts: list[tuple[int, tuple[str, ...]]] = []
    run: list[str] = []
    size = 0
    for key, shape in zip(reversed(keys), reversed(shapes)):
        run.append(key)
        size += math.prod(shape) * itemsize
        if size >= PIECE_BYTES:
            parts.append((len(parts), tuple(reversed(run))))
            run, size = [], 0
    return parts + ([(len(parts), tuple(reversed(run)))] if run else [])


def replay_parts(state: HookParts, keys: list[str]) -> list[tuple[int, tuple[str, ...]]] | None:
    """After a resume, the loaded layouts (index, keys) that make up this DDP bucket, when it is
    not one of them but exactly their union (a fresh model's first buckets); else None."""
    if not state.replay or tuple(keys) in state.replay:
        return None
    mine = set(keys)
    parts = [(i, layout) for i, layout in enumerate(state.replay) if mine.issuperset(layout)]
    if sum(len(layout) for _, layout in parts) != len(mine) or set().union(*(p for _, p in parts)) != mine:
        return None  # DDP cut the tensors otherwise: reduce the bucket as it is
    return parts


def reduce_parts(state: HookParts, array: Any, keys: list[str], shapes: list[tuple],
                  parts: list[tuple[int, tuple[str, ...]]], is_last: bool) -> list[tuple[Any, Any]]:
    """Reduce ``array``'s tensors as the buckets ``parts``: each gathered into a bucket of its
    own, in the loaded order. Returns (where each tensor goes back in ``array``, the part's
    Future) per part."""
    xp = array_module(array)
    spans, at = {}, 0
    for key, shape in zip(keys, shapes):
        size = math.prod(shape)
        spans[key] = (at, size, shape)
        at += size
    jobs = []
    for j, (index, layout) in enumerate(parts):
        where = [spans[k][:2] for k in layout]
        start, end = where[0][0], where[-1][0] + where[-1][1]
        if all(a + n == b for (a, n), (b, _) in zip(where, where[1:])):  # consecutive: a view, no copy
            flat, where = array[start:end], [(start, end - start)]
        else:
            flat = xp.concatenate([array[start:start + size] for start, size in where])
        part = Bucket(flat, index, [spans[k][2] for k in layout], is_last and j == len(parts) - 1,
                      scratch=True, keys=layout)
        jobs.append((where, state.compressor.reduce(part, state.comm)))
    return jobs


def same_place(mean: Any, array: Any, start: int) -> bool:
    """Whether ``mean`` is ``array``'s own memory from ``start`` on (a part reduced in place)."""
    if mean.dtype != array.dtype or is_device_array(mean) != is_device_array(array):
        return False
    view = array[start:]
    if is_device_array(array):
        return bool(mean.data.ptr == view.data.ptr)
    return bool(mean.__array_interface__["data"][0] == view.__array_interface__["data"][0])


def record_layouts(state: HookParts, layouts: list[tuple[str, ...]], is_last: bool) -> None:
    """Keep this step's bucket layouts; a whole step's become ``state.layouts`` (checkpointed).
    The loaded ones are replayed for one step only: DDP has rebuilt its buckets after it."""
    state._step_layouts.extend(layouts)
    if is_last:
        state.layouts, state._step_layouts = state._step_layouts, []
        state.replay = []
        record = record_of(state.compressor)
        if record is not None and state.names:
            record.layouts = state.layouts  # what a pickled compressor carries
