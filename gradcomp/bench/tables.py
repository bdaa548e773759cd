"""For the scripts that run one job per compressor and print a row each (demo, convergence,
cnn_convergence): the run loop with its progress lines, the failures' report, and aligned
Markdown tables, readable as plain text in a terminal and as a table once pasted into
BENCHMARKS.md."""
from __future__ import annotations

import sys
from typing import Callable, Sequence


def run_each(names: Sequence[str], ranks: int, run_once: Callable[[str], dict],
             status: Callable[[dict], str]) -> dict[str, dict]:
    """``{name: run_once(name)}`` in order, a progress line per job on stderr (``status`` of a
    result that has no "error")."""
    results: dict[str, dict] = {}
    for i, name in enumerate(names, 1):
        print(f"[{i}/{len(names)}] {name} on {ranks} ranks ...", end=" ", file=sys.stderr, flush=True)
        r = results[name] = run_once(name)
        print(f"{r['wall_seconds']:.0f} s, {r['error'] if 'error' in r else status(r)}", file=sys.stderr, flush=True)
    return results


def failures(results: dict[str, dict]) -> str:
    """Each failed job's error and the last lines of its output ("" when none failed)."""
    return "".join(f"\n{name} FAILED ({r['error']}), last lines:\n    " + "\n    ".join(r["tail"]) + "\n"
                   for name, r in results.items() if "error" in r)


def aligned_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """First column left-aligned, the others right-aligned (numbers), every column as wide as its
    widest cell."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    rule = "|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule] + [line(r) for r in rows])
