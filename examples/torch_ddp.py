"""A small CNN on scikit-learn's digits, trained with PyTorch DDP and a gradcomp compressor.

    mpiexec -n 4 .venv/bin/python examples/torch_ddp.py --compressor fp16

No torchrun: ``gradcomp.torch.init_process_group()`` starts torch.distributed from the MPI launch
(gloo on CPU, nccl on GPU), and ``gradcomp.torch.register`` plugs the compressor into DDP. Every
rank trains on its own shard of each global batch; rank 0 prints the final test accuracy.
``--compressor`` takes any name of ``gradcomp.REGISTRY``.
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.registry import compressor_spec
import gradcomp.torch as gt


class DigitsCNN(nn.Module):
    """Two 3x3 convolutions, a 2x2 max-pool and two linear layers: 8x8 images -> 10 classes."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def digits(test_fraction: float = 0.2, seed: int = 0):
    """(train images, train labels, test images, test labels) as tensors, pixels scaled to [0, 1].
    The split is the same on every rank (fixed seed)."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.images / 16.0, dtype=torch.float32).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return x[train], y[train], x[test], y[test]


def global_batches(n: int, per_rank: int, rank: int, size: int, epoch: int, seed: int = 0):
    """Index tensors of this rank's share of each global batch of one epoch (same shuffle on every
    rank, so the ranks' shares never overlap)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 100003 + epoch))
    step = per_rank * size
    for start in range(0, n - step + 1, step):
        yield order[start + rank * per_rank: start + (rank + 1) * per_rank]


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return 100.0 * (model(x).argmax(1) == y).float().mean().item()


def make_comm(kind: str):
    if kind == "mpi":
        return gradcomp.default_communicator()
    if kind == "torch":
        return gt.TorchCommunicator()
    return None  # gradcomp.torch.register picks (MPI under mpiexec)


def test_loss(model, x, y) -> float:
    with torch.no_grad():
        return F.cross_entropy(model(x), y).item()


def train(compressor: str, epochs: int = 30, per_rank_batch: int = 32, lr: float = 0.05,
          comm: str = "auto", bucket_cap_mb: float = 0.05, seed: int = 0, launch=None,
          optimizer: str = "sgd") -> dict:
    """Train; ``optimizer`` is ``sgd`` (torch's, momentum 0.9, gradients averaged by the hook) or
    gradcomp's ``dgc[:key=value,...]``, which communicates itself (``compressor`` is then unused)."""
    from gradcomp.registry import parse_spec

    launch = launch or gt.init_process_group()
    x_train, y_train, x_test, y_test = (t.to(launch.device) for t in digits(seed=seed))
    torch.manual_seed(seed)
    model = DistributedDataParallel(DigitsCNN().to(launch.device), bucket_cap_mb=bucket_cap_mb,
                                    gradient_as_bucket_view=True)
    name, options = parse_spec(optimizer)
    if name == "sgd":
        state = None if compressor == "none" else gt.register(model, gradcomp.make(compressor), make_comm(comm))
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, **options)
        # --compressor none: DDP's own fp32 allreduce, counted as an allreduce hook counts it
        # (``step``, read when called: the steps synced so far)
        stats = state.compressor.stats if state is not None else lambda: gt.plain_ddp_stats(model, step)
    elif name in ("dgc", "onebitadam"):
        state = None
        if name == "dgc":
            opt = gt.DGC(model.parameters(), lr=lr, momentum=0.9, model=model, comm=make_comm(comm),
                         bucket_cap_mb=bucket_cap_mb, **options)
        else:
            opt = gt.OneBitAdam(model.parameters(), lr=lr, model=model, comm=make_comm(comm),
                                bucket_cap_mb=bucket_cap_mb, **options)
        stats = opt.stats
    else:
        raise SystemExit(f"unknown optimizer {name!r} (sgd, dgc, onebitadam)")
    curve, late, start, step, evaluating = [], {}, time.perf_counter(), 0, 0.0
    for epoch in range(epochs):
        for idx in global_batches(len(y_train), per_rank_batch, launch.rank, launch.size, epoch, seed):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
            loss.backward()
            opt.step()
            step += 1
        if epoch == epochs * 3 // 4 - 1:
            late = dict(stats())
        model.eval()
        before = time.perf_counter()
        curve.append([step, test_loss(model, x_test, y_test), accuracy(model, x_test, y_test),
                      before - start - evaluating])  # training seconds: evaluations excluded
        evaluating += time.perf_counter() - before
        model.train()
    seconds = time.perf_counter() - start - evaluating
    model.eval()
    end = stats()
    sent = end["bytes_sent"] - late.get("bytes_sent", 0.0)
    reference = end["reference_bytes"] - late.get("reference_bytes", 0.0)
    return dict(compressor=compressor, optimizer=optimizer, ranks=launch.size, epochs=epochs, steps=step,
                loss=loss.item(), test_accuracy=accuracy(model, x_test, y_test), test_curve=curve,
                bytes_per_step=end["bytes_sent_per_step"],
                steady_bytes_per_step=sent / max(end["steps"] - late.get("steps", 0), 1),
                compression_ratio=reference / sent if sent else 1.0,
                seconds=seconds, comm=repr(state.comm if state is not None else getattr(
                    getattr(opt, "method_state", None), "comm", "torch.distributed (DDP's own allreduce)")))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compressor", default="allreduce", type=compressor_spec,
                        help="a registry name or name:key=value,... (e.g. powersgd:rank=4); none: DDP's own allreduce")
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--comm", default="auto", choices=["auto", "mpi", "torch"],
                        help="transport for the compressor (auto: MPI under mpiexec)")
    parser.add_argument("--bucket-cap-mb", type=float, default=0.05,
                        help="DDP bucket size (small, so the model spans several buckets)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--optimizer", default="sgd",
                        help="sgd (torch's, gradients averaged by --compressor) or gradcomp's dgc[:key=value,...]")
    parser.add_argument("--json", metavar="PATH", help="write the result here (rank 0)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result = train(args.compressor, args.epochs, args.batch_size, args.lr, args.comm,
                   args.bucket_cap_mb, args.seed, optimizer=args.optimizer)
    if torch.distributed.get_rank() == 0 and args.json:
        import json
        from pathlib import Path

        Path(args.json).write_text(json.dumps(result, indent=1))
    if torch.distributed.get_rank() == 0:
        exchange = (f"compressor={result['compressor']}" if result["optimizer"] == "sgd"
                    else f"optimizer={result['optimizer']} (its own exchange)")
        print(f"{exchange} ranks={result['ranks']} epochs={result['epochs']} "
              f"comm={result['comm']}\n"
              f"final loss {result['loss']:.4f}  test accuracy {result['test_accuracy']:.2f}%  "
              f"bytes/rank/step {result['bytes_per_step']:.0f}  "
              f"compression x{result['compression_ratio']:.2f}  train time {result['seconds']:.1f} s",
              flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
