"""Local steps (gradcomp.torch.DiLoCo) against every-step averaging on examples/torch_lm.py's LM.

    mpiexec -n 4 .venv/bin/python benchmarks/scripts/diloco_lm.py --mode ddp --steps 300 --json ddp.json
    mpiexec -n 4 .venv/bin/python benchmarks/scripts/diloco_lm.py --mode diloco --sync-every 20 \\
        --outer-lr 1.0 --outer-momentum 0 --compressor int8 --steps 300 --json h20.json

The model, corpus, batches (seeded by step and rank), AdamW and its schedule are torch_lm.py's;
``--mode ddp`` averages the gradients exactly at every step (a ``GradientReducer`` with
``Allreduce`` over MPI: DDP's arithmetic without torch.distributed), ``--mode diloco`` steps each
rank's AdamW locally and runs DiLoCo's outer step every ``--sync-every`` steps. Validation loss is
torch_lm.py's (nats per byte on fixed windows), taken at outer steps, where the replicas agree;
each point of ``val_curve`` is ``[step, loss, training seconds]`` (validation time left out).
What docs/guides/local-steps.md's table was measured with.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # examples/ (the checkout)

import gradcomp
import gradcomp.torch as gt
from examples.torch_lm import TinyLM, model_arguments, rate_factor, stdlib_corpus, weights_digest, windows
from gradcomp.torch.tensors import as_array


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ddp", "diloco"), default="diloco")
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--outer-lr", type=float, help="default: the exchange's (DiLoCo's 0.7; sparseloco's 1)")
    p.add_argument("--outer-momentum", type=float, help="default: the exchange's (DiLoCo's 0.5; sparseloco's 0)")
    p.add_argument("--nesterov", type=int, default=1)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0, help="inner steps an outer exchange runs behind")
    p.add_argument("--keep-local", action="store_true",
                   help="landing keeps the overlapped steps' progress (evaluated: the synced model)")
    p.add_argument("--compressor", default="int8")
    p.add_argument("--budget", type=lambda v: None if v.lower() == "none" else float(v),
                   default=gradcomp.optim.GOVERNOR_BUDGET,
                   help="the exchange's governor (none: off; int8 and exact exchanges are never governed)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--decay-steps", type=int, help="the steps the cosine decays over (default: --steps); "
                   "longer leaves the rate higher at the end")
    model_arguments(p)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--corpus-mb", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json")
    p.add_argument("--stop-at", type=float, help="end the run at the first evaluation at or below this "
                   "validation loss (time to quality: the rest of the run is not needed)")
    return p.parse_args(argv)


def validation_loss(model, val, starts, context, comm) -> float:
    total = np.zeros(1)
    mine = starts[comm.rank::comm.size]
    with torch.no_grad():
        for i in range(0, len(mine), 32):
            x, y = windows(val, mine[i:i + 32], context)
            total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").double().item()
    return float(comm.allgather(total).sum()) / (len(starts) * context)


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(1)
    comm = gradcomp.MPICommunicator()
    train_text, val_text = stdlib_corpus(args.corpus_mb * 1e6)
    val_starts = torch.randint(0, len(val_text) - args.context - 1, (args.val_windows,),
                               generator=torch.Generator().manual_seed(12345))
    torch.manual_seed(args.seed)
    model = TinyLM(args.layers, args.d_model, args.heads, args.context)
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: rate_factor(s, args.warmup, args.decay_steps or args.steps))
    if args.mode == "diloco":
        spec = args.compressor
        outer = gt.DiLoCo(model, opt, sync_every=args.sync_every, compressor=spec, lr=args.outer_lr,
                          momentum=args.outer_momentum, nesterov=bool(args.nesterov),
                          fragments=args.fragments, overlap=args.overlap, comm=comm, budget=args.budget,
                          keep_local=args.keep_local)
    else:
        grads = [torch.zeros_like(p) for p in model.parameters()]
        reducer = gradcomp.GradientReducer([as_array(g) for g in grads], gradcomp.Allreduce(), comm)
    curve = []
    start = time.perf_counter()
    evaluating = 0.0  # seconds spent on validation, left out of the training time
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + comm.rank)
        starts = torch.randint(0, len(train_text) - args.context - 1, (args.batch_size,), generator=gen)
        x, y = windows(train_text, starts, args.context)
        opt.zero_grad(set_to_none=False)
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if args.mode == "ddp":
            for g, p in zip(grads, model.parameters()):
                g.copy_(p.grad)
            reducer.step()
            for g, p in zip(grads, model.parameters()):
                p.grad.copy_(g)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # of the local gradients under DiLoCo
        if args.mode == "diloco":
            outer.step()
        else:
            opt.step()
        sched.step()
        landed = step + 1 - (args.overlap if args.mode == "diloco" else 0)  # the outer step landing now
        if landed > 0 and landed % args.eval_every == 0 or step + 1 == args.steps:
            if args.mode == "diloco":
                if step + 1 == args.steps and (args.fragments > 1 or args.overlap):
                    outer.sync_now()  # streaming: every fragment synced once more at the end
                elif args.fragments > 1 or landed % args.sync_every:
                    continue  # the replicas differ between outer steps (some fragment always does)
            before = time.perf_counter()
            training = before - start - evaluating
            if args.mode == "diloco" and args.keep_local and step + 1 < args.steps:
                with outer.synced():  # the replicas differ by their steps since the last sync
                    loss = validation_loss(model, val_text, val_starts, args.context, comm)
            else:
                loss = validation_loss(model, val_text, val_starts, args.context, comm)
            evaluating += time.perf_counter() - before
            curve.append([step + 1, loss, training])
            if comm.rank == 0:
                print(f"step {step + 1:5d}  val {loss:.4f}  {curve[-1][2]:6.1f} s training", flush=True)
            if args.stop_at is not None and loss <= args.stop_at:
                break
    digests = comm.allgather(np.frombuffer(bytes.fromhex(weights_digest(model))[:8], np.int64).copy())
    result = dict(vars(args), val_curve=curve, final_val_loss=curve[-1][1],
                  weights_identical=bool((digests == digests[0]).all()), ranks=comm.size,
                  seconds=time.perf_counter() - start)
    if args.mode == "diloco":
        stats = outer.stats()
        result["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str))}
        if "fit" in stats:  # compressor="auto": what it chose and why
            result["fit"] = stats["fit"]
        if "governor" in stats:
            result["governor"] = {k: stats["governor"][k] for k in ("tensor_steps", "decisions", "audit_share")}
    if comm.rank == 0:
        print(json.dumps({k: v for k, v in result.items() if k != "val_curve"}), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
