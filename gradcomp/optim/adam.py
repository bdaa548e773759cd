"""1-bit Adam: exact Adam for a warm-up, then frozen variance and compressed momentum.

Error feedback on raw gradients does not converge under Adam (Tang et al., ICML 2021): the
variance sees the compressed, bursty gradients and rescales every coordinate differently step to
step, so the error that feedback re-sends is not the error that was made. 1-bit Adam's answer,
followed here:

1. **Warm-up** (``warmup`` steps): plain AdamW on exactly averaged gradients (the same update as
   ``torch.optim.AdamW``, bias corrections included). The variance settles.
2. **Frozen variance**: from then on ``v`` (bias-corrected at the freeze) no longer changes, so Adam
   is momentum SGD with a fixed per-coordinate preconditioner ``1 / (sqrt(v) + eps)``.
3. **Compressed momentum**: every rank folds its *local* gradient into the momentum, ``m = b1 m +
   (1 - b1) g``, and the momentum is averaged through ``compressor`` with error feedback; the
   average becomes everybody's momentum. The default is gradcomp's 1-bit two-stage exchange with
   the workers' and the slice owners' residuals (DeepSpeed's ``compressed_allreduce``): about 30x
   fewer bytes than fp32 allreduce in steady state.

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
from ..compressors.base import Compressor
from ..compressors.feedback import ErrorFeedback
from ..compressors.quantize import OneBit
from ..params import check_bool, check_float, check_int
from ..registry import make
from ..schedule import Schedule
from .base import Hyper, Optimizer


class OneBitAdam(Optimizer):
    """Adam(W) whose momentum is averaged through a compressed exchange after a warm-up.

        opt = gradcomp.optim.OneBitAdam(params, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        for step in range(steps):
            grads = local_gradients(params)     # this rank's own gradients, not averaged
            opt.step(grads)                     # params updated in place, identical on every rank

    ``warmup``: steps of exact AdamW before the variance freezes (1-bit Adam used 15-25% of
    training; the step-time saving starts after it). ``compressor``: the momentum's exchange after
    the warm-up, a gradcomp compressor or a registry name (default ``ErrorFeedback(OneBit())``:
    1-bit codes with both residuals). ``lr``, ``weight_decay``: one value or one per parameter; ``step`` may
    override them for one step (a schedule).
    """

    def __init__(self, params: Sequence[Array], lr: Hyper = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: Hyper = 0.0, warmup: int = 100,
                 compressor: Compressor | str | None = None, preconditioned: bool = False,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0):
        super().__init__(params, lr, weight_decay, comm, bucket_cap_mb)
        if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
            raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.betas = (check_float("beta1", betas[0], minimum=0, maximum=0.999999),
                      check_float("beta2", betas[1], minimum=0, maximum=0.999999))
        self.eps = check_float("eps", eps, above=0)
        self.warmup = check_int("warmup", warmup, 1)
        self.preconditioned = check_bool("preconditioned", preconditioned)
        inner = (ErrorFeedback(OneBit()) if compressor is None
                 else make(compressor) if isinstance(compressor, str) else compressor)
        if not isinstance(inner, Compressor):
            raise TypeError(f"compressor must be a gradcomp Compressor or a registry name, got {inner!r}")
        self.momentum_compressor = inner
        reducer = self._exchange(Schedule([(0, Allreduce()), (self.warmup, inner)]))
        self._sent = reducer.gradients  # what travels: gradients in the warm-up, momentum after
        xp = array_module(self.params[0])
        self.m = [xp.zeros(p.shape, p.dtype) for p in self.params]
        self.v = [xp.zeros(p.shape, p.dtype) for p in self.params]
        self._arrays = {"m": self.m, "v": self.v}
        self._frozen: list[Array] | None = None  # the frozen variance's denominators

    def config(self) -> dict[str, Any]:
        return {"betas": self.betas, "eps": self.eps, "warmup": self.warmup,
                "compressor": self.momentum_compressor.describe(), "preconditioned": self.preconditioned}

    def phase(self) -> str:
        return "warm-up" if self.steps < self.warmup else "frozen variance"

    def step(self, grads: Sequence[Array], lr: Hyper | None = None, weight_decay: Hyper | None = None) -> None:
        """One update from this rank's local ``grads`` (one per parameter, any float dtype)."""
        grads = self._check_grads(grads)
        rates, decay = self._hyper(lr, weight_decay)
        b1, b2 = self.betas
        warm = self.steps < self.warmup
        t = self.steps + 1
        if warm:
            for s, g in zip(self._sent, grads):
                s[...] = g
            self.reducer.step()
            for m, v, g in zip(self.m, self.v, self._sent):
                m *= m.dtype.type(b1)
                m += m.dtype.type(1 - b1) * g
                v *= v.dtype.type(b2)
                v += v.dtype.type(1 - b2) * g * g
            second = 1 - b2 ** t
        else:
            second = 1 - b2 ** min(t - 1, self.warmup)  # frozen with the variance
            scale = self._denominators(second) if self.preconditioned else [None] * len(self.m)
            for s, m, g, d in zip(self._sent, self.m, grads, scale):
                s[...] = m
                s *= s.dtype.type(b1)
                s += s.dtype.type(1 - b1) * g
                if d is not None:
                    s /= d  # compressed in the update's own units
            self.reducer.step()
            for s, m, d in zip(self._sent, self.m, scale):
                m[...] = s
                if d is not None:
                    m *= d
        first = 1 - b1 ** t
        for p, m, v, rate, wd in zip(self.params, self.m, self.v, rates, decay):
            kind = p.dtype.type
            if wd:
                p *= kind(1 - rate * wd)
            denom = array_module(v).sqrt(v / kind(second))
            denom += kind(self.eps)
            p -= kind(rate / first) * m / denom
        self.steps += 1

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self._frozen = None  # the denominators follow the loaded variance

    def _denominators(self, second: float) -> list[Array]:
        """``sqrt(v / (1 - beta2^T)) + eps`` of the frozen variance, kept once frozen."""
        if self._frozen is None:
            xp = array_module(self.v[0])
            frozen = []
            for v in self.v:
                d = xp.sqrt(v / v.dtype.type(second))
                d += v.dtype.type(self.eps)
                frozen.append(d)
            self._frozen = frozen
        return self._frozen
