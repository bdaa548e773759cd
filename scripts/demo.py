"""`make demo`: train examples/numpy_mlp.py once per compressor under mpiexec, print one table.

    python scripts/demo.py                                  # every registered name, and DGC
    python scripts/demo.py --compressors allreduce fp16 dgc --repeats 3 -- --epochs 20

Without arguments after ``--`` the example runs ``DEFAULT_EXAMPLE_ARGS``: 8 epochs of batch 16 with
32 hidden units, 168 steps at 4 ranks, past every recipe's warm-up, and short enough that the
methods still differ (test loss shows it best); the table takes about 6-8 minutes at 4 ranks on 2
cores.

``dgc`` (or ``dgc:key=value,...``) is ``gradcomp.optim.DGC`` in place of the example's momentum
SGD: the optimizer that compresses its own state. Each run is a separate ``mpiexec -n RANKS`` job (the mpiexec beside this Python, so the one the
virtual environment installed) writing a JSON summary; the table gathers them. Arguments after
``--`` go to the example unchanged. With ``--repeats``, the compressors take turns (round-robin), so
slow moments of a shared machine spread over all of them, and the time per step is the median over
repeats. Accuracy and bytes are deterministic for a given seed; only the time varies.

One seed per method: ``--noise-seeds`` (2) more runs of allreduce at other seeds, on the same test
images, measure how far an exact run moves from another start alone; a difference from allreduce
no larger is marked ``~`` (issue 56 saw a default table where 8 of 15 rows tied with allreduce
and lossy rows "beat" exact by 4%: noise, read as results). Under the table: how many rows tie, and what ``auto`` picked and why.

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
    p.add_argument("--noise-seeds", type=int, default=2,
                   help="extra seeds of allreduce (1, 2, ...), whose spread marks the differences a single "
                        "seed cannot tell from noise (0: none)")
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


def noise(base: dict, seeds: list[dict]) -> tuple[float, float] | None:
    """(test loss in %, test accuracy in points): how far allreduce's runs at other seeds ended
    from its run at the table's seed, the largest; None without them."""
    runs = [r for r in seeds if "test_curve" in r]
    if not runs or "test_curve" not in base:
        return None
    loss = base["test_curve"][-1][1]
    return (max(abs(100 * (r["test_curve"][-1][1] / loss - 1)) for r in runs),
            max(abs(100 * (r["test_accuracy"] - base["test_accuracy"])) for r in runs))


def picked(summary: dict) -> str | None:
    """What ``auto`` chose, per bucket, in a few words (None for other methods)."""
    choices = summary.get("choices") or []
    if not choices:
        return None
    chosen = sorted({c["chosen"] for c in choices})
    return ", ".join(chosen) if len(chosen) > 1 else chosen[0]


def table(results: dict[str, list[dict]], spread: tuple[float, float] | None = None) -> str:
    """A Markdown table (also readable as plain text): one row per compressor. With ``spread``
    (``noise``), a difference from allreduce no larger than allreduce's own spread over seeds is
    marked ``~``."""
    base = results.get("allreduce", [{}])[0]
    base_time = statistics.median(r["time_per_step_s"] for r in results["allreduce"]) \
        if "test_accuracy" in base else None
    base_loss = base["test_curve"][-1][1] if "test_curve" in base else None

    def marked(diff: float, text: str, within: float | None) -> str:
        return f"{text} ~" if within is not None and abs(diff) <= within + 1e-9 else text
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
        d_loss = 100 * (loss / base_loss - 1) if base_loss else 0.0
        d_acc = acc - 100 * base["test_accuracy"] if "test_accuracy" in base else 0.0
        near = name != "allreduce" and spread is not None
        auto = picked(first)
        rows.append([
            f"{name} (picked {auto})" if auto else name, f"{loss:.4f}",
            marked(d_loss, f"{d_loss:+.2f}%", spread[0] if near else None) if base_loss else "", f"{acc:.2f}",
            marked(d_acc, f"{d_acc:+.2f}", spread[1] if near else None) if "test_accuracy" in base else "",
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


def noise_note(results: dict[str, list[dict]], spread: tuple[float, float] | None, seeds: int) -> str:
    """What one seed per method can tell apart, and what ``auto`` picked: printed under the table."""
    base = results.get("allreduce", [{}])[0]
    done = {n: runs[0] for n, runs in results.items() if "test_accuracy" in runs[0]}
    parts = []
    if spread is not None and "test_accuracy" in base:
        ties = sum(1 for n, r in done.items() if n != "allreduce" and r["test_accuracy"] == base["test_accuracy"])
        ahead = [n for n, r in done.items() if n != "allreduce" and r["test_curve"][-1][1] < base["test_curve"][-1][1]]
        parts.append(f"Single seed. '~': within how far allreduce itself moved at {seeds} other seed(s) (other "
                     f"initial weights and batches, the same test images): test loss {spread[0]:.2f}%, accuracy "
                     f"{spread[1]:.2f} points. One seed per method cannot tell such a difference from noise. "
                     f"{ties} of {len(done) - 1} methods tie with allreduce's accuracy exactly (one test image "
                     f"of {base.get('test_images', '?')} is {100 / base.get('test_images', float('nan')):.2f} "
                     "points)"
                     + (f"; {', '.join(ahead)} {'ends' if len(ahead) == 1 else 'end'} below exact allreduce's "
                        "test loss: one trajectory's luck, not a gain" if ahead else "")
                     + ". `--repeats` reruns the same seed (only the times vary); `-- --seed N` runs another.")
    for name, r in done.items():
        if r.get("choices"):
            why = r["choices"][0]["why"]
            parts.append(f"{name} picked {picked(r)} for its {len(r['choices'])} bucket(s): {why}.")
    return "\n\n".join(textwrap.fill(p, width=100) for p in parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    results: dict[str, list[dict]] = {name: [] for name in args.compressors}
    seeds = args.noise_seeds if "allreduce" in results else 0
    total, done = len(args.compressors) * args.repeats + seeds, 0
    extra: list[dict] = []
    jobs = [(name, args.example_args, results[name]) for _ in range(args.repeats) for name in args.compressors]
    jobs += [("allreduce", None, extra)] * seeds  # (its arguments once the table's seed is known)
    for name, example_args, into in jobs:
        if example_args is None:  # the next seed, on the table's train/test split
            seed = results["allreduce"][0].get("seed", 0)
            example_args = [*args.example_args, "--seed", str(seed + len(extra) + 1), "--split-seed", str(seed)]
        done += 1
        start = time.perf_counter()
        seed = " (noise seed)" if into is extra else ""
        print(f"[{done}/{total}] {name}{seed} on {args.ranks} ranks ...", end=" ", file=sys.stderr, flush=True)
        summary = run_once(name, args.ranks, example_args, args.timeout)
        into.append(summary)
        status = summary["error"] if "error" in summary else f"{100 * summary['test_accuracy']:.2f} %"
        print(f"{time.perf_counter() - start:.1f} s, {status}", file=sys.stderr, flush=True)
    spread = noise(results["allreduce"][0], extra) if seeds else None
    first = next((r for runs in results.values() for r in runs if "steps" in r), {})
    print(f"\nDigits MLP (examples/numpy_mlp.py) on {args.ranks} ranks"
          + (f": {first['epochs']} epochs, {first['steps']} steps, batch {first['batch_size_per_rank']}"
             f" per rank, lr {first['lr']}, seed {first['seed']}, bucket cap {first['bucket_cap_mb']} MB"
             if first else "")
          + f"; time/step: median over steps, then over {args.repeats} run(s)\n")
    print(table(results, spread))
    said = noise_note(results, spread, seeds)
    if said:
        print("\n" + said)
    print("\n" + timing_note(args.ranks, os.cpu_count()))
    print("\nMeasured numbers, with the commands behind them: BENCHMARKS.md (kernels, bytes per rank, "
          "step times on a capped network: `make bench`, `make bench-capped`).")
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "allreduce at other seeds": extra} if extra else results,
                                              indent=1))
    failed = [n for n, runs in results.items() if any("error" in r for r in runs)]
    unequal = [n for n, runs in results.items()
               if len({r.get("test_accuracy") for r in runs}) > 1 or not all(r.get("weights_identical", 1) for r in runs)]
    if unequal:
        print(f"\nnot deterministic across repeats or ranks: {', '.join(unequal)}", file=sys.stderr)
    return 1 if failed or unequal else 0


if __name__ == "__main__":
    sys.exit(main())
