"""Launch the zoo's jobs: one ``mpiexec -n RANKS`` job per (workload, length, seed), running the
methods whose results are missing (so an interrupted sweep resumes where it stopped).

The reference (``none``) is always run first when its result is missing, even if not asked for:
every gap is measured against it. A job that fails part-way keeps the results it wrote; the
method it was running gets an error record (its log's tail) and the rest are launched again in a
new job, so one broken method never hides the others.
"""
from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

from gradcomp import launcher

from . import methods as MT
from . import workloads as W
from .worker import result_path

ROOT = Path(__file__).resolve().parent.parent.parent


def missing(out: Path, workload: W.Workload, steps: int, seed: int, specs: list[str]) -> list[str]:
    """The specs of ``specs`` that apply to ``workload`` and have no result yet, ``none`` first."""
    wanted = ["none"] + [s for s in specs if s != "none"]
    return [s for s in wanted if MT.applies(MT.parse(s), workload)
            and not result_path(out, workload.name, steps, s, seed).exists()]


def run_job(out: Path, workload: W.Workload, steps: int, seed: int, specs: list[str], ranks: int,
            timeout: float, evals: int, bucket_cap_mb: float, quiet: bool = False) -> None:
    """Run ``specs`` in one job, then again (without the method that failed) until every one has
    a result or an error record."""
    todo = list(specs)
    while todo:
        started: list[str] = []

        def on_line(line: str) -> bool:
            m = re.match(r"zoo: (start|done) \S+ \d+ (\S+) seed", line)
            if m and m.group(1) == "start":
                started.append(m.group(2))
            if m and m.group(1) == "done" and not quiet:
                print("  " + line.split(": ", 1)[1].rstrip(), file=sys.stderr, flush=True)
            return not m
        cmd = ["-m", "benchmarks.zoo.worker", "--workload", workload.name, "--steps", str(steps), "--seed",
               str(seed), "--out", str(out.resolve()), "--evals", str(evals), "--bucket-cap-mb", str(bucket_cap_mb),
               "--methods", *todo]
        start = time.perf_counter()
        done = launcher.run(ranks, cmd, timeout=timeout, cwd=ROOT, on_line=on_line)
        log = out / workload.name / str(steps) / f"job@{seed}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"# {' '.join(cmd)}\n# exit {done.returncode}, {time.perf_counter() - start:.0f} s\n{done.output}\n")
        left = [s for s in todo if not result_path(out, workload.name, steps, s, seed).exists()]
        if not left:
            return
        failed = started[-1] if started and started[-1] in left else left[0]
        error = dict(workload=workload.name, method=failed, steps=steps, seed=seed, ranks=ranks,
                     error="hung" if done.hung else f"exit {done.returncode}",
                     tail=done.output.strip().splitlines()[-15:])
        path = result_path(out, workload.name, steps, failed, seed)
        path.write_text(json.dumps(error, indent=1))
        print(f"  {workload.name} {steps} {failed} seed {seed}: FAILED ({error['error']}), see {log}",
              file=sys.stderr, flush=True)
        todo = [s for s in left if s != failed]


def sweep(out: Path, workloads: list[W.Workload], steps_list: list[int], seeds: list[int], specs: list[str],
          ranks: int, timeout_per_step: float, evals: int, bucket_cap_mb: float, rerun: bool = False) -> None:
    """Every (workload, length, seed) job, methods missing only (all of them with ``rerun``)."""
    for spec in specs:
        MT.parse(spec)  # a typo fails before the first job
    jobs = [(w, n, s) for n in steps_list for s in seeds for w in workloads]
    for i, (w, n, s) in enumerate(jobs, 1):
        if rerun:
            for spec in specs:
                result_path(out, w.name, n, spec, s).unlink(missing_ok=True)
        todo = missing(out, w, n, s, specs)
        if not todo:
            continue
        print(f"[zoo {i}/{len(jobs)}] {w.name}, {n} steps, seed {s}: {' '.join(todo)}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        run_job(out, w, n, s, todo, ranks, timeout=120 + timeout_per_step * n * len(todo), evals=evals,
                bucket_cap_mb=bucket_cap_mb)
        print(f"[zoo {i}/{len(jobs)}] {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
