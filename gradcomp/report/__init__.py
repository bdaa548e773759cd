"""A run's story on one HTML page: ``python -m gradcomp.report RUN [-o report.html]``.

What it reads (``RUN``: files, or folders holding them):

* **stats records** (``*.jsonl``): one JSON object a line, ``{"step", "rank", "stats"}``, where
  ``stats`` is a compressor's ``stats()`` at that step; ``record`` appends one. Every ``N`` steps
  on rank 0 is enough: ``stats()`` is cumulative, and the governor's holds each tensor's rung.
* **timelines** (``*.json``): the Chrome trace files ``gradcomp.timeline`` writes, one per rank
  (an unclosed one, from a process that died, too).

What it shows, from whichever of them it finds: the bytes sent and the compression ratio over
the steps, each tensor's rung over the steps (a governed method), the audits' costs against the
budget, the step's time split (compress, wire, agreement, audit, decode, wait, from the
timeline's spans), and the decisions the timeline recorded (rung changes, warm-up ends, guard
actions, quorums, outer steps). Plots need matplotlib (``pip install matplotlib``); it is
imported only to draw them, and figures are embedded as inline SVG, so the page stands alone.

Modules: ``inputs`` (reading and the time split), ``plots`` (the figures), ``page`` (the HTML).
"""
from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping

from .. import timeline


def record(stats: Mapping[str, Any], path: str, step: int, rank: int | None = None) -> None:
    """Append ``stats`` (a compressor's ``stats()``) at ``step`` to the JSON-lines file ``path``
    (its folder is made), for ``python -m gradcomp.report``. ``rank``: default this process's.
    Non-finite numbers are written as null (JSON has none)."""
    row = {"step": int(step), "rank": timeline._rank() if rank is None else int(rank),
           "time": time.time(), "stats": _plain(stats)}
    folder = os.path.dirname(os.fspath(path))
    if folder:
        os.makedirs(folder, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, separators=(",", ":")) + "\n")


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it: mappings with text keys, lists, finite numbers or None, text."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if hasattr(value, "tolist"):  # NumPy scalars and arrays
        return _plain(value.tolist())
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


def render(paths: list[str], out: str, png: str | None = None) -> str:
    """Write the report of the runs at ``paths`` (files or folders) to ``out`` (HTML), and its
    figures as one picture to ``png`` where given; returns ``out``."""
    from .inputs import load
    from .page import page

    run = load(paths)
    html = page(run, png)
    with open(out, "w", encoding="utf-8") as f:
        f.write(html)
    return out


__all__ = ["record", "render"]
