"""The zoo's workloads: a model, its data, the user's optimizer and learning rate, and a metric.

Every workload is what a user might train, not what the repository trains (its digits MLP and
CNN, its stdlib transformer LM). The learning rate of each was picked for *exact* averaging at 4
ranks (the global batch is 4 x ``batch``) from a short sweep, so that the reference trains well and
a method's gap is the method's, not the schedule's.

Halves (issue 57): constants and defaults are tuned on ``half="tuning"`` only; the figures that
README, docs and BENCHMARKS publish come from ``half="validation"``. Each half has an MLP, a CNN
and sequence models, under at least two optimizers.

Optimizers, as a user writes them (``build_optimizer``): ``sgd`` is ``torch.optim.SGD`` with
momentum 0.9 and weight decay on every parameter, under a cosine schedule to zero; ``adamw``
decays the matrices only; ``adam`` (no decay) and ``rmsprop`` as torch ships them. The Adam family
and RMSprop warm up linearly over the first 5% of steps and then follow a cosine to a tenth of
the peak.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import data as D
from . import models as M

FAMILIES = ("mlp", "cnn", "rnn", "transformer")
OPTIMIZERS = ("sgd", "adamw", "adam", "rmsprop")
HALVES = ("tuning", "validation")


@dataclass(frozen=True)
class Workload:
    """One task. ``metric``: ``"accuracy"`` (percent of held-out examples, or positions, right;
    the gap is in points) or ``"loss"`` (the held-out loss; the gap is in percent)."""

    name: str
    family: str
    optimizer: str
    half: str
    lr: float
    batch: int                      # examples (or sequences) per rank and step
    metric: str
    describe: str
    data: Callable[[], D.Data]
    model: Callable[[], nn.Module]
    loss: str = "ce"                # "ce": cross-entropy over the last axis; "mse"
    weight_decay: float = 0.0
    clip: float | None = None       # gradient-norm clipping, as the user's loop does it
    options: dict[str, Any] = field(default_factory=dict)  # more optimizer arguments (betas, ...)

    @property
    def classifier(self) -> bool:
        return self.metric == "accuracy"


WORKLOADS: list[Workload] = [
    # ---- tuning half --------------------------------------------------------------------------
    Workload("mlp-tabular", "mlp", "sgd", "tuning", lr=0.2, batch=32, metric="accuracy",
             describe="MLP 40-256-256-10 on make_classification (10 classes, 3 clusters each)",
             data=D.tabular_classes, model=lambda: M.MLP(40, 10, 256, 2), weight_decay=5e-4),
    Workload("cnn-shapes", "cnn", "sgd", "tuning", lr=0.1, batch=32, metric="accuracy",
             describe="3-conv CNN on noisy 16x16 synthetic shapes (8 classes)",
             data=D.shapes, model=lambda: M.ShapesCNN(8), weight_decay=5e-4),
    Workload("gru-markov", "rnn", "adamw", "tuning", lr=0.01, batch=16, metric="loss",
             describe="GRU LM (hidden 128) on an order-2 Markov chain over 16 symbols",
             data=D.markov, model=lambda: M.RecurrentLM(16, 32, 128, "gru"), weight_decay=0.05,
             clip=1.0, options=dict(betas=(0.9, 0.95))),
    Workload("tfm-sklearn", "transformer", "adamw", "tuning", lr=0.006, batch=8, metric="loss",
             describe="2-layer byte transformer LM (d 64, context 64) on scikit-learn's .py sources",
             data=D.sklearn_source, model=lambda: M.Transformer(256, 64, 64, 2, 4),
             weight_decay=0.1, clip=1.0, options=dict(betas=(0.9, 0.95))),
    Workload("mlp-friedman", "mlp", "adam", "tuning", lr=0.005, batch=32, metric="loss", loss="mse",
             describe="MLP 10-128-128-1 regression on make_friedman1 (held-out MSE)",
             data=D.friedman, model=lambda: M.MLP(10, 1, 128, 2)),
    # ---- validation half -----------------------------------------------------------------------
    Workload("mlp-shells", "mlp", "sgd", "validation", lr=0.1, batch=32, metric="accuracy",
             describe="MLP 10-256-256-6 on make_gaussian_quantiles (6 concentric shells)",
             data=D.gaussian_shells, model=lambda: M.MLP(10, 6, 256, 2), weight_decay=5e-4),
    Workload("cnn1d-waves", "cnn", "sgd", "validation", lr=0.2, batch=32, metric="accuracy",
             describe="1-D CNN with BatchNorm on noisy synthetic waveforms (8 classes)",
             data=D.waves, model=lambda: M.WaveCNN(8, 32), weight_decay=5e-4),
    Workload("lstm-majority", "rnn", "rmsprop", "validation", lr=0.005, batch=32, metric="accuracy",
             describe="LSTM classifier (hidden 96): the most frequent of 8 symbols in 24",
             data=D.majority, model=lambda: M.RecurrentClassifier(8, 8, 16, 96), clip=1.0),
    Workload("tfm-sort", "transformer", "adam", "validation", lr=0.002, batch=32, metric="accuracy",
             describe="2-layer transformer encoder (d 64) sorting 12 integers below 32 (per position)",
             data=D.sorting, model=lambda: M.Transformer(32, 12, 64, 2, 4, causal=False), clip=1.0),
    Workload("lstm-metadata", "rnn", "adamw", "validation", lr=0.01, batch=16, metric="loss",
             describe="LSTM byte LM (hidden 128) on the environment's METADATA files (prose)",
             data=D.package_metadata, model=lambda: M.RecurrentLM(256, 64, 128, "lstm"),
             weight_decay=0.05, clip=1.0, options=dict(betas=(0.9, 0.95))),
]

BY_NAME = {w.name: w for w in WORKLOADS}


def select(half: str = "all", names: list[str] | None = None) -> list[Workload]:
    """The workloads of ``half`` (``tuning``, ``validation`` or ``all``), or those named."""
    if names:
        unknown = [n for n in names if n not in BY_NAME]
        if unknown:
            raise SystemExit(f"unknown workload(s) {unknown}; known: {sorted(BY_NAME)}")
        return [BY_NAME[n] for n in names]
    return [w for w in WORKLOADS if half == "all" or w.half == half]


def param_groups(workload: Workload, net: nn.Module) -> list[dict]:
    """AdamW decays matrices only (the usual recipe); SGD decays every parameter; Adam and
    RMSprop do not decay."""
    params = [p for p in net.parameters() if p.requires_grad]
    if workload.optimizer == "adamw":
        return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": workload.weight_decay},
                {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return [{"params": params, "weight_decay": workload.weight_decay}]


def build_optimizer(workload: Workload, groups: list[dict]) -> torch.optim.Optimizer:
    """The user's own optimizer."""
    name, lr, opts = workload.optimizer, workload.lr, workload.options
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, **opts)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, **opts)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, **opts)
    if name == "rmsprop":
        return torch.optim.RMSprop(groups, lr=lr, **opts)
    raise ValueError(f"unknown optimizer {name!r}")


def schedule(workload: Workload, steps: int) -> Callable[[int], float]:
    """The multiplier of the peak learning rate at each step (for ``LambdaLR``)."""
    if workload.optimizer == "sgd":
        return lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    warm = max(steps // 20, 1)
    return lambda s: (s + 1) / warm if s < warm else \
        0.1 + 0.45 * (1 + math.cos(math.pi * min(s - warm, steps - warm) / max(steps - warm, 1)))


def loss_fn(workload: Workload, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if workload.loss == "mse":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@torch.no_grad()
def evaluate(workload: Workload, net: nn.Module, x: torch.Tensor, y: torch.Tensor,
             rank: int = 0, size: int = 1, chunk: int = 512) -> dict[str, float]:
    """Held-out loss and (classifiers) accuracy in percent; each rank takes every ``size``-th
    example and the sums are added over the ranks (float64), so every rank gets the same
    numbers."""
    was_training = net.training
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, right, elements
    xs, ys = x[rank::size], y[rank::size]
    for i in range(0, len(ys), chunk):
        out, target = net(xs[i:i + chunk]), ys[i:i + chunk]
        if workload.loss == "mse":
            sums[0] += F.mse_loss(out, target, reduction="sum").double()
            sums[2] += target.numel()
        else:
            flat, labels = out.reshape(-1, out.shape[-1]), target.reshape(-1)
            sums[0] += F.cross_entropy(flat, labels, reduction="sum").double()
            sums[1] += (flat.argmax(-1) == labels).sum().double()
            sums[2] += labels.numel()
    if size > 1:
        import torch.distributed as dist

        dist.all_reduce(sums)
    net.train(was_training)
    result = {"loss": sums[0].item() / sums[2].item()}
    if workload.classifier:
        result["accuracy"] = 100.0 * sums[1].item() / sums[2].item()
    return result


def metric_of(workload: Workload, evaluation: dict[str, float]) -> float:
    return evaluation["accuracy"] if workload.classifier else evaluation["loss"]


def gap(workload: Workload, value: float | None, reference: float | None) -> float | None:
    """Classifiers: points of accuracy, method minus reference (negative = worse). Loss
    workloads: percent, (method - reference) / reference * 100 (positive = worse)."""
    if value is None or reference is None or not (math.isfinite(value) and math.isfinite(reference)):
        return None
    if workload.classifier:
        return value - reference
    return (value - reference) / reference * 100.0


def badness(workload: Workload, g: float | None) -> float | None:
    """The gap with the sign that makes positive mean worse, in either unit (the heatmap's colour)."""
    if g is None:
        return None
    return -g if workload.classifier else g
