"""One warning for a measured mistake: a sparse, low-rank or 1-bit code at the DDP hook under Adam.

Adam(W) divides each coordinate's momentum by its own running magnitude, so every coordinate
steps by about the same size. A code that sends only part of each gradient (``partial_update``:
onebit, topk, randomk, PowerSGD) leaves most coordinates' updates waiting in its residual, and
trains measurably worse than int4 at the hook or ``OneBitAdam``, which compresses Adam's momentum
instead (BENCHMARKS.md, section 6). The hook cannot see the optimizer, so ``register`` asks torch to call
``_before_step`` before any optimizer's step: the first step of an Adam-like optimizer (one whose
parameter groups have ``betas``; gradcomp's own optimizers excepted) over a watched model's
parameters warns once, on every rank (each steps its own optimizer), and tells the hook's
governors (``gradcomp.planning.governor``) that the optimizer is adaptive: they then run a rung
down (4-bit codes) and let the method earn its place against a quarter of their budget. The same
first step on every rank, before any audit.
"""
from __future__ import annotations

import os
import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Iterable

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..compressors.contract import parts, sends_part
from ..planning.auto import Auto
from ..planning.governor import Governed

if TYPE_CHECKING:
    from ..compressors import Compressor

_WATCHED: weakref.WeakKeyDictionary[Any, tuple[str, set[int]]] = weakref.WeakKeyDictionary()
_SEEN: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HANDLE: Any = None


def watch(state: Any, parameters: Iterable[torch.nn.Parameter]) -> None:
    """Where ``state.compressor`` (the hook's) sends only part of each gradient, warn at the first
    step of an Adam-like optimizer over ``parameters`` (see the module), while ``state`` lives."""
    global _HANDLE
    if not sends_part(state.compressor):
        return
    sends = "may choose a method that sends" if isinstance(state.compressor, Auto) else "sends"
    _WATCHED[state] = (f"{state.compressor.describe()}, which {sends}", {id(p) for p in parameters})
    if _HANDLE is None:
        _HANDLE = register_optimizer_step_pre_hook(_before_step)


def _adam_like(optimizer: torch.optim.Optimizer) -> bool:
    """Adam's kind (parameter groups with ``betas``), or torch's other optimizers that scale each
    coordinate by its own running magnitude (RMSprop, Adagrad, Adadelta)."""
    scaling = (torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta)
    return (not type(optimizer).__module__.startswith("gradcomp.")
            and (isinstance(optimizer, scaling) or all("betas" in group for group in optimizer.param_groups)))


def _user_level() -> int:
    """``stacklevel`` of the first caller outside torch and gradcomp (the user's ``opt.step()``),
    counted from ``_before_step``."""
    inside = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and frame.f_code.co_filename.startswith(inside):
        frame, level = frame.f_back, level + 1
    return level


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    global _HANDLE
    if optimizer in _SEEN:
        return
    _SEEN.add(optimizer)
    if not _adam_like(optimizer):
        return
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for state, (method, ids) in list(_WATCHED.items()):
        if ids & stepped:
            del _WATCHED[state]
            governed = [p for p in parts(state.compressor) if isinstance(p, Governed)]
            for g in governed:
                g.adapt()
            warnings.warn(
                f"gradcomp: the DDP hook runs {method} a sparse, low-rank or 1-bit part "
                f"of each gradient, and {type(optimizer).__name__} steps every coordinate by about "
                "the same size, so most of each update waits in the residual and training ends "
                "worse than exact averaging. For Adam(W), let the optimizer compress its momentum: "
                "gradcomp.torch.OneBitAdam(model.parameters(), ..., model=model), with "
                "compressor='topk:stages=2,ratio=0.02' or 'fp16-powersgd:rank=8,factor_bits=8' for "
                "a sparse or low-rank exchange; or int8 / int4 at the hook"
                + ("; the hook's governor now sends 4-bit codes and tries the method later, against a "
                   "quarter of its budget" if governed else ""),
                RuntimeWarning, stacklevel=_user_level())
    if not _WATCHED and _HANDLE is not None:
        _HANDLE.remove()
        _HANDLE = None
