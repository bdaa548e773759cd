"""Local steps for PyTorch: ``gradcomp.optim.DiLoCo`` around a model and its inner optimizer.

    model = TinyLM(...)                              # no DistributedDataParallel: nothing per step
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    diloco = gt.DiLoCo(model, inner, sync_every=20, compressor="int8")
    for batch in data:
        inner.zero_grad(); loss(model, batch).backward()
        diloco.step()                                # inner step; every 20th call also the outer one

Each rank trains its own replica; DDP would average every step, which is what local steps avoid,
so the model must not be wrapped in it. The parameters (and buffers) are broadcast from rank 0 at
construction; the outer step works on NumPy (CPU) or CuPy (CUDA) views of the parameters, so after
it every rank holds the same bits. Floating-point buffers (BatchNorm's running statistics) are
broadcast from rank 0 at every outer step, as DDP's ``broadcast_buffers`` does every step.

Learning-rate schedulers and gradient clipping work on the inner optimizer as usual.
``state_dict()`` holds the inner optimizer's and the outer state (the synced parameters, the outer
momentum, the compressor's residuals, the step counters); with the model's own ``state_dict`` a
resume is bit-exact. Under mpiexec the exchange runs over MPI, under torchrun over
torch.distributed (``default_comm``).

On torchft (``manager=``, a ``torchft.Manager`` made with ``use_async_quorum=False``), the replica
groups may die and join: each outer step is one step of the manager (a quorum, the exchange over
its process group, ``should_commit``); a failed one is discarded and its pseudo-gradient sent again
at the next one; a joining group receives the outer state. ``gradcomp.torch.ft_diloco`` (``OuterSteps``)
and docs/guides/fault-tolerance.md say how.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .. import optim as core
from ..comm import Communicator
from .checkpoint import from_torch_state, to_torch_state
from .tensors import as_array


class DiLoCo:
    """``inner_optimizer`` for ``sync_every`` steps, then an outer step over the ranks.

    ``compressor``: the pseudo-gradients' exchange, a gradcomp compressor or registry name
    (``"int8"``: 8-bit codes with error feedback kept across outer steps; ``"allreduce"``: exact).
    ``budget``: the exchange's governor, for a compressor that sends fewer bytes than ``"int8"``
    (``gradcomp.optim.DiLoCo``; None: off).
    ``"sparseloco"`` (``"sparseloco:density=0.03"``): SparseLoCo's 2-bit chunked top-k under a
    decaying accumulator (``gradcomp.optim.sparseloco``), never governed.
    ``lr``, ``momentum``, ``nesterov``: the outer optimizer (default Nesterov with lr 0.7 and
    momentum 0.5; with ``"sparseloco"`` lr 1 and no momentum; ``lr=1, momentum=0`` averages the
    replicas; docs/guides/local-steps.md has the measurements behind the defaults).
    ``fragments``: streaming DiLoCo, fragments of the parameters synced on staggered steps;
    ``overlap``: their exchange runs while the next ``overlap`` inner steps compute, and lands then;
    ``keep_local``: landing keeps those steps' local progress (``gradcomp.optim.DiLoCo``).
    ``manager``: a ``torchft.Manager`` (``use_async_quorum=False``): the outer steps run over its
    quorum, failures discard them, joining replica groups heal (``gradcomp.torch.ft``; not with
    ``comm``). The construction then joins the job: a restarted group heals here and takes part
    in the outer step its peers are in. Train while ``steps`` is below the run's length.
    """

    def __init__(self, model: torch.nn.Module, inner_optimizer: torch.optim.Optimizer,
                 sync_every: int = core.diloco.SYNC_EVERY, compressor: Any = "int8",
                 lr: float | None = None, momentum: float | None = None,
                 nesterov: bool = True, fragments: int = 1, comm: Communicator | None = None,
                 bucket_cap_mb: float = 25.0, overlap: int = 0, manager: Any = None,
                 budget: float | None = core.diloco.GOVERNOR_BUDGET, keep_local: bool = False):
        from torch.nn.parallel import DistributedDataParallel

        from .communicator import default_comm

        if isinstance(model, DistributedDataParallel):
            raise TypeError("gradcomp.torch.DiLoCo: pass the model itself, not a DistributedDataParallel "
                            "wrapper (DDP would average the gradients at every step, which local steps "
                            "avoid)")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError(f"gradcomp.torch.DiLoCo: inner_optimizer must be a torch.optim.Optimizer, "
                            f"got {type(inner_optimizer).__name__}")
        self.model = model
        self.inner = inner_optimizer
        self.ft: Any = None  # gradcomp.torch.ft_diloco.OuterSteps, with a manager
        if manager is not None:
            if comm is not None:
                raise TypeError("gradcomp.torch.DiLoCo: pass comm or manager, not both (with a manager, "
                                "the exchange runs over its process group)")
            from .ft_diloco import OuterSteps  # (imports torchft)

            self.ft = OuterSteps(manager)
            comm = self.ft.comm
        self.comm = comm if comm is not None else default_comm()
        self._tensors = [p for p in model.parameters() if p.requires_grad]
        for i, p in enumerate(self._tensors):
            if not p.is_contiguous():
                raise ValueError(f"gradcomp.torch.DiLoCo: parameter {i} is not contiguous")
        self._buffers = [b for b in model.buffers() if b.is_floating_point() and b.is_contiguous()]
        if self.ft is None:
            with torch.no_grad():  # no DDP to broadcast the start: the same weights everywhere
                for t in self._tensors + self._buffers:
                    view = as_array(t)
                    view[...] = self.comm.broadcast(view)
        self.outer = core.DiLoCo([as_array(p) for p in self._tensors], sync_every=sync_every,
                                 compressor=compressor, lr=lr, momentum=momentum, nesterov=nesterov,
                                 fragments=fragments, comm=self.comm, bucket_cap_mb=bucket_cap_mb,
                                 overlap=overlap, coordinator=self.ft, budget=budget,
                                 keep_local=keep_local)
        if self.ft is not None:
            with torch.no_grad():
                self.ft.attach(self.outer, self._buffers)  # joins the job (a heal, or its start)

    @property
    def steps(self) -> int:
        """Inner steps so far (a healed replica group's are its source's)."""
        return self.outer.steps

    @property
    def sync_every(self) -> int:
        return self.outer.sync_every

    @property
    def landed(self) -> list[int]:
        """The fragments whose outer step landed at the last step (their parameters are the same
        bits on every rank, unless ``keep_local``: see ``synced``); empty between outer steps."""
        return self.outer.landed

    @torch.no_grad()
    def step(self, closure: Any = None) -> bool:
        """The inner optimizer's step (``closure`` passed on), then the outer step when due.
        Returns whether an outer step landed (its parameters are then the same on every rank)."""
        if closure is not None:
            with torch.enable_grad():
                self.inner.step(closure)
        else:
            self.inner.step()
        self.outer.step()
        synced = bool(self.outer.landed)
        if synced and self.ft is None:  # (with a manager, sent before the commit)
            self._broadcast_buffers()
        return synced

    @torch.no_grad()
    def sync_now(self) -> bool:
        """An outer step now, off schedule (every rank at the same point): before an evaluation
        or at the end of training, so every rank holds the same, averaged, model. Returns whether
        it landed (with a manager, False where it was discarded)."""
        self.outer.sync_now()
        if self.ft is None:
            self._broadcast_buffers()
            return True
        return bool(self.ft.last.get("committed"))

    @contextmanager
    def synced(self) -> Iterator[torch.nn.Module]:
        """The model holding the synced parameters (the same bits on every rank) inside the block,
        its replica's own again after it: where to evaluate with ``keep_local``, whose replicas
        differ by the steps taken since their last sync. No communication."""
        with torch.no_grad():
            replica = [t.detach().clone() for t in self._tensors]
            for t, s in zip(self._tensors, self.outer.synced):
                as_array(t)[...] = s
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for t, mine in zip(self._tensors, replica):
                    t.copy_(mine)

    def _broadcast_buffers(self) -> None:
        for b in self._buffers:
            view = as_array(b)
            view[...] = self.comm.broadcast(view)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def stats(self) -> dict[str, Any]:
        """``bytes_sent``, ``compression_ratio`` against DDP's fp32 allreduce of the gradients at
        every inner step, ``steps``, ``outer_steps`` (``gradcomp.optim.DiLoCo.stats``); with a
        manager also ``outer_steps_discarded``, ``heals`` and ``failures`` (this process)."""
        out = self.outer.stats()
        if self.ft is not None:
            out.update(outer_steps_discarded=self.ft.discarded, heals=self.ft.heals,
                       failures=self.ft.comm.failures)
        return out

    def metrics(self) -> dict[str, float]:
        """``gradcomp.metrics`` of ``stats()`` with the ``recent_*`` figures since the previous call,
        for a logger (``gradcomp.Meter``; its ``events``: the back-off lines)."""
        from ..metrics import Meter

        return self.__dict__.setdefault("_meter", Meter()).update(self.stats())

    def state_dict(self) -> dict[str, Any]:
        """``{"inner": the inner optimizer's state_dict, "outer": DiLoCo's state as tensors}``
        (``torch.save``-able, loads with ``weights_only=True``). Save the model's own with it."""
        return {"inner": self.inner.state_dict(), "outer": to_torch_state(self.outer.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output. The outer state is checked whole (a ValueError naming
        the key: a shape, the configuration, a step) before it changes; then the inner optimizer's
        is loaded by torch."""
        missing = [k for k in ("inner", "outer") if k not in state_dict]
        if missing:
            raise ValueError(f"gradcomp.torch.DiLoCo: the state has no {missing[0]!r} entry (expected the "
                             "output of DiLoCo.state_dict())")
        extra = sorted(set(state_dict) - {"inner", "outer"})
        if extra:
            raise ValueError(f"gradcomp.torch.DiLoCo: unexpected state key {extra[0]!r}")
        self.outer.load_state_dict(from_torch_state(state_dict["outer"]))
        self.inner.load_state_dict(state_dict["inner"])

    def __repr__(self) -> str:
        return f"gradcomp.torch.DiLoCo({self.outer.describe()}, inner={type(self.inner).__name__})"
