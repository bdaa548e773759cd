"""The zoo's table and heatmap, from the JSON results alone (``--report`` runs nothing else).

Per length (steps), one table of method x workload whose cells read ``gap, ratio``: the gap to
exact averaging (classifiers: points of accuracy, method minus reference, negative = worse; loss
workloads: percent of the reference's loss, positive = worse) and the whole-run compression ratio
(what DDP's fp32 allreduce would have sent over the run / what the method sent). Over several
seeds a cell shows the means. ``n/a``: the method does not apply to the workload's optimizer;
``-``: no result yet; ``ERR``: the run failed (its JSON has the log's tail).

The heatmap draws the same cells, coloured by the gap over the issue's tolerance (1.5 points, or
2% of the loss), so 1 is the edge of "holds quality" in either unit, with the ratio written in.
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from benchmarks.tables import aligned_table

from . import methods as MT
from . import workloads as W

CANONICAL = ["none", "fp16", "bf16", "int8", "int4", "onebit", "topk", "randomk", "powersgd", "auto",
             "dgc", "onebitadam", "diloco"]
TOLERANCE = {"points": 1.5, "percent": 2.0}  # issue 57's targets: 1.5 points, 2% of the loss


def load(out: Path) -> dict[int, dict[str, dict[str, dict[int, dict]]]]:
    """``{steps: {workload: {method: {seed: result}}}}`` from ``OUT/WORKLOAD/STEPS/METHOD@SEED.json``."""
    found: dict[int, dict[str, dict[str, dict[int, dict]]]] = {}
    for path in sorted(out.glob("*/*/*@*.json")):
        if path.parent.parent.name not in W.BY_NAME or not path.parent.name.isdigit():
            continue
        try:
            r = json.loads(path.read_text())
        except ValueError:
            continue
        method, _, seed = path.stem.rpartition("@")
        method = r.get("method", method)
        found.setdefault(int(path.parent.name), {}).setdefault(path.parent.parent.name, {}) \
            .setdefault(method, {})[int(seed)] = r
    return found


def order_methods(names) -> list[str]:
    def key(name: str):
        head = name.partition(":")[0]
        return (CANONICAL.index(head) if head in CANONICAL else len(CANONICAL), name != head, name)
    return sorted(set(names), key=key)


def cell(workload: W.Workload, method: str, by_seed: dict[int, dict] | None,
         refs: dict[int, dict]) -> dict:
    """The means over seeds of one method on one workload: ``gap``, ``ratio``, ``status`` (ok,
    n/a, missing, error), ``seconds``."""
    if not MT.applies(MT.parse(method), workload):
        return dict(status="n/a")
    if not by_seed:
        return dict(status="missing")
    good = {s: r for s, r in by_seed.items() if "error" not in r}
    if not good:
        return dict(status="error")
    gaps = []
    for s, r in good.items():
        ref = refs.get(s)
        if ref is not None and "error" not in ref:
            g = W.gap(workload, _num(r.get("value")), _num(ref.get("value")))
            gaps.append(float("nan") if g is None else g)
    ratios = [r["compression_ratio"] for r in good.values() if r.get("compression_ratio")]
    return dict(status="ok", gap=statistics.mean(gaps) if gaps else None,
                ratio=statistics.mean(ratios) if ratios else None,
                seconds=statistics.mean(r["seconds"] for r in good.values()),
                value=statistics.mean(_num(r.get("value")) for r in good.values()),
                seeds=len(good), failed=len(by_seed) - len(good),
                unit="points" if workload.classifier else "percent")


def _num(v) -> float:
    return float("nan") if v is None else float(v)


def text(c: dict) -> str:
    if c["status"] != "ok":
        return {"n/a": "n/a", "missing": "-", "error": "ERR"}[c["status"]]
    g = c["gap"]
    unit = "pt" if c["unit"] == "points" else "%"
    shown = "?" if g is None else ("diverged" if math.isnan(g) else f"{g:+.2f}{unit}")
    ratio = f"{c['ratio']:.1f}x" if c.get("ratio") else "-"
    return f"{shown}, {ratio}" + (f" ({c['failed']} failed)" if c.get("failed") else "")


def grid(runs: dict[str, dict[str, dict[int, dict]]], workloads: list[W.Workload],
         methods: list[str]) -> dict[tuple[str, str], dict]:
    return {(m, w.name): cell(w, m, runs.get(w.name, {}).get(m), runs.get(w.name, {}).get("none", {}))
            for w in workloads for m in methods}


def table(steps: int, runs: dict[str, dict[str, dict[int, dict]]], workloads: list[W.Workload],
          methods: list[str]) -> str:
    cells = grid(runs, workloads, methods)
    header = ["method"] + [w.name for w in workloads]
    rows = [[m] + [text(cells[(m, w.name)]) for w in workloads] for m in methods]
    ref = [cells.get(("none", w.name), {}) for w in workloads]
    rows.append(["(none: metric)"] + [
        (f"{'acc' if w.classifier else 'loss'} {c['value']:.{2 if w.classifier else 4}f}"
         if c.get("status") == "ok" else "-") for w, c in zip(workloads, ref)])
    rows.append(["(none: s/run)"] + [f"{c['seconds']:.1f}" if c.get("status") == "ok" else "-" for c in ref])
    rows.append(["(half, optimizer)"] + [f"{w.half[:3]}, {w.optimizer}" for w in workloads])
    ranks = {r.get("ranks") for by_m in runs.values() for by_s in by_m.values() for r in by_s.values()}
    seeds = sorted({s for by_m in runs.values() for by_s in by_m.values() for s in by_s})
    title = (f"{steps} steps, {'/'.join(str(r) for r in sorted(x for x in ranks if x))} ranks, seeds {seeds}: "
             "gap to exact averaging (classifiers: accuracy points, negative = worse; loss: %, "
             "positive = worse), whole-run compression ratio")
    return title + "\n\n" + aligned_table(header, rows)


def heatmap(steps: int, runs: dict[str, dict[str, dict[int, dict]]], workloads: list[W.Workload],
            methods: list[str], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm

    cells = grid(runs, workloads, methods)
    value = np.full((len(methods), len(workloads)), np.nan)
    for i, m in enumerate(methods):
        for j, w in enumerate(workloads):
            c = cells[(m, w.name)]
            if c["status"] == "ok" and c.get("gap") is not None:
                b = W.badness(w, c["gap"])
                value[i, j] = 8.0 if b is None or math.isnan(b) else b / TOLERANCE[c["unit"]]
    fig, ax = plt.subplots(figsize=(1.45 * len(workloads) + 2.5, 0.6 * len(methods) + 2.2))
    cmap = plt.get_cmap("RdYlGn_r").with_extremes(bad="0.92")
    image = ax.imshow(np.ma.masked_invalid(np.clip(value, -2, 6)), cmap=cmap, aspect="auto",
                      norm=TwoSlopeNorm(vmin=-2, vcenter=0, vmax=6))
    for i, m in enumerate(methods):
        for j, w in enumerate(workloads):
            c = cells[(m, w.name)]
            shown = text(c).replace(", ", "\n", 1) if c["status"] == "ok" else text(c)
            ax.text(j, i, shown, ha="center", va="center", fontsize=7.5,
                    color="0.45" if c["status"] != "ok" else "black")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([f"{w.name}\n{w.family}, {w.optimizer}\n{w.half}" for w in workloads], fontsize=7.5)
    ax.set_yticks(range(len(methods)))
    ax.set_yticklabels(methods, fontsize=8.5)
    for j in range(1, len(workloads)):
        if workloads[j].half != workloads[j - 1].half:
            ax.axvline(j - 0.5, color="black", lw=2)
    bar = fig.colorbar(image, ax=ax, fraction=0.03, pad=0.02)
    bar.set_label("gap / tolerance (1.5 points or 2% loss); > 1: fails the target", fontsize=8)
    ax.set_title(f"Workload zoo, {steps} steps: gap to exact averaging (cell: gap, whole-run compression ratio)",
                 fontsize=9.5)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def loss_vs_bytes(found: dict[int, dict[str, dict[str, dict[int, dict]]]], workloads: list[W.Workload],
                  path: Path) -> Path | None:
    """One panel per loss workload: each method's final loss (mean over seeds) against its
    whole-run compression ratio, one series per run length: what each byte saved costs (the
    sparse local-steps exchanges against the dense ones and DDP). None where no loss workload ran."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [w for w in workloads if w.metric == "loss" and any(w.name in runs for runs in found.values())]
    if not shown:
        return None
    fig, axes = plt.subplots(1, len(shown), figsize=(6.2 * len(shown), 4.2), squeeze=False)
    for ax, w in zip(axes[0], shown):
        for n in sorted(found):
            points = []
            for method, by_seed in found[n].get(w.name, {}).items():
                done = [r for r in by_seed.values() if isinstance(r.get("final"), dict) and "loss" in r["final"]]
                if done:
                    points.append((sum(r.get("compression_ratio", 1.0) for r in done) / len(done),
                                   sum(r["final"]["loss"] for r in done) / len(done), method))
            points.sort()
            if not points:
                continue
            line, = ax.plot([p[0] for p in points], [p[1] for p in points], "o-", label=f"{n} steps")
            for x, y, method in points:
                ax.annotate(method.replace("diloco:compressor=", "").replace("sparseloco:density=", "sparseloco ")
                            .replace("'", ""), (x, y),
                            fontsize=6.5, color=line.get_color(), xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("fewer bytes than DDP's fp32 allreduce (whole run)")
        ax.set_ylabel("final validation loss")
        ax.set_title(f"{w.name} ({w.half} half): loss against bytes", fontsize=9.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out: Path, workloads: list[W.Workload] | None = None, methods: list[str] | None = None,
           steps: list[int] | None = None, plots: bool = True) -> tuple[str, list[Path]]:
    """Every length's table (also written to ``OUT/zoo-STEPS.md``) and heatmap
    (``OUT/zoo-STEPS.png``), and the loss workloads' ``loss_vs_bytes`` (``OUT/zoo-loss-vs-bytes.png``); ``workloads`` and ``steps`` narrow it down; ``methods``: the rows
    (with ``none``), even those without a result (default: every method found)."""
    found = load(out)
    texts, figures = [], []
    for n in sorted(found):
        if steps and n not in steps:
            continue
        runs = found[n]
        shown_w = [w for w in (workloads or W.WORKLOADS) if w.name in runs]
        shown_w.sort(key=lambda w: (W.HALVES.index(w.half), W.WORKLOADS.index(w)))
        present = order_methods(m for by_m in runs.values() for m in by_m)
        shown_m = ["none"] + [m for m in methods if m != "none"] if methods else present
        if not shown_w or not shown_m:
            continue
        t = table(n, runs, shown_w, shown_m)
        (out / f"zoo-{n}.md").write_text(t + "\n")
        texts.append(t)
        if plots:
            figures.append(heatmap(n, runs, shown_w, shown_m, out / f"zoo-{n}.png"))
    if plots:
        chosen = {n: runs for n, runs in found.items() if not steps or n in steps}
        drawn = loss_vs_bytes(chosen, workloads or W.WORKLOADS, out / "zoo-loss-vs-bytes.png")
        figures += [drawn] if drawn is not None else []
    return "\n\n".join(texts) if texts else f"no zoo results under {out}", figures
