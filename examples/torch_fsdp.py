"""The byte-level transformer LM of ``torch_lm.py``, trained with FSDP2 (``fully_shard``), its
gradient reduce-scatters compressed by gradcomp.

    torchrun --standalone --nproc_per_node 2 examples/torch_fsdp.py --compressor int8
    mpiexec -n 4 .venv/bin/python examples/torch_fsdp.py --compressor int8 --json fsdp.json
    mpiexec -n 4 .venv/bin/python examples/torch_fsdp.py --compressor none     # FSDP's own reduce-scatter
    mpiexec -n 4 .venv/bin/python examples/torch_fsdp.py --compressor int8 --all-gather int8  # and int8 weights

Each transformer block is an FSDP module, and so is the root (embeddings, final norm, head): FSDP
reduce-scatters each module's gradients once per step, and ``gradcomp.torch.register(model,
NAME)`` puts gradcomp's reduce-scatter form of NAME in its place. ``--save``/``--load`` checkpoint
FSDP's model and optimizer state dicts together with gradcomp's (per rank), so a resumed run
continues bit for bit: ``--steps 200 --save ck`` then ``--steps 200 --load ck --first-step 200``
ends where one 400-step run ends (with ``--schedule-steps 400`` on both halves).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch_lm import TinyLM, stdlib_corpus, train_step, validation_loss

import gradcomp
import gradcomp.torch as gt
from gradcomp.registry import compressor_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="int8", type=compressor_spec,
                   help="a registry name with a reduce-scatter form, or none (FSDP's own reduce-scatter)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--first-step", type=int, default=0, help="the step a --load run starts at")
    p.add_argument("--schedule-steps", type=int, help="length of the learning-rate schedule (default --steps)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear learning-rate warm-up steps")
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--corpus-mb", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mesh", choices=("world", "local"), default="world",
                   help="shard over every rank (world), or inside each host and compress across hosts "
                        "(local: hosts from GRADCOMP_RANKS_PER_HOST or torchrun's LOCAL_WORLD_SIZE; with "
                        "--compressor none, FSDP's own HSDP on the (hosts, local) mesh)")
    p.add_argument("--all-gather", metavar="CODES",
                   help="also send FSDP's parameter all-gathers in chunk codes: int8 or int4 (ZeRO++'s qwZ; "
                        "register(..., all_gather=CODES)); needs a --compressor other than none")
    p.add_argument("--allow-partial", action="store_true",
                   help="run a method that sends part of each gradient (onebit, topk), refused by default")
    p.add_argument("--save", metavar="PREFIX", help="checkpoint here at the end (PREFIX.rankN.pt)")
    p.add_argument("--load", metavar="PREFIX", help="resume from a --save checkpoint")
    p.add_argument("--json", metavar="PATH", help="write a summary here (rank 0)")
    return p.parse_args(argv)


def build(args, device, size):
    """TinyLM with each block and the root as FSDP modules (sharded over ``--mesh``)."""
    # FSDP2 warns when a module returns a view (the head's output); this loop does nothing in place on it
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.manual_seed(args.seed)
    model = TinyLM(args.layers, args.d_model, args.heads, args.context).to(device)
    mesh = None
    if args.mesh == "local":
        per_host = int(os.environ.get("GRADCOMP_RANKS_PER_HOST") or os.environ.get("LOCAL_WORLD_SIZE") or size)
        mesh = init_device_mesh(device.type, (size // per_host, per_host), mesh_dim_names=("host", "local"))
        # gradcomp averages across hosts itself; FSDP's own counterpart (none) is HSDP on the 2-D mesh
        mesh = mesh if args.compressor == "none" else mesh["local"]
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(args) -> dict:
    torch.set_num_threads(1)
    launch = gt.init_process_group()
    rank, size, device = launch.rank, launch.size, launch.device
    train_text, val_text = (t.to(device) for t in stdlib_corpus(args.corpus_mb * 1e6))
    val_starts = torch.randint(0, len(val_text) - args.context - 1, (args.val_windows,),
                               generator=torch.Generator().manual_seed(12345))
    model = build(args, device, size)
    if args.compressor == "none" and args.all_gather:
        raise SystemExit("--all-gather needs a --compressor (allreduce: FSDP's exact mean through gradcomp)")
    state = None if args.compressor == "none" else gt.register(model, gradcomp.make(args.compressor),
                                                                   allow_partial=args.allow_partial,
                                                                   all_gather=args.all_gather)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    total = args.schedule_steps or args.steps
    schedule = lambda s: (s + 1) / args.warmup if s < args.warmup else \
        0.1 + 0.45 * (1 + math.cos(math.pi * (s - args.warmup) / max(total - args.warmup, 1)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    if args.load:
        saved = torch.load(f"{args.load}.rank{rank}.pt", weights_only=True)
        set_state_dict(model, opt, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
        sched.load_state_dict(saved["schedule"])
        if state is not None:
            state.load_state_dict(saved["gradcomp"])
    curve, step_seconds = [], []
    start, eval_seconds = time.perf_counter(), 0.0
    for step in range(args.first_step, args.first_step + args.steps):
        began = time.perf_counter()
        train_step(model, opt, sched, train_text, args, step, rank)
        step_seconds.append(time.perf_counter() - began)
        last = step + 1 == args.first_step + args.steps
        if (step + 1) % args.eval_every == 0 or last:
            t = time.perf_counter()
            with exact(state):  # the trained weights, not their all-gather codes (--all-gather)
                val = validation_loss(model, val_text, val_starts, args.context, rank, size)
            eval_seconds += time.perf_counter() - t
            curve.append([step + 1, val])
            if rank == 0:
                print(f"step {step + 1:5d}  val {val:.4f}  {time.perf_counter() - start:6.1f} s", flush=True)
    seconds = time.perf_counter() - start - eval_seconds
    if args.save:
        msd, osd = get_state_dict(model, opt)
        torch.save({"model": msd, "optim": osd, "schedule": sched.state_dict(),
                    "gradcomp": state.state_dict() if state is not None else None},
                   f"{args.save}.rank{rank}.pt")
    stats = state.compressor.stats() if state is not None else {}
    gathered = state.all_gather_stats() if state is not None else None
    timed = sorted(step_seconds[min(5, len(step_seconds) - 1):])  # past the first steps' allocations
    return dict(compressor=args.compressor, ranks=size, steps=args.steps, final_val_loss=curve[-1][1],
                val_curve=curve, seconds=seconds, step_ms_median=1e3 * timed[len(timed) // 2], bytes_sent_per_step=stats.get("bytes_sent_per_step"),
                compression_ratio=stats.get("compression_ratio"), all_gather=args.all_gather,
                all_gather_ratio=gathered and gathered["compression_ratio"])


def exact(state):
    """FSDP's own all-gather for evaluation where gradcomp's codes carry it in training."""
    return state.exact_all_gather() if state is not None else contextlib.nullcontext()


def main(argv=None):
    args = parse_args(argv)
    result = train(args)
    if dist.get_rank() == 0:
        ratio = result["compression_ratio"]
        extra = f", {ratio:.2f}x fewer bytes than FSDP's reduce-scatter" if ratio else ""
        if result["all_gather_ratio"]:
            extra += f", {result['all_gather_ratio']:.2f}x fewer than its parameter all-gathers"
        print(f"{result['compressor']} under FSDP2 on {result['ranks']} ranks: val loss "
              f"{result['final_val_loss']:.4f} after {result['steps']} steps, {result['seconds']:.1f} s "
              f"(median step {result['step_ms_median']:.0f} ms){extra}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
