"""Local steps with compressed outer gradients: DiLoCo (Douillard et al. 2023), framework-agnostic.

Every compressor in gradcomp cuts the bytes of one exchange; local steps cut the number of
exchanges. Each rank trains its own replica with its own inner optimizer (AdamW, say) for
``sync_every`` (H) steps without communicating, then the replicas meet in one *outer step*:

1. each rank's **pseudo-gradient**, its parameters at the last sync minus its parameters now, is
   averaged over the ranks by any gradcomp compressor (``"int8"`` by default), through a
   ``GradientReducer`` whose buckets are the same keyed buckets at every outer step. A compressor
   with error feedback therefore keeps each tensor's residual from one outer step to the next:
   what the codes could not send at outer step k is added to the pseudo-gradient at k + 1;
2. an **outer optimizer** turns the averaged pseudo-gradient into a step from the synced
   parameters: Nesterov momentum (the default, ``lr=0.7, momentum=0.5``), or plain averaging with
   ``lr=1, momentum=0`` (the new synced parameters are then the mean of the replicas);
3. every rank copies the new synced parameters into its replica: the same bits on every rank
   (the mean is bit-identical everywhere, so is the arithmetic after it).

The inner optimizer's state (Adam's moments) stays local and is never averaged. Between outer
steps nothing travels, so over H steps the bytes are one compressed exchange against H fp32
allreduces (``stats()``: ``compression_ratio`` is measured against DDP's fp32 allreduce of the
gradients at every inner step).

Defaults come from measurement on the repository's LM, not from the papers: at H = 20 the paper's
Nesterov ``lr=0.7, momentum=0.9`` ended +19% from DDP's validation loss after 300 steps, plain
averaging +10.3%, Nesterov ``lr=0.7, momentum=0.5`` +8.8% (and +10.4% against averaging's +14.7%
after 900); ``docs/guides/local-steps.md`` has the table.

**Streaming** (Douillard et al. 2025): ``fragments=F`` splits the parameters into F consecutive
groups of about equal size, each with its own exchange, synced on staggered steps (fragment f at
steps ``k H + (f + 1) H / F``): each fragment still meets every H steps, but a sync moves 1/F of
the bytes, which spreads the traffic out. ``overlap=T`` (0 by default) lets a fragment's exchange run
on the communicator's pipeline while the next T inner steps compute: the pseudo-gradient is taken
at the sync step, and the outer step lands T steps later. It then overwrites the fragment's
parameters with the new synced ones, so the replicas are the same bits again, and the T steps of
local progress on that fragment are dropped (the Streaming DiLoCo paper's mixing weight 0).
``keep_local=True`` keeps them instead: the outer step lands as a correction, the replica moved by
its own pseudo-gradient back and by the outer update on (the synced parameters are the same bits
everywhere, the replicas differ by their last T steps), and ``overlap`` may then be H, the whole
interval: the update is one outer step late (DiLoCoX's one-step-delay overlap). A checkpoint
taken with an exchange in flight waits for it and saves the averaged pseudo-gradient (and the own
one), to land at the same step after a resume (``optim.flight``).

**Coordinated** (``coordinator=``): ranks that come and go, such as torchft's replica groups
(``gradcomp.torch.ft``). The coordinator is asked before each outer step's pseudo-gradients are
taken (``begin``: who takes part; a rank that joins or fell behind may receive its peers' state
and outer step here), starts or withholds each exchange (``start``), and once the means are in
decides whether the step counts (``end``: a factor to scale the mean by, or None to discard it;
the coordinator then undoes what the exchange changed, and the replica keeps its local progress
for the next outer step). The construction then runs no collective: the coordinator sees to the
same start.

Memory: where an outer step lands at its sync and overwrites the replica (no ``overlap``, no
``keep_local``, no coordinator, which may undo a step), the pseudo-gradients are formed and
averaged in the replica's own memory; else each fragment keeps a buffer of its own for them.

Agreement: the configuration (H, the outer optimizer, the compressor, the fragments, the overlap) and the
step counters (inner and outer) are part of every bucket's agreement (``_Agreed``), so ranks whose
runs or resumed states differ raise ``CollectiveError`` on every rank at the next sync, before any
data moves. Ranks must start from the same parameters: checked (a digest) at construction.
"""
from __future__ import annotations

import copy
from concurrent.futures import wait
from typing import Any, Mapping, Sequence

import numpy as np

from .. import timeline
from ..arrays import Array, array_module, to_host
from ..bucket import group
from ..comm import Communicator, wire_bytes
from ..compressors.contract import Compressor
from ..params import check_bool, check_float, check_int
from ..planning.governor import BUDGET as GOVERNOR_BUDGET
from ..planning.governor import Governed
from ..planning.rungs import has_safer_rungs
from ..reducer import GradientReducer
from ..registry import make, steady
from ..state import reject_leftovers, saved_by, take_config, take_int
from .optimizer import Hyper, Optimizer, _Agreed, governors
from . import flight
from .fit import FittedExchange, Fitting
from .replicas import Coordinator, check_same_start, split
from .sparseloco import EXCHANGES, exchange

#: the defaults, measured on examples/torch_lm.py's TinyLM (docs/guides/local-steps.md)
SYNC_EVERY = 20
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.5
#: the exchange's governor (``budget``), counted in outer steps, of which a run has few: an audit
#: window of one outer step at every outer step; the exchange starts on rung ``GOVERNOR_START``
#: (8-bit codes) and climbs a rung after each ``GOVERNOR_HOLD`` outer steps within budget (chosen
#: on the workload zoo's tuning half, BENCHMARKS.md)
GOVERNOR_EVERY, GOVERNOR_WINDOW, GOVERNOR_HOLD, GOVERNOR_START = 1, 1, 5, 2


class DiLoCo(Optimizer):
    """Local steps with compressed, error-fed-back outer gradients (see the module docstring).

        outer = gradcomp.optim.DiLoCo(params, sync_every=20, compressor="int8")
        for step in range(steps):
            inner_step(params)        # this rank's own optimizer, in place, no communication
            outer.step()              # every sync_every calls: the outer step, params synced

    ``params``: this rank's replica (NumPy or CuPy arrays updated in place by the inner
    optimizer), the same values on every rank at construction. ``compressor``: a gradcomp
    compressor or a registry name (a name's own exact warm-up is dropped unless the name sets it:
    ``"int8"`` sends codes from the first outer step; ``"allreduce"`` averages exactly).
    ``"sparseloco"`` (``"sparseloco:density=0.03,bits=4"``): SparseLoCo's exchange
    (``gradcomp.optim.sparseloco``), 2-bit chunked top-k under a decaying accumulator, never governed.
    ``lr``/``momentum``/``nesterov``: the outer optimizer (default Nesterov, lr 0.7, momentum 0.5,
    measured best on the LM; with ``"sparseloco"``, lr 1 and no momentum, the method's own;
    ``lr=1, momentum=0``: plain averaging); given, they win over the exchange's defaults.
    ``fragments``, ``overlap``, ``keep_local``: streaming, see the module docstring. ``step(lr=...)`` may override
    the outer learning rate for one call. ``coordinator``: ranks that come and go (the module
    docstring; ``gradcomp.torch.ft``). ``budget``: the exchange's governor
    (``gradcomp.planning.governor``, audits counted in outer steps: ``GOVERNOR_EVERY``,
    ``GOVERNOR_WINDOW``, ``GOVERNOR_HOLD``) for a compressor that sends fewer bytes than 8-bit
    codes (``"onebit"``, ``"topk"``, ``"int4"``, ``"powersgd"``): where its error costs more than
    ``budget`` times the replicas' own spread, the exchange steps down to 4-bit, then 8-bit codes;
    None: not governed. ``"int8"``, the exact mean and a compressor already governed run as given.
    """

    runaway_advice = "sync more often (a smaller sync_every) or lower the outer learning rate"

    def __init__(self, params: Sequence[Array], sync_every: int = SYNC_EVERY,
                 compressor: Compressor | str = "int8", lr: Hyper | None = None,
                 momentum: float | None = None, nesterov: bool = True, fragments: int = 1,
                 comm: Communicator | None = None, bucket_cap_mb: float = 25.0, overlap: int = 0,
                 coordinator: Coordinator | None = None, budget: float | None = GOVERNOR_BUDGET,
                 keep_local: bool = False):
        sparse = exchange(compressor) if isinstance(compressor, str) else None
        outer = sparse[1] if sparse else {"lr": OUTER_LR, "momentum": OUTER_MOMENTUM}
        fitted = isinstance(compressor, str) and compressor.strip() == "auto"
        #: ``compressor="auto"``: the exchange chosen at the first outer step (``optim.fit``)
        self.fitting = Fitting(lr is not None, momentum is not None, outer) if fitted else None
        if fitted and coordinator is not None:
            raise ValueError("DiLoCo: compressor='auto' chooses the exchange from a probe of the link, "
                             "which a coordinator's changing ranks would not share; name the exchange")
        lr = outer["lr"] if lr is None else lr
        momentum = outer["momentum"] if momentum is None else momentum
        super().__init__(params, lr, 0.0, comm, bucket_cap_mb)
        self.coordinator = coordinator
        self.sync_every = check_int("sync_every", sync_every, 1)
        self.momentum = check_float("momentum", momentum, minimum=0, maximum=0.999999)
        self.nesterov = check_bool("nesterov", nesterov)
        self.fragments = check_int("fragments", fragments, 1, len(self.params))
        self.keep_local = check_bool("keep_local", keep_local)
        if self.keep_local and coordinator is not None:
            raise ValueError("DiLoCo: keep_local is not supported with a coordinator (torchft): a rank that "
                             "heals takes its peers' state, whose own pseudo-gradient is not its own")
        # (dropping the local steps, an exchange that lands at the next sync would drop them all)
        self.overlap = check_int("overlap", overlap, 0, self.sync_every - (not self.keep_local))
        self.own: dict[int, list[Array]] = {}  # keep_local: each fragment's own pseudo-gradients in flight
        #: fragments whose exchange is in flight: fragment -> (the step it lands after, the
        #: reductions' futures or None once waited for, the outer rates taken at the sync)
        self.flight: dict[int, tuple[int, list | None, list[float]]] = {}
        if self.overlap and coordinator is None:
            flight.wait_at_exit(self)
        self.landed: list[int] = []  # the fragments whose outer step landed at the last step()
        if sparse:
            inner = sparse[0]
        elif fitted:
            inner = FittedExchange()
        else:
            inner = make(steady(compressor, keep_given=True)) if isinstance(compressor, str) else compressor
        if not isinstance(inner, Compressor):
            raise TypeError(f"compressor must be a gradcomp Compressor, a registry name or a local-steps "
                            f"exchange ({', '.join(EXCHANGES)}), got {compressor!r}")
        self.budget = None if budget is None else check_float("budget", budget, above=0)
        if self.budget is not None and not sparse and not isinstance(inner, Governed) and has_safer_rungs(inner):
            inner = Governed(inner, budget=self.budget, every=GOVERNOR_EVERY, window=GOVERNOR_WINDOW,
                             hold=GOVERNOR_HOLD, start=GOVERNOR_START, delay=1)
        self.outer_compressor = inner
        self.outer_steps = 0
        xp = array_module(self.params[0])
        if coordinator is None:  # (a coordinator sees to the same start: no collective here)
            check_same_start(self.comm, self.params)
        self.synced = [p.copy() for p in self.params]
        self.buf = [xp.zeros(p.shape, p.dtype) for p in self.params] if self.momentum else []
        self._arrays = {"synced": self.synced, **({"momentum": self.buf} if self.momentum else {})}
        self.groups = split(self.params, self.fragments)
        self.fitted: list[FittedExchange] = []  # compressor="auto": each fragment's chosen exchange
        self._codes: list[Compressor] = []
        for f in range(len(self.groups)):
            # one compressor per fragment: each keeps its own residuals, keyed by position in it
            code = inner if f == 0 else copy.deepcopy(inner)
            if isinstance(code, FittedExchange):
                self.fitted.append(code)
            self._codes.append(code)
        self.plan(per_tensor=sparse is not None, checked=coordinator is None)
        self._total = sum(int(p.size) for p in self.params)

    def plan(self, per_tensor: bool, checked: bool = False) -> None:
        """Each fragment's reducer: DiLoCo's buckets, or (``per_tensor``) one bucket per tensor for a
        sparse exchange, which chunks each tensor on its own as SparseLoCo does (a chunk across
        tensors of other scales would send the larger one's values only; BENCHMARKS.md, 12).
        ``checked``: the ranks compare the buckets here (a collective); else the agreement of the
        first exchange does (coordinated ranks, and ``auto``'s choice)."""
        self.per_tensor = per_tensor
        self.reducers: list[GradientReducer] = []
        for code, members in zip(self._codes, self.groups):
            arrays = [self.params[i] for i in members]
            own = [[i] for i in range(len(arrays))] if per_tensor else None
            planned = {"buckets": own} if checked else {"_groups": own or group(arrays, self.bucket_cap_mb)}
            self.reducers.append(GradientReducer(arrays, _Agreed(code, self), self.comm, self.bucket_cap_mb,
                                                 hierarchical=False, window=2 if self.in_replica else None,
                                                 **planned))
        self.reducer = self.reducers[0]
        self.compressor = self.reducer.compressor
        self._deltas = ([[self.params[i] for i in members] for members in self.groups] if self.in_replica
                        else [r.gradients for r in self.reducers])

    @property
    def in_replica(self) -> bool:
        """Whether the pseudo-gradients live in the replica, which the landing overwrites (module docstring)."""
        return not self.overlap and not self.keep_local and self.coordinator is None

    # -- configuration and agreement -------------------------------------------------------------------
    def config(self) -> dict[str, Any]:
        momentum = "auto" if self.fitting is not None and not self.fitting.momentum_given else self.momentum
        return {"sync_every": self.sync_every, "compressor": self.outer_compressor.describe(),
                "momentum": momentum, "nesterov": self.nesterov, "fragments": self.fragments,
                **({"overlap": self.overlap} if self.overlap else {}),
                **({"keep_local": True} if self.keep_local else {})}

    def phase(self) -> str:
        """The outer steps so far: agreed on by every rank with the inner step at each sync."""
        return f"outer step {self.outer_steps}"

    def due(self, step: int | None = None) -> list[int]:
        """The fragments synced after inner step ``step`` (default: the next one, ``steps + 1``)."""
        t = self.steps + 1 if step is None else step
        return [f for f in range(self.fragments)
                if t > 0 and t % self.sync_every == (f + 1) * self.sync_every // self.fragments % self.sync_every]

    # -- the step ----------------------------------------------------------------------------------------
    def acts(self) -> bool:
        """Whether the next ``step()`` starts or lands an exchange (reads or writes ``params``)."""
        return bool(self.due()) or any(at == self.steps + 1 for at, _, _ in self.flight.values())

    def step(self, grads: Sequence[Array] | None = None, lr: Hyper | None = None,
             weight_decay: Hyper | None = None) -> None:
        """Count one inner step (taken by the caller's optimizer on ``params``); on every
        ``sync_every``-th (per fragment, when streaming) run the outer step, or start its exchange
        and land it ``overlap`` steps later. ``grads`` must be None (the inner optimizer consumed
        them); ``lr``: the outer rate for this call. ``landed`` then lists the fragments whose outer
        step landed (their parameters are the same bits on every rank unless ``keep_local``)."""
        if grads is not None or weight_decay is not None:
            raise TypeError("DiLoCo.step takes no gradients or weight decay: the inner optimizer "
                            "steps the gradients, DiLoCo.step() counts that step and syncs when due")
        due = self.due()
        if self._fit_pending():
            self.fitting.tick()  # type: ignore[union-attr]
            if due:
                self.fitting.run(self)  # type: ignore[union-attr]
        rates, _ = self._hyper(lr, None)
        self.steps += 1
        landed = self._land_due()
        if due:
            landed += self.sync(due, rates, self.steps + self.overlap)
        self.landed = landed

    def sync_now(self, lr: Hyper | None = None) -> None:
        """An outer step of every fragment now, off schedule (before evaluating, or at the end of
        training), after landing any exchange in flight; collective: every rank must call it at
        the same point."""
        for at in sorted({at for at, _, _ in self.flight.values()}):
            self._land_due(at)
        if self._fit_pending():
            self.fitting.run(self)  # type: ignore[union-attr]
        rates, _ = self._hyper(lr, None)
        self.sync(list(range(self.fragments)), rates, self.steps)

    def _fit_pending(self) -> bool:
        """Whether ``compressor="auto"`` has yet to choose (at the first outer step)."""
        return self.fitting is not None and self.fitted[0].chosen < 0

    def sync(self, fragments: list[int], rates: list[float], lands_at: int) -> list[int]:
        """One outer step of ``fragments``: their exchange started, landing after inner step
        ``lands_at`` (now, or ``overlap`` steps on); the fragments landed now. ``step`` and
        ``sync_now`` call it; a coordinator calls it for a joining rank, to take part in the outer
        step its peers are in."""
        if self.coordinator is not None:
            theirs = self.coordinator.begin(self, fragments, lands_at, rates)
            if theirs is not None:  # this rank fell behind and took its peers' state
                fragments, lands_at, rates = theirs
        self._step_lr = rates  # (agreed on with the step: a joining rank's are its peers')
        self.outer_steps += 1
        for f in fragments:
            self._start(f, rates, lands_at)
        return self._land_due() if lands_at == self.steps else []

    def _start(self, f: int, rates: list[float], lands_at: int) -> None:
        """Fragment ``f``'s pseudo-gradients, their mean started on the pipeline."""
        for d, i in zip(self._deltas[f], self.groups[f]):
            array_module(d).subtract(self.synced[i], self.params[i], out=d)
        if self.in_replica:  # averaged now, in the replica (overwritten by the landing, now)
            self.reducers[f].step(self._deltas[f])
            self.flight[f] = (lands_at, None, rates)  # (None: waited for)
            return
        if self.keep_local and lands_at > self.steps:
            flight.keep_own(self.own, f, self._deltas[f])
        else:
            self.own.pop(f, None)
        reducer = self.reducers[f]
        futures = reducer.start() if self.coordinator is None else self.coordinator.start(self, reducer)
        self.flight[f] = (lands_at, [] if futures is None else futures, rates)  # []: withheld

    def _land_due(self, step: int | None = None) -> list[int]:
        """The outer step of the fragments whose exchange lands after inner step ``step`` (default:
        this one), one outer step together; the fragments landed (none if it was discarded)."""
        at = self.steps if step is None else step
        fragments = [f for f, (lands, _, _) in sorted(self.flight.items()) if lands == at]
        if not fragments:
            return []
        scale: float | None = 1.0
        if self.coordinator is None:
            for f in fragments:
                _, futures, _ = self.flight[f]
                if futures is not None:
                    self.reducers[f].finish(futures)
        else:
            scale = self.coordinator.end(self, fragments, self._finish_all(fragments))
        rates = {f: self.flight.pop(f)[2] for f in fragments}
        if scale is None:
            timeline.instant("outer step discarded", "decision", step=at, fragments=fragments)
            return []  # discarded: the coordinator undid the exchange; the replica is left as it is
        for f in fragments:
            self._land(f, rates[f], scale)
        if timeline.enabled:
            timeline.instant("outer step", "decision", step=at, outer_step=self.outer_steps, fragments=fragments,
                             bytes=float(sum(self.reducers[f].compressor.stats()["bytes_sent"] for f in fragments)))
        return fragments

    def _finish_all(self, fragments: list[int]) -> BaseException | None:
        """Wait for every exchange of ``fragments`` (none left running, whatever failed) and write
        the means; the first failure, or None."""
        error: BaseException | None = None
        for f in fragments:
            _, futures, _ = self.flight[f]
            if futures is None:
                continue  # waited for already (a checkpoint's)
            if not futures:
                error = error or RuntimeError(f"fragment {f}'s exchange did not run (withheld)")
                continue
            wait(futures)
            try:
                self.reducers[f].finish(futures)
            except Exception as exc:
                error = error or exc
        return error

    def _land(self, f: int, rates: list[float], scale: float = 1.0) -> None:
        """Fragment ``f``'s outer step from its mean pseudo-gradient (the same bits on every rank),
        times ``scale`` (a coordinator's: the mean over the ranks that contributed), written into
        the synced parameters and the replica (``keep_local``, landing after the sync: added to
        the replica with its own pseudo-gradient, which keeps the local steps taken since)."""
        mu = self.momentum
        own = self.own.get(f)
        for j, (d, i) in enumerate(zip(self._deltas[f], self.groups[f])):
            kind = d.dtype.type
            if scale != 1.0:
                d *= kind(scale)
            update = d
            if mu:
                b = self.buf[i]
                b *= kind(mu)
                b += d
                if self.nesterov:
                    d += kind(mu) * b
                else:
                    update = b
            if rates[i] != 1.0:
                update = kind(rates[i]) * update
            self.synced[i] -= update
            if own is None:
                self.params[i][...] = self.synced[i]
            else:
                self.params[i] += own[j]
                self.params[i] -= update

    # -- traffic and checkpoints ---------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """``bytes_sent`` (this rank, all fragments), ``reference_bytes``: what DDP's fp32 allreduce
        of the gradients at every inner step would have sent over the same steps, their ratio
        ``compression_ratio``, the inner ``steps`` and ``outer_steps``."""
        parts = [r.compressor.stats() for r in self.reducers]
        sent = float(sum(s["bytes_sent"] for s in parts))
        # (a coordinated run's ranks come and go: counted at the current size)
        reference = wire_bytes("allreduce", 4.0 * self._total, self.comm.size) * self.steps
        return {"bytes_sent": sent, "reference_bytes": reference,
                "compression_ratio": reference / sent if sent else 1.0,
                "bytes_sent_per_step": sent / max(self.steps, 1), "steps": self.steps,
                "outer_steps": self.outer_steps, "optimizer_step": self.steps, "phase": self.phase(),
                "exchange_compression_ratio": (sum(s["reference_bytes"] for s in parts) / sent) if sent else 1.0,
                **governors(self.reducers),
                **({"fit": self.fitting.stats(self)} if self.fitting is not None else {})}

    def state_dict(self) -> dict[str, Any]:
        """The inner step, the outer step, the synced parameters, the outer momentum, each
        fragment's compressor state (residuals) under ``exchange/`` (``exchange/<f>/`` streaming),
        and each exchange in flight under ``flight/<f>/`` (waited for: its averaged
        pseudo-gradient, its outer rates and the step it lands after)."""
        out: dict[str, Any] = {"config": self.describe(), "step": self.steps, "outer_step": self.outer_steps}
        out.update(flight.save(self))
        for name, arrays in self._arrays.items():
            for i, a in enumerate(arrays):
                out[f"{name}/{i}"] = np.array(to_host(a), copy=True)
        for f, r in enumerate(self.reducers):
            prefix = "exchange/" if self.fragments == 1 else f"exchange/{f}/"
            out.update({prefix + k: v for k, v in r.compressor.state_dict().items()})
        out.update(saved_by(self.comm))
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output; everything is checked (a ValueError naming the key)
        before anything changes."""
        state = dict(state)
        owner = type(self).__name__
        take_config(state, owner, self.describe(), "optimizer")
        step = take_int(state, "step", owner)
        outer = take_int(state, "outer_step", owner)
        loaded = self._take_arrays(state, owner)
        in_flight = flight.take(self, state, owner, step)
        exchanges = []
        for f in range(self.fragments):
            prefix = "exchange/" if self.fragments == 1 else f"exchange/{f}/"
            exchanges.append({k[len(prefix):]: state.pop(k) for k in [k for k in state if k.startswith(prefix)]})
        self._check_saved_here(state, {k: v for e in exchanges for k, v in e.items()}, owner)
        reject_leftovers(state, owner)
        for r, part in zip(self.reducers, exchanges):
            r.compressor.load_state_dict(part, r.shapes)
        if self.fitting is not None and not self._fit_pending():
            self.fitting.apply(self, self.fitted[0].chosen)
        for name, arrays in self._arrays.items():
            for a, value in zip(arrays, loaded[name]):
                a[...] = array_module(a).asarray(value)
        self.steps, self.outer_steps = step, outer
        flight.restore(self, in_flight)
