"""``python -m benchmarks zoo``: run the workload zoo, print the table, draw the heatmap.

    python -m benchmarks zoo --list
    python -m benchmarks zoo --half tuning --steps 400 --methods none int8 onebit topk powersgd dgc onebitadam
    python -m benchmarks zoo --half validation --steps 400 2000 --seeds 0 1
    python -m benchmarks zoo --report --out results/zoo

One ``mpiexec -n RANKS`` job per (workload, length, seed) trains every method in turn; each
result is ``OUT/WORKLOAD/STEPS/METHOD@SEED.json`` and is skipped when present (``--rerun`` runs it
again). ``--report`` runs nothing. Tables go to ``OUT/zoo-STEPS.md``, heatmaps to ``OUT/zoo-STEPS.png``.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_METHODS = ["none", "int8", "onebit", "topk", "randomk", "powersgd", "dgc", "onebitadam", "diloco"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks zoo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--half", choices=("tuning", "validation", "all"), default="all",
                   help="which half of the zoo (default: %(default)s); tune on tuning, publish validation")
    p.add_argument("--workloads", nargs="+", metavar="NAME", help="these workloads instead of a half")
    p.add_argument("--methods", nargs="+", metavar="SPEC",
                   help="none, a registry spec (int8, topk:ratio=0.01, ...), dgc[:...], onebitadam[:...], "
                        f"diloco[:...] (default: {' '.join(DEFAULT_METHODS)}; with --report, every one found)")
    p.add_argument("--steps", type=int, nargs="+",
                   help="run lengths (default: 400; with --report, every length found)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path("results/zoo"))
    p.add_argument("--report", action="store_true", help="run nothing: table and heatmap from OUT's JSON files")
    p.add_argument("--list", action="store_true", help="print the workloads and exit")
    p.add_argument("--rerun", action="store_true", help="run again even where a result exists")
    p.add_argument("--evals", type=int, default=8, help="held-out evaluations per run (the curve)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap (default: DDP's own, 25)")
    p.add_argument("--timeout-per-step", type=float, default=1.0,
                   help="seconds a job may take per step and method, plus 120 (default: %(default)s)")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="draw the heatmaps")
    return p.parse_args(argv)


def listing() -> str:
    """The workloads, one a line, every column left-aligned."""
    from .workloads import WORKLOADS

    header = ["workload", "family", "optimizer", "lr", "batch/rank", "metric", "half", "what"]
    rows = [header] + [[w.name, w.family, w.optimizer, f"{w.lr:g}", str(w.batch), w.metric, w.half, w.describe]
                       for w in WORKLOADS]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(n) for c, n in zip(r, widths)).rstrip() for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.list:
        print(listing())
        return 0
    from . import methods as MT
    from . import report, runner
    from . import workloads as W

    chosen = W.select(args.half, args.workloads)
    specs = list(dict.fromkeys(args.methods or DEFAULT_METHODS))
    for spec in specs:
        try:
            MT.parse(spec)
        except ValueError as exc:
            raise SystemExit(f"python -m benchmarks zoo: method {spec!r}: {exc}") from None
    if not args.report:
        runner.sweep(args.out, chosen, args.steps or [400], args.seeds, specs, args.ranks, args.timeout_per_step,
                     args.evals, args.bucket_cap_mb, rerun=args.rerun)
    text, figures = report.report(args.out, chosen, specs if args.methods or not args.report else None, args.steps or ([] if args.report else [400]), plots=args.plots)
    print(text)
    for path in figures:
        print("figure:", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
