"""Deep Gradient Compression: momentum SGD whose exchange sends the top-k of each rank's values.

Two forms of momentum (``momentum_form``):

* ``"global"`` (the default): each rank sends the top ``ratio`` of its gradient plus what it has
  not sent yet (``ErrorFeedback(TopK)``: the residual is checkpointed and handed over like any
  other), and the momentum runs on the averaged sparse update, ``v = momentum * v + (mean +
  weight_decay * p)``, ``p -= lr * v``, the same bits on every rank (the global momentum of Zhao et
  al., "Global Momentum Compression", 2019). Every gradient reaches the parameters in full, only
  later, and its momentum then runs its course, so the step never shrinks: with ``ratio=1.0``
  this is ``torch.optim.SGD(momentum=...)`` on the averaged gradients.
* ``"local"``: the paper's form (Lin et al., ICLR 2018, section 3.2). **Momentum correction**:
  ``u = momentum * u + g`` (each rank's own velocity) and ``acc += u``; the top of ``acc`` is sent
  and cleared, the rest waits. **Momentum factor masking**: where a value was sent, ``u`` is
  cleared too. The masking drops the rest of a sent value's momentum, so the effective step
  shrinks: with ``ratio=1.0`` nothing of the momentum is left (plain SGD), and on workloads the
  recipe was not tuned on it lost 10+ points in 400 steps (docs/convergence.md).

Both share:

* **local gradient clipping** (``clip_norm``): each rank scales its gradient to a norm of at most
  ``clip_norm / sqrt(N)`` before it enters the exchange (the paper's rule for N workers);
* **the exchange** (``stages``): the top-k allgathered (1, the paper's), or reduced in two stages
  (2: ``ReducedTopK``, each slice's owner sums the ranks' top values and sends back the top of the
  mean, keeping what it drops as its own residual; bytes flat in the number of ranks, so twice the
  ratio fits the same bytes at 4 ranks, 4x at 8);
* **sparsity warm-up**: over the first ``warmup`` steps the kept fraction falls exponentially, 25%,
  6.25%, 1.6%, 0.4%, then ``ratio`` (``Schedule`` stages; residuals are handed over), over
  ``warmup`` steps (the paper ramps over 4 epochs; 30 was the default until 2026-12-06).
  ``warmup="auto"`` (``WARMUP``, the default): instead of the ramp, the
  registered names' warm-up, 8-bit codes with error feedback until the averaged update's scale
  settles (``gradcomp.settling``, as ``OneBitAdam``'s warm-up; the same step on every rank,
  checkpointed, in ``stats()``), then ``ratio`` at once.

Weight decay is added to the gradient, as ``torch.optim.SGD`` does (after the exchange in the
global form: ``p`` is the same on every rank, so it need not travel).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

from ..arrays import Array, array_module
from ..comm import Communicator
from ..compressors.feedback import ErrorFeedback
from ..compressors.sparsifiers import ReducedTopK, TopK
from ..params import check_choice, check_float, check_int
from ..planning.governor import BUDGET
from ..planning.recipes import WARMUP_BITS, sparsity_ramp, warmup_codes
from ..schedule import Schedule
from ..settling import Settling
from .optimizer import Hyper, Optimizer, global_norm

#: the forms of momentum (the module docstring)
MOMENTUM_FORMS = ("global", "local")

#: the default warm-up: 8-bit codes until the averaged update's scale settles, then the top-k.
#: Chosen on the workload zoo's tuning half (400 steps, 4 ranks, global momentum, governed): the
#: CNN -0.90 points at 5.4x over the run against the 30-step sparsity ramp's -2.15 at 7.8x, the
#: MLP -0.65 at 8.1x against -0.65 at 7.3x (a number of steps is the ramp, as before)
WARMUP: int | str = "auto"


class DGC(Optimizer):
    """Momentum SGD with Deep Gradient Compression (see the module docstring).

        opt = gradcomp.optim.DGC(params, lr=0.1, momentum=0.9, ratio=0.01)
        for step in range(steps):
            opt.step(local_gradients(params))   # this rank's own gradients, not averaged

    ``ratio``: the kept fraction after the warm-up (0.01: 1%, 25x fewer bytes than fp32 allreduce
    at 4 ranks; top-k is allgathered, so the saving shrinks as ranks are added). ``warmup``: steps
    of the sparsity ramp, or ``"auto"`` (its first level until the scale settles). ``clip_norm``:
    local gradient clipping (None: off). ``stages``: 1, top-k allgathered; 2, reduced in two
    stages (``topk:stages=2``'s exchange: ``ratio=0.02`` is 25x at any number of ranks).
    ``momentum_form``: ``"global"`` (momentum on the averaged update: ``ratio=1.0`` is momentum
    SGD) or ``"local"`` (the paper's momentum correction and factor masking). ``budget``: the
    governor's (``gradcomp.planning.governor``; None: the exchange is not governed).
    """

    runaway_advice = ("lengthen the sparsity warm-up (warmup=...), lower the learning rate, or keep "
                      "more values (a larger ratio)")

    def __init__(self, params: Sequence[Array], lr: Hyper = 0.01, momentum: float = 0.9,
                 weight_decay: Hyper = 0.0, ratio: float = 0.01, warmup: int | str = WARMUP,
                 clip_norm: float | None = None, stages: int = 1, comm: Communicator | None = None,
                 bucket_cap_mb: float = 25.0, momentum_form: str = "global", budget: float | None = BUDGET):
        super().__init__(params, lr, weight_decay, comm, bucket_cap_mb)
        self.momentum = check_float("momentum", momentum, minimum=0, maximum=0.999999)
        self.ratio = check_float("ratio", ratio, above=0, maximum=1)
        if isinstance(warmup, str) and warmup != "auto":
            raise ValueError(f"DGC warmup: a number of steps or 'auto', got {warmup!r}")
        self.warmup: int | str = warmup if warmup == "auto" else check_int("warmup", warmup, 0)
        self.clip_norm = None if clip_norm is None else check_float("clip_norm", clip_norm, above=0)
        self.exchange_stages = check_choice("stages", stages, (1, 2))
        self.momentum_form = check_choice("momentum_form", momentum_form, MOMENTUM_FORMS)
        codec = TopK if self.exchange_stages == 1 else ReducedTopK
        if warmup == "auto":
            # 8-bit codes (the registered names' auto warm-up) until the scale settles, then the
            # top-k; laid out as if it ended at ``settling.latest``, moved earlier when it ends
            self.settling: Settling | None = Settling()
            self.fractions: list[float | None] = [None, self.ratio]
            self.ramp = Schedule([(0, warmup_codes(self.settling, WARMUP_BITS)),
                                  (self.settling.latest, ErrorFeedback(codec(self.ratio)))])
        else:
            ramp = sparsity_ramp(self.ratio, int(warmup))
            self.settling = None
            self.fractions = [f for _, f in ramp]
            self.ramp = Schedule([(s, ErrorFeedback(codec(f))) for s, f in ramp])
        self._exchange(self.ramp, budget)
        xp = array_module(self.params[0])
        #: the velocity: each rank's own (local), or the averaged update's, the same on every rank
        self.u = [xp.zeros(p.shape, p.dtype) for p in self.params]
        self._arrays = {"u": self.u}
        self._keys = [str(i) for i in range(len(self.params))]

    def config(self) -> dict[str, Any]:
        # stages only when 2, the form only when global: a checkpoint saved before either existed
        # (the local form, one stage) still names its configuration, and is refused by the global
        return {"momentum": self.momentum, "ratio": self.ratio, "warmup": self.warmup,
                "clip_norm": self.clip_norm, **({"stages": 2} if self.exchange_stages == 2 else {}),
                **({"momentum_form": "global"} if self.momentum_form == "global" else {}),
                **({"budget": self.budget} if self.budget is not None else {})}

    def phase(self) -> str:
        kept = self.fractions[self.ramp.stage_at(self.steps)]
        return "8-bit warm-up" if kept is None else f"kept {kept:g}"

    def step(self, grads: Sequence[Array], lr: Hyper | None = None, weight_decay: Hyper | None = None) -> None:
        """One update from this rank's local ``grads`` (one per parameter; they are the exchange's
        buffer and hold what was averaged afterwards, ``Optimizer.in_place``)."""
        grads = self._check_grads(grads)
        rates, decay = self._hyper(lr, weight_decay)
        scale = 1.0
        if self.clip_norm is not None:
            norm = global_norm(grads)
            limit = self.clip_norm / math.sqrt(self.comm.size)
            scale = min(1.0, limit / norm) if norm > 0 else 1.0
        # averaged where they lie: the gradients' own arrays (``in_place``)
        sent = self.in_place(grads)
        if self.momentum_form == "global":
            self._global_step(sent, scale, rates, decay)
        else:
            self._local_step(grads, sent, scale, rates, decay)
        if self.settling is not None and self.settling.warm:
            self._observe(sent)
        self.steps += 1

    def _global_step(self, sent: list[Array], scale: float, rates: Sequence[float],
                     decay: Sequence[float]) -> None:
        """The gradients (``sent``) exchanged (top-k with error feedback), then momentum SGD on
        the mean, in ``torch.optim.SGD``'s order: ``d = mean + wd * p``, ``v = momentum * v + d``."""
        if scale != 1.0:
            for s in sent:
                s *= s.dtype.type(scale)
        self.reducer.step(sent)
        for u, p, s, wd, rate in zip(self.u, self.params, sent, decay, rates):
            kind = u.dtype.type
            if wd:
                s += kind(wd) * p
            u *= kind(self.momentum)
            u += s
            p -= kind(rate) * u

    def _local_step(self, grads: Sequence[Array], sent: list[Array], scale: float, rates: Sequence[float],
                    decay: Sequence[float]) -> None:
        """The paper's: each rank's velocity exchanged (top-k of its accumulation, in ``sent``),
        and where a value was sent its velocity cleared (momentum factor masking)."""
        for u, g, p, wd, s in zip(self.u, grads, self.params, decay, sent):
            kind = u.dtype.type
            u *= kind(self.momentum)
            if scale != 1.0:
                u += kind(scale) * g
            else:
                u += g
            if wd:
                u += kind(wd) * p
            s[...] = u
        self.reducer.step(sent)
        residuals = self.compressor.residuals(self._keys)
        for i, (u, p, s, rate) in enumerate(zip(self.u, self.params, sent, rates)):
            acc = residuals.get(self._keys[i])
            if acc is not None:
                u[acc.reshape(u.shape) == 0] = 0  # sent from here: its momentum goes with it
            p -= p.dtype.type(rate) * s

    def _settled(self, end: int) -> None:
        self.ramp.start_later_stages(end)  # the top-k from the end on (also called by a load)
        warm = self.ramp.compressors[0]
        if self.settling is not None and self.settling.ended_at is not None and isinstance(warm, ErrorFeedback):
            warm.drop_owner_residuals()  # the warm-up has ended and does not come back
