"""``python -m benchmarks bench``: launch the jobs, show progress, write JSON, CSV, PNG and a summary.

Each (model, number of ranks, path) is one ``mpiexec -n N`` launch of ``benchmarks.worker``
(``MODEL-Nranks-PATH.json``; paths: ``reducer``, the README's NumPy ``GradientReducer``, and
``ddp``, DistributedDataParallel with comm hooks, when torch is there); the kernel figures come from
one more process (``benchmarks.kernels``). Results from capped-network runs
(``benchmarks/capped_steps.sh``, files ``capped-*.json`` in the output folder) are folded into the
figures and the summary when present.

``report`` (``python -m benchmarks report DIR``) rebuilds the summary, CSV and figures from the JSON
files in a folder; a folder with no per-run JSON files but a ``results.json`` (a committed
results folder) is rebuilt from that, and a folder with neither is left untouched (nothing is ever
written over earlier results with nothing).
"""
from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import subprocess
import sys
import time

from gradcomp.launcher import mpiexec  # noqa: F401  (also what the tests use to launch workers)
from gradcomp.launcher import run as launch_ranks

from .methods import select, torch_available
from .worker import not_default

CSV_FIELDS = ["model", "ranks", "network", "method", "kind", "same_as", "time_s", "time_vs_memcpy",
              "time_vs_allreduce", "time_vs_fp16", "time_vs_same_method", "bytes_per_rank",
              "compression_ratio", "rel_error", "rounds_per_step", "error",
              # added with the two paths (after the original columns: readers by position keep working)
              "path", "tag", "label", "faults_per_step", "time_vs_ddp", "time_vs_backward",
              "rel_diff_vs_ddp", "cpu_s", "cpu_system_share", "cpu_floor_vs_allreduce",
              "machine_cpu_s", "machine_floor_vs_allreduce", "runq_wait_s"]
#: Hours a job may run before it is killed as a hang (BERT-base with every method takes long).
JOB_TIMEOUT_S = 12 * 3600
#: What ``report`` reads and writes itself (never a per-run result).
OWN_FILES = ("results.json", "kernels.json")
#: The checkout that holds ``benchmarks`` (not installed): put on the jobs' ``PYTHONPATH``, so that
#: ``-m benchmarks.worker`` imports wherever the command was started.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _job_env() -> dict[str, str]:
    path = os.environ.get("PYTHONPATH")
    return {"PYTHONPATH": ROOT + (os.pathsep + path if path else "")}


def _follow(bar, log):
    """An ``on_line`` for ``gradcomp.launcher.run``: ``@progress`` lines advance ``bar``, the rest
    goes to ``log``."""
    last = [0]

    def on_line(line: str) -> bool:
        if line.startswith("@progress "):
            _, done, _total, name = line.rstrip("\n").split(" ", 3)
            bar.update(int(done) - last[0])
            last[0] = int(done)
            bar.set_postfix_str(name[:40])
        else:
            log.write(line)
            log.flush()
        return False
    return on_line


def _launch(ranks: int | None, args: list[str], bar, log_path: str) -> None:
    """Run ``python *args`` (under ``mpiexec -n ranks``, or as one process when ``ranks`` is None),
    advancing ``bar`` on each ``@progress`` line; the rest goes to ``log_path``."""
    rc: int | None
    with open(log_path, "w") as log:
        on_line = _follow(bar, log)
        if ranks is None:
            proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True, env={**os.environ, **_job_env()})
            assert proc.stdout is not None  # stdout=PIPE
            for line in proc.stdout:
                on_line(line)
            rc = proc.wait()
        else:
            rc = launch_ranks(ranks, args, timeout=JOB_TIMEOUT_S, env=_job_env(), on_line=on_line).returncode
    if rc != 0:
        with open(log_path) as f:
            tail = f.read()[-3000:]
        what = "did not finish in time (killed)" if rc is None else f"failed with exit code {rc}"
        raise SystemExit(f"python -m benchmarks bench: {' '.join(args)}\n{what}:\n{tail}")


def paths_of(args: argparse.Namespace) -> list[str]:
    """The worker paths to run: ``args.paths`` when the command line has that option, else
    ``reducer`` and, when torch is there and not turned off, ``ddp``."""
    text = getattr(args, "paths", None)
    if text:
        paths = [p.strip() for p in text.split(",") if p.strip()]
        bad = [p for p in paths if p not in ("reducer", "ddp")]
        if bad:
            raise SystemExit(f"python -m benchmarks bench: unknown path(s) {bad}: reducer, ddp")
        return paths
    with_torch = torch_available() if args.torch == "auto" else args.torch == "on"
    return ["reducer", "ddp"] if with_torch else ["reducer"]


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    outdir = os.path.abspath(args.out)
    os.makedirs(outdir, exist_ok=True)
    with_torch = None if args.torch == "auto" else args.torch == "on"
    try:
        select(args.methods, with_torch)  # an unknown name fails here, before any launch
    except ValueError as exc:
        raise SystemExit(f"python -m benchmarks bench: {exc}") from None
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    paths = paths_of(args)
    if "ddp" in paths and args.torch == "off":
        raise SystemExit("python -m benchmarks bench: the ddp path needs torch (got --torch off)")
    total = len(models) * len(ranks) * sum(len(select(args.methods, with_torch, path)) + 2 for path in paths)
    if args.kernels:
        from .kernels import count
        total += count(args.kernel_methods)
    bar = tqdm(total=total, unit="method", desc="benchmarks", disable=args.quiet)
    jobs = []
    t0 = time.time()
    for model in models:
        for n in ranks:
            for path in paths:
                out = os.path.join(outdir, f"{model}-{n}ranks-{path}.json")
                cmd = ["-m", "benchmarks.worker", "--path", path,  # the worker expands all per path
                       "--model", model, "--methods", args.methods,
                       "--repeats", str(args.repeats), "--warmup", str(args.warmup),
                       "--bucket-mb", str(args.bucket_mb), "--torch", args.torch, "--out", out]
                order = getattr(args, "order", None)
                if order:
                    cmd += ["--order", order]
                bar.set_description(f"{model} x{n} {path}")
                _launch(n, cmd, bar, out[:-5] + ".log")
                with open(out) as f:
                    jobs.append(json.load(f))
    kernel_rows = []
    if args.kernels:
        out = os.path.join(outdir, "kernels.json")
        bar.set_description("kernels")
        _launch(None, ["-m", "benchmarks.kernels", "--mb", str(args.kernel_mb),
                       "--repeats", str(max(args.repeats, 3)), "--methods", args.kernel_methods,
                       "--out", out],
                bar, out[:-5] + ".log")
        with open(out) as f:
            kernel_rows = json.load(f)["kernels"]
    bar.close()
    return report(outdir, jobs, kernel_rows, dict(command=" ".join(sys.argv), seconds=time.time() - t0),
                  plots=args.plots)


def load(outdir: str) -> tuple[list[dict], list[dict], list[dict]]:
    """(jobs, kernel rows, capped runs) found in ``outdir``: the per-run JSON files (worker
    outputs, ``capped-*.json``, ``kernels.json``); when there are none, what an earlier report
    gathered in ``results.json`` (a committed results folder keeps only that)."""
    jobs: list[dict] = []
    capped: list[dict] = []
    for path in sorted(glob.glob(os.path.join(outdir, "*.json"))):
        name = os.path.basename(path)
        if name in OWN_FILES:
            continue
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "results" not in data:
            continue
        if data.get("link_problem"):  # a capped run whose link did not reach its rate
            print(f"python -m benchmarks report: {name} left out: {data['link_problem']}", file=sys.stderr)
            continue
        (capped if name.startswith("capped-") else jobs).append(data)
    kernel_rows = []
    if os.path.exists(os.path.join(outdir, "kernels.json")):
        with open(os.path.join(outdir, "kernels.json")) as f:
            kernel_rows = json.load(f)["kernels"]
    gathered = os.path.join(outdir, "results.json")
    if not (jobs or capped or kernel_rows) and os.path.exists(gathered):
        with open(gathered) as f:
            data = json.load(f)
        if isinstance(data, dict):
            jobs, kernel_rows, capped = (list(data.get("jobs") or []), list(data.get("kernels") or []),
                                         list(data.get("capped") or []))
    return jobs, kernel_rows, capped


def report(outdir: str, jobs: list[dict], kernel_rows: list[dict], meta: dict, plots: bool = True,
           capped: list[dict] | None = None) -> dict:
    """Write results.json, results.csv, kernels.csv, summary.md and the PNGs; return the JSON.

    ``capped``: the capped runs (default: those ``load`` finds in ``outdir``). With no results at
    all, nothing is written and SystemExit says so: a report never replaces earlier results with
    an empty one."""
    if capped is None:
        _, _, capped = load(outdir)
    if not (jobs or kernel_rows or capped):
        raise SystemExit(f"python -m benchmarks report: no benchmark results in {outdir} (no job, capped-*.json "
                         "or kernels.json files, no results.json): nothing written")
    everything = dict(meta=meta, jobs=jobs, kernels=kernel_rows, capped=capped)
    with open(os.path.join(outdir, "results.json"), "w") as f:
        json.dump(everything, f, indent=1)
    with open(os.path.join(outdir, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        w.writeheader()
        for job in jobs + capped:
            for r in job["results"]:
                w.writerow(dict(r, model=job["model"], ranks=job["ranks"], network=job.get("network", ""),
                                path=job.get("path", ""), tag=job.get("tag", "")))
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


def run_title(job) -> str:
    """How a run is named in tables: network (or shared memory), ranks, path, tag."""
    parts = [job.get("network") or "local", f"x{job['ranks']}"]
    if job.get("path"):
        parts.append(job["path"])
    if job.get("tag"):
        parts.append(f"({job['tag']})")
    return " ".join(parts)


def _is_baseline(r) -> bool:
    return r.get("kind") == "baseline" or r["method"] == "memcpy"


def capped_table(capped) -> str:
    """One markdown table, a column group per capped run: step ms and the ratios."""
    paths = ("", "reducer", "ddp")
    runs = sorted(capped, key=lambda c: (-(_rate(c.get("network", "")) or 0),
                                         paths.index(c["path"]) if c.get("path") in paths else 3,
                                         c.get("tag", "")))
    if not runs:
        return ""
    head = "| method |" + "".join(f" {run_title(c)}: step ms | / fp32 | / fp16 | / torch same |"
                                  for c in runs)
    lines = [head, "|---|" + "---|---|---|---|" * len(runs)]
    names = []
    for c in runs:
        for r in c["results"]:
            if not _is_baseline(r) and r["method"] not in names:
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


def bytes_table(jobs, model, path=None) -> str:
    """MiB each rank sends per step, one column per number of ranks (jobs of one path)."""
    mine = sorted((j for j in jobs if j["model"] == model and j.get("path") == path),
                  key=lambda j: j["ranks"])
    if not mine:
        return ""
    lines = ["| method |" + "".join(f" {j['ranks']} ranks |" for j in mine) + " ratio at the most ranks |",
             "|---|" + "---|" * (len(mine) + 1)]
    names = [r["method"] for r in mine[-1]["results"] if not _is_baseline(r)]
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


PATH_NAMES = {"reducer": "GradientReducer on NumPy arrays (the README path)",
              "ddp": "DistributedDataParallel, each method its comm hook"}


def job_table(job) -> list[str]:
    """One run's rows: times and ratios, traffic, error, page faults."""
    ddp = any(r["method"] == "ddp" for r in job["results"])
    out = ["| method | step ms | / fp32 allreduce | / fp16 allreduce | / same method |"
           + (" / DDP |" if ddp else "") + " MiB per rank | ratio | rel. error |"
           + (" vs DDP |" if ddp else "") + " faults/step | CPU s (all ranks) | CPU floor / fp32 | machine floor / fp32 | run-queue wait s (all ranks) |",
           "|---|---|---|---|---|" + ("---|" if ddp else "") + "---|---|---|" + ("---|" if ddp else "") + "---|---|---|---|---|"]
    for r in job["results"]:
        if "error" in r:
            out.append(f"| {r['method']} | fails: {r['error'][:90]} |" + " |" * (11 + 2 * ddp))
            continue
        cells = [r["method"], f"{r['time_s'] * 1e3:.1f}", _fmt(r.get("time_vs_allreduce"), ".3f"),
                 _fmt(r.get("time_vs_fp16"), ".3f"), _fmt(r.get("time_vs_same_method"), ".2f")]
        if ddp:
            cells.append(_fmt(r.get("time_vs_ddp"), ".3f"))
        cells += [f"{r['bytes_per_rank'] / 2**20:.2f}", _fmt(r.get("compression_ratio"), ".1f"),
                  f"{r['rel_error']:.2e}"]
        if ddp:
            cells.append(_fmt(r.get("rel_diff_vs_ddp"), ".1e"))
        cells += [_fmt(r.get("faults_per_step"), ".0f"), _fmt(r.get("cpu_s"), ".3f"),
                  _fmt(r.get("cpu_floor_vs_allreduce"), ".3f"), _fmt(r.get("machine_floor_vs_allreduce"), ".3f"),
                  _fmt(r.get("runq_wait_s"), ".3f")]
        out.append("| " + " | ".join(cells) + " |")
    return out


def summarize(jobs, kernel_rows, capped) -> str:
    """Markdown tables: one per job (and per capped run), plus the kernel table."""
    out = []
    if capped:
        out.append("### capped network, side by side\n")
        out.append(capped_table(capped))
    for model in sorted({j["model"] for j in jobs}):
        for path in sorted({j.get("path") for j in jobs if j["model"] == model}, key=str):
            where = f" ({path} path)" if path else ""
            out.append(f"### {model}{where}: MiB sent per rank per step\n")
            out.append(bytes_table(jobs, model, path))
    for job in jobs + capped:
        net = f", network {job['network']}" if job.get("network") else ", shared memory (one host)"
        path = f", {PATH_NAMES.get(job['path'], job['path'])}" if job.get("path") else ""
        tag = f", {job['tag']}" if job.get("tag") else ""
        out.append(f"### {job['model']} ({job['numel']:,} floats, {job['buckets']} buckets), "
                   f"{job['ranks']} ranks{net}{path}{tag}\n")
        notes = []
        if job.get("compute_s") is not None:
            notes.append(f"compute alone (forward + backward without DDP): {job['compute_s'] * 1e3:.1f} ms "
                         "of each step")
        tuned = {k: v for k, v in job.get("settings", {}).items() if not_default(k)}
        if tuned:
            notes.append("not a default configuration, set in the environment: "
                         + ", ".join(f"`{k}={v}`" for k, v in tuned.items()))
        if notes:
            out.append("; ".join(notes) + "\n")
        out += job_table(job)
        out.append("")
    if kernel_rows:
        out.append(f"### kernels, {kernel_rows[0]['mb']:g} MB float32 buffer, one process\n")
        out.append("| kernel | ms | / memcpy |")
        out.append("|---|---|---|")
        for r in kernel_rows:
            out.append(f"| {r['kernel']} | {r['time_s'] * 1e3:.1f} | {r['vs_memcpy']:.2f} |")
        out.append("")
    return "\n".join(out) + "\n"
