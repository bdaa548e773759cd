"""What compression is doing, as flat scalars for any logger, and one line when a method backs off.

Every object that compresses says what it did in ``stats()``: a nested dict whose shape depends on
the method (the governor's rungs per tensor, ``auto``'s choice per bucket, the divergence guard,
a warm-up's end, DiLoCo's outer steps). A logger wants a flat dict of numbers under stable names,
so ``metrics(stats)`` turns any of them into one, under one prefix (``gradcomp/``), ready for
``SummaryWriter.add_scalars`` or a framework's ``log_dict``:

    values = gradcomp.metrics(state.compressor.stats())   # whole-run figures, stateless

A ratio over the whole run moves less and less as a run goes on, so ``Meter`` keeps the previous
reading and adds the ratio and the bytes per step *since then* (``recent_*``); its ``events`` are
the lines that say, once, when a method backed off between two readings (``backoffs``): the
governor moved tensors to a safer rung, ``auto`` chose another method for a bucket, the divergence
guard saw a residual run away. The framework adapters (``gradcomp.torch.lightning``,
``.transformers``, ``.accelerate``) log both at the framework's own interval through its own
logger; docs/guides/observing.md has the table of names.

Reading only: nothing here knows a compressor beyond the keys its ``stats()`` documents, and a key
a method does not have is simply absent from the output. Non-numeric entries become numbers on
purpose (a rung's name: the share of tensors on it) or are left out; no value is a string. Pure
Python (DESIGN invariant 6).
"""
from __future__ import annotations

import math
import re
from typing import Any, Iterator, Mapping

#: the one prefix of every name
PREFIX = "gradcomp/"

#: numbers copied as they are, where a ``stats()`` has them (traffic; DiLoCo's outer steps; what
#: torchft's coordinator counted)
COPIED = ("bytes_sent", "reference_bytes", "compression_ratio", "bytes_sent_per_step", "steps",
          "local_bytes_sent", "outer_steps", "exchange_compression_ratio", "outer_steps_discarded",
          "heals", "failures")


def metrics(stats: Mapping[str, Any], prefix: str = PREFIX) -> dict[str, float]:
    """``stats`` (any gradcomp ``stats()``) as a flat dict of float scalars named ``prefix + name``:
    traffic, warm-up, governor rungs and audits, guard, ``auto``'s choices, DiLoCo's outer steps
    (docs/guides/observing.md). Whole-run figures only; ``Meter`` adds the recent ones."""
    out: dict[str, float] = {}
    for name in COPIED:
        if _number(stats.get(name)):
            out[name] = float(stats[name])
    for part in _parts(stats):
        for name, value in (*_warmup(part), *_guard(part), *_auto(part)):
            out.setdefault(name, value)
    governors = _governors(stats)
    if governors:
        out.update(_governed(governors, stats.get("bytes_sent")))
    return {prefix + name: value for name, value in out.items()}


class Meter:
    """``metrics`` plus the figures since the previous ``update``: ``recent_compression_ratio``
    (the reference bytes over the bytes sent in between) and ``recent_bytes_sent_per_step``,
    left out where nothing was sent in between (a DiLoCo interval without an outer step). After
    each ``update``, ``events`` holds the back-off lines (``backoffs``) since the previous one.
    Keep one per logger: the interval is the logger's."""

    def __init__(self, prefix: str = PREFIX):
        self.prefix = prefix
        self.last: Mapping[str, Any] | None = None
        self.events: list[str] = []

    def update(self, stats: Mapping[str, Any]) -> dict[str, float]:
        out = metrics(stats, self.prefix)
        before = self.last or {}
        sent, reference, steps = (_delta(stats, before, k) for k in ("bytes_sent", "reference_bytes", "steps"))
        if sent is not None and sent > 0:
            if reference is not None:
                out[self.prefix + "recent_compression_ratio"] = reference / sent
            if steps:
                out[self.prefix + "recent_bytes_sent_per_step"] = sent / steps
        self.events = backoffs(self.last, stats)
        self.last = stats
        return out


def backoffs(before: Mapping[str, Any] | None, now: Mapping[str, Any]) -> list[str]:
    """One line for each time a method backed off between two ``stats()`` of the same object
    (``before``: None for the first): a governor decision over its budget (or the guard's step
    down), ``auto`` choosing another method for the same bucket, the guard's first runaway."""
    lines: list[str] = []
    was = {_decision_key(d) for g in _governors(before or {}) for d in g.get("decisions", ())}
    for g in _governors(now):
        limit = g.get("limit", g.get("budget", math.inf))
        for d in g.get("decisions", ()):
            if _decision_key(d) in was or d.get("cost", math.nan) <= limit:
                continue  # seen at the previous reading, or a rung above tried and kept
            tensors = list(d.get("tensors", ()))
            named = ", ".join(repr(t) for t in tensors[:3]) + (", ..." if len(tensors) > 3 else "")
            lines.append(f"gradcomp: the governor moved tensor(s) {named} to {d.get('to')} at step "
                         f"{d.get('step')}: {d.get('why')}")
    chosen = {(c.get("bucket"), c.get("numel")): c.get("chosen")
              for part in _parts(before or {}) for c in part.get("choices", ()) if isinstance(c, Mapping)}
    for part in _parts(now):
        for c in part.get("choices", ()):
            old = chosen.get((c.get("bucket"), c.get("numel"))) if isinstance(c, Mapping) else None
            if old is not None and old != c.get("chosen"):
                lines.append(f"gradcomp: auto now reduces bucket {c.get('bucket')} ({c.get('numel')} values) "
                             f"with {c.get('chosen')} instead of {old}: {c.get('why')}")
    warned = any(bool(p["guard"].get("warned")) for p in _parts(before or {}) if isinstance(p.get("guard"), Mapping))
    for part in _parts(now):
        guard = part.get("guard")
        if isinstance(guard, Mapping) and guard.get("warned") and not warned:
            warned = True
            lines.append(f"gradcomp: the divergence guard saw an error-feedback residual run away "
                         f"(worst: {guard.get('worst_tensor')!r}, {guard.get('worst_ratio', math.nan):.3g}x its "
                         "gradient); a governed method steps every tensor a rung down")
    return lines


# -- reading the parts ---------------------------------------------------------------------------------
def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parts(stats: Mapping[str, Any]) -> Iterator[Mapping[str, Any]]:
    """``stats`` and the stats it nests of the method it reduces through (``Hierarchical``'s
    ``inner``), outermost first."""
    while isinstance(stats, Mapping):
        yield stats
        stats = stats.get("inner")  # type: ignore[assignment]


def _governors(stats: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Every governor's ``stats()["governor"]`` within ``stats`` (DiLoCo's streaming fragments
    have one each: a list)."""
    found: list[Mapping[str, Any]] = []
    for part in _parts(stats):
        g = part.get("governor")
        found += [x for x in (g if isinstance(g, list) else [g]) if isinstance(x, Mapping)]
    return found


def _delta(now: Mapping[str, Any], before: Mapping[str, Any], key: str) -> float | None:
    """``now[key] - before[key]``; all of ``now[key]`` when it fell (another run or a reset)."""
    value, was = now.get(key), before.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    start = float(was) if isinstance(was, (int, float)) and was <= value else 0.0
    return float(value) - start


def _warmup(part: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """``warmup_done`` (1 once compression started), with ``warmup_ended_at`` (a warm-up that
    ends when the gradients settle) or ``warmup_steps_left`` (a fixed one)."""
    if "warmup_ended_at" in part:
        ended = part["warmup_ended_at"]
        yield "warmup_done", float(ended is not None)
        if _number(ended):
            yield "warmup_ended_at", float(ended)
    elif _number(part.get("warmup_steps_left")):
        yield "warmup_done", float(part["warmup_steps_left"] == 0)
        yield "warmup_steps_left", float(part["warmup_steps_left"])


def _guard(part: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    guard = part.get("guard")
    if isinstance(guard, Mapping):
        yield "guard_runaway", float(bool(guard.get("warned")))
        if _number(guard.get("worst_ratio")):
            yield "guard_worst_ratio", float(guard["worst_ratio"])


def _auto(part: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """The share of buckets on each method ``auto`` chose (a bucket seen in several layouts
    counts in its latest), and the bytes its measurements sent."""
    latest = {c.get("bucket"): c.get("chosen") for c in part.get("choices", ()) if isinstance(c, Mapping)}
    for label in sorted(set(map(str, latest.values()))):
        yield "auto_share_" + _snake(label), sum(str(v) == label for v in latest.values()) / len(latest)
    if _number(part.get("probe_bytes_sent")):
        yield "auto_probe_bytes", float(part["probe_bytes_sent"])


def _governed(governors: list[Mapping[str, Any]], bytes_sent: Any) -> dict[str, float]:
    """The share of tensors on each rung now, the latest audit's cost and the budget it is held
    to, and the audits' share of the bytes sent."""
    out: dict[str, float] = {}
    rungs = list(dict.fromkeys(r for g in governors for r in (g.get("tensor_steps") or {})))
    levels = {k: v for g in governors for k, v in (g.get("levels") or {}).items()}
    if levels:
        for rung in rungs or sorted(set(levels.values())):
            out["rung_share_" + _snake(rung)] = sum(v == rung for v in levels.values()) / len(levels)
    audits = [(a[0], a[2], g) for g in governors for a in g.get("audits", ()) if len(a) >= 3]
    if audits:
        _, cost, g = max(audits, key=lambda a: (a[0], a[1]))
        out["audit_cost"] = float(cost)
        if _number(g.get("limit")):
            out["audit_budget"] = float(g["limit"])
    if _number(bytes_sent):
        spent = sum(float(g.get("audit_bytes", 0.0)) for g in governors)
        out["audit_share"] = spent / bytes_sent if bytes_sent else 0.0
    return out


def _decision_key(d: Mapping[str, Any]) -> tuple:
    return d.get("step"), d.get("to"), tuple(d.get("tensors", ())), d.get("why")


def _snake(label: str) -> str:
    """``label`` in lower_snake_case: ``hier-int8`` -> ``hier_int8``, ``powersgd:rank=4`` ->
    ``powersgd_rank_4``."""
    return re.sub(r"[^a-z0-9]+", "_", label.lower()).strip("_") or "unnamed"
