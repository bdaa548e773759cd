"""PowerSGD's checkpoint: ``state_dict`` and a ``load_state_dict`` that checks everything first.

Keys (all plain numbers, strings and arrays, ``numpy.savez``-able):
``config`` (the configuration it was saved with), ``step``, ``rng/keys`` ``rng/pos``
``rng/has_gauss`` ``rng/gauss`` (the generator of fresh factors), the statistics counters, and per
tensor key K: ``residual/K`` (shaped like the tensor), ``q/K`` (m x r) and, for ``rounds=1``,
``p/K`` (n x r).
"""
from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, NamedTuple, NoReturn

import numpy as np

from ..state import (TensorStore, check_array, pop_shapes, reject_leftovers, shape_entries, take_int,
                     tensor_arrays)


def saved(config: str, step: int, rng: np.random.RandomState, counts: Mapping[str, int],
          errors: TensorStore, q: TensorStore, p: TensorStore) -> dict[str, Any]:
    """The checkpoint of a compressor of configuration ``config`` (``describe()``) at ``step``."""
    kind, keys, pos, has_gauss, gauss = rng.get_state()
    out: dict[str, Any] = {
        "config": config,
        "step": step,
        "rng/keys": np.array(keys, dtype=np.uint32),
        "rng/pos": int(pos), "rng/has_gauss": int(has_gauss), "rng/gauss": float(gauss),
    }
    for k, v in counts.items():
        out[k] = int(v)
    for prefix, store in (("residual/", errors), ("q/", q), ("p/", p)):
        for key, value in store.arrays().items():
            out[prefix + key] = value
    out.update(shape_entries(errors))
    return out


class Checked(NamedTuple):
    """A checkpoint's content, every part checked: what ``load_state_dict`` then sets."""
    step: int
    rng: tuple           # for ``RandomState.set_state``
    counts: dict[str, int]
    residuals: dict[str, Any]
    q: dict[str, Any]
    p: dict[str, Any]


def checked(owner: str, config: str, rank: int, counters: Iterable[str], state: Mapping[str, Any],
            shapes: Mapping[str, tuple] | None) -> Checked:
    """``state`` checked against the configuration ``config`` of a compressor (type ``owner``) of
    rank ``rank`` with statistics ``counters``: a ``ValueError`` names the first thing wrong."""
    state = dict(state)
    if not state:
        raise ValueError(f"{owner} state: empty (expected the output of state_dict())")
    saved_by = state.pop("config", None)
    if saved_by is None:
        raise ValueError(f"{owner} state: missing 'config'")
    if str(np.asarray(saved_by)) != config:
        raise ValueError(f"{owner} state: saved by {str(np.asarray(saved_by))}, but this compressor is "
                         f"{config} (another configuration)")
    step = take_int(state, "step", owner)
    rng_keys = check_array(state.pop("rng/keys") if "rng/keys" in state else _missing(owner, "rng/keys"),
                           "rng/keys", owner, (624,), ("uint32", "int64"))
    if rng_keys.min(initial=0) < 0 or rng_keys.max(initial=0) > 0xFFFFFFFF:
        raise ValueError(f"{owner} state: 'rng/keys' must hold 32-bit unsigned words")
    rng_keys = rng_keys.astype(np.uint32)
    pos = take_int(state, "rng/pos", owner)
    if pos > 624:
        raise ValueError(f"{owner} state: 'rng/pos' must be <= 624, got {pos}")
    has_gauss = take_int(state, "rng/has_gauss", owner)
    gauss = state.pop("rng/gauss", None)
    if gauss is None or np.asarray(gauss).shape != () or not np.isfinite(float(np.asarray(gauss))):
        raise ValueError(f"{owner} state: 'rng/gauss' must be a finite number, got {gauss!r}")
    counts = {k: take_int(state, k, owner) if k in state else 0 for k in counters}
    shapes = pop_shapes(state, owner, shapes)
    residuals = tensor_arrays(state, "residual/", owner, shapes)
    missing = sorted(k for k in residuals if k not in shapes)
    if missing:
        raise ValueError(f"{owner} state: no 'shape/{missing[0]}' for 'residual/{missing[0]}'")
    factors = {}
    for which, rows_of in (("q", lambda shape: math.prod(shape[1:])), ("p", lambda shape: shape[0])):
        values = tensor_arrays(state, f"{which}/", owner)
        for key, value in values.items():
            name = f"{which}/{key}"
            if value.ndim != 2 or not 1 <= value.shape[1] <= rank:
                raise ValueError(f"{owner} state: {name!r} must be (rows, r) with 1 <= r <= rank "
                                 f"{rank}, got shape {value.shape}")
            if not np.isfinite(value).all():
                raise ValueError(f"{owner} state: {name!r} holds NaN or Inf")
            if key in shapes and len(shapes[key]) >= 2:
                shape = tuple(shapes[key])
                r = min(shape[0], math.prod(shape[1:]), rank)
                expect = (rows_of(shape), r)
                if value.shape != expect:
                    raise ValueError(f"{owner} state: {name!r} must have shape {expect} for a tensor of "
                                     f"shape {shape}, got {value.shape}")
        factors[which] = values
    reject_leftovers(state, owner)
    return Checked(step, ("MT19937", rng_keys, pos, has_gauss, float(np.asarray(gauss))), counts,
                   residuals, factors["q"], factors["p"])


def _missing(owner: str, key: str) -> NoReturn:
    raise ValueError(f"{owner} state: missing {key!r}")
