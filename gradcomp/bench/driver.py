"""``python -m gradcomp bench``: launch the jobs, show progress, write JSON, CSV, PNG and a summary.

Each (model, number of ranks) is one ``mpiexec -n N`` launch of ``gradcomp.bench.worker``; the
kernel figures come from one more process (``gradcomp.bench.kernels``). Results from capped-network
runs (``bench/capped.sh``, files ``capped-*.json`` in the output folder) are folded into the
figures and the summary when present.
"""
from __future__ import annotations

import csv
import glob
import json
import os
import shutil
import subprocess
import sys
import time

from .methods import select

CSV_FIELDS = ["model", "ranks", "network", "method", "kind", "same_as", "time_s", "time_vs_memcpy",
              "time_vs_allreduce", "time_vs_fp16", "time_vs_same_method", "bytes_per_rank",
              "compression_ratio", "rel_error", "rounds_per_step", "error"]


def mpiexec() -> str:
    here = os.path.dirname(sys.executable)
    found = shutil.which("mpiexec", path=here + os.pathsep + os.environ.get("PATH", ""))
    if not found:
        raise SystemExit("gradcomp bench: mpiexec not found (pip install mpich, or put it on PATH)")
    return found


def _launch(cmd: list[str], bar, log_path: str) -> None:
    """Run ``cmd``, advancing ``bar`` on each ``@progress`` line; the rest goes to ``log_path``."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        last = 0
        for line in proc.stdout:
            if line.startswith("@progress "):
                _, done, _total, name = line.rstrip("\n").split(" ", 3)
                bar.update(int(done) - last)
                last = int(done)
                bar.set_postfix_str(name[:40])
            else:
                log.write(line)
        rc = proc.wait()
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"gradcomp bench: {' '.join(cmd)}\nfailed with exit code {rc}:\n{tail}")


def run(args) -> dict:
    from tqdm import tqdm

    outdir = os.path.abspath(args.out)
    os.makedirs(outdir, exist_ok=True)
    with_torch = None if args.torch == "auto" else args.torch == "on"
    methods = select(args.methods, with_torch)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    total = len(models) * len(ranks) * (len(methods) + 2)
    if args.kernels:
        from .kernels import count
        total += count(args.kernel_methods)
    bar = tqdm(total=total, unit="method", desc="gradcomp bench", disable=args.quiet)
    jobs = []
    t0 = time.time()
    for model in models:
        for n in ranks:
            out = os.path.join(outdir, f"{model}-{n}ranks.json")
            cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "gradcomp.bench.worker",
                   "--model", model, "--methods", ",".join(m.name for m in methods),
                   "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                   "--bucket-mb", str(args.bucket_mb), "--torch", args.torch, "--out", out]
            bar.set_description(f"{model} x{n}")
            _launch(cmd, bar, out[:-5] + ".log")
            with open(out) as f:
                jobs.append(json.load(f))
    kernel_rows = []
    if args.kernels:
        out = os.path.join(outdir, "kernels.json")
        bar.set_description("kernels")
        _launch([sys.executable, "-m", "gradcomp.bench.kernels", "--mb", str(args.kernel_mb),
                 "--repeats", str(max(args.repeats, 3)), "--methods", args.kernel_methods, "--out", out],
                bar, out[:-5] + ".log")
        with open(out) as f:
            kernel_rows = json.load(f)["kernels"]
    bar.close()
    return report(outdir, jobs, kernel_rows, dict(command=" ".join(sys.argv), seconds=time.time() - t0),
                  plots=args.plots)


def load(outdir: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(jobs, kernel rows, capped runs) found in ``outdir``."""
    jobs, capped = [], []
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        name = os.path.basename(path)
        if name in ("results.json", "kernels.json"):
            continue
        with open(path) as f:
            data = json.load(f)
        if "results" not in data:
            continue
        (capped if name.startswith("capped-") else jobs).append(data)
    kernel_rows = []
    if os.path.exists(os.path.join(outdir, "kernels.json")):
        with open(os.path.join(outdir, "kernels.json")) as f:
            kernel_rows = json.load(f)["kernels"]
    return jobs, kernel_rows, capped


def report(outdir: str, jobs: list[dict], kernel_rows: list[dict], meta: dict, plots: bool = True) -> dict:
    """Write results.json, results.csv, kernels.csv, summary.md and the PNGs; return the JSON."""
    _, _, capped = load(outdir)
    everything = dict(meta=meta, jobs=jobs, kernels=kernel_rows, capped=capped)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(everything, f, indent=1)
    with open(os.path.join(outdir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for job in jobs + capped:
            for r in job["results"]:
                w.writerow(dict(r, model=job["model"], ranks=job["ranks"], network=job.get("network", "")))
    if kernel_rows:
        with open(os.path.join(outdir, "kernels.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["kernel", "mb", "time_s", "vs_memcpy", "gradcomp_cast_vs_this"],
                               extrasaction="ignore")
            w.writeheader()
            w.writerows(kernel_rows)
    figures = []
    if plots:
        from .plots import all_figures
        figures = all_figures(jobs, kernel_rows, capped, outdir)
    summary = summarize(jobs, kernel_rows, capped)
    with open(os.path.join(outdir, "summary.md"), "w") as f:
        f.write(summary)
    everything["figures"] = figures
    everything["summary"] = summary
    return everything


def _fmt(v, spec):
    return "" if v is None else format(v, spec)


def capped_table(capped) -> str:
    """One markdown table, a column group per capped run: step ms and the ratios."""
    runs = sorted(capped, key=lambda c: -(_rate(c.get("network", "")) or 0))
    if not runs:
        return ""
    head = "| method |" + "".join(f" {c['network']} x{c['ranks']}: step ms | / fp32 | / fp16 | / torch same |"
                                  for c in runs)
    lines = [head, "|---|" + "---|---|---|---|" * len(runs)]
    names = []
    for c in runs:
        for r in c["results"]:
            if r["method"] != "memcpy" and r["method"] not in names:
                names.append(r["method"])
    for name in names:
        cells = []
        for c in runs:
            r = next((r for r in c["results"] if r["method"] == name), None)
            if r is None or "time_s" not in r:
                cells.append(" fails | | | |" if r is not None else " | | | |")
                continue
            cells.append(f" {r['time_s'] * 1e3:.0f} | {_fmt(r.get('time_vs_allreduce'), '.3f')} | "
                         f"{_fmt(r.get('time_vs_fp16'), '.3f')} | {_fmt(r.get('time_vs_same_method'), '.2f')} |")
        lines.append(f"| {name} |" + "".join(cells))
    return "\n".join(lines) + "\n"


def bytes_table(jobs, model) -> str:
    """MiB each rank sends per step, one column per number of ranks."""
    mine = sorted((j for j in jobs if j["model"] == model), key=lambda j: j["ranks"])
    if not mine:
        return ""
    lines = ["| method |" + "".join(f" {j['ranks']} ranks |" for j in mine) + " ratio at the most ranks |",
             "|---|" + "---|" * (len(mine) + 1)]
    names = [r["method"] for r in mine[-1]["results"] if r["method"] != "memcpy"]
    for name in names:
        cells = []
        last = None
        for j in mine:
            r = next((r for r in j["results"] if r["method"] == name and "bytes_per_rank" in r), None)
            cells.append(f" {r['bytes_per_rank'] / 2**20:.2f} |" if r else " |")
            last = r or last
        ratio = _fmt(last.get("compression_ratio") if last else None, ".1f")
        lines.append(f"| {name} |" + "".join(cells) + f" {ratio} |")
    return "\n".join(lines) + "\n"


def _rate(text):
    from .plots import _rate_gbit

    return _rate_gbit(text)


def summarize(jobs, kernel_rows, capped) -> str:
    """Markdown tables: one per job (and per capped run), plus the kernel table."""
    out = []
    if capped:
        out.append("### capped network, side by side\n")
        out.append(capped_table(capped))
    for model in sorted({j["model"] for j in jobs}):
        out.append(f"### {model}: MiB sent per rank per step\n")
        out.append(bytes_table(jobs, model))
    for job in jobs + capped:
        net = f", network {job['network']}" if job.get("network") else ", shared memory (one host)"
        out.append(f"### {job['model']} ({job['numel']:,} floats, {job['buckets']} buckets), "
                   f"{job['ranks']} ranks{net}\n")
        out.append("| method | step ms | / fp32 allreduce | / fp16 allreduce | / same method | "
                   "MiB per rank | ratio | rel. error |")
        out.append("|---|---|---|---|---|---|---|---|")
        for r in job["results"]:
            if "error" in r:
                out.append(f"| {r['method']} | fails: {r['error'][:90]} | | | | | | |")
                continue
            out.append(f"| {r['method']} | {r['time_s'] * 1e3:.1f} | {_fmt(r.get('time_vs_allreduce'), '.3f')} | "
                       f"{_fmt(r.get('time_vs_fp16'), '.3f')} | {_fmt(r.get('time_vs_same_method'), '.2f')} | "
                       f"{r['bytes_per_rank'] / 2**20:.2f} | {_fmt(r.get('compression_ratio'), '.1f')} | "
                       f"{r['rel_error']:.2e} |")
        out.append("")
    if kernel_rows:
        out.append(f"### kernels, {kernel_rows[0]['mb']:g} MB float32 buffer, one process\n")
        out.append("| kernel | ms | / memcpy |")
        out.append("|---|---|---|")
        for r in kernel_rows:
            out.append(f"| {r['kernel']} | {r['time_s'] * 1e3:.1f} | {r['vs_memcpy']:.2f} |")
        out.append("")
    return "\n".join(out) + "\n"
