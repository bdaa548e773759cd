"""Local steps with DiLoCo: each rank trains alone, and every H steps the ranks meet.

    mpiexec -n 4 .venv/bin/python examples/diloco.py --sync-every 20 --compressor int8
    torchrun --nproc_per_node 4 examples/diloco.py

The digits CNN of ``examples/torch_ddp.py``, not wrapped in DistributedDataParallel: each rank
steps its own replica with its own AdamW on its share of each batch, and ``gt.DiLoCo`` averages the
ranks' pseudo-gradients (parameters at the last sync minus now) through ``--compressor`` every
``--sync-every`` steps, then takes the outer (Nesterov) step. After each outer step every rank
holds the same bits; rank 0 prints the test accuracy, the bytes against DDP's and whether the
replicas agree. When local steps pay (a slow link only): docs/guides/local-steps.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import gradcomp.torch as gt
from torch_ddp import DigitsCNN, accuracy, digits, global_batches  # beside this script


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sync-every", type=int, default=20, help="inner steps between outer steps (H)")
    p.add_argument("--compressor", default="int8", help="the pseudo-gradients' exchange (a registry name)")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3, help="the inner AdamW's")
    p.add_argument("--json", metavar="PATH", help="write a summary here (rank 0)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    launch = gt.init_process_group()
    x, y, x_test, y_test = digits()
    torch.manual_seed(launch.rank)  # different starts on purpose: DiLoCo broadcasts rank 0's
    model = DigitsCNN().to(launch.device)
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr)
    diloco = gt.DiLoCo(model, inner, sync_every=args.sync_every, compressor=args.compressor)
    for epoch in range(args.epochs):
        for idx in global_batches(len(y), 32, launch.rank, launch.size, epoch):
            diloco.zero_grad()
            F.cross_entropy(model(x[idx].to(launch.device)), y[idx].to(launch.device)).backward()
            diloco.step()  # the inner step; every sync_every-th call the outer one too
    diloco.sync_now()  # one outer step at the end: every rank holds the same, averaged, model

    digest = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in model.parameters()))
    digests = diloco.comm.allgather(np.frombuffer(digest.digest(), dtype=np.uint8))
    stats = diloco.stats()
    result = dict(method=repr(diloco), ranks=launch.size, steps=stats["steps"], outer_steps=stats["outer_steps"],
                  test_accuracy=accuracy(model, x_test.to(launch.device), y_test.to(launch.device)),
                  bytes_sent=stats["bytes_sent"], compression_ratio=stats["compression_ratio"],
                  weights_identical=bool((digests == digests[0]).all()))
    if "governor" in stats:  # an exchange cheaper than int8: the rungs its governor ran
        result["governor_tensor_steps"] = stats["governor"]["tensor_steps"]
    if launch.rank == 0:
        print(f"{result['method']} on {launch.size} ranks: {result['steps']} inner steps, "
              f"{result['outer_steps']} outer; test accuracy {result['test_accuracy']:.2f}%; "
              f"{result['bytes_sent']:,.0f} bytes sent per rank, {result['compression_ratio']:.1f}x fewer than "
              f"DDP's fp32 allreduce at every step; weights identical on every rank: "
              f"{result['weights_identical']}", flush=True)
        if "governor_tensor_steps" in result:
            print(f"governed exchange: tensor outer steps per rung {result['governor_tensor_steps']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    if not result["weights_identical"]:
        raise SystemExit(f"rank {launch.rank}: weights differ across ranks after the last outer step")
    torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
