"""A method spec -> what a user would build around their model and optimizer.

``none``
    DDP's own fp32 allreduce, no hook: the reference every other method is compared with.
a registry spec (``int8``, ``onebit``, ``topk:ratio=0.01``, ``powersgd``, ``auto``, ...)
    ``gt.register(DistributedDataParallel(net, gradient_as_bucket_view=True), gradcomp.make(spec))``;
    the user's optimizer and schedule unchanged.
``dgc[:key=value,...]``
    ``gt.DGC`` replaces the user's momentum SGD (same learning rate, momentum 0.9, weight decay
    and schedule); momentum-SGD workloads only.
``onebitadam[:key=value,...]``
    ``gt.OneBitAdam`` replaces the user's Adam or AdamW (same learning rate, betas, decoupled
    weight decay); Adam workloads only.
``diloco[:key=value,...]``
    ``gt.DiLoCo`` around the bare model and the user's own optimizer (its inner optimizer); any
    workload. The replicas are synced once more at the end (``sync_now``), before the final
    evaluation; evaluations before that average over the ranks' own replicas.

A method that does not apply to a workload's optimizer is skipped (``applies``), shown as n/a.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from .workloads import Workload, build_optimizer, param_groups

OPTIMIZER_METHODS = ("dgc", "onebitadam", "diloco")


@dataclass(frozen=True)
class Method:
    spec: str
    kind: str                 # "none", "hook", "dgc", "onebitadam", "diloco"
    options: dict[str, Any]


def parse(spec: str) -> Method:
    """Check a spec and split it: a typo fails here, before any job starts."""
    from gradcomp import REGISTRY
    from gradcomp.registry import parse_spec, unknown_name

    name, options = parse_spec(spec)
    if name == "none":
        if options:
            raise ValueError("none takes no options")
        return Method(spec, "none", {})
    if name in OPTIMIZER_METHODS:
        return Method(spec, name, options)
    if name not in REGISTRY:
        raise ValueError(unknown_name(name))
    return Method(spec, "hook", options)


def applies(method: Method, workload: Workload) -> bool:
    """DGC replaces momentum SGD and OneBitAdam replaces Adam/AdamW; everything else wraps any
    optimizer."""
    if method.kind == "dgc":
        return workload.optimizer == "sgd"
    if method.kind == "onebitadam":
        return workload.optimizer in ("adam", "adamw")
    return True


def filename(spec: str) -> str:
    """A spec as a file name (``/`` is the only character it may not keep)."""
    return spec.replace("/", "_")


class Trainer:
    """One method around one fresh model: ``model`` is what the loop calls forward on,
    ``optimizer`` what it calls ``zero_grad``/``step`` on, ``scheduled`` the torch optimizer a
    ``LambdaLR`` drives; ``stats()`` the method's traffic counters (``bytes_sent``)."""

    def __init__(self, method: Method, workload: Workload, net: nn.Module, bucket_cap_mb: float):
        import gradcomp
        import gradcomp.torch as gt
        from torch.nn.parallel import DistributedDataParallel

        self.method, self.net, self.steps = method, net, 0
        self.ddp: Any = None
        groups = param_groups(workload, net)
        if method.kind == "diloco":
            inner = build_optimizer(workload, groups)
            self.model: nn.Module = net
            self.diloco = gt.DiLoCo(net, inner, bucket_cap_mb=bucket_cap_mb, **method.options)
            self.optimizer: Any = self.diloco
            self.scheduled: torch.optim.Optimizer = inner
            self._stats: Callable[[], dict] = self.diloco.stats
            self.describe = repr(self.diloco)
            return
        self.ddp = DistributedDataParallel(net, bucket_cap_mb=bucket_cap_mb, gradient_as_bucket_view=True)
        self.model = self.ddp
        if method.kind == "dgc":
            opt: Any = gt.DGC(groups, lr=workload.lr, momentum=0.9, model=self.ddp, bucket_cap_mb=bucket_cap_mb,
                              **method.options)
            self._stats, self.describe = opt.stats, repr(opt.method_state)
        elif method.kind == "onebitadam":
            betas = workload.options.get("betas", (0.9, 0.999))
            opt = gt.OneBitAdam(groups, lr=workload.lr, betas=betas, model=self.ddp, bucket_cap_mb=bucket_cap_mb,
                                **method.options)
            self._stats, self.describe = opt.stats, repr(opt.method_state)
        else:
            opt = build_optimizer(workload, groups)
            if method.kind == "hook":
                state = gt.register(self.ddp, gradcomp.make(method.spec))
                self._stats, self.describe = state.compressor.stats, repr(state.compressor)
            else:  # DDP's own allreduce, counted as an allreduce hook counts it
                self._stats = lambda: gt.plain_ddp_stats(self.ddp, self.steps)
                self.describe = "DDP's own fp32 allreduce"
        self.optimizer = opt
        self.scheduled = opt

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def step(self) -> None:
        self.optimizer.step()
        self.steps += 1

    def finish(self) -> None:
        """DiLoCo: one more outer step, so that every rank holds the same model for the final
        evaluation (what a user does at the end of training)."""
        if self.method.kind == "diloco":
            self.diloco.sync_now()

    def stats(self) -> dict:
        return dict(self._stats())

    def reference_bytes(self) -> float:
        """What DDP's own fp32 allreduce would have sent from this rank over the steps so far
        (``gt.plain_ddp_stats``, which reads only the parameters and the world size): the
        numerator of every method's whole-run compression ratio."""
        import gradcomp.torch as gt

        return float(gt.plain_ddp_stats(self.ddp if self.ddp is not None else self.net, self.steps)["bytes_sent"])
