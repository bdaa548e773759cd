"""Convergence of compressors on examples/torch_ddp.py (small CNN on digits, PyTorch DDP).

    python scripts/cnn_convergence.py --np 4 --compressors allreduce int8 int8-noef --json results/conv/cnn.json
    python scripts/cnn_convergence.py --compressors allreduce topk -- --epochs 10 --seed 1

One ``mpiexec -n RANKS`` job per compressor (the mpiexec beside this Python), every job with the
same arguments (so the same seed: the example's ``--seed``, 0 unless given after ``--``). The
example prints its result on rank 0 only, so this script parses that line from stdout; a run
counts as finished only when mpiexec exits 0 (every rank returned from ``main``) and the line is
there. A failed or timed-out run is a FAILED row, with the end of its output printed and kept in
the JSON. The table compares test accuracy with the ``allreduce`` run, in points.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from gradcomp import launcher
from gradcomp.bench.tables import aligned_table, failures, run_each

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torch_ddp.py"
RESULT = re.compile(r"final loss (?P<loss>\S+)\s+test accuracy (?P<acc>[^%\s]+)%\s+bytes/rank/step "
                    r"(?P<bytes>\d+)\s+compression x(?P<ratio>[\d.infa]+)\s+train time (?P<seconds>[\d.]+) s")


def parse_args(argv=None):
    import gradcomp
    from gradcomp.registry import compressor_spec

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", nargs="+", default=list(gradcomp.REGISTRY), type=compressor_spec)
    p.add_argument("--ranks", "--np", type=int, default=4, help="mpiexec -n (default 4)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="also write every run's result here")
    p.add_argument("--logs", type=Path, help="folder for each run's full output (NAME.log)")
    p.add_argument("example_args", nargs="*", help="after --: passed to the example unchanged")
    return p.parse_args(argv)


def run_once(name: str, args) -> dict:
    cmd = [str(EXAMPLE), "--compressor", name, *args.example_args]
    start = time.perf_counter()
    done = launcher.run(args.ranks, cmd, timeout=args.timeout, cwd=ROOT)
    wall = time.perf_counter() - start
    output = done.output
    code = f"timeout after {args.timeout:.0f} s" if done.hung else done.returncode
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
        (args.logs / f"{name.replace(':', '_').replace('=', '')}.log").write_text(output)
    match = RESULT.search(output)
    if code != 0 or not match:
        return {"compressor": name, "error": f"exit {code}" + ("" if match else ", no result line"),
                "tail": output.strip().splitlines()[-15:], "wall_seconds": wall, "command": cmd}
    return {"compressor": name, "test_accuracy": float(match["acc"]), "final_loss": float(match["loss"]),
            "bytes_per_step": int(match["bytes"]), "compression_ratio": float(match["ratio"]),
            "train_seconds": float(match["seconds"]), "wall_seconds": wall, "command": cmd}


def table(results: dict[str, dict]) -> str:
    base = results.get("allreduce", {}).get("test_accuracy")
    header = ["compressor", "test acc %", "vs allreduce (points)", "bytes/rank/step", "compression",
              "train s", "wall s"]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "FAILED", r["error"], "", "", "", f"{r['wall_seconds']:.0f}"])
            continue
        acc = r["test_accuracy"]
        rows.append([name, f"{acc:.2f}", f"{acc - base:+.2f}" if base is not None else "",
                     f"{r['bytes_per_step']:,}", f"{r['compression_ratio']:.2f}",
                     f"{r['train_seconds']:.1f}", f"{r['wall_seconds']:.0f}"])
    return aligned_table(header, rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    results = run_each(args.compressors, args.ranks, lambda name: run_once(name, args),
                       lambda r: f"{r['test_accuracy']:.2f} %")
    extra = " ".join(args.example_args)
    print(f"\nDigits CNN (examples/torch_ddp.py{' ' + extra if extra else ''}) on {args.ranks} ranks; "
          f"test accuracy of rank 0 after training\n")
    print(table(results))
    print(failures(results), end="")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any("error" in r for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
