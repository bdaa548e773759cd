"""Convergence of every method on three workloads and several seeds: one table and figure each.

    python benchmarks/scripts/convergence.py --workload lm --methods none powersgd onebitadam --seeds 0 1 2
    python benchmarks/scripts/convergence.py --workload mlp --seeds 0 1 2          # every registered name + dgc
    python benchmarks/scripts/convergence.py --report --out results/conv           # tables and figures only

Workloads (each an example script, one ``mpiexec -n RANKS`` job per method and seed):

* ``lm``: ``examples/torch_lm.py``, a byte-level transformer under AdamW, DDP, validation loss;
* ``lm-sgd``: the same model under momentum SGD (lr ``LM_SGD_LR``), the home of the DGC path and of
  PowerSGD's and DGC's own papers; the reference is DDP's allreduce under the same SGD;
* ``mlp``: ``examples/numpy_mlp.py``, the digits MLP under momentum SGD, NumPy only, test loss;
  (on ``lm``, ``diloco[:sync_every=H,compressor=...,...]`` runs local steps instead:
  ``benchmarks/scripts/diloco_lm.py``, the same model, data and AdamW, each key one of its flags);
* ``cnn``: ``examples/torch_ddp.py``, the digits CNN under momentum SGD, DDP, test loss.

A method is a registry spec (``topk``, ``powersgd:rank=2``: the user's optimizer unchanged, the
gradients averaged by that compressor), ``none`` (DDP's own allreduce: the reference of the torch
workloads; ``allreduce`` is the MLP's), or one of gradcomp's optimizers, which communicate
themselves: ``onebitadam[:key=value,...]`` (the LM) and ``dgc[:...]`` (any workload).

Per workload and method, over the seeds: the final loss (mean and worst) against the exact
reference of the same seed, the final accuracy and the mean of the last evaluations' (digits:
``late_accuracy``), the steps to reach the reference's final loss (each seed against its own
reference; "-" when a seed never gets there), and the bytes each
rank sends per step in the last quarter of training (steady state, after any warm-up) and over
the whole run. A run whose loss is not finite, or higher at the end than at the start, counts as
diverged. Runs are kept as ``OUT/WORKLOAD/METHOD@SEED.json`` and skipped when present (so an
interrupted sweep resumes); ``--report`` only reads them.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ is not installed: it is imported from the checkout

from benchmarks.tables import aligned_table  # noqa: E402
from gradcomp import launcher  # noqa: E402

EXAMPLES = {"lm": "torch_lm.py", "lm-sgd": "torch_lm.py", "mlp": "numpy_mlp.py", "cnn": "torch_ddp.py"}
REFERENCE = {"lm": "none", "lm-sgd": "none", "mlp": "allreduce", "cnn": "none"}
OPTIMIZERS = ("onebitadam", "dgc")
LOSS_NAME = {"lm": "validation loss (nats/byte)", "lm-sgd": "validation loss (nats/byte)",
             "mlp": "test loss", "cnn": "test loss"}
LATE_EVALS = 5  # digits: accuracy points are also given over the last 5 evaluations (late_accuracy)
LM_SGD_LR = 0.3  # the best of 0.1, 0.3 and 1.0 for exact momentum SGD over 1000 steps (BENCHMARKS.md)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=sorted(EXAMPLES), nargs="+", default=["lm"])
    p.add_argument("--methods", nargs="+", help="default: the reference, every registered name, and "
                   "gradcomp's optimizers for the workload")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--reference", help="the exact method the others are compared with (default: none "
                   "for lm and cnn, allreduce for mlp; e.g. onebitadam:warmup=100000,warmup_compressor='allreduce', "
                   "exact Adam)")
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", type=Path, default=ROOT / "results" / "convergence")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    p.add_argument("--capped", metavar="RATE", help="run every job on benchmarks/capped.sh's emulated link at "
                   "RATE (root), one host per rank: time to quality; results go to OUT/WORKLOAD-RATE")
    p.add_argument("--report", action="store_true", help="run nothing: tables and figures from OUT")
    p.add_argument("--rerun", action="store_true", help="run again even where a result exists")
    p.add_argument("extra", nargs="*", help="after --: passed to the example unchanged")
    return p.parse_args(argv)


def default_methods(workload: str) -> list[str]:
    import gradcomp

    names = [REFERENCE[workload]] + [n for n in gradcomp.REGISTRY if n != REFERENCE[workload]]
    return names + (["onebitadam", "dgc"] if workload == "lm" else ["dgc"])


def workload_args(workload: str, method: str) -> list[str]:
    """What a workload adds to its example's command line: lm-sgd's optimizer and learning rate."""
    if workload != "lm-sgd":
        return []
    own = method.partition(":")[0] in OPTIMIZERS  # dgc brings its own momentum SGD
    return ([] if own else ["--optimizer", "sgd"]) + ["--lr", str(LM_SGD_LR)]


def command(workload: str, method: str, seed: int, out_json: Path, extra: list[str]) -> list[str]:
    """The example's command line for one run."""
    head = method.partition(":")[0]
    if head == "diloco":  # local steps: benchmarks/scripts/diloco_lm.py, on the LM only
        if workload != "lm":
            raise SystemExit("diloco runs on the lm workload only")
        from gradcomp.registry import parse_spec

        options = [a for k, v in parse_spec(method)[1].items() for a in (f"--{k.replace('_', '-')}", str(v))]
        return [str(ROOT / "benchmarks" / "scripts" / "diloco_lm.py"), "--seed", str(seed), "--json",
                str(out_json), *options, *extra]
    cmd = [str(ROOT / "examples" / EXAMPLES[workload]), "--seed", str(seed), "--json", str(out_json)]
    if head in OPTIMIZERS:
        cmd += ["--optimizer", method] + (["--compressor", "none"] if EXAMPLES[workload] == "torch_lm.py" else [])
    else:
        cmd += ["--compressor", method]
    return cmd + workload_args(workload, method) + list(extra)


def folder_of(workload: str, args) -> Path:
    return args.out / (f"{workload}-{args.capped}" if args.capped else workload)


def run_one(workload: str, method: str, seed: int, args) -> dict:
    folder = folder_of(workload, args)
    folder.mkdir(parents=True, exist_ok=True)
    out_json = folder / f"{method}@{seed}.json"
    if out_json.exists() and not args.rerun:
        return json.loads(out_json.read_text())
    start = time.perf_counter()
    cmd = command(workload, method, seed, out_json, args.extra)
    if args.capped:  # benchmarks/capped.sh starts mpiexec itself, inside the emulated hosts
        import subprocess

        try:
            proc = subprocess.run([str(ROOT / "benchmarks" / "capped.sh"), args.capped, str(args.ranks), sys.executable,
                                   *cmd], cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
            done = launcher.Result(proc.returncode, proc.stdout + proc.stderr)
        except subprocess.TimeoutExpired as exc:
            done = launcher.Result(None, str(exc.stdout or ""))
    else:
        done = launcher.run(args.ranks, cmd, timeout=args.timeout, cwd=ROOT)
    (folder / f"{method}@{seed}.log").write_text(done.output)
    if done.returncode != 0 or not out_json.exists():
        error = {"method": method, "seed": seed, "error": "hung" if done.hung else f"exit {done.returncode}",
                 "tail": done.output.strip().splitlines()[-12:], "wall_seconds": time.perf_counter() - start}
        out_json.write_text(json.dumps(error, indent=1))
        return error
    result = json.loads(out_json.read_text())
    result.update(method=method, seed=seed, wall_seconds=time.perf_counter() - start)
    out_json.write_text(json.dumps(result, indent=1))
    return result


# -- reading a run ---------------------------------------------------------------------------------
def curve(r: dict) -> list[tuple[int, float]]:
    """(step, loss) points of a run, every workload alike."""
    if "val_curve" in r:
        return [(int(p[0]), float(p[1])) for p in r["val_curve"]]
    return [(int(p[0]), float(p[1])) for p in r.get("test_curve", [])]


def accuracy(r: dict) -> float | None:
    acc = r.get("test_accuracy")
    if acc is None:
        return None
    return _percent(acc)


def late_accuracy(r: dict) -> float | None:
    """The mean test accuracy of the last ``LATE_EVALS`` evaluations (one an epoch on digits).

    The final accuracy alone cannot resolve half a point there: exact averaging's own CNN, seed
    1, reads 95.82, 96.94, 95.82, 96.66% over its last four epochs (4 images of 360), and on that
    seed fp16 ended 0.56 points below it while bf16, 8x coarser, ended level. Averaged over the
    last evaluations, that swing cancels and a code's cost shows."""
    accs = [_percent(p[2]) for p in r.get("test_curve", []) if len(p) > 2]
    if len(accs) < LATE_EVALS:
        return None
    return statistics.mean(accs[-LATE_EVALS:])


def _percent(acc: float) -> float:
    return 100 * acc if acc <= 1 else acc  # the MLP reports a fraction, the CNN percent


def traffic(r: dict) -> tuple[float | None, float | None]:
    """(bytes per rank per step in steady state, over the whole run)."""
    if "last_epoch" in r:  # the MLP
        return r["last_epoch"]["bytes_sent_per_step"], r["run"]["bytes_sent_per_step"]
    if "steady_bytes_per_step" in r:  # the CNN
        return r["steady_bytes_per_step"], r["bytes_per_step"]
    stats = r.get("stats")
    if stats is None:
        return None, None
    return r.get("bytes_sent_per_step"), stats.get("bytes_sent_per_step")


def diverged(r: dict) -> bool:
    points = curve(r)
    return (not points or not all(math.isfinite(l) for _, l in points) or points[-1][1] >= points[0][1])


def steps_to(points: list[tuple[int, float]], target: float) -> int | None:
    return next((s for s, l in points if l <= target), None)


# -- the table ----------------------------------------------------------------------------------------
def load(folder: Path) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(folder.glob("*@*.json")):
        method, _, seed = path.stem.rpartition("@")
        runs.setdefault(method, {})[int(seed)] = json.loads(path.read_text())
    return runs


def table(workload: str, runs: dict[str, dict[int, dict]]) -> str:
    ref_name = REFERENCE[workload]
    refs = runs.get(ref_name, {})
    header = ["method", "final loss (mean)", "vs exact % (mean / worst)", "test acc % (mean / worst)",
              "vs exact points (mean / worst)", f"points, last {LATE_EVALS} evals (mean / worst)",
              "steps to exact's final loss", "bytes/rank/step steady",
              "compression steady", "bytes/rank/step whole run", "seeds", "diverged"]
    rows = []
    for method, by_seed in runs.items():
        good = {s: r for s, r in by_seed.items() if "error" not in r}
        failed = sorted(s for s, r in by_seed.items() if "error" in r)
        if not good:
            rows.append([method, "FAILED"] + [""] * (len(header) - 3) + [f"{len(failed)}"])
            continue
        finals = [curve(r)[-1][1] for r in good.values()]
        rel = [100 * (curve(r)[-1][1] / curve(refs[s])[-1][1] - 1) for s, r in good.items()
               if s in refs and "error" not in refs[s]]
        accs = [a for r in good.values() if (a := accuracy(r)) is not None]
        points = _points(accuracy, good, refs)
        late = _points(late_accuracy, good, refs)
        reach = []
        for s, r in good.items():
            if s in refs and "error" not in refs[s]:
                reach.append(steps_to(curve(r), curve(refs[s])[-1][1]))
        steady, whole = zip(*(traffic(r) for r in good.values()))
        ref_bytes = _reference_bytes(good, refs)
        mean_steady = _mean(steady)
        rows.append([
            method, f"{statistics.mean(finals):.4f}",
            f"{statistics.mean(rel):+.2f} / {max(rel):+.2f}" if rel else "",  # worst: the highest loss
            f"{statistics.mean(accs):.2f} / {min(accs):.2f}" if accs else "",
            f"{statistics.mean(points):+.2f} / {min(points):+.2f}" if points else "",
            f"{statistics.mean(late):+.2f} / {min(late):+.2f}" if late else "",
            " ".join("-" if x is None else str(x) for x in reach),
            f"{mean_steady:,.0f}" if mean_steady is not None else "-",
            f"{ref_bytes / mean_steady:.1f}x" if ref_bytes and mean_steady else "-",
            f"{_mean(whole):,.0f}" if _mean(whole) is not None else "-",
            str(len(good)) + (f" (+{len(failed)} failed)" if failed else ""),
            str(sum(diverged(r) for r in good.values()))])
    return aligned_table(header, rows)


def seconds_to(r: dict, target: float) -> float | None:
    """Training seconds (evaluations excluded) until the loss first reaches ``target``."""
    timed = r.get("val_curve") or [p[:2] + [p[3]] for p in r.get("test_curve", []) if len(p) > 3]
    return next((float(p[2]) for p in timed if len(p) > 2 and p[1] <= target), None)


def time_table(workload: str, runs: dict[str, dict[int, dict]]) -> str:
    """Time to quality: per method, the training seconds to reach the exact reference's final loss
    (each seed against its own reference), against the reference's own time and fp16's."""
    refs = runs.get(REFERENCE[workload], {})
    header = ["method", "seconds to exact's final loss", "vs exact", "vs fp16", "total training s"]
    fp16 = {s: seconds_to(r, curve(refs[s])[-1][1]) for s, r in runs.get("fp16", {}).items()
            if s in refs and "error" not in r}
    rows = []
    for method, by_seed in runs.items():
        times, totals, vs_exact, vs_fp16 = [], [], [], []
        for s, r in by_seed.items():
            if "error" in r or s not in refs or "error" in refs[s]:
                continue
            target = curve(refs[s])[-1][1]
            t, ref_t = seconds_to(r, target), seconds_to(refs[s], target)
            times.append(t)
            totals.append(r.get("seconds"))
            if t is not None and ref_t:
                vs_exact.append(t / ref_t)
            if t is not None and fp16.get(s):
                vs_fp16.append(t / fp16[s])
        shown = " ".join("never" if t is None else f"{t:.0f}" for t in times)
        rows.append([method, shown, f"{statistics.mean(vs_exact):.2f}" if vs_exact else "-",
                     f"{statistics.mean(vs_fp16):.2f}" if vs_fp16 else "-",
                     " ".join(f"{t:.0f}" for t in totals if t is not None)])
    return aligned_table(header, rows)


def _points(measure, good: dict[int, dict], refs: dict[int, dict]) -> list[float]:
    """Per seed, ``measure`` of the run minus the same seed's reference's (accuracy points)."""
    return [a - b for s, r in good.items() if s in refs and "error" not in refs[s]
            and (a := measure(r)) is not None and (b := measure(refs[s])) is not None]


def _mean(values) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.mean(known) if known else None


def _reference_bytes(good: dict[int, dict], refs: dict[int, dict]) -> float | None:
    """What a plain fp32 allreduce sends per rank per step (from the runs' own counters)."""
    for r in list(good.values()) + list(refs.values()):
        stats = r.get("stats") or {}
        if stats.get("reference_bytes") and stats.get("steps"):
            return stats["reference_bytes"] / stats["steps"]
        if "last_epoch" in r:
            return r["last_epoch"]["reference_bytes_per_step"]
        if "steady_bytes_per_step" in r and r.get("compression_ratio"):
            return r["steady_bytes_per_step"] * r["compression_ratio"]
    return None


def timed_curve(r: dict) -> list[tuple[float, float]]:
    """(training seconds, loss) points of a run (the LM's and the CNN's record both)."""
    if "val_curve" in r:
        return [(float(p[2]), float(p[1])) for p in r["val_curve"] if len(p) > 2]
    return [(float(p[3]), float(p[1])) for p in r.get("test_curve", []) if len(p) > 3]


def plot_time(workload: str, runs: dict[str, dict[int, dict]], path: Path, rate: str) -> None:
    """Loss against training seconds (seed 0, or the first seed each method has), the reference's
    final loss as a line: time to quality at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    palette = plt.get_cmap("tab20").colors
    target = None
    ref = runs.get(REFERENCE[workload], {})
    for k, (method, by_seed) in enumerate(runs.items()):
        r = next((by_seed[s] for s in sorted(by_seed) if "error" not in by_seed[s]), None)
        if r is None or not timed_curve(r):
            continue
        xs, ys = zip(*timed_curve(r))
        exact = method == REFERENCE[workload]
        ax.plot(xs, ys, label=method, **(dict(color="black", lw=2.2) if exact else dict(color=palette[k % 20], lw=1.3)))
        if exact:
            target = ys[-1]
    if target is not None:
        ax.axhline(target, color="0.5", ls=":", lw=1)
        ax.set_ylim(target * 0.9, target * 1.8)
    ax.set_xlabel("training seconds (evaluations excluded)")
    ax.set_ylabel(LOSS_NAME[workload])
    ax.set_title(f"{EXAMPLES[workload]} on a {rate} link, {next(iter(ref.values()), {}).get('ranks', 4)} ranks: "
                 "time to exact's final loss (dotted)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(workload: str, runs: dict[str, dict[int, dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, tail) = plt.subplots(1, 2, figsize=(13, 5))
    palette = plt.get_cmap("tab20").colors
    palette = palette[0::2] + palette[1::2]
    lows = []
    last = 0
    for k, (method, by_seed) in enumerate(runs.items()):
        curves = [curve(r) for r in by_seed.values() if "error" not in r]
        if not curves:
            continue
        # the mean over seeds at each evaluation step all runs share
        steps = sorted(set.intersection(*(set(s for s, _ in c) for c in curves)))
        mean = [statistics.mean(dict(c)[s] for c in curves) for s in steps]
        exact = method == REFERENCE[workload]
        style = dict(color="black", lw=2.2, zorder=5) if exact else dict(color=palette[k % len(palette)], lw=1.2)
        label = f"{method} ({mean[-1]:.3f})"
        for ax in (full, tail):
            ax.plot(steps, mean, label=label, **style)
        last = max(last, steps[-1])
        lows += [m for s, m in zip(steps, mean) if s >= steps[-1] / 2 and math.isfinite(m)]
    if not lows:
        plt.close(fig)
        return
    tail.set_xlim(last / 2, last * 1.01)
    ref = [statistics.mean(curve(r)[-1][1] for r in runs.get(REFERENCE[workload], {}).values() if "error" not in r)] \
        if runs.get(REFERENCE[workload]) else []
    low = min(lows)
    tail.set_ylim(low - 0.05 * abs(low), (ref[0] if ref else low) * 1.3)
    for ax, title in ((full, LOSS_NAME[workload]), (tail, "second half, zoomed")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    seeds = sorted({s for by_seed in runs.values() for s in by_seed})
    fig.suptitle(f"{EXAMPLES[workload]}: mean over seeds {seeds}")
    tail.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=8, title="method (final)")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.reference:
        for workload in args.workload:
            REFERENCE[workload] = args.reference
    status = 0
    for workload in args.workload:
        folder = folder_of(workload, args)
        if not args.report:
            methods = args.methods or default_methods(workload)
            jobs = [(m, s) for s in args.seeds for m in methods]
            for i, (method, seed) in enumerate(jobs, 1):
                start = time.perf_counter()
                print(f"[{workload} {i}/{len(jobs)}] {method} seed {seed} ...", end=" ", file=sys.stderr, flush=True)
                r = run_one(workload, method, seed, args)
                shown = r.get("error") or f"final loss {curve(r)[-1][1]:.4f}"
                print(f"{time.perf_counter() - start:.0f} s, {shown}", file=sys.stderr, flush=True)
        runs = load(folder)
        if not runs:
            continue
        print(f"\n{workload}: {EXAMPLES[workload]}, {LOSS_NAME[workload]}, {args.ranks} ranks"
              + (f", capped at {args.capped}" if args.capped else "") + "\n")
        print(table(workload, runs))
        if args.capped:
            print("\n" + time_table(workload, runs))
            plot_time(workload, runs, args.out / f"time-to-quality-{folder.name}.png", args.capped)
        plot(workload, runs, args.out / f"convergence-{folder.name}.png")
        bad = [f"{m}@{s}" for m, by in runs.items() for s, r in by.items() if "error" in r or diverged(r)]
        if bad:
            print(f"\nfailed or diverged: {', '.join(bad)}")
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
