"""What a report reads: stats records and timelines (``gradcomp.report``), and what it computes
from them: the series over steps, and the step's time split from the timeline's spans."""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass, field
from typing import Any

from .. import timeline

#: the parts of a step's time, from the timeline's span names (``gradcomp.timeline``): a
#: collective inside the agreement or the governor's audit counts as that, not as the wire
PARTS = ("compress", "wire", "agree", "audit", "decode", "wait")
_PART_OF = {"compress": "compress", "agree": "agree", "audit": "audit", "decode": "decode", "owner": "decode",
            "wait": "wait"}
_WIRE = "wire"


@dataclass
class Run:
    """What was found: stats records by rank (each ``{"step", "stats"}``, by step), and each
    rank's timeline events."""
    records: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    traces: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def stats_rank(self) -> list[dict[str, Any]]:
        """The records of the lowest rank that wrote any (every rank sees the same decisions)."""
        return self.records[min(self.records)] if self.records else []

    def instants(self) -> list[dict[str, Any]]:
        """Every rank's instant events, in time order, each with its ``pid`` (the rank)."""
        return sorted((e for events in self.traces.values() for e in events if e.get("ph") == "i"),
                      key=lambda e: (e.get("ts", 0), e.get("pid", 0)))


def load(paths: list[str]) -> Run:
    """Read ``paths``: ``*.jsonl`` stats records and ``*.json`` timelines, or folders of them."""
    run = Run()
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(glob.glob(os.path.join(path, "**", "*.json*"), recursive=True))
        elif os.path.exists(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"gradcomp.report: {path} does not exist")
    for name in files:
        if name.endswith(".jsonl"):
            _records(run, name)
        elif name.endswith(".json"):
            events = timeline.read(name)
            ranks = {int(e["pid"]) for e in events if isinstance(e.get("pid"), int)}
            for rank in ranks:
                run.traces.setdefault(rank, []).extend(e for e in events if e.get("pid") == rank)
        else:
            continue
        run.files.append(name)
    if not run.records and not run.traces:
        raise ValueError(f"gradcomp.report: found no stats records (*.jsonl) or timelines (*.json) in {paths}")
    return run


def _records(run: Run, name: str) -> None:
    with open(name, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except ValueError:  # a last line cut short by a process that died
                continue
            if isinstance(row, dict) and isinstance(row.get("stats"), dict):
                run.records.setdefault(int(row.get("rank", 0)), []).append(row)
    for rows in run.records.values():
        rows.sort(key=lambda r: r["step"])


def series(records: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per record: the step, bytes sent so far, the whole-run ratio, and the ratio since the
    record before (what a plain allreduce would have sent over what was)."""
    out: dict[str, list[float]] = {"step": [], "bytes": [], "ratio": [], "recent": []}
    before = None
    for row in records:
        s = row["stats"]
        sent, reference = s.get("bytes_sent"), s.get("reference_bytes")
        if sent is None:
            continue
        out["step"].append(row["step"])
        out["bytes"].append(float(sent))
        out["ratio"].append(float(s.get("compression_ratio") or 1.0))
        recent = float("nan")
        if before is not None and reference is not None and sent > before[0]:
            recent = (reference - before[1]) / (sent - before[0])
        out["recent"].append(recent)
        before = (float(sent), float(reference or 0.0))
    return out


def rungs(records: list[dict[str, Any]]) -> tuple[list[int], list[str], list[list[int]]]:
    """Each tensor's rung at each record of a governed run: (steps, tensors, rung index per
    tensor per record, -1 where the record does not name it)."""
    rows = [(r["step"], r["stats"]["governor"]) for r in records if isinstance(r["stats"].get("governor"), dict)]
    if not rows:
        return [], [], []
    names = list(dict.fromkeys(k for _, g in rows for k in g.get("levels", {})))
    order = list(dict.fromkeys(v for _, g in rows for v in g.get("levels", {}).values()))
    known = ["method", "int4", "int8"]
    ladder = known + [r for r in order if r not in known]
    grid = [[ladder.index(g["levels"][k]) if k in g.get("levels", {}) else -1 for _, g in rows] for k in names]
    return [s for s, _ in rows], names, grid


def audits(run: Run) -> tuple[list[tuple[int, str, float]], float | None]:
    """Every audit seen, (step, rung, cost), and the budget (the limit) it was judged against:
    from the timeline's ``audit`` events, and the stats' latest audits."""
    seen: dict[tuple[int, str], float] = {}
    limit = None
    ladder = ["method", "int4", "int8"]
    for row in run.stats_rank():
        g = row["stats"].get("governor")
        if isinstance(g, dict):
            limit = g.get("limit", limit)
            for step, level, cost in g.get("audits", []):
                if cost is not None:
                    seen[(int(step), ladder[int(level)] if int(level) < 3 else str(level))] = float(cost)
    for e in run.instants():
        a = e.get("args", {})
        if e.get("name") == "audit" and e.get("pid") == min(run.traces) and isinstance(a.get("cost"), (int, float)):
            seen[(int(a.get("step", 0)), str(a.get("rung")))] = float(a["cost"])
            limit = a.get("budget", limit)
    return [(s, r, c) for (s, r), c in sorted(seen.items())], limit


def time_split(events: list[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """One rank's step time by part (``PARTS``), in milliseconds, per step: the spans of each
    part summed over the step's buckets. Compress runs on the compute thread beside the wire
    thread's work, so the parts add up to more than the step's wall time where they overlap."""
    out: dict[int, dict[str, float]] = {}
    tracks: dict[Any, list[dict[str, Any]]] = {}
    for e in events:
        if e.get("ph") == "X":
            tracks.setdefault(e.get("tid"), []).append(e)
    for spans in tracks.values():
        spans.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[tuple[float, str | None]] = []  # (end, the part of an enclosing agree or audit)
        for e in spans:
            end = e["ts"] + e.get("dur", 0)
            while stack and stack[-1][0] <= e["ts"]:
                stack.pop()
            inside = next((part for _, part in reversed(stack) if part), None)
            name = str(e.get("name"))
            if e.get("cat") == _WIRE:
                part = None if inside else "wire"  # (a collective of the agreement or audit: theirs)
            else:
                part = None if inside and name in ("agree", "audit") else _PART_OF.get(name)
            step = e.get("args", {}).get("step")
            if part is not None and isinstance(step, int):
                out.setdefault(step, dict.fromkeys(PARTS, 0.0))[part] += e.get("dur", 0) / 1000.0
            stack.append((end, name if name in ("agree", "audit") else None))
    return dict(sorted(out.items()))
