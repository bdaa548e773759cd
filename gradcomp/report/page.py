"""The report's HTML page (``gradcomp.report``): the figures inline, a summary and the decisions."""
from __future__ import annotations

import html
import json
from typing import Any

from . import inputs, plots

#: the decisions listed on the page at most (the timeline may hold thousands of audits)
MAX_EVENTS = 300

_STYLE = """body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:2em}table{border-collapse:collapse;font-size:.85em}
td,th{border-bottom:1px solid #ddd;padding:.25em .6em;text-align:left;vertical-align:top}
.muted{color:#777}svg{max-width:100%;height:auto}"""


def page(run: inputs.Run, png: str | None = None) -> str:
    """The whole page, as text; the figures also as one picture at ``png`` where given."""
    parts = [f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>gradcomp report</title>"
             f"<style>{_STYLE}</style></head><body><h1>gradcomp report</h1>", _summary(run)]
    for title, fig in plots.figures(run):
        parts.append(f"<h2>{html.escape(title)}</h2>{plots.svg(fig)}")
    parts.append(_split_table(run))
    parts.append(_events(run))
    parts.append("<p class='muted'>Files: " + ", ".join(html.escape(f) for f in run.files) + "</p></body></html>")
    if png is not None:
        plots.picture(run, png)
    return "\n".join(parts)


def _summary(run: inputs.Run) -> str:
    rows = []
    records = run.stats_rank()
    if records:
        last = records[-1]["stats"]
        rows.append(("steps recorded", f"{records[0]['step']} to {records[-1]['step']} ({len(records)} records)"))
        rows.append(("bytes sent (this rank)", f"{(last.get('bytes_sent') or 0) / 2**20:.1f} MiB"))
        rows.append(("compression ratio", f"{last.get('compression_ratio') or 1.0:.1f}x"))
        g = last.get("governor")
        if isinstance(g, dict):
            rows.append(("governor", f"budget {g.get('budget')}, limit {g.get('limit')}, tensor steps per rung "
                                     f"{json.dumps(g.get('tensor_steps'))}"))
        if last.get("warmup_ended_at") is not None:
            rows.append(("warm-up ended at", str(last["warmup_ended_at"])))
    if run.traces:
        methods = {e.get("args", {}).get("method") for ev in run.traces.values() for e in ev
                   if e.get("name") == "reduce"}
        rows.append(("timelines", f"ranks {sorted(run.traces)}"))
        if methods - {None}:
            rows.append(("method", ", ".join(sorted(str(m) for m in methods - {None}))))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in rows)
    return f"<table>{body}</table>"


def _split_table(run: inputs.Run) -> str:
    if not run.traces:
        return ""
    head = "".join(f"<th>{p}</th>" for p in inputs.PARTS)
    rows = []
    for rank, events in sorted(run.traces.items()):
        split = inputs.time_split(events)
        if not split:
            continue
        n = len(split)
        means = [sum(row[p] for row in split.values()) / n for p in inputs.PARTS]
        cells = "".join(f"<td>{m:.2f}</td>" for m in means)
        rows.append(f"<tr><td>rank {rank}</td><td>{n}</td>{cells}</tr>")
    if not rows:
        return ""
    return ("<h2>Time per step, by part (ms, mean over steps, summed over buckets)</h2>"
            f"<table><tr><th>rank</th><th>steps</th>{head}</tr>{''.join(rows)}</table>"
            "<p class='muted'>compress runs on the compute thread while the wire thread sends the bucket "
            "before; wait is the training thread's wait for the means (DDP: from the last bucket handed "
            "over).</p>")


def _events(run: inputs.Run) -> str:
    events = [e for e in run.instants() if e.get("pid") == min(run.traces)] if run.traces else []
    if not events:
        return ""
    rows = []
    for e in events[:MAX_EVENTS]:
        args: dict[str, Any] = dict(e.get("args", {}))
        step = args.pop("step", "")
        text = ", ".join(f"{k}={v}" for k, v in args.items())
        rows.append(f"<tr><td>{html.escape(str(step))}</td><td>{html.escape(str(e.get('name')))}</td>"
                    f"<td>{html.escape(text[:400])}</td></tr>")
    more = f"<p class='muted'>{len(events) - MAX_EVENTS} more not listed.</p>" if len(events) > MAX_EVENTS else ""
    return (f"<h2>Decisions (rank {min(run.traces)}'s timeline)</h2><table><tr><th>step</th><th>event</th>"
            f"<th>arguments</th></tr>{''.join(rows)}</table>{more}")
