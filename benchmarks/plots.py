"""PNG figures from the benchmark results (matplotlib, Agg backend: no screen needed).

* ``time_vs_bandwidth.png``: step time against link bandwidth, one small panel per family of
  methods (exact, half precision, int8 quantized, low rank), with fp32 allreduce as the reference
  line in every panel. Lines are a model, said so on the figure: the step time measured on this host
  (ranks talk through shared memory, so it is nearly all compute) plus the bytes each rank sends
  divided by the bandwidth. Dots are real runs on a capped network (``benchmarks/capped.sh``), drawn (and
  claimed) only when such results for the same model and number of ranks are in the output folder.
* ``error_vs_ratio.png``: relative error of one step against compression ratio. Colour = family,
  marker = implementation; methods that land on the same spot share one label, and labels are
  placed so that no two overlap and none covers a point.
* ``bytes_vs_ranks.png``: bytes each rank sends per step, as a multiple of the fp32 gradient,
  against the number of ranks, with the bandwidth-optimal formulas drawn beside the measurements:
  allreduce-based methods send ``c * 2(N-1)/N`` (bounded by ``2c``), allgather-based ones
  ``c * (N-1)`` (linear in N).
* ``kernels.png``: kernel time as a multiple of memcpy.
* ``capped.png``: measured step time on the capped link as a fraction of the fp32 allreduce step.

Jobs that say their worker path (``reducer`` or ``ddp``) get one set of figures per model and path
(``time_vs_bandwidth-MODEL-PATH.png``, ...) and are matched with capped runs of the same path.
Baseline rows (``memcpy``, ``backward``: ``kind == "baseline"``) are never drawn as methods.

Every function returns the (closed) matplotlib figure, so tests can inspect what was drawn.
"""
from __future__ import annotations

import itertools
import math
import os
from typing import Any

import numpy as np

from .labels import _clusters, _label_lines, place_labels

DPI = 110

# Families of methods, in panel order, with one colour each (error_vs_ratio).
FAMILIES = ("exact", "half precision", "int8 quantized", "low rank (PowerSGD)", "other")
FAMILY_COLORS = {"exact": "0.1", "half precision": "tab:blue", "int8 quantized": "tab:orange",
                 "low rank (PowerSGD)": "tab:green", "other": "tab:purple"}
# Implementation -> (marker, line style).
IMPLEMENTATIONS = {"gradcomp (MPI)": ("o", "-"), "gradcomp (gloo)": ("s", "-."),
                   "PyTorch hook (gloo)": ("x", "--")}


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(**kw: Any) -> Any:
    plt = _plt()
    return plt.subplots(dpi=DPI, **kw)


def _save(fig: Any, path: str, layout: bool = True) -> None:
    """Write ``fig`` as a PNG and free it (figures are made in loops; pyplot keeps them alive).
    ``layout=False`` when the figure was laid out already (labels placed in display coordinates
    must not move after placement)."""
    if layout:
        fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    _plt().close(fig)


def _timed(rows: list[dict]) -> list[dict]:
    """Rows of methods that ran (baselines left out: ``memcpy``, ``backward``)."""
    return [r for r in rows if "time_s" in r and r["method"] != "memcpy" and r.get("kind") != "baseline"]


def family(method: str) -> str:
    """Which family a method belongs to, from its name: ``torch-``, ``gloo-`` and ``mpi-``
    prefixes, a `` (tag)`` suffix and a spec's ``:key=value,...`` are dropped; ``ddp`` (DDP's own
    allreduce) is exact."""
    base = method.split(" (", 1)[0]
    for prefix in ("torch-", "gloo-", "mpi-"):
        if base.startswith(prefix):
            base = base[len(prefix):]
    base = base.split(":", 1)[0]
    if base == "ddp":
        return "exact"
    if "powersgd" in base:
        return "low rank (PowerSGD)"
    if base.startswith(("quantize", "int8")):
        return "int8 quantized"
    if base in ("fp16", "bf16"):
        return "half precision"
    if base in ("allreduce", "allgather"):
        return "exact"
    return "other"


def implementation(row: dict) -> str:
    if row.get("kind") == "torch" or row["method"].startswith(("torch-", "ddp")):
        return "PyTorch hook (gloo)"
    if row["method"].startswith("gloo-"):
        return "gradcomp (gloo)"
    return "gradcomp (MPI)"


def _rate_gbit(text: str) -> float | None:
    """'1gbit' -> 1.0, '500mbit' -> 0.5 (tc's units)."""
    t = text.strip().lower()
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * scale
            except ValueError:
                return None
    return None


def _outside_legend(ax: Any, **kw: Any) -> Any:
    """A legend to the right of ``ax``, outside it."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kw)


# -- step time against bandwidth ----------------------------------------------------------------------
def time_vs_bandwidth(job: dict, capped: list[dict], path: str) -> Any:
    rows = _timed(job["results"])
    measured = []  # (rate Gbit/s, network name, row) from capped runs of the same model and ranks
    for c in capped:
        if (c.get("ranks") != job["ranks"] or c.get("model") != job["model"]
                or c.get("path") != job.get("path")):
            continue
        rate = _rate_gbit(c.get("network", ""))
        if rate is None:
            continue
        measured += [(rate, c["network"], r) for r in _timed(c["results"])]  # (a rate: a network)
    names = [r["method"] for r in rows] + [r["method"] for _, _, r in measured]
    panels = [f for f in FAMILIES if any(family(n) == f for n in names)] or ["exact"]
    ncols = 1 if len(panels) == 1 else 2
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(nrows=nrows, ncols=ncols, figsize=(6.4 * ncols, 3.4 * nrows + 1.0),
                        sharex=True, sharey=True, squeeze=False)
    gbits = np.logspace(-1, 2, 60)
    reference = next((r for r in rows if r["method"] == "allreduce"), None)
    for k, ax in enumerate(axes.flat):
        if k >= len(panels):
            ax.set_visible(False)
            continue
        fam = panels[k]
        mine = [r for r in rows if family(r["method"]) == fam]
        colors = {}
        palette = itertools.cycle(_plt().cm.tab10.colors)
        if reference is not None and fam != "exact":
            ax.plot(gbits, reference["time_s"] + reference["bytes_per_rank"] * 8 / (gbits * 1e9),
                    color="0.6", linewidth=3, alpha=0.6, label="allreduce (fp32, reference)")
        for r in mine:
            colors[r["method"]] = next(palette)
            ax.plot(gbits, r["time_s"] + r["bytes_per_rank"] * 8 / (gbits * 1e9),
                    color=colors[r["method"]], linestyle=IMPLEMENTATIONS[implementation(r)][1],
                    linewidth=1.6, label=r["method"])
        dots = [(rate, r) for rate, _, r in measured if family(r["method"]) == fam]
        for rate, r in dots:
            if r["method"] not in colors:
                colors[r["method"]] = next(palette)
                ax.plot([], [], color=colors[r["method"]], marker="o", linestyle="none",
                        label=f"{r['method']} (measured only)")
            ax.scatter([rate], [r["time_s"]], color=colors[r["method"]],
                       marker=IMPLEMENTATIONS[implementation(r)][0], s=30, zorder=3,
                       edgecolors="k" if implementation(r) != "PyTorch hook (gloo)" else None,
                       linewidths=0.5)
        if dots:
            ax.scatter([], [], color="w", edgecolors="k", marker="o", s=30, label="measured, capped link")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(fam, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        _outside_legend(ax, fontsize=7, frameon=False)
        if k % ncols == 0:
            ax.set_ylabel("time per step (s)")
        if k >= len(panels) - ncols:
            ax.set_xlabel("link bandwidth per rank (Gbit/s)")
            ax.xaxis.set_tick_params(labelbottom=True)
    nets = sorted({(rate, net) for rate, net, _ in measured}, reverse=True)
    claim = ("lines: model = step measured on this host (shared memory) + bytes sent per rank / bandwidth"
             + (f"\ndots: measured on a tc-capped link ({', '.join(n for _, n in nets)})" if nets else
                "\nmodel only: no capped-link measurements for this model and number of ranks"))
    where = f", {job['path']} path" if job.get("path") else ""
    fig.suptitle(f"{job['model']}, {job['ranks']} ranks{where}: time per step against link bandwidth\n{claim}",
                 fontsize=9)
    _save(fig, path)
    return fig


# -- error against compression ratio -----------------------------------------------------------------

def error_vs_ratio(job: dict, path: str) -> Any:
    from matplotlib.lines import Line2D
    from matplotlib.transforms import Bbox

    rows = [r for r in _timed(job["results"]) if r.get("compression_ratio")]
    fig, ax = _figure(figsize=(9.5, 5.8))
    xs = np.array([r["compression_ratio"] for r in rows], float)
    ys = np.array([max(r["rel_error"], 1e-9) for r in rows], float)
    for r, x, y in zip(rows, xs, ys):
        marker = IMPLEMENTATIONS[implementation(r)][0]
        color = FAMILY_COLORS[family(r["method"])]
        if marker == "x":
            ax.scatter([x], [y], marker=marker, s=55, zorder=3, linewidths=1.2, color=color)
        else:  # gradcomp over MPI: filled circle; over gloo: hollow square
            ax.scatter([x], [y], marker=marker, s=42, zorder=3, linewidths=1.2,
                       facecolors=color if marker == "o" else "none", edgecolors=color)
    ax.set_xscale("log")
    ax.set_yscale("log")
    if len(rows):  # room for labels: half a decade either side, a decade above and below
        ax.set_xlim(xs.min() / 2.5, xs.max() * 4)
        ax.set_ylim(ys.min() / 8, ys.max() * 8)
    ax.set_xlabel("compression ratio (fp32 allreduce bytes / bytes sent)")
    ax.set_ylabel("relative error of one step (L2)")
    net = f", network {job['network']}" if job.get("network") else ""
    net += f", {job['path']} path" if job.get("path") else ""
    ax.set_title(f"{job['model']}, {job['ranks']} ranks{net}, heavy-tailed gradients: error against "
                 "compression\n(lower right is better; methods on the same spot share a label)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    fams = [f for f in FAMILIES if any(family(r["method"]) == f for r in rows)]
    impls = [i for i in IMPLEMENTATIONS if any(implementation(r) == i for r in rows)]
    handles = [Line2D([], [], marker="o", color=FAMILY_COLORS[f], linestyle="none", label=f) for f in fams]
    handles += [Line2D([], [], marker=IMPLEMENTATIONS[i][0], color="0.65", linestyle="none",  # light grey:
                       markerfacecolor="0.65" if IMPLEMENTATIONS[i][0] == "o" else "none", label=i)  # not a family
                for i in impls]
    _outside_legend(ax, handles=handles, fontsize=8, title="colour: family; marker: implementation",
                    title_fontsize=8)
    fig.tight_layout()  # final layout first: labels are placed in display coordinates
    if len(rows):
        px = ax.transData.transform(np.column_stack([xs, ys]))
        groups = _clusters(px, radius=7.0)
        anchors = [px[g].mean(axis=0) for g in groups]
        texts = [_label_lines([rows[i]["method"] for i in g]) for g in groups]
        markers = [Bbox.from_extents(x - 6, y - 6, x + 6, y + 6) for x, y in px]
        place_labels(fig, ax, anchors, texts, markers, fontsize=7)
    _save(fig, path, layout=False)
    return fig


# -- bytes against ranks -----------------------------------------------------------------------------
def ring_allreduce_factor(n: Any) -> np.ndarray:
    """Bytes each rank sends in a bandwidth-optimal allreduce, per byte of the buffer: 2(N-1)/N."""
    n = np.asarray(n, float)
    return 2 * (n - 1) / n


def allgather_factor(n: Any) -> np.ndarray:
    """Bytes each rank sends in an allgather (everyone gets everyone's buffer), per byte: N-1."""
    return np.asarray(n, float) - 1


def _pattern(name: str, pts: list[tuple[int, float]]) -> tuple[str, float]:
    """('allreduce' or 'allgather', c): the formula whose constant c = bytes / formula(N) varies
    least over the measured numbers of ranks; by name when there is one number of ranks only."""
    pts = [(n, b) for n, b in pts if n > 1 and b > 0]
    fits = {}
    for kind, f in (("allreduce", ring_allreduce_factor), ("allgather", allgather_factor)):
        cs = [b / float(f(n)) for n, b in pts]
        fits[kind] = (max(cs) / min(cs) if cs else 1.0, float(np.median(cs)) if cs else 0.0)
    if len({n for n, _ in pts}) >= 2:
        kind = min(fits, key=lambda k: fits[k][0])
    else:
        base = name.split("-", 1)[1] if name.startswith(("torch-", "gloo-")) else name
        kind = "allgather" if base.startswith(("allgather", "quantize")) else "allreduce"
    return kind, fits[kind][1]


def bytes_vs_ranks(jobs: list[dict], model: str, path: str) -> Any:
    mine = sorted((j for j in jobs if j["model"] == model), key=lambda j: j["ranks"])
    series: dict[str, list[tuple[int, float]]] = {}
    for job in mine:
        gradient = 4.0 * job["numel"] if job.get("numel") else None
        for r in _timed(job["results"]):
            if gradient is None:  # fall back on fp32 allreduce's bytes = 2(N-1)/N * gradient
                ar = next((x for x in job["results"] if x["method"] == "allreduce"), None)
                if ar is None or job["ranks"] < 2:
                    continue
                gradient = ar["bytes_per_rank"] / float(ring_allreduce_factor(job["ranks"]))
            series.setdefault(r["method"], []).append((job["ranks"], r["bytes_per_rank"] / gradient))
    # methods that send the same bytes at every N, by the same formula, share one line and one label
    merged: dict[tuple, list[str]] = {}
    for name, pts in series.items():
        key = (_pattern(name, pts)[0],) + tuple((n, round(math.log(b), 3) if b > 0 else None) for n, b in pts)
        merged.setdefault(key, []).append(name)
    measured_n = sorted({n for pts in series.values() for n, _ in pts})
    top = max(16, 2 * max(measured_n, default=2))
    theory_n = np.arange(2, top + 1)
    fig, ax = _figure(figsize=(11, 6.5))
    # the two formulas, per byte of the fp32 gradient (fp32 allreduce and allgather lie on them)
    ax.plot(theory_n, ring_allreduce_factor(theory_n), color="0.55", linewidth=6, alpha=0.35,
            solid_capstyle="butt", gid="ref-allreduce", label="2(N-1)/N  (bandwidth-optimal allreduce)")
    ax.plot(theory_n, allgather_factor(theory_n), color="0.55", linewidth=6, alpha=0.35, linestyle=(0, (1, 1)),
            gid="ref-allgather", label="N-1  (allgather)")
    ax.annotate("2(N-1)/N: rises towards 2, then stays flat", (top, 2 * (top - 1) / top),
                xytext=(-4, -8), textcoords="offset points", ha="right", va="top", fontsize=8, color="0.3")
    ax.annotate("N-1: grows linearly with the ranks", (top * 0.75, top * 0.75 - 1), xytext=(-6, 4),
                textcoords="offset points", ha="right", va="bottom", fontsize=8, color="0.3")
    palette = itertools.cycle(_plt().cm.tab10.colors)
    markers = itertools.cycle("os^Dv<>PX*")  # lines that nearly coincide (int8 per tensor / per channel) stay apart
    crossings = []
    for key, names in merged.items():
        pts = series[names[0]]
        kind, c = _pattern(names[0], pts)
        color = next(palette)
        positive = [(n, b) for n, b in pts if b > 0]
        style = "-" if kind == "allreduce" else "--"
        label = (_label_lines(names, per_line=3)
                 + f"\n    {c:.3g} x {'2(N-1)/N' if kind == 'allreduce' else '(N-1)'}")
        if positive:
            xs, ys = zip(*positive)
            ax.plot(xs, ys, marker=next(markers), color=color, linestyle=style, label=label,
                    gid=f"measured-{names[0]}", markerfacecolor="none" if kind == "allgather" else color)
        f = ring_allreduce_factor if kind == "allreduce" else allgather_factor
        ax.plot(theory_n, c * f(theory_n), color=color, linestyle=":", linewidth=1, gid=f"formula-{names[0]}")
        if kind == "allgather" and 0 < c < 1:  # first N at which it sends more than fp32 allreduce
            cross = next((int(n) for n in theory_n if c * (n - 1) > 2 * (n - 1) / n), None)
            if cross is not None:
                crossings.append((cross, names[0], color))
    for cross, name, color in sorted(crossings)[:1]:
        ax.annotate(f"{name} sends more than fp32 allreduce from {cross} ranks on",
                    (cross, float(ring_allreduce_factor(cross))), xytext=(12, -48), textcoords="offset points",
                    fontsize=8, color=color, arrowprops=dict(arrowstyle="->", color=color, linewidth=0.8))
    ax.set_yscale("log")
    ax.set_xticks(sorted({n for n in measured_n if n >= 2} | {8, 12, 16} | {top}))
    ax.set_xlim(1.6, top + 0.5)  # after the ticks: set_xticks widens the limits to take them all
    ax.set_xlabel("ranks N (markers: measured; dotted: the formula beyond them)")
    ax.set_ylabel("bytes each rank sends per step / fp32 gradient bytes")
    ax.set_title(f"{model}: traffic per rank is bounded for allreduce-based methods (c x 2(N-1)/N < 2c)\n"
                 "and grows linearly for allgather-based ones (c x (N-1)); c = bytes per fp32 gradient byte",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _outside_legend(ax, fontsize=7, title="solid, filled: allreduce-based; dashed, hollow: allgather-based", title_fontsize=7)
    _save(fig, path)
    return fig


# -- kernels and capped bars ---------------------------------------------------------------------------
def kernels(rows: list[dict], path: str) -> Any:
    fig, ax = _figure(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [r["kernel"] for r in rows]
    ax.barh(range(len(rows)), [r["vs_memcpy"] for r in rows])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time / memcpy of the same buffer")
    ax.set_title(f"kernel cost, {rows[0].get('mb', '?'):g} MB float32 buffer, one process", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)
    return fig


def capped_bars(capped: list[dict], path: str) -> Any:
    runs = sorted(capped, key=lambda c: -(_rate_gbit(c.get("network", "")) or 0))
    methods = []
    for c in runs:
        for r in _timed(c["results"]):
            if r["method"] not in methods:
                methods.append(r["method"])
    fig, ax = _figure(figsize=(9, 0.3 * len(methods) * len(runs) + 1.5))
    width = 0.8 / max(len(runs), 1)
    for k, c in enumerate(runs):
        by = {r["method"]: r for r in _timed(c["results"])}
        vals = [by[m].get("time_vs_allreduce", np.nan) if m in by else np.nan for m in methods]
        extra = "".join(f", {c[key]}" for key in ("path", "tag") if c.get(key))
        ax.barh(np.arange(len(methods)) + k * width, vals, height=width,
                label=f"{c.get('network')} x {c['ranks']} ranks{extra}")
    ax.set_yticks(np.arange(len(methods)) + 0.4 - width / 2, methods, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_xlabel("step time / fp32 allreduce step (same link, same run)")
    models = ", ".join(sorted({str(c.get("model", "?")) for c in runs}))
    ax.set_title(f"measured on a tc-capped network, {models}-sized gradient", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)
    return fig
def all_figures(jobs: list[dict], kernel_rows: list[dict], capped: list[dict], outdir: str) -> list[str]:
    """Write every figure the data allows; returns the paths."""
    paths = []
    # one set of figures per model and path (``-PATH`` in the name when the jobs say their path)
    for model, path in sorted({(j["model"], j.get("path") or "") for j in jobs}):
        mine = [j for j in jobs if j["model"] == model and (j.get("path") or "") == path]
        biggest = max(mine, key=lambda j: j["ranks"])
        name = f"{model}-{path}" if path else model
        p = os.path.join(outdir, f"time_vs_bandwidth-{name}.png")
        time_vs_bandwidth(biggest, capped, p)
        paths.append(p)
        p = os.path.join(outdir, f"error_vs_ratio-{name}.png")
        error_vs_ratio(biggest, p)
        paths.append(p)
        p = os.path.join(outdir, f"bytes_vs_ranks-{name}.png")
        bytes_vs_ranks(mine, model, p)
        paths.append(p)
    if kernel_rows:
        p = os.path.join(outdir, "kernels.png")
        kernels(kernel_rows, p)
        paths.append(p)
    if capped:
        p = os.path.join(outdir, "capped.png")
        capped_bars(capped, p)
        paths.append(p)
        for c in capped:
            name = "-".join(str(c[k]) for k in ("path", "tag") if c.get(k)).replace(" ", "_").replace(",", "")
            name = f"{c.get('network') or 'run'}" + (f"-{name}" if name else "")
            p = os.path.join(outdir, f"error_vs_ratio-capped-{name}.png")
            error_vs_ratio(c, p)
            paths.append(p)
    return paths
