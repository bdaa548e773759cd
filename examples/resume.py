"""Checkpoint and resume a DDP run with a stateful compressor, exactly.

    mpiexec -n 2 .venv/bin/python examples/resume.py          # or: torchrun --nproc_per_node 2 ...

Trains the digits CNN with PowerSGD (error feedback and warm start: state that a resume must not
lose) for 2 x STEPS steps straight, then again with a checkpoint after STEPS: the model, the
optimizer and the compressor (``HookState.state_dict()``: tensors and plain values) go through
``torch.save``, a fresh model is built, and ``torch.load(..., weights_only=True)`` restores all
three. The compressor keeps its state per parameter name, so the fresh DDP model's different first
buckets do not matter (a code over a bucket's chunks, ``--compressor int8``, also needs the saved
bucket layouts, which the hook state keeps). Rank 0 prints how far the resumed run ends from the
straight one.
"""
from __future__ import annotations

import argparse
import io

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gradcomp
import gradcomp.torch as gt
from torch_ddp import DigitsCNN, digits, global_batches  # beside this script


def build(launch, spec):
    torch.manual_seed(0)
    model = DistributedDataParallel(DigitsCNN().to(launch.device), bucket_cap_mb=0.05,
                                    gradient_as_bucket_view=True)
    state = gt.register(model, gradcomp.make(spec))
    return model, state, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def train(model, opt, launch, data, steps, first=0):
    x, y = data
    batches = [idx for epoch in range(100) for idx in global_batches(len(y), 32, launch.rank, launch.size, epoch)]
    for idx in batches[first:first + steps]:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx].to(launch.device)), y[idx].to(launch.device)).backward()
        opt.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="powersgd:rank=2,start_iter=5")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    launch = gt.init_process_group()
    x, y, _, _ = digits()

    model, state, opt = build(launch, args.compressor)
    train(model, opt, launch, (x, y), 2 * args.steps)
    straight = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    model, state, opt = build(launch, args.compressor)
    train(model, opt, launch, (x, y), args.steps)
    checkpoint = io.BytesIO()  # a file on disk in real use
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(),
                "compressor": state.state_dict()}, checkpoint)

    checkpoint.seek(0)
    saved = torch.load(checkpoint, weights_only=True)
    model, state, opt = build(launch, args.compressor)  # a fresh process would start here
    model.module.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    state.load_state_dict(saved["compressor"])
    train(model, opt, launch, (x, y), args.steps, first=args.steps)
    resumed = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if launch.rank == 0:
        print(f"{args.compressor}: resumed run vs straight run, max |difference| = "
              f"{(resumed - straight).abs().max().item():.3g} after {2 * args.steps} steps", flush=True)


if __name__ == "__main__":
    main()
