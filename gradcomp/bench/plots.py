"""PNG figures from the benchmark results (matplotlib, Agg backend: no screen needed).

* ``time_vs_bandwidth.png``: step time against link bandwidth. Lines are a model, said so on the
  figure: the step time measured on this host (ranks talk through shared memory, so it is nearly
  all compute) plus the bytes each rank sends divided by the bandwidth. Points are real runs on a
  capped network (``bench/capped.sh``), when their results are in the output folder.
* ``error_vs_ratio.png``: relative error of one step against compression ratio.
* ``bytes_vs_ranks.png``: bytes each rank sends per step against the number of ranks.
* ``kernels.png``: kernel time as a multiple of memcpy.
* ``capped.png``: measured step time on the capped link as a fraction of the fp32 allreduce step.
"""
from __future__ import annotations

import os

import numpy as np


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt



def _save(fig, path: str) -> None:
    """Write ``fig`` as a PNG and free it (figures are made in loops; pyplot keeps them alive)."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)

def _timed(rows):
    return [r for r in rows if "time_s" in r and r["method"] != "memcpy"]


def time_vs_bandwidth(job: dict, capped: list[dict], path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    gbits = np.logspace(-1, 2, 60)
    colors = {}
    for r in _timed(job["results"]):
        line, = ax.plot(gbits, r["time_s"] + r["bytes_per_rank"] * 8 / (gbits * 1e9), label=r["method"],
                        linestyle="--" if r["kind"] == "torch" else "-")
        colors[r["method"]] = line.get_color()
    for c in capped:
        if c.get("ranks") != job["ranks"] or c.get("model") != job["model"]:
            continue
        rate = _rate_gbit(c.get("network", ""))
        if rate is None:
            continue
        for r in _timed(c["results"]):
            ax.scatter([rate], [r["time_s"]], color=colors.get(r["method"], "k"), marker="o", zorder=3)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth per rank (Gbit/s)")
    ax.set_ylabel("time per step (s)")
    ax.set_title(f"{job['model']}, {job['ranks']} ranks: model = measured local step + bytes/bandwidth"
                 "\n(dots: measured on a tc-capped link)", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def _rate_gbit(text: str):
    """'1gbit' -> 1.0, '500mbit' -> 0.5 (tc's units)."""
    t = text.strip().lower()
    for unit, scale in (("gbit", 1.0), ("mbit", 1e-3), ("kbit", 1e-6)):
        if t.endswith(unit):
            try:
                return float(t[: -len(unit)]) * scale
            except ValueError:
                return None
    return None


def error_vs_ratio(job: dict, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    for r in _timed(job["results"]):
        if not r.get("compression_ratio"):
            continue
        err = max(r["rel_error"], 1e-9)
        ax.scatter([r["compression_ratio"]], [err], marker="x" if r["kind"] == "torch" else "o")
        ax.annotate(r["method"], (r["compression_ratio"], err), fontsize=7, xytext=(4, 2),
                    textcoords="offset points")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("compression ratio (fp32 allreduce bytes / bytes sent)")
    ax.set_ylabel("relative error of one step (L2)")
    ax.set_title(f"{job['model']}, {job['ranks']} ranks, heavy-tailed gradients", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    _save(fig, path)


def bytes_vs_ranks(jobs: list[dict], model: str, path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)
    series: dict[str, list[tuple[int, float]]] = {}
    for job in sorted((j for j in jobs if j["model"] == model), key=lambda j: j["ranks"]):
        for r in _timed(job["results"]):
            series.setdefault(r["method"], []).append((job["ranks"], r["bytes_per_rank"] / 2**20))
    for name, pts in series.items():
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o", label=name, linestyle="--" if name.startswith("torch") else "-")
    ax.set_yscale("log")
    ax.set_xticks(sorted({n for pts in series.values() for n, _ in pts}))
    ax.set_xlabel("ranks")
    ax.set_ylabel("MiB sent per rank per step")
    ax.set_title(f"{model}: allgather-based methods grow with ranks, allreduce-based do not", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    _save(fig, path)


def kernels(rows: list[dict], path: str) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.5))
    names = [r["kernel"] for r in rows]
    ax.barh(range(len(rows)), [r["vs_memcpy"] for r in rows])
    ax.set_yticks(range(len(rows)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("time / memcpy of the same buffer")
    ax.set_title(f"kernel cost, {rows[0].get('mb', '?'):g} MB float32 buffer, one process", fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)


def capped_bars(capped: list[dict], path: str) -> None:
    plt = _plt()
    runs = sorted(capped, key=lambda c: -(_rate_gbit(c.get("network", "")) or 0))
    methods = []
    for c in runs:
        for r in _timed(c["results"]):
            if r["method"] not in methods:
                methods.append(r["method"])
    fig, ax = plt.subplots(figsize=(9, 0.3 * len(methods) * len(runs) + 1.5))
    width = 0.8 / max(len(runs), 1)
    for k, c in enumerate(runs):
        by = {r["method"]: r for r in _timed(c["results"])}
        vals = [by[m].get("time_vs_allreduce", np.nan) if m in by else np.nan for m in methods]
        ax.barh(np.arange(len(methods)) + k * width, vals, height=width,
                label=f"{c.get('network')} x {c['ranks']} ranks")
    ax.set_yticks(np.arange(len(methods)) + 0.4 - width / 2, methods, fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", linewidth=0.8)
    ax.set_xlabel("step time / fp32 allreduce step (same link, same run)")
    ax.set_title("measured on a tc-capped network, ResNet-50-sized gradient", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="x", alpha=0.3)
    _save(fig, path)


def all_figures(jobs: list[dict], kernel_rows: list[dict], capped: list[dict], outdir: str) -> list[str]:
    """Write every figure the data allows; returns the paths."""
    paths = []
    for model in sorted({j["model"] for j in jobs}):
        mine = [j for j in jobs if j["model"] == model]
        biggest = max(mine, key=lambda j: j["ranks"])
        p = os.path.join(outdir, f"time_vs_bandwidth-{model}.png")
        time_vs_bandwidth(biggest, capped, p)
        paths.append(p)
        p = os.path.join(outdir, f"error_vs_ratio-{model}.png")
        error_vs_ratio(biggest, p)
        paths.append(p)
        p = os.path.join(outdir, f"bytes_vs_ranks-{model}.png")
        bytes_vs_ranks(jobs, model, p)
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
            p = os.path.join(outdir, f"error_vs_ratio-capped-{c.get('network') or 'run'}.png")
            error_vs_ratio(c, p)
            paths.append(p)
    return paths
