"""The report's figures (``gradcomp.report``), drawn with matplotlib, imported here only."""
from __future__ import annotations

import io
import math
from typing import Any

from . import inputs

COLORS = {"compress": "#4c72b0", "wire": "#dd8452", "agree": "#937860", "audit": "#8172b3",
          "decode": "#55a868", "wait": "#c44e52"}
RUNG_COLORS = ["#55a868", "#dd8452", "#c44e52", "#8172b3", "#937860"]


def pyplot() -> Any:
    """matplotlib's pyplot, without a display; a clear error where it is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError("gradcomp.report draws its plots with matplotlib, which is not installed: "
                          "pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def figures(run: inputs.Run) -> list[tuple[str, Any]]:
    """(title, matplotlib figure) for each plot the run's files allow."""
    out = []
    records = run.stats_rank()
    s = inputs.series(records)
    if s["step"]:
        out.append(("Bytes sent and compression ratio", _bytes(s)))
    steps, names, grid = inputs.rungs(records)
    if names:
        out.append(("Each tensor's rung", _rungs(steps, names, grid)))
    seen, limit = inputs.audits(run)
    if seen:
        out.append(("Audit costs against the budget", _audits(seen, limit)))
    if run.traces:
        splits = {rank: inputs.time_split(events) for rank, events in sorted(run.traces.items())}
        if any(splits.values()):
            out.append(("The step's time split", _split(splits)))
    return out


def svg(fig: Any) -> str:
    """``fig`` as inline SVG text (no XML header), and closed."""
    plt = pyplot()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", bbox_inches="tight")
    plt.close(fig)
    text = buf.getvalue()
    return text[text.index("<svg"):]


def picture(run: inputs.Run, path: str) -> None:
    """Every figure of the report, one under another, as one PNG at ``path`` (for documents)."""
    plt = pyplot()
    from matplotlib.image import imread

    images = []
    for _, fig in figures(run):
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        buf.seek(0)
        images.append(imread(buf))
    if not images:
        raise ValueError("gradcomp.report: nothing to draw")
    width = max(im.shape[1] for im in images)
    height = sum(im.shape[0] for im in images)
    whole = plt.figure(figsize=(width / 90, height / 90), dpi=90)
    top = 0
    for im in images:
        ax = whole.add_axes((0, 1 - (top + im.shape[0]) / height, im.shape[1] / width, im.shape[0] / height))
        ax.imshow(im)
        ax.axis("off")
        top += im.shape[0]
    whole.savefig(path, dpi=90)
    plt.close(whole)


def _bytes(s: dict[str, list[float]]) -> Any:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.2))
    left.plot(s["step"], [b / 2**20 for b in s["bytes"]], color=COLORS["wire"])
    left.set(xlabel="step", ylabel="MiB sent by this rank", title="bytes sent (whole run)")
    right.plot(s["step"], s["ratio"], label="whole run", color=COLORS["compress"])
    recent = [(x, y) for x, y in zip(s["step"], s["recent"]) if not math.isnan(y)]
    if recent:
        right.plot(*zip(*recent), label="since the record before", color=COLORS["decode"], alpha=0.8)
    right.set(xlabel="step", ylabel="fp32 allreduce bytes / bytes sent", title="compression ratio")
    right.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _rungs(steps: list[int], names: list[str], grid: list[list[int]]) -> Any:
    plt = pyplot()
    from matplotlib.colors import ListedColormap

    rungs = max(max(row) for row in grid) + 1
    fig, ax = plt.subplots(figsize=(10, min(1.5 + 0.18 * len(names), 9)))
    cmap = ListedColormap(["#eeeeee"] + RUNG_COLORS[:max(rungs, 1)])
    shown = [[v + 1 for v in row] for row in grid]
    edges = list(steps) + [steps[-1] + (steps[-1] - steps[-2] if len(steps) > 1 else 1)]
    ax.pcolormesh(edges, range(len(names) + 1), shown, cmap=cmap, vmin=0, vmax=max(rungs, 1), shading="flat")
    if len(names) <= 40:
        ax.set_yticks([i + 0.5 for i in range(len(names))], names, fontsize=7)
    ax.invert_yaxis()
    ladder = ["method", "int4", "int8"]
    for i in range(rungs):
        ax.plot([], [], "s", color=RUNG_COLORS[i], label=ladder[i] if i < 3 else f"rung {i}")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.set(xlabel="step", title=f"the rung of each of {len(names)} tensors (grey: not reduced yet)")
    fig.tight_layout()
    return fig


def _audits(seen: list[tuple[int, str, float]], limit: float | None) -> Any:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    rungs = list(dict.fromkeys(r for _, r, _ in seen))
    for i, rung in enumerate(rungs):
        pts = [(s, max(c, 1e-6)) for s, r, c in seen if r == rung]
        ax.scatter(*zip(*pts), s=14, color=RUNG_COLORS[i % len(RUNG_COLORS)], label=f"audited on {rung}")
    if limit is not None:
        ax.axhline(limit, color="black", linestyle="--", linewidth=1, label=f"budget {limit:g}")
    ax.set_yscale("log")
    ax.set(xlabel="step", ylabel="cost (x the exact mean's noise)", title="each audit window's cost")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _usual(split: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    """``split`` without the steps that took over 5 times the median step (the first steps
    compile the kernels; ``auto`` probes the link): they would hide the others."""
    totals = sorted(sum(row.values()) for row in split.values())
    if not totals:
        return split
    median = totals[len(totals) // 2]
    return {s: row for s, row in split.items() if sum(row.values()) <= 5 * median}


def _split(splits: dict[int, dict[int, dict[str, float]]]) -> Any:
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), gridspec_kw={"width_ratios": [3, 1]})
    splits = {r: _usual(v) for r, v in splits.items()}
    rank = min(r for r, v in splits.items() if v)
    steps = list(splits[rank])
    bottom = [0.0] * len(steps)
    for part in inputs.PARTS:
        values = [splits[rank][s][part] for s in steps]
        if any(values):
            axes[0].bar(steps, values, bottom=bottom, color=COLORS[part], label=part, width=1.0)
            bottom = [b + v for b, v in zip(bottom, values)]
    axes[0].set(xlabel="step", ylabel="ms (summed over buckets)",
                title=f"rank {rank}: each step's parts (steps over 5x the median left out: compiling, probes)")
    axes[0].legend(fontsize=8, ncol=3)
    ranks = [r for r, v in splits.items() if v]
    left = [0.0] * len(ranks)
    for part in inputs.PARTS:
        totals = [sum(row[part] for row in splits[r].values()) for r in ranks]
        whole = [sum(sum(row.values()) for row in splits[r].values()) or 1.0 for r in ranks]
        shares = [100 * t / w for t, w in zip(totals, whole)]
        axes[1].barh([f"rank {r}" for r in ranks], shares, left=left, color=COLORS[part])
        left = [a + b for a, b in zip(left, shares)]
    axes[1].set(xlabel="% of the run's summed time", title="shares, whole run")
    fig.tight_layout()
    return fig
