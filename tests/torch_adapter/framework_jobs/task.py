"""The small task every framework job trains: sklearn's digits (8x8 images, 10 classes) with a
two-layer MLP. The same data and initial weights on every rank and in every run, so a run with a
compressor and one without differ only by the compression."""
from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn

BATCH = 32       # samples per rank per step
LR = 0.05


def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, validation x, validation y): flat pixels in [0, 1], a fixed 80/20 split."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data / 16.0, dtype=torch.float32)
    y = torch.tensor(data.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    val, train = order[:360], order[360:]
    return x[train], y[train], x[val], y[val]


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def val_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return float(nn.functional.cross_entropy(model(x), y))


def flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def report(**values) -> None:
    """One line the test reads (rank 0 only; the ranks share a pipe)."""
    print("RESULT " + json.dumps(values), flush=True)


def governor_of(stats: dict) -> dict:
    """A governed compressor's decisions and budget, as the logging jobs report them."""
    return {"decisions": stats["governor"]["decisions"], "limit": stats["governor"]["limit"]}


def leave() -> None:
    """Every rank done: out past torch 2.13's gloo teardown, which aborts now and then
    (tests.mpi_launch)."""
    import torch

    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


def same_state(a: dict, b: dict) -> bool:
    """Two HookState.state_dict() outputs hold the same values."""
    if a.keys() != b.keys():
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, dict) and isinstance(y, dict):
            if not same_state(x, y):
                return False
        elif isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
