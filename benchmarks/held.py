"""What gradcomp keeps between steps, counted exactly: the bytes of every distinct array reachable
from its objects (residuals, codes, buffers, its communicator's pools), found by walking them.

The scale suite's memory slope is taken from peak RSS, which moves by tens of MB between runs of
the same job (allocator, page cache); over a difference of 40M parameters that is a byte a
parameter. This count has no noise, and it says what the slope cannot: which object keeps what.
It leaves out the model's own tensors (parameters, gradients), the inner optimizer's state (a
torch optimizer that is not gradcomp's, and ``own`` arrays such as ``OneBitAdam``'s m and v, AdamW's
own state) and what is freed within a step (temporaries: the peak RSS sees those).
"""
from __future__ import annotations

import collections
import inspect
from typing import Any, Iterable

import numpy as np


def _span(a: Any) -> tuple[int, int] | None:
    """(first byte, end) of an array's or tensor's memory, or None."""
    import torch

    if isinstance(a, torch.Tensor):
        local = getattr(a, "to_local", None)  # an FSDP2 parameter: its shard
        storage = (local() if local is not None else a).untyped_storage()
        return (storage.data_ptr(), storage.data_ptr() + storage.nbytes()) if storage.nbytes() else None
    if isinstance(a, np.ndarray) and a.nbytes:
        start = a.__array_interface__["data"][0]
        return start, start + a.nbytes
    return None


def kept(roots: dict[str, Any], own: Iterable[Any]) -> dict[str, int]:
    """Bytes kept under each kind of path from ``roots`` (name -> object): distinct memory, each
    counted once, under the first path that reaches it, leaving out memory inside ``own`` (tensors
    or arrays)."""
    import torch

    mine = sorted(s for s in (_span(a) for a in own) if s is not None)
    seen_memory: dict[int, tuple[str, int]] = {}
    visited: set[int] = set()

    def owned(span: tuple[int, int]) -> bool:
        return any(lo <= span[0] < hi for lo, hi in mine)

    def visit(obj: Any, path: str, depth: int) -> None:
        if isinstance(obj, (np.ndarray, torch.Tensor)):
            base = obj
            while isinstance(base, np.ndarray) and isinstance(base.base, np.ndarray):
                base = base.base
            span = _span(base)
            if span is not None and not owned(span):
                seen_memory.setdefault(span[0], (path, span[1] - span[0]))
            return
        skipped = (str, bytes, int, float, bool, type, torch.nn.Module)
        if depth > 20 or id(obj) in visited or isinstance(obj, skipped) or inspect.isroutine(obj):
            return
        if isinstance(obj, torch.optim.Optimizer) and not type(obj).__module__.startswith("gradcomp"):
            return  # the inner optimizer's own state
        visited.add(id(obj))
        if isinstance(obj, dict):
            items: Iterable[tuple[Any, Any]] = obj.items()
        elif isinstance(obj, (list, tuple, set, frozenset, collections.deque)):
            items = enumerate(obj)
        else:
            slots = [k for k in getattr(type(obj), "__slots__", ()) if hasattr(obj, k)]
            for k, v in [*getattr(obj, "__dict__", {}).items(), *((k, getattr(obj, k)) for k in slots)]:
                visit(v, f"{path}.{k}", depth + 1)
            return
        for k, v in items:
            visit(v, f"{path}[]", depth + 1)

    for name, root in roots.items():
        visit(root, name, 0)
    totals: collections.Counter[str] = collections.Counter()
    for path, size in seen_memory.values():
        totals[path] += size
    return dict(totals)
