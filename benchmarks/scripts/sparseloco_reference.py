"""gradcomp's ``sparseloco`` exchange against SparseLoCo written out from its description, on a GRU
byte LM that no default was chosen on (BENCHMARKS.md section 12, "Outside the repo").

    mpiexec -n 4 .venv/bin/python benchmarks/scripts/sparseloco_reference.py --mode ddp --steps 1000
    mpiexec -n 4 .venv/bin/python benchmarks/scripts/sparseloco_reference.py --mode reference --steps 1000
    mpiexec -n 4 .venv/bin/python benchmarks/scripts/sparseloco_reference.py --mode diloco --steps 1000

The model: a 2-layer GRU (embedding 256 x 64, hidden 160, a linear head; 0.32M parameters) on
torch's own ``.py`` sources (every 10th file held out), AdamW (lr 3e-3, betas 0.9/0.95, weight
decay 0.01) with a linear warm-up over the first 10% of steps and a cosine to zero, 12 windows of
64 bytes per rank and step, gradients clipped to norm 1. ``--mode ddp`` averages the gradients
exactly every step. ``--mode reference`` runs, every ``--sync-every`` steps and per tensor:
``e = 0.95 e + (synced - local)``; per chunk of 4096 values (the last one padded with zeros) the
64 largest ``|e|``, each sent as +-0.5 or +-1.5 times the chunk's largest kept ``|e|`` / 1.5;
``e -= sent``; ``synced -= mean over ranks of sent``; ``local = synced`` (a dense allreduce of the
sparse messages: its bytes are counted as an allgather of them). ``--mode diloco`` is
``gradcomp.torch.DiLoCo(model, opt, compressor=--compressor)``. Prints the final validation loss
(nats per byte) and the bytes against DDP's fp32 allreduce.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

import gradcomp
import gradcomp.torch as gt

CONTEXT, BATCH, CHUNK, KEPT, BETA = 64, 12, 4096, 64, 0.95


class GRULM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.gru, self.head = nn.Embedding(256, 64), nn.GRU(64, 160, 2, batch_first=True), nn.Linear(160, 256)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(self.emb(x))[0])


def corpus(train_bytes: float = 4e6) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's ``.py`` files in sorted order: every 10th to validation, the rest to training."""
    root = Path(torch.__file__).parent
    train, val, n = [], [], 0
    for i, path in enumerate(sorted(root.rglob("*.py"), key=lambda q: q.relative_to(root).as_posix())):
        data = path.read_bytes() + b"\n"
        (val if i % 10 == 0 else train).append(data)
        n += len(data) if i % 10 else 0
        if n > train_bytes:
            break
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val)


def windows(text: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    w = text[starts[:, None] + torch.arange(CONTEXT + 1)]
    return w[:, :-1], w[:, 1:]


def reference_sent(e: torch.Tensor) -> torch.Tensor:
    """The issue's chunked top-k of ``e`` in 2 bits, as a dense tensor of what is sent."""
    flat = e.flatten()
    chunks = -(-flat.numel() // CHUNK)
    rows = torch.zeros(chunks * CHUNK)
    rows[:flat.numel()] = flat
    rows = rows.view(chunks, CHUNK)
    place = rows.abs().topk(KEPT, dim=1).indices
    values = rows.gather(1, place)
    scale = values.abs().max(dim=1, keepdim=True).values / 1.5
    coded = torch.where(values.abs() >= scale, 1.5, 0.5) * scale * values.sign()
    return torch.zeros_like(rows).scatter_(1, place, coded).flatten()[:flat.numel()].view_as(e)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("ddp", "reference", "diloco"), default="diloco")
    p.add_argument("--compressor", default="sparseloco")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    torch.set_num_threads(1)
    comm = gradcomp.MPICommunicator()
    world, rank, size = comm.comm, comm.rank, comm.size
    train, val = corpus()
    val_starts = torch.randint(0, len(val) - CONTEXT - 1, (384,), generator=torch.Generator().manual_seed(7))
    torch.manual_seed(1)
    model = GRULM()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
    warm = args.steps // 10
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * (s - warm) / (args.steps - warm))))
    if args.mode == "diloco":
        outer = gt.DiLoCo(model, opt, sync_every=args.sync_every, compressor=args.compressor, comm=comm, budget=None)
    synced = [q.detach().clone() for q in params]
    residual = [torch.zeros_like(q) for q in params]
    sent_bytes = 0.0
    start = time.perf_counter()
    for step in range(args.steps):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = windows(train, torch.randint(0, len(train) - CONTEXT - 1, (BATCH,), generator=g))
        opt.zero_grad()
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        if args.mode == "ddp":
            for q in params:
                world.Allreduce(MPI.IN_PLACE, q.grad.numpy())
                q.grad /= size
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        if args.mode == "diloco":
            outer.step()
        else:
            opt.step()
        if args.mode == "reference" and (step + 1) % args.sync_every == 0:
            for q, s, e in zip(params, synced, residual):
                e.mul_(BETA).add_(s - q.detach())
                sent = reference_sent(e)
                e.sub_(sent)
                total = sent.numpy().copy()
                world.Allreduce(MPI.IN_PLACE, total)
                s.sub_(torch.from_numpy(total) / size)
                q.data.copy_(s)
                sent_bytes += -(-e.numel() // CHUNK) * (4 + KEPT * (2 + 12) / 8)
        sched.step()
    if args.mode == "diloco" and args.steps % args.sync_every:
        outer.sync_now()
    mine = [vs for vs in val_starts[rank::size].split(32)]
    total = 0.0
    with torch.no_grad():
        for starts in mine:
            x, y = windows(val, starts)
            total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    loss = world.allreduce(total) / (len(val_starts) * CONTEXT)
    ddp_bytes = 4.0 * sum(q.numel() for q in params) * 2 * (size - 1) / size * args.steps
    ratio = {"ddp": 1.0, "diloco": outer.stats()["compression_ratio"] if args.mode == "diloco" else 0.0,
             "reference": ddp_bytes / (sent_bytes * (size - 1)) if sent_bytes else 0.0}[args.mode]
    result = dict(vars(args), final_val_loss=loss, compression_ratio=ratio, seconds=time.perf_counter() - start)
    if rank == 0:
        print(json.dumps(result), flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
