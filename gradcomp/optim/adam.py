"""1-bit Adam: Adam for a warm-up, then frozen variance and compressed momentum.

Error feedback on raw gradients does not converge under Adam (Tang et al., ICML 2021): the
variance sees the compressed, bursty gradients and rescales every coordinate differently step to
step, so the error that feedback re-sends is not the error that was made. 1-bit Adam's answer,
followed here:

1. **Warm-up**: plain AdamW on averaged gradients (the same update as ``torch.optim.AdamW``,
   bias corrections included), until the averaged gradients' scale has settled (``warmup="auto"``,
   ``gradcomp.settling``: the variance then holds what it will hold), or for ``warmup`` steps.
   The gradients are averaged through ``warmup_compressor``: 8-bit codes with error feedback by
   default (``WARMUP_COMPRESSOR``), which keep AdamW close to exact averaging, as DeepSpeed's 1-bit
   Adam warms up on half-precision gradients; ``"allreduce"`` is exact.
   Its residual, a gradient's error, is dropped at the freeze, where the momentum starts to
   travel instead.
2. **Frozen variance**: from then on ``v`` (bias-corrected at the freeze) no longer changes, so Adam
   is momentum SGD with a fixed per-coordinate preconditioner ``1 / (sqrt(v) + eps)``.
3. **Compressed momentum**: every rank folds its *local* gradient into the momentum, ``m = b1 m +
   (1 - b1) g``, and the momentum is averaged through ``compressor`` with error feedback; the
   average becomes everybody's momentum. The default is gradcomp's 1-bit two-stage exchange with
   the workers' and the slice owners' residuals (DeepSpeed's ``compressed_allreduce``): about 30x
   fewer bytes than fp32 allreduce in steady state.

With ``preconditioned`` (the default) the momentum is compressed in the update's own units,
``m / (sqrt(v) + eps)``: a code's error then weighs the same on every coordinate, where on the raw
momentum a coordinate with a tiny variance would have it multiplied by ``1 / eps`` (measured: the
digits MLP diverged without it). Coordinates whose gradient was zero through the whole warm-up
(frozen ``v = 0``) take no step: a sign code cannot send their zero. And the frozen denominator of
each coordinate is at least ``floor`` times its tensor's mean: a coordinate whose gradient was
nearly zero at the freeze and grows later would otherwise take steps ``1 / eps`` large, which live
Adam avoids by updating its variance (the digits MLP diverged 150 steps after the freeze).

``local_momentum=True`` is DGC's momentum correction in the update's units instead, for sparse
codes (``compressor=ErrorFeedback(TopK(...))``): each rank keeps its own momentum, the code's
residual accumulates ``m / (sqrt(v) + eps)`` and sends its largest values, and the momentum of
what was sent is cleared; the averaged sends are the step.

Decoupled weight decay as AdamW (``p -= lr * weight_decay * p``). ``compressor`` may be any gradcomp
compressor with error feedback (``ErrorFeedback(TopK(0.01))``, ``PowerSGD(rank=4, start_iter=2)``,
``"int8"``...): the frozen variance is what makes the feedback sound, whatever the code.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..arrays import Array, array_module
from ..comm import Communicator
from ..compressors.allreduce import Allreduce
from ..compressors.contract import Compressor
from ..compressors.feedback import ErrorFeedback
from ..compressors.quantize import OneBit
from ..params import check_bool, check_float, check_int
from ..registry import make, steady
from ..schedule import Schedule
from ..settling import Settling
from .optimizer import Hyper, Optimizer


#: the warm-up's exchange: 8-bit codes from the first step (a quarter of fp32's bytes; ``int8``'s
#: own 50 exact steps would cost a 300-step run half its saving)
WARMUP_COMPRESSOR = "int8:warmup=0"
#: the momentum exchange's governor budget (``gradcomp.planning.governor``), chosen on the workload
#: zoo's tuning half at 300, 400 and 2000 steps: 8 was never more than 0.32% worse than 4, sent no
#: more bytes, and its worst gap was +2.3% against 4's +3.4%; ungoverned, a regression lost 8.8%,
#: and 1 halved the ratio on a GRU that was within 0.1% without it (docs/convergence.md). A state
#: saved under another budget is refused, naming it (4 was the default before 2026-12-06)
BUDGET = 8.0


class OneBitAdam(Optimizer):
    """Adam(W) whose momentum is averaged through a compressed exchange after a warm-up.

        opt = gradcomp.optim.OneBitAdam(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        for step in range(steps):
            grads = local_gradients(params)     # this rank's own gradients, not averaged
            opt.step(grads)                     # params updated in place, identical on every rank
                                                # (grads are the exchange's buffer: overwritten)

    ``warmup``: ``"auto"`` (the default) freezes the variance once the averaged gradients' scale
    has settled, on the same step on every rank (``stats()`` says when and why; the decision is
    checkpointed); a number is that many steps of AdamW (1-bit Adam used 15-25% of training).
    The warm-up's gradients are averaged through ``warmup_compressor`` (default
    ``"int8:warmup=0"``: 4x fewer bytes than fp32; ``"allreduce"``: exact).

    A sparse or low-rank code delays the update more than 1 bit does and needs a longer warm-up
    (a fifth of training rather than a fifteenth), and PowerSGD a rank of 8:
    ``"fp16-powersgd:rank=8,factor_bits=8"`` sends rank 8 in rank 4's half-precision bytes;
    ``"topk:stages=2,ratio=0.02"`` is the sparse choice (BENCHMARKS.md, section 6, has the runs).

    ``compressor``: the momentum's exchange after the warm-up, a gradcomp compressor or a registry
    name (default ``ErrorFeedback(OneBit())``: 1-bit codes with both residuals; a name's own exact
    warm-up is dropped unless the name sets it, since this warm-up comes first:
    ``"topk:stages=2,ratio=0.02"`` sparsifies from the freeze). ``lr``, ``weight_decay``: one
    value or one per parameter; ``step`` may override them for one step (a schedule).
    ``budget``: the momentum exchange's governor (``BUDGET``; None: not governed): a bucket whose
    1-bit momentum costs more steps down to 4-bit, then 8-bit codes.
    """

    runaway_advice = ("lengthen the warm-up (warmup=...; warmup_compressor='allreduce' makes it exact), "
                      "lower the learning rate, or keep the default 1-bit momentum, which delays the "
                      "update least")

    def __init__(self, params: Sequence[Array], lr: Hyper = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: Hyper = 0.0, warmup: int | str = "auto",
                 compressor: Compressor | str | None = None, preconditioned: bool = True,
                 floor: float = 0.01, local_momentum: bool = False,
                 warmup_compressor: Compressor | str = WARMUP_COMPRESSOR,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0, budget: float | None = BUDGET):
        super().__init__(params, lr, weight_decay, comm, bucket_cap_mb)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.betas = (check_float("beta1", betas[0], minimum=0, maximum=0.999999),
                      check_float("beta2", betas[1], minimum=0, maximum=0.999999))
        self.eps = check_float("eps", eps, above=0)
        if isinstance(warmup, str) and warmup != "auto":
            raise ValueError(f"OneBitAdam warmup: a number of steps or 'auto', got {warmup!r}")
        self.warmup: int | str = warmup if warmup == "auto" else check_int("warmup", warmup, 1)
        self.settling = Settling() if warmup == "auto" else None
        # the first frozen step (with settling: the latest it can be, until it is decided)
        self._freeze: int = self.settling.end if self.settling is not None else int(self.warmup)
        self.preconditioned = check_bool("preconditioned", preconditioned)
        self.floor = check_float("floor", floor, minimum=0, maximum=1)
        self.local_momentum = check_bool("local_momentum", local_momentum)
        inner = (ErrorFeedback(OneBit()) if compressor is None
                 else make(steady(compressor, keep_given=True)) if isinstance(compressor, str) else compressor)
        if not isinstance(inner, Compressor):
            raise TypeError(f"compressor must be a gradcomp Compressor or a registry name, got {inner!r}")
        self.momentum_compressor = inner
        warm = make(warmup_compressor) if isinstance(warmup_compressor, str) else warmup_compressor
        if not isinstance(warm, Compressor):
            raise TypeError("warmup_compressor must be a gradcomp Compressor or a registry name, "
                            f"got {warmup_compressor!r}")
        self.warmup_compressor = warm
        # an exact warm-up is described as before warmup_compressor existed: its checkpoints load
        exact = warm.describe() == Allreduce().describe()
        self._warmup_config = {} if exact else {"warmup_compressor": warm.describe()}
        self._schedule = Schedule([(0, warm), (self._freeze, inner)])
        self._exchange(self._schedule, budget)
        xp = array_module(self.params[0])
        self.m = [xp.zeros(p.shape, p.dtype) for p in self.params]
        self.v = [xp.zeros(p.shape, p.dtype) for p in self.params]
        self._keys = [str(i) for i in range(len(self.params))]
        # where the frozen variance is positive; None until the freeze writes its denominators
        # over v (``_denominators``)
        self._alive: list[Array] | None = None
        self._hold(None)

    def config(self) -> dict[str, Any]:
        return {"betas": self.betas, "eps": self.eps, "warmup": self.warmup, **self._warmup_config,
                "compressor": self.momentum_compressor.describe(), "preconditioned": self.preconditioned,
                "floor": self.floor, "local_momentum": self.local_momentum,
                **({"budget": self.budget} if self.budget is not None else {})}

    def phase(self) -> str:
        return "warm-up" if self.steps < self._freeze else "frozen variance"

    def step(self, grads: Sequence[Array], lr: Hyper | None = None, weight_decay: Hyper | None = None) -> None:
        """One update from this rank's local ``grads`` (one per parameter, any float dtype; in the
        warm-up they are averaged in place, ``Optimizer.in_place``)."""
        grads = self._check_grads(grads)
        rates, decay = self._hyper(lr, weight_decay)
        b1, b2 = self.betas
        warm = self.steps < self._freeze
        t = self.steps + 1
        if self.steps == self._freeze and self.warmup_compressor is not self.momentum_compressor:
            # the warm-up's residual is a gradient's error; from now on the momentum travels (in
            # the update's units): handed over, it would be added to a quantity of other units
            self.warmup_compressor.take_residual(self._keys)
        # What travels is averaged where it lies: the gradients in the warm-up (``in_place``),
        # then the momentum itself (the same on every rank before and after).
        if warm:
            sent = self.reducer.step(self.in_place(grads))
            for m, v, g in zip(self.m, self.v, sent):
                m *= m.dtype.type(b1)
                m += m.dtype.type(1 - b1) * g
                v *= v.dtype.type(b2)
                v += v.dtype.type(1 - b2) * g * g
            second = 1 - b2 ** t
            if self.settling is not None:
                self._observe(sent)
        elif self.local_momentum:
            second = 1 - b2 ** min(t - 1, self._freeze)
            sent = self.in_place(grads)
            for s, m, g, d in zip(sent, self.m, grads, self._denominators(second)):
                m *= m.dtype.type(b1)  # this rank's own momentum (DGC's momentum correction)
                m += m.dtype.type(1 - b1) * g
                s[...] = m
                s /= d
            self.reducer.step(sent)  # each rank's accumulated m / d, sparsified, averaged: the step
            residuals = self.compressor.residuals(self._keys)
            for i, (m, s, live) in enumerate(zip(self.m, sent, self._live(second))):
                acc = residuals.get(self._keys[i])
                if acc is not None:
                    m[acc.reshape(m.shape) == 0] = 0  # sent: its momentum goes with it
                s *= live
        else:
            second = 1 - b2 ** min(t - 1, self._freeze)  # frozen with the variance
            scale = self._denominators(second) if self.preconditioned else [None] * len(self.m)
            for m, g, d in zip(self.m, grads, scale):
                m *= m.dtype.type(b1)
                m += m.dtype.type(1 - b1) * g
                if d is not None:
                    m /= d  # compressed in the update's own units
            self.reducer.step(self.m)
            for m, d, live in zip(self.m, scale, self._live(second)):
                if d is not None:
                    m *= d
                m *= live  # a sign code has no zero: what never had a gradient takes no step
        first = 1 - b1 ** t
        denominators = self._denominators(second) if not warm else [None] * len(self.v)
        for i, (p, m, v, rate, wd, frozen) in enumerate(zip(self.params, self.m, self.v, rates, decay,
                                                             denominators)):
            kind = p.dtype.type
            if wd:
                p *= kind(1 - rate * wd)
            if self.local_momentum and not warm:
                p -= kind(rate / first) * sent[i]  # already in the update's units
                continue
            if frozen is None:
                denom = array_module(v).sqrt(v / kind(second))
                denom += kind(self.eps)
            else:
                denom = frozen
            p -= kind(rate / first) * m / denom
        self.steps += 1

    def _settled(self, end: int) -> None:
        """The averaged gradients settled: step ``end`` is the first frozen one (the same step on
        every rank: they were averaged)."""
        self._freeze = end
        self._schedule.start_later_stages(end)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        state = dict(state)
        saved = str(np.asarray(state.get("config", "")))
        if self._warmup_config and saved and "warmup_compressor=" not in saved:
            raise ValueError(f"OneBitAdam state: saved by {saved}, whose warm-up averaged exactly (the "
                             "default before warmup_compressor, now int8); to resume it, construct "
                             "OneBitAdam(..., warmup_compressor='allreduce')")
        before = self._alive
        # the state holds the warm-up's variance, or (saved after the freeze) its denominators
        xp = array_module(self.v[0])
        self._hold([xp.zeros(v.shape, bool) for v in self.v] if "denominator/0" in state else None)
        try:
            super().load_state_dict(state)
        except BaseException:
            self._hold(before)
            raise

    def _hold(self, alive: list[Array] | None) -> None:
        """Before the freeze (``alive`` None) v holds the variance; after it, the denominators,
        with ``alive``: what ``_arrays`` (the checkpoint) names."""
        self._alive = alive
        self._arrays = ({"m": self.m, "v": self.v} if alive is None
                        else {"m": self.m, "denominator": self.v, "live": alive})

    def _live(self, second: float) -> list[Array]:
        """1 where the frozen variance is positive, 0 where the gradient was zero all through the
        warm-up (Adam would divide by ``eps`` there; a compressed momentum, e.g. a sign code, is
        never exactly zero, so those coordinates would drift); a bool a coordinate."""
        self._denominators(second)
        assert self._alive is not None
        return self._alive

    def _denominators(self, second: float) -> list[Array]:
        """``sqrt(v / (1 - beta2^T)) + eps`` of the frozen variance, written over it at the first
        frozen step (it no longer changes, and is not kept beside them: 4 bytes a parameter);
        checkpoints then hold the denominators and the live flags instead of ``v``."""
        if self._alive is None:
            xp = array_module(self.v[0])
            alive = [v > 0 for v in self.v]
            for v in self.v:
                v /= v.dtype.type(second)
                xp.sqrt(v, out=v)
                if self.floor and v.size:
                    xp.maximum(v, v.dtype.type(self.floor * float(v.mean())), out=v)
                v += v.dtype.type(self.eps)
            self._hold(alive)
        return self.v
