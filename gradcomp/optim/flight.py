"""DiLoCo's exchanges in flight (``overlap``): what a checkpoint holds of them, and the replica's
own pseudo-gradient that ``keep_local`` needs when one lands.

An exchange in flight is saved waited for: its averaged pseudo-gradient, the outer rates taken at
its sync and the inner step it lands after; with ``keep_local`` also this rank's own
pseudo-gradient, which the landing adds back (``gradcomp.optim.diloco``, "Streaming"). A resume
lands it at the same step, so the run goes on bit for bit.
"""
from __future__ import annotations

import atexit
import weakref
from typing import Any, Sequence

import numpy as np

from ..arrays import Array, array_module, to_host
from ..state import take_int

#: what is in flight for one fragment: the step it lands after, the outer rates, the means and
#: (``keep_local``) this rank's own pseudo-gradients
Loaded = tuple[int, list[float], list, list | None]


def keep_own(kept: dict[int, list[Array]], f: int, deltas: Sequence[Array]) -> None:
    """A copy of fragment ``f``'s own pseudo-gradients (``deltas``, before the exchange averages
    them in place), into buffers kept from one sync to the next."""
    if f not in kept:
        kept[f] = [array_module(d).empty_like(d) for d in deltas]
    for mine, d in zip(kept[f], deltas):
        mine[...] = d


def wait_at_exit(outer: Any) -> None:
    """At exit, wait for ``outer``'s exchanges still in flight: a loop that ends between a sync
    and its landing (every rank ends the same loop, so each waits for the same collectives) then
    ends its process as a finished run, not as one that left work in flight, which
    ``gradcomp.comm.exits`` aborts. Their means are not applied: the run is over (``sync_now``
    lands them first). Registered after the communicator, so it runs before its exit checks."""
    ref = weakref.ref(outer)

    def wait() -> None:
        live = ref()
        if live is not None:
            wait_all(live)

    atexit.register(wait)


def wait_all(outer: Any) -> None:
    """Wait for ``outer``'s exchanges in flight: their means are then in the fragments' deltas,
    to land at their steps (``flight`` holds None for their futures)."""
    for f, (at, futures, rates) in sorted(outer.flight.items()):
        if futures is not None:
            outer.reducers[f].finish(futures)
            outer.flight[f] = (at, None, rates)


def save(outer: Any) -> dict[str, Any]:
    """``outer``'s exchanges in flight, waited for, as ``flight/<f>/...`` entries."""
    wait_all(outer)
    out: dict[str, Any] = {}
    for f, (at, _, rates) in sorted(outer.flight.items()):
        out[f"flight/{f}/lands_at"] = at
        out[f"flight/{f}/rates"] = np.array(rates, dtype=np.float64)
        for d, i in zip(outer._deltas[f], outer.groups[f]):
            out[f"flight/{f}/mean/{i}"] = np.array(to_host(d), copy=True)
        if outer.keep_local:
            for d, i in zip(outer.own[f], outer.groups[f]):
                out[f"flight/{f}/own/{i}"] = np.array(to_host(d), copy=True)
    return out


def take(outer: Any, state: dict[str, Any], owner: str, step: int) -> dict[int, Loaded]:
    """The exchanges in flight in ``state`` (popped), checked against ``outer``'s configuration."""
    flight = {}
    for f in sorted({int(k.split("/")[1]) for k in state if k.startswith("flight/") and k.split("/")[1].isdigit()}):
        if f >= outer.fragments or not outer.overlap:
            raise ValueError(f"{owner}: the state has an exchange in flight for fragment {f}, but this "
                             f"optimizer has {outer.fragments} fragment(s) and overlap {outer.overlap}")
        at = take_int(state, f"flight/{f}/lands_at", owner)
        if not step < at <= step + outer.overlap:
            raise ValueError(f"{owner}: flight/{f}/lands_at is {at}, outside steps {step + 1}..{step + outer.overlap}")
        rates = np.asarray(state.pop(f"flight/{f}/rates", None), dtype=np.float64).reshape(-1)
        if rates.shape != (len(outer.params),):
            raise ValueError(f"{owner}: flight/{f}/rates must hold {len(outer.params)} rates")
        parts = ("mean", "own") if outer.keep_local else ("mean",)
        arrays: dict[str, list] = {part: [] for part in parts}
        for part in parts:
            for d, i in zip(outer._deltas[f], outer.groups[f]):
                value = state.pop(f"flight/{f}/{part}/{i}", None)
                if value is None or tuple(np.shape(value)) != tuple(d.shape):
                    raise ValueError(f"{owner}: flight/{f}/{part}/{i} is missing or not of shape {tuple(d.shape)}")
                arrays[part].append(value)
        flight[f] = (at, [float(r) for r in rates], arrays["mean"], arrays.get("own"))
    return flight


def restore(outer: Any, flight: dict[int, Loaded]) -> None:
    """``take``'s exchanges put back in flight in ``outer`` (its state already checked)."""
    outer.flight, outer.own = {}, {}
    for f, (at, rates, means, own) in flight.items():
        for d, mean in zip(outer._deltas[f], means):
            d[...] = array_module(d).asarray(mean)
        if own is not None:
            keep_own(outer.own, f, [array_module(d).asarray(o) for d, o in zip(outer._deltas[f], own)])
        outer.flight[f] = (at, None, rates)
