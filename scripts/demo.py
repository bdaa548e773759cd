"""`make demo`: train examples/numpy_mlp.py once per compressor under mpiexec, print one table.

    python scripts/demo.py                                  # every registered name, and DGC
    python scripts/demo.py --compressors allreduce fp16 dgc --repeats 3 -- --epochs 20

Without arguments after ``--`` the example runs ``DEFAULT_EXAMPLE_ARGS``: 8 epochs of batch 16 with
32 hidden units, 168 steps at 4 ranks, past every recipe's warm-up, and short enough that the
methods still differ (test loss shows it best); the table takes about 5-7 minutes at 4 ranks on 2
cores.

``dgc`` (or ``dgc:key=value,...``) is ``gradcomp.optim.DGC`` in place of the example's momentum
SGD: the optimizer that compresses its own state. Each run is a separate ``mpiexec -n RANKS`` job (the mpiexec beside this Python, so the one the
virtual environment installed) writing a JSON summary; the table gathers them. Arguments after
``--`` go to the example unchanged. With ``--repeats``, the compressors take turns (round-robin), so
slow moments of a shared machine spread over all of them, and the time per step is the median over
repeats. Accuracy and bytes are deterministic for a given seed; only the time varies.

Bytes and compression ratio are those of the last epoch, i.e. after any warm-up (PowerSGD starts
with plain allreduce); the ratio is what a plain allreduce of the same buckets would send divided by
what was sent, both counted for bandwidth-optimal algorithms (ring allreduce, allgather).

The time columns are wall-clock time on this one host, where ranks talk through shared memory: the
wire is nearly free, so they show compute, and with more ranks than CPU cores they mostly show CPU
contention between the ranks (who waits for a core), not communication. A note under the table says
which case this run is (ranks against ``os.cpu_count()``); bytes/rank/step is the column that
compares communication.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # benchmarks/ (its table helper) is not installed: it is in the checkout

from benchmarks.tables import aligned_table  # noqa: E402
from gradcomp.launcher import mpiexec  # noqa: E402

EXAMPLE = ROOT / "examples" / "numpy_mlp.py"
DEFAULT_EXAMPLE_ARGS = ("--epochs", "8", "--batch-size", "16", "--hidden", "32")


def parse_args(argv=None):
    import gradcomp

    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", nargs="+", default=list(gradcomp.REGISTRY) + ["dgc"], type=method_spec,
                   help="registry names, or dgc[:key=value,...] (default: all of gradcomp.REGISTRY, and dgc)")
    p.add_argument("--ranks", "--np", type=int, default=4, help="mpiexec -n (default 4)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--timeout", type=float, default=300, help="seconds per run")
    p.add_argument("--json", metavar="PATH", help="also write every run's summary here")
    args = p.parse_args(argv)
    # a short run by default: after 40 epochs almost every method reaches the same accuracy (the
    # digits are easy), while after a few the methods still differ, in test loss most of all
    args.example_args = passthrough or list(DEFAULT_EXAMPLE_ARGS)
    return args


def method_spec(text: str) -> str:
    """A registry spec, or ``dgc[:key=value,...]`` (the optimizer)."""
    from gradcomp.registry import compressor_spec

    return text if text.partition(":")[0] == "dgc" else compressor_spec(text)


def run_once(name: str, ranks: int, example_args: list[str], timeout: float) -> dict:
    """One mpiexec job; its JSON summary, or {"error": ...} with the tail of its output."""
    with tempfile.TemporaryDirectory() as tmp:
        out_json = Path(tmp) / "summary.json"
        which = "--optimizer" if name.partition(":")[0] == "dgc" else "--compressor"
        cmd = [mpiexec(), "-n", str(ranks), sys.executable, str(EXAMPLE), which, name,
               "--json", str(out_json), *example_args]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if proc.returncode != 0 or not out_json.exists():
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            return {"error": f"exit {proc.returncode}:\n    " + "\n    ".join(tail)}
        return json.loads(out_json.read_text())


def table(results: dict[str, list[dict]]) -> str:
    """A Markdown table (also readable as plain text): one row per compressor."""
    base = results.get("allreduce", [{}])[0]
    base_time = statistics.median(r["time_per_step_s"] for r in results["allreduce"]) \
        if "test_accuracy" in base else None
    base_loss = base["test_curve"][-1][1] if "test_curve" in base else None
    header = ["method", "test loss", "vs allreduce", "test acc %", "vs allreduce (points)", "bytes/rank/step",
              "compression ratio", "time/step ms", "time vs allreduce"]
    rows = []
    for name, runs in results.items():
        first = runs[0]
        if "error" in first:
            rows.append([name, "FAILED"] + [""] * (len(header) - 2))
            continue
        acc = 100 * first["test_accuracy"]
        loss = first["test_curve"][-1][1]
        t = statistics.median(r["time_per_step_s"] for r in runs)
        rows.append([
            name, f"{loss:.4f}", f"{100 * (loss / base_loss - 1):+.2f}%" if base_loss else "", f"{acc:.2f}",
            f"{acc - 100 * base['test_accuracy']:+.2f}" if "test_accuracy" in base else "",
            f"{first['last_epoch']['bytes_sent_per_step']:,.0f}",
            f"{first['last_epoch']['compression_ratio']:.2f}",
            f"{1e3 * t:.2f}",
            f"{t / base_time:.2f}x" if base_time else ""])
    return aligned_table(header, rows)


def timing_note(ranks: int, cpus: int | None) -> str:
    """What the time columns measure on this machine: printed under the table (never a table row)."""
    cores = f"{cpus} CPU core{'s' if cpus != 1 else ''}" if cpus else "an unknown number of CPU cores"
    ranks_text = f"{ranks} rank{'s' if ranks != 1 else ''}"
    if cpus and ranks > cpus:
        text = (f"Note on the time columns: {ranks_text} on {cores} (os.cpu_count()), so the machine "
                "is oversubscribed: 'time/step ms' and 'time vs allreduce' measure CPU contention between "
                "the ranks (who waits for a core), not the network. The ranks talk through shared memory "
                "(loopback), where the wire is nearly free, so a method that sends more bytes can still "
                "show less time (allgather against allreduce, for one). Compare communication by "
                "'bytes/rank/step'; step times on a real (capped) link: BENCHMARKS.md, `make bench-capped`.")
    else:
        text = (f"Note on the time columns: {ranks_text} on {cores} (os.cpu_count()). The ranks talk "
                "through shared memory (loopback), where the wire is nearly free, so 'time/step ms' is "
                "mostly compute, not the network. Compare communication by 'bytes/rank/step'; step times "
                "on a real (capped) link: BENCHMARKS.md, `make bench-capped`.")
    return textwrap.fill(text, width=100)


def main(argv=None) -> int:
    args = parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in args.compressors}
    total, done = len(args.compressors) * args.repeats, 0
    for _ in range(args.repeats):
        for name in args.compressors:
            done += 1
            start = time.perf_counter()
            print(f"[{done}/{total}] {name} on {args.ranks} ranks ...", end=" ", file=sys.stderr, flush=True)
            summary = run_once(name, args.ranks, args.example_args, args.timeout)
            results[name].append(summary)
            status = summary["error"] if "error" in summary else f"{100 * summary['test_accuracy']:.2f} %"
            print(f"{time.perf_counter() - start:.1f} s, {status}", file=sys.stderr, flush=True)
    first = next((r for runs in results.values() for r in runs if "steps" in r), {})
    print(f"\nDigits MLP (examples/numpy_mlp.py) on {args.ranks} ranks"
          + (f": {first['epochs']} epochs, {first['steps']} steps, batch {first['batch_size_per_rank']}"
             f" per rank, lr {first['lr']}, seed {first['seed']}, bucket cap {first['bucket_cap_mb']} MB"
             if first else "")
          + f"; time/step: median over steps, then over {args.repeats} run(s)\n")
    print(table(results))
    print("\n" + timing_note(args.ranks, os.cpu_count()))
    print("\nMeasured numbers, with the commands behind them: BENCHMARKS.md (kernels, bytes per rank, "
          "step times on a capped network: `make bench`, `make bench-capped`).")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    failed = [n for n, runs in results.items() if any("error" in r for r in runs)]
    unequal = [n for n, runs in results.items()
               if len({r.get("test_accuracy") for r in runs}) > 1 or not all(r.get("weights_identical", 1) for r in runs)]
    if unequal:
        print(f"\nnot deterministic across repeats or ranks: {', '.join(unequal)}", file=sys.stderr)
    return 1 if failed or unequal else 0


if __name__ == "__main__":
    sys.exit(main())
