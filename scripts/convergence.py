"""Convergence of every compressor on a harder task: examples/torch_lm.py once per compressor.

    python scripts/convergence.py                                    # none + all of gradcomp.REGISTRY
    python scripts/convergence.py --compressors none allreduce powersgd --steps 200 --out /tmp/conv

Each compressor is one ``mpiexec -n RANKS`` job (the mpiexec beside this Python) training the same
byte-level transformer on the Python standard library with the same seed and step count; the job
writes a JSON summary. The table compares the final validation loss (nats per byte) with the
``allreduce`` run (or, without one, the ``none`` run: DDP's own allreduce, no hook); exact methods
should match it to a fraction of a percent, lossy ones show what their compression costs. Bytes and
compression ratio are those of the second half of training, after any warm-up. ``seconds`` is
training time without the evaluations, ``wall s`` the whole job. Writes ``OUT/convergence.json``
(every summary, failures included) and ``OUT/convergence.png`` (validation-loss curves).
A failed run is a row marked FAILED with the end of its output; the others still run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from gradcomp import launcher
from gradcomp.bench.tables import aligned_table, failures, run_each

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "torch_lm.py"
EXACT = ("none", "allreduce", "allgather")  # methods that average gradients without loss
EXACT_STYLE = {"none": dict(color="0.65", lw=4.5, ls="-", zorder=3),
               "allreduce": dict(color="black", lw=1.8, ls="--", zorder=4),
               "allgather": dict(color="black", lw=1.8, ls=":", zorder=4)}


def parse_args(argv=None):
    import gradcomp
    from gradcomp.registry import compressor_spec

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressors", nargs="+", default=["none", *gradcomp.REGISTRY], type=compressor_spec,
                   help="'none' and/or registry names (default: none + all of gradcomp.REGISTRY)")
    p.add_argument("--ranks", type=int, default=4, help="mpiexec -n (default 4)")
    p.add_argument("--steps", type=int, help="training steps (default: the example's)")
    p.add_argument("--out", type=Path, default=ROOT / "results" / "convergence",
                   help="output folder (default: results/convergence, git-ignored)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--replot", action="store_true",
                   help="run nothing: redraw OUT/convergence.png (and reprint the table) from OUT/convergence.json")
    p.add_argument("extra", nargs="*", help="after --: passed to the example unchanged")
    args = p.parse_args(argv)
    return args


def run_once(name: str, args) -> dict:
    """One mpiexec job: its JSON summary plus ``wall_seconds``, or {"error": ..., "tail": [...]}."""
    out_json = args.out / f"{name}.json"
    out_json.unlink(missing_ok=True)
    cmd = [str(EXAMPLE), "--compressor", name, "--json", str(out_json), *args.extra]
    if args.steps:
        cmd += ["--steps", str(args.steps)]
    start = time.perf_counter()
    done = launcher.run(args.ranks, cmd, timeout=args.timeout, cwd=ROOT)
    wall = time.perf_counter() - start
    output = done.output
    code = f"timeout after {args.timeout:.0f} s" if done.hung else done.returncode
    (args.out / f"{name}.log").write_text(output)
    if code != 0 or not out_json.exists():
        return {"compressor": name, "error": f"exit {code}", "tail": output.strip().splitlines()[-12:],
                "wall_seconds": wall}
    return dict(json.loads(out_json.read_text()), wall_seconds=wall)


def table(results: dict[str, dict]) -> str:
    base_name = next((b for b in ("allreduce", "none") if "final_val_loss" in results.get(b, {})), None)
    base = results[base_name]["final_val_loss"] if base_name else None
    header = ["compressor", "final val loss", f"vs {base_name or 'base'} %", "compression",
              "bytes/rank/step", "seconds", "wall s", "same weights"]
    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "FAILED", r["error"], "", "", "", f"{r['wall_seconds']:.0f}", ""])
            continue
        loss, ratio, sent = r["final_val_loss"], r["compression_ratio"], r["bytes_sent_per_step"]
        rows.append([name, f"{loss:.4f}", f"{100 * loss / base:.2f}" if base else "",
                     f"{ratio:.2f}" if ratio else "-", f"{sent:,.0f}" if sent is not None else "-",
                     f"{r['seconds']:.1f}", f"{r['wall_seconds']:.0f}", "yes" if r["weights_identical"] else "NO"])
    return aligned_table(header, rows)


def plot(results: dict[str, dict], path: Path, ranks: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, tail) = plt.subplots(1, 2, figsize=(13, 5))
    # lossy methods: one colour per method, shared by its error-feedback and -noef runs (the -noef
    # one dashed, hollow markers), so the pairs read as pairs; 20 colours before any repeats
    palette = plt.get_cmap("tab20").colors
    palette = palette[0::2] + palette[1::2]
    colours: dict[str, tuple] = {}
    for name, r in results.items():
        if "val_curve" not in r:
            continue
        steps, losses = zip(*r["val_curve"])
        exact = name in EXACT
        noef = name.partition(":")[0].endswith("-noef")
        family = name.replace("-noef", "", 1)  # topk and topk-noef: one colour; topk:ratio=0.05 its own
        colour = colours.setdefault(family, palette[len(colours) % len(palette)])
        # exact methods: grey/black, no markers, line styles that stay visible when they coincide
        style = EXACT_STYLE[name] if exact else dict(
            color=colour, lw=1.3, marker="o" if noef else ".", ms=3.5 if noef else 4,
            ls="--" if noef else "-", mfc="none" if noef else colour)
        label = f"{name} ({r['final_val_loss']:.3f})" + (" [exact]" if exact else "")
        for ax in (full, tail):
            ax.plot(steps, losses, label=label, **style)
    done = [r for r in results.values() if "val_curve" in r]
    if not done:
        plt.close(fig)
        return
    # right panel: the second half, where the differences are
    last = max(s for r in done for s, _ in r["val_curve"])
    tail_losses = [l for r in done for s, l in r["val_curve"] if s >= last / 2]
    tail.set_xlim(last / 2, last * 1.01)
    tail.set_ylim(min(tail_losses) - 0.02, max(tail_losses) + 0.02)
    full.set_title("validation loss")
    tail.set_title("second half, zoomed")
    for ax in (full, tail):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy, nats/byte")
        ax.grid(alpha=0.3)
    r0 = done[0]
    fig.suptitle(f"examples/torch_lm.py: {r0['parameters']:,}-parameter byte-level transformer on the "
                 f"stdlib, {ranks} ranks, {r0['steps']} steps")
    tail.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize=9, title="compressor (final)")
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        results = json.loads((args.out / "convergence.json").read_text())
        print(table(results))
        plot(results, args.out / "convergence.png", next(iter(results.values())).get("ranks", args.ranks))
        print(f"\nwrote {args.out / 'convergence.png'}")
        return 0
    results = run_each(args.compressors, args.ranks, lambda name: run_once(name, args),
                       lambda r: f"val loss {r['final_val_loss']:.4f}")
    print(f"\nexamples/torch_lm.py on {args.ranks} ranks; final validation loss in nats per byte; "
          f"bytes and compression over the second half of training\n")
    print(table(results))
    print(failures(results), end="")
    (args.out / "convergence.json").write_text(json.dumps(results, indent=1))
    plot(results, args.out / "convergence.png", args.ranks)
    print(f"\nwrote {args.out / 'convergence.json'} and {args.out / 'convergence.png'}")
    return 1 if any("error" in r or not r["weights_identical"] for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
