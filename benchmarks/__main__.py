"""Command line: ``python -m benchmarks bench ...``, ``python -m benchmarks report DIR`` and
``python -m benchmarks zoo ...``, run from the repository root (the benchmarks are not part of
the installed package).

``bench``  run the benchmarks (ranks x models x methods, plus kernel throughput) and write
           results.json, results.csv, kernels.csv, summary.md and PNG figures to ``--out``.
``report`` rebuild the summary, CSV and figures from the JSON files already in a folder (for
           example after adding ``capped-*.json`` files from ``benchmarks/capped_steps.sh`` runs).
``zoo``    the workload zoo: quality and ratio of each method against exact averaging
           (``python -m benchmarks zoo --help``).
``scale``  GPT-2 small and a ResNet-50 through every name: memory per parameter and step time
           (``python -m benchmarks scale --help``).
"""
from __future__ import annotations

import argparse
import sys


def _bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default="resnet50,bert-base",
                   help="comma-separated: resnet50, bert-base, tiny (default: %(default)s)")
    p.add_argument("--ranks", default="2,3,4", help="comma-separated numbers of ranks (default: %(default)s)")
    p.add_argument("--methods", default="all",
                   help="comma-separated method names, or all / gradcomp / torch (default: %(default)s)")
    p.add_argument("--paths", default=None,
                   help="comma-separated: reducer (GradientReducer, the NumPy path), ddp (real DDP with "
                        "the hook); default: both when torch is there")
    p.add_argument("--order", choices=("round-robin", "blocks"), default="round-robin",
                   help="timed steps round-robin over the methods, or each method's steps together")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per method; the median is kept")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 3 so PowerSGD compresses)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap in MiB (DDP's default: 25)")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto",
                   help="compare with PyTorch's DDP hooks (auto: when torch is installed)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure kernel throughput as a multiple of memcpy")
    p.add_argument("--kernel-mb", type=float, default=100.0, help="buffer size of the kernel figures")
    p.add_argument("--kernel-methods", default="gradcomp", help="methods in the kernel figure")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True, help="write PNG figures")
    p.add_argument("--out", default="results/bench", help="output folder (default: %(default)s)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    if (sys.argv[1:] if argv is None else argv)[:1] == ["zoo"]:  # the workload zoo: benchmarks/zoo/cli.py
        from .zoo.cli import main as zoo
        return zoo((sys.argv[1:] if argv is None else argv)[1:])
    if (sys.argv[1:] if argv is None else argv)[:1] == ["scale"]:  # real model sizes: benchmarks/scale.py
        from .scale import main as scale
        return scale((sys.argv[1:] if argv is None else argv)[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    bench = sub.add_parser("bench", help="run the benchmarks")
    _bench_args(bench)
    rep = sub.add_parser("report", help="summary, CSV and figures from the JSON files in a folder")
    rep.add_argument("folder", nargs="?", default="results/bench")
    rep.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True)
    sub.add_parser("zoo", help="the workload zoo (its own options: python -m benchmarks zoo --help)")
    sub.add_parser("scale", help="real model sizes (its own options: python -m benchmarks scale --help)")
    args = parser.parse_args(argv)

    from . import driver

    if args.command == "bench":
        result = driver.run(args)
    else:
        jobs, kernel_rows, _ = driver.load(args.folder)
        result = driver.report(args.folder, jobs, kernel_rows, dict(command=" ".join(sys.argv)),
                               plots=args.plots)
    print(result["summary"])
    for path in result.get("figures", []):
        print("figure:", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
