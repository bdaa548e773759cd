"""gradcomp's optimizer-level methods as ``torch.optim.Optimizer``: ``OneBitAdam`` and ``DGC``.

    model = DistributedDataParallel(net)
    opt = gt.OneBitAdam(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, model=model)
    ... loss.backward(); opt.step()           # as any optimizer; schedulers and clipping work

These methods average what *they* send (Adam's momentum, DGC's accumulated velocity), not the
gradients, so the optimizer does the communication itself (as DeepSpeed's ``OnebitAdam`` does) and
DDP must not average first: pass the DDP model as ``model=`` and its communication hook is replaced
by one that leaves each rank's gradients local (``local_hook``). A model without DDP works too; its
parameters are then broadcast from rank 0 at construction, as DDP would. A DDP model's parameters
without ``model=`` are refused on every rank (a ``ValueError`` naming ``model=``), unless that model
already runs ``local_hook``: DDP would average the gradients in fp32 first, and nothing would be
compressed. The arithmetic is
``gradcomp.optim``'s, on NumPy (CPU) or CuPy (CUDA) views of the parameters, so every rank holds
the same bits. ``state_dict()`` adds the method's state (momentum, variance, residuals) as tensors.
The gradients are averaged where they lie, so after ``step`` a ``.grad`` may hold what was averaged
(as under DDP or Horovod), and no copy of the model's size is kept for the exchange.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from .. import optim as core
from ..comm import Communicator
from .checkpoint import from_torch_state, to_torch_state
from .tensors import as_array


def local_hook(state: Any, bucket):  # bucket and result unannotated: see hook._hook
    """A DDP communication hook that communicates nothing: each rank keeps its own gradients."""
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _owning_ddp(tensor: torch.Tensor) -> Any:
    """The ``DistributedDataParallel`` model whose parameters include ``tensor``, or None. Nothing
    on a tensor says DDP wraps it; DDP keeps its parameters in a list (``_module_parameters``),
    found here through the garbage collector's referrers (tensor -> that list -> the model's
    ``__dict__`` -> the model), once, at the optimizer's construction."""
    import gc

    from torch.nn.parallel import DistributedDataParallel

    for held in gc.get_referrers(tensor):
        if not isinstance(held, list):
            continue
        for attrs in gc.get_referrers(held):
            if not (isinstance(attrs, dict) and attrs.get("_module_parameters") is held):
                continue
            for owner in gc.get_referrers(attrs):
                if isinstance(owner, DistributedDataParallel) and getattr(owner, "__dict__", None) is attrs:
                    return owner
    return None


class _Wrapped(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` running a ``gradcomp.optim`` method on views of its tensors."""

    method: type[core.Optimizer]
    per_group = ("lr", "weight_decay")  # hyperparameters a group (or a scheduler) may change

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], model: Any = None,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0, **options: Any):
        super().__init__(params, defaults)
        self._tensors = [p for group in self.param_groups for p in group["params"]]
        for i, p in enumerate(self._tensors):
            if not p.is_contiguous():
                raise ValueError(f"gradcomp.torch.{type(self).__name__}: parameter {i} is not contiguous")
        from .communicator import default_comm

        comm = comm if comm is not None else default_comm()
        self._install(model, comm)
        group_of = [g for g in self.param_groups for _ in g["params"]]
        hyper = {k: [g[k] for g in group_of] for k in self.per_group}
        self.method_state = self.method([as_array(p) for p in self._tensors], comm=comm,
                                        bucket_cap_mb=bucket_cap_mb, **hyper, **options)

    def _install(self, model: Any, comm: Communicator) -> None:
        from torch.nn.parallel import DistributedDataParallel

        if isinstance(model, DistributedDataParallel):
            model.register_comm_hook(None, local_hook)
            return
        if model is not None:
            raise TypeError(f"gradcomp.torch.{type(self).__name__}: model= must be the "
                            f"DistributedDataParallel model, got {type(model).__name__}")
        self._refuse_averaging_ddp(comm)
        with torch.no_grad():  # no DDP to broadcast the start: the same weights everywhere
            for p in self._tensors:
                view = as_array(p)
                view[...] = comm.broadcast(view)

    def _refuse_averaging_ddp(self, comm: Communicator) -> None:
        """Raise, on every rank alike, when these parameters are a DDP model's that averages their
        gradients itself (no ``model=``, no ``local_hook``): DDP would send them in fp32 before
        this optimizer sends its own compressed message, so nothing would be saved."""
        ddp = _owning_ddp(self._tensors[0]) if self._tensors else None
        hooks = [hook for hook, _ in getattr(ddp, "_comm_hooks", [])] if ddp is not None else []
        averaging = ddp is not None and local_hook not in hooks
        # the ranks agree first: a rank that raised alone would leave the others in the broadcast
        if float(comm.allreduce(np.array([float(averaging)], np.float32))[0]) == 0.0:
            return
        name = type(self).__name__
        how = (f"averages their gradients through its communication hook ({hooks[0].__qualname__})"
               if hooks else "averages their gradients in fp32 (DDP's own allreduce)")
        raise ValueError(
            f"gradcomp.torch.{name}: these parameters belong to a DistributedDataParallel model, which "
            f"{how} before {name} communicates its own compressed message: nothing would be saved. "
            f"Pass the model as model=, e.g. {name}(ddp_model.parameters(), ..., model=ddp_model), so "
            "that its gradients stay local (gradcomp.torch.local_hook); or register local_hook "
            "yourself (ddp_model.register_comm_hook(None, gradcomp.torch.local_hook)) and no other hook")

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grads = [as_array(p.grad) if p.grad is not None else np.zeros(tuple(p.shape), as_array(p).dtype)
                 for p in self._tensors]
        group_of = [g for g in self.param_groups for _ in g["params"]]
        hyper = {k: [float(g[k]) for g in group_of] for k in self.per_group}
        self.method_state.step(grads, **hyper)
        return loss

    def stats(self) -> dict[str, Any]:
        """Traffic and phase (``gradcomp.optim.Optimizer.stats``)."""
        return self.method_state.stats()

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["gradcomp"] = to_torch_state(self.method_state.state_dict())
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        if "gradcomp" not in state_dict:
            raise ValueError(f"gradcomp.torch.{type(self).__name__}: this checkpoint has no 'gradcomp' "
                             "entry (it was not saved by this optimizer's state_dict())")
        self.method_state.load_state_dict(from_torch_state(state_dict.pop("gradcomp")))
        super().load_state_dict(state_dict)


class OneBitAdam(_Wrapped):
    """``gradcomp.optim.OneBitAdam`` as a torch optimizer (AdamW semantics in the warm-up)."""

    method = core.OneBitAdam

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, warmup: int | str = "auto",
                 compressor: Any = None, preconditioned: bool = True, floor: float = 0.01,
                 local_momentum: bool = False, warmup_compressor: Any = core.WARMUP_COMPRESSOR, model: Any = None,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0,
                 budget: float | None = core.ONEBITADAM_BUDGET):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), model, comm, bucket_cap_mb,
                         betas=betas, eps=eps, warmup=warmup, compressor=compressor,
                         preconditioned=preconditioned, floor=floor, local_momentum=local_momentum,
                         warmup_compressor=warmup_compressor, budget=budget)


class DGC(_Wrapped):
    """``gradcomp.optim.DGC`` as a torch optimizer (momentum SGD semantics)."""

    method = core.DGC

    def __init__(self, params: Iterable[Any], lr: float = 0.01, momentum: float = 0.9,
                 weight_decay: float = 0.0, ratio: float = 0.01, warmup: int | str = core.DGC_WARMUP,
                 clip_norm: float | None = None, stages: int = 1, momentum_form: str = "global",
                 budget: float | None = core.GOVERNOR_BUDGET, model: Any = None, comm: Communicator | None = None,
                 bucket_cap_mb: float = 25.0):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay), model, comm, bucket_cap_mb,
                         momentum=momentum, ratio=ratio, warmup=warmup, clip_norm=clip_norm, stages=stages,
                         momentum_form=momentum_form, budget=budget)
