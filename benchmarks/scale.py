"""The scale suite: real model sizes through every name, for memory and step time (issue 65).

    python -m benchmarks scale                                   # GPT-2 small + a ResNet-50, 2 ranks
    python -m benchmarks scale --models gpt2 --sizes 6,12 --names int8,topk --steps 12
    sudo benchmarks/capped.sh 1gbit 2 .venv/bin/python -m benchmarks.scale --worker ...   # (what --network runs)

Two models: GPT-2 small built from ``transformers``' ``GPT2Config`` (nothing downloaded; ``--sizes``
are its layers, 6 and 12: 81M and 124M parameters) and a ResNet-50 (bottleneck blocks 3-4-6-3, the
widths scaled by ``--sizes`` in eighths for the CNN: 6 and 8, about 14M and 25M parameters; 32x32
inputs, so the compute stays small). Each (model, size, method) runs as its own job of ``--ranks``
ranks: plain DDP (``ddp``: its own allreduce), every registered name through ``gt.register``,
``gt.OneBitAdam`` and ``gt.DGC`` (``opt:...``), FSDP2 with ``int8`` gradients (``fsdp:int8``) and
FSDP's own (``fsdp``), and ``gt.DiLoCo`` with its default exchange (``diloco``). Each job reports
every rank's peak RSS, the median step, the bytes each rank sent per step, what gradcomp keeps
between steps (``benchmarks.held``: exact, where peak RSS moves by tens of MB between runs) and,
where a governor runs, its audits' share of the bytes.

The summary: per method, the memory it adds over its reference (DDP's own run; FSDP's own for
``fsdp:``) in bytes per parameter, as the slope between the two sizes (the fixed cost of compiled
kernels and libraries does not count), against the issue's targets: a hook at most 4 + 4/n + 1
(the residuals of two-stage error feedback and codes), ``OneBitAdam`` at most 8 over AdamW's own
state, DiLoCo at most 12; the fixed part at most 400 MB. With ``--network RATE`` (root: the jobs
run on ``capped.sh``'s emulated hosts, one rank each) the step against DDP's and against its floor,
max(compute-only step, bytes / link rate): the compute-only step is a DDP step whose hook sends
nothing (``compute``). Results: ``OUT/scale.json`` and ``OUT/scale.png``.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the issue's memory targets, bytes per parameter over the reference (n: ranks)
HOOK_TARGET = "4 + 4/n + 1"
OPT_TARGET, DILOCO_TARGET, FIXED_TARGET_MB = 8.0, 12.0, 400.0
FLOOR_TARGET = 1.15
TOKENS, CNN_BATCH = 64, 4


def _methods(names: str) -> list[str]:
    import gradcomp

    every = ["ddp", *sorted(gradcomp.REGISTRY), "opt:onebitadam", "opt:dgc", "fsdp", "fsdp:int8", "diloco"]
    return every if names == "all" else ["ddp", *[n for n in names.split(",") if n != "ddp"]]


# -- the worker: one job, every rank -------------------------------------------------------------
def _gpt2(layers: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_layer=layers, n_positions=TOKENS)), "lm"


def _resnet(eighths: int):
    """A ResNet-50 (bottleneck blocks 3-4-6-3) with its widths times ``eighths / 8``."""
    import torch
    from torch import nn

    def width(c: int) -> int:
        return max(8, c * eighths // 8)

    class Bottleneck(nn.Module):
        def __init__(self, cin: int, mid: int, stride: int):
            super().__init__()
            out = 4 * mid
            self.body = nn.Sequential(nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                      nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU(),
                                      nn.Conv2d(mid, out, 1, bias=False), nn.BatchNorm2d(out))
            self.skip = (nn.Sequential(nn.Conv2d(cin, out, 1, stride, bias=False), nn.BatchNorm2d(out))
                         if stride != 1 or cin != out else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers: list[nn.Module] = [nn.Conv2d(3, width(64), 3, 1, 1, bias=False), nn.BatchNorm2d(width(64)), nn.ReLU()]
    cin = width(64)
    for i, (blocks, mid) in enumerate(((3, 64), (4, 128), (6, 256), (3, 512))):
        for b in range(blocks):
            layers.append(Bottleneck(cin, width(mid), 2 if b == 0 and i else 1))
            cin = 4 * width(mid)
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, 1000)]
    return nn.Sequential(*layers), "cnn"


def _batch(kind: str, step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + rank)
    if kind == "lm":
        x = torch.randint(0, 50257, (1, TOKENS), generator=g)
        return x, x
    return torch.randn(CNN_BATCH, 3, 32, 32, generator=g), torch.randint(0, 1000, (CNN_BATCH,), generator=g)


def _loss(kind: str, model, x, y):
    import torch

    if kind == "lm":
        return model(input_ids=x, labels=y).loss
    return torch.nn.functional.cross_entropy(model(x), y)


def worker(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    torch.set_num_threads(1)
    import gradcomp
    import gradcomp.torch as gt
    from torch.nn.parallel import DistributedDataParallel

    launch = gt.init_process_group()
    torch.manual_seed(0)
    net, kind = _gpt2(args.size) if args.model == "gpt2" else _resnet(args.size)
    params = sum(p.numel() for p in net.parameters())
    method, holder, diloco = args.method, None, None
    if method.startswith("fsdp"):
        from torch.distributed.fsdp import fully_shard

        for block in (net.transformer.h if kind == "lm" else [m for m in net if len(list(m.parameters()))]):
            fully_shard(block)
        fully_shard(net)
        model = net
        if ":" in method:
            holder = gt.register(net, method.split(":", 1)[1])
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    elif method == "diloco":
        model = net
        inner = torch.optim.AdamW(net.parameters(), lr=1e-4)
        diloco = gt.DiLoCo(net, inner, sync_every=4)
        holder, opt = diloco, inner
    else:
        model = DistributedDataParallel(net, bucket_cap_mb=25, gradient_as_bucket_view=True)
        if method == "opt:onebitadam":
            # frozen halfway, so that the peak covers both phases
            opt = gt.OneBitAdam(model.parameters(), lr=1e-4, model=model, warmup=max(1, args.steps // 2))
            holder = opt
        elif method == "opt:dgc":
            opt = gt.DGC(model.parameters(), lr=1e-3, model=model)
            holder = opt
        else:
            if method == "compute":
                model.register_comm_hook(None, gt.local_hook)
            elif method != "ddp":
                holder = gt.register(model, gradcomp.make(method))
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, cpu = [], []  # wall clock, and this process's CPU time (every thread)
    for step in range(args.steps):
        x, y = _batch(kind, step, launch.rank)
        start, start_cpu = time.perf_counter(), time.process_time()
        _loss(kind, model, x, y).backward()
        (diloco or opt).step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    stats = {**_stats(holder), **_kept(net, method, holder)}
    peak = np.array([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024], np.float64)
    everyone = [torch.zeros(1, dtype=torch.float64) for _ in range(launch.size)]
    torch.distributed.all_gather(everyone, torch.from_numpy(peak))
    if launch.rank == 0:
        timed = times[args.warmup:] or times
        stats["cpu_s"] = statistics.median(cpu[args.warmup:] or cpu)
        row = dict(model=args.model, size=args.size, method=method, params=params, ranks=launch.size,
                   steps=args.steps, step_s=statistics.median(timed), peak_rss_mb=[float(t) for t in everyone],
                   network=os.environ.get("GRADCOMP_NETWORK", ""), **stats)
        Path(args.out).write_text(json.dumps(row))
        print(json.dumps(row), flush=True)


def _stats(holder) -> dict:
    """Bytes sent per step and rank and the governor's audit share, from ``stats()``."""
    if holder is None:
        return {}
    s = holder.compressor.stats() if hasattr(holder, "compressor") and hasattr(holder.compressor, "stats") \
        else holder.stats()
    steps = max(int(s.get("steps", 0) or s.get("optimizer_step", 0) or 1), 1)
    out = {"bytes_per_step": float(s.get("bytes_sent", 0.0)) / steps}
    gov = s.get("governor")
    if gov:
        out["audit_share"] = float(gov.get("audit_share", 0.0))
        out["rungs"] = {rung: sum(1 for v in gov["levels"].values() if v == rung) for rung in ("method", "int4", "int8")}
    return out


def _kept(net, method: str, holder) -> dict:
    """What gradcomp keeps between steps (``benchmarks.held``): MB in all and its five largest
    kinds, leaving out the model's tensors, the inner optimizer's state and ``OneBitAdam``'s m
    and v (AdamW's own)."""
    from gradcomp.torch.communicator import default_comm

    from .held import kept

    own = [*net.parameters(), *(p.grad for p in net.parameters() if p.grad is not None)]
    if method == "opt:onebitadam":
        own += [*holder.method_state.m, *holder.method_state.v]
    held = kept({"gradcomp": holder, "comm": default_comm()}, own)
    largest = sorted(held.items(), key=lambda kv: -kv[1])[:5]
    return {"kept_mb": sum(held.values()) / 2**20, "kept_by": {k: v / 2**20 for k, v in largest}}


# -- the driver ----------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> list[dict]:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    methods = _methods(args.names) + (["compute"] if args.network else [])
    for model in args.models.split(","):
        sizes = [int(s) for s in (args.sizes or ("6,12" if model == "gpt2" else "6,8")).split(",")]
        for size in sizes:
            for method in methods:
                path = out / f"{model}-{size}-{method.replace(':', '_')}{'-' + args.network if args.network else ''}.json"
                if not path.exists() or args.rerun:
                    _launch(args, model, size, method, path)
                if path.exists():
                    rows.append(json.loads(path.read_text()))
    (out / "scale.json").write_text(json.dumps(rows, indent=1))
    print(summary(rows))
    if args.plots:
        print("figure:", plot(rows, out / "scale.png"))
    return rows


def _launch(args: argparse.Namespace, model: str, size: int, method: str, path: Path) -> None:
    worker_args = ["-m", "benchmarks.scale", "--worker", "--model", model, "--size", str(size), "--method", method,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(path.resolve())]
    python = sys.executable
    if args.network:
        cmd = [str(ROOT / "benchmarks" / "capped.sh"), args.network, str(args.ranks), python, *worker_args]
    else:
        mpiexec = str(Path(python).parent / "mpiexec")
        cmd = [mpiexec, "-n", str(args.ranks), python, *worker_args]
    print(f"== {model} {size} {method}", flush=True)
    done = subprocess.run(cmd, cwd=ROOT, timeout=args.timeout, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"   failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}", flush=True)


def _slopes(rows: list[dict], kept: bool = False) -> dict[tuple[str, str], tuple[float, float]]:
    """(model, method) -> (bytes per parameter over the reference, fixed MB over it), from the
    rank-largest peak at the two sizes (``kept``: from what gradcomp keeps, ``benchmarks.held``)."""
    by = {(r["model"], r["size"], r["method"]):
          (r["params"], r.get("kept_mb", math.nan) if kept else max(r["peak_rss_mb"])) for r in rows}
    out = {}
    for model, _, method in by:
        ref = "fsdp" if method.startswith("fsdp:") else "ddp"
        sizes = sorted({s for m, s, x in by if m == model and x == method and (m, s, ref) in by})
        if len(sizes) < 2 or method == ref:
            continue
        (n0, a0), (n1, a1) = by[(model, sizes[0], method)], by[(model, sizes[-1], method)]
        (_, r0), (_, r1) = by[(model, sizes[0], ref)], by[(model, sizes[-1], ref)]
        per = ((a1 - r1) - (a0 - r0)) * 2**20 / (n1 - n0)
        out[(model, method)] = (per, (a1 - r1) - per * n1 / 2**20)
    return out


def target(method: str, ranks: int) -> float:
    if method == "diloco":
        return DILOCO_TARGET
    if method == "opt:onebitadam":
        return OPT_TARGET
    return 4 + 4 / ranks + 1


def rate(network: str) -> float:
    """Bytes per second of a tc rate ("1gbit", "500mbit", "1mbit"); NaN for none."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale_ in units.items():
        if network.endswith(unit):
            return float(network[:-len(unit)]) * scale_ / 8
    return math.nan


def sent(row: dict) -> float:
    """Bytes a rank sends per step: its stats', or DDP's ring allreduce of fp32 for DDP's own."""
    if row["method"] in ("ddp", "fsdp"):
        return 2 * (row["ranks"] - 1) / row["ranks"] * 4 * row["params"]
    return row.get("bytes_per_step", math.nan)


def summary(rows: list[dict]) -> str:
    """The table of every job and, with two sizes, the memory slopes against the targets. On a
    capped network (one rank per emulated host), each step against its floor: max(the
    compute-only step, the bytes a rank sends per step over the link's rate)."""
    lines = ["| model | size | method | params | peak RSS / rank (MB) | step (s) | x DDP | x floor | bytes/step/rank "
             "| audits | CPU over compute (s) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    ddp = {(r["model"], r["size"], r["network"]): r["step_s"] for r in rows if r["method"] == "ddp"}
    compute = {(r["model"], r["size"], r["network"]): r for r in rows if r["method"] == "compute"}
    for r in rows:
        where = (r["model"], r["size"], r["network"])
        base, bare = ddp.get(where), compute.get(where, {})
        floor = max(bare.get("step_s", math.nan), sent(r) / rate(r["network"]))
        # (one core a rank on capped.sh's hosts: CPU the method adds cannot hide behind the backward)
        added = r.get("cpu_s", math.nan) - bare.get("cpu_s", math.nan)
        lines.append(f"| {r['model']} | {r['size']} | {r['method']} | {r['params'] / 1e6:.1f}M | "
                     f"{max(r['peak_rss_mb']):,.0f} | {r['step_s']:.2f} | {r['step_s'] / base if base else math.nan:.2f} | "
                     f"{r['step_s'] / floor:.2f} | {sent(r) / 1e6:.1f} MB | {r.get('audit_share', math.nan):.1%} | "
                     f"{added:.2f} |")
    slopes, kept = _slopes(rows), _slopes(rows, kept=True)
    if slopes:
        ranks = rows[0]["ranks"]
        lines += ["", "| model | method | added bytes / parameter | kept by gradcomp | target | fixed MB |",
                  "|---|---|---|---|---|---|"]
        for (model, method), (per, fixed) in sorted(slopes.items()):
            t = target(method, ranks)
            mark = "" if per <= t and fixed <= FIXED_TARGET_MB else " (over)"
            held = kept.get((model, method), (math.nan, math.nan))[0]
            lines.append(f"| {model} | {method} | {per:.1f} | {held:.1f} | {t:g} | {fixed:.0f}{mark} |")
        over = [(k, per - target(k[1], ranks), fixed) for k, (per, fixed) in sorted(slopes.items())
                if per > target(k[1], ranks) or fixed > FIXED_TARGET_MB]
        for (model, method), by, fixed in over:
            parts = ", ".join(f"{path} {v:.1f}" for path, v in _kept_parts(rows, model, method))
            lines.append(f"- {model} `{method}`: {max(by, 0):.1f} bytes a parameter over its target, fixed part "
                         f"{fixed:.0f} MB; what gradcomp keeps, bytes a parameter: {parts or 'nothing'}")
    return "\n".join(lines)


def _kept_parts(rows: list[dict], model: str, method: str) -> list[tuple[str, float]]:
    """What gradcomp keeps, by where it is kept (``kept_by``), in bytes a parameter between the
    two sizes: where the memory a target misses sits."""
    mine = sorted((r for r in rows if r["model"] == model and r["method"] == method), key=lambda r: r["params"])
    if len(mine) < 2:
        return []
    small, large = mine[0], mine[-1]
    paths = set(small.get("kept_by", {})) & set(large.get("kept_by", {}))
    per = {p: (large["kept_by"][p] - small["kept_by"][p]) * 2**20 / (large["params"] - small["params"]) for p in paths}
    return [(p.removeprefix("gradcomp."), v) for p, v in sorted(per.items(), key=lambda kv: -kv[1]) if abs(v) >= 0.05]


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slopes, kept = _slopes(rows), _slopes(rows, kept=True)
    models = sorted({m for m, _ in slopes}) or sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(2, len(models), figsize=(7 * len(models), 8), squeeze=False)
    for j, model in enumerate(models):
        mine = sorted((meth, v) for (m, meth), v in slopes.items() if m == model)
        ax = axes[0][j]
        ax.barh([m for m, _ in mine], [v[0] for _, v in mine], color="tab:blue")
        for y, (meth, _) in enumerate(mine):
            ax.plot([target(meth, rows[0]["ranks"])] * 2, [y - 0.4, y + 0.4], color="tab:red")
            ax.plot([kept.get((model, meth), (math.nan,))[0]], [y], "k|", markersize=14)
        ax.set_title(f"{model}: added bytes a parameter (bars: peak RSS; black: kept; red: target)")
        big = max((r["size"] for r in rows if r["model"] == model), default=0)
        steps = sorted((r["method"], r["step_s"]) for r in rows if r["model"] == model and r["size"] == big)
        ax = axes[1][j]
        ax.barh([m for m, _ in steps], [s for _, s in steps], color="tab:green")
        ax.set_title(f"{model} (size {big}): median step, s")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,cnn", help="comma-separated: gpt2, cnn (default: %(default)s)")
    p.add_argument("--sizes", default=None, help="comma-separated sizes (gpt2: layers, default 6,12; cnn: "
                                                 "widths in eighths, default 6,8); the slope needs two")
    p.add_argument("--names", default="all", help="comma-separated methods (default: all; ddp always runs)")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4, help="steps left out of the median step")
    p.add_argument("--network", default="", help="a tc rate (1gbit): run on capped.sh's emulated hosts (root)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds per job")
    p.add_argument("--out", default="results/scale")
    p.add_argument("--rerun", action="store_true", help="run again where a result exists")
    p.add_argument("--plots", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker:
        worker(args)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
