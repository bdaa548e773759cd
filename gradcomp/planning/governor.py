"""The governor: a lossy method that measures what its compression costs while it trains, and
steps down to safer codes where the cost is over its budget.

Whether a method's residual, sparsity or rank matters depends on the workload: the same recipe
held on one model and lost 10+ points on another (issue 57). So the governor measures, on the
model it runs on, how far compression moves the updates against the noise the exact mean has.

**What is measured.** Every ``every`` steps, and at once when what reduces a bucket changes
(a warm-up's end, another rung), each bucket runs an audit window of ``window`` steps: on a fixed
sample of its coordinates (the same on every rank, at least ``PER_TENSOR`` of each tensor, in
all about as many as cost ``SHARE`` of the method's bytes over a period), each rank also sends
its gradient exactly (a small float64 allreduce, counted in ``bytes_sent``). Over the window it
sums ``D``, the compressed mean minus the exact mean (error feedback delivers late what it held
back, so the window sees the delay the optimizer's averaging sees), and per tensor ``E``, the
exact mean's variance (the ranks' spread over their number). A tensor's cost is ``|D|^2 / E``
(1 adds as much noise again, as if each batch were halved); the window's is its worst tensor's,
so a norm's gain or a bias that one scale per bucket gets wrong is not averaged away.

**What is decided.** The rungs: the method, then 4-bit and 8-bit two-stage codes with error
feedback at both stages (``int4``'s and ``int8``'s steady methods). A bucket over ``budget``
steps one rung down, its residual handed over as a ``Schedule`` hands it between stages; after
``hold`` steps it tries the rung above again, and one that fails again holds twice as long. The
divergence guard acts through it: a runaway moves every bucket a rung down. Under an optimizer
that scales each coordinate by its own magnitude (``adapt``) a bucket starts a rung down and the
method must hold ``ADAPTIVE_SHARE`` of the budget. Rungs are kept per tensor (they survive DDP's
bucket rebuild); a bucket runs at the lowest rung of its tensors.

**Agreement.** The audit's sums come from allreduced values, the same bits on every rank, and
what each rank computes from them alone is the same bits on any CPU (``gradcomp.exact``), so
every rank decides alike; each bucket's rung is agreed state (DESIGN invariant 3). A decision
taken at step ``s`` applies from ``s + DELAY``, past any job of ``s + 1`` the pipeline prepared
ahead. Rungs, holds, open windows and every rung's state are checkpointed: a resume continues
bit for bit. ``stats()["governor"]`` has each tensor's rung, the steps per rung and each
decision with its cost and why. FSDP's ``scatter`` buckets run at their rung, never audited
(each rank holds only its row of the mean).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from .. import timeline
from ..arrays import Array, array_module, to_host
from ..bucket import Bucket, StepCount, digest
from ..comm import Communicator, Workspace
from ..comm.protocol import method_traffic
from ..compressors.contract import Compressor
from ..exact import sums
from ..params import check_float, check_int
from ..schedule import Routed, Stages, hand_over, load_stage_states, stage_states, take_stage_states
from ..state import ClaimCheck, check_array, reject_leftovers, take_int
from .audit import Plan, Sample, Window, tensor_costs, window_cost
from .rungs import DELAY, HOLD, LEVELS, RUNGS, Rungs, TensorRung, ladder

#: the default budget: compression may add at most this multiple of the exact mean's own noise
#: to the updates of an audit window (chosen on the workload zoo's tuning half, BENCHMARKS.md)
BUDGET = 1.0
#: the share of the budget that holds under an optimizer that scales each coordinate by its own
#: magnitude (Adam, RMSprop: ``adaptive``): it steps a small coordinate as far as a large one, so
#: an error small against the whole gradient is not small against the coordinates it falls on
ADAPTIVE_SHARE = 0.25
#: under such an optimizer a method starts a rung down and is tried after this many steps (on
#: the zoo's tuning half, even the steps before a first audit cost the methods too much)
ADAPTIVE_HOLD = 400
#: steps between the starts of two audit windows, and the steps of one window
EVERY, WINDOW = 50, 10
#: the audit's bytes over a period as a share of the method's (the sample's size follows from
#: the method's declared traffic), and the fewest coordinates sampled
SHARE, MIN_SAMPLES = 0.02, 64
#: the decisions kept for ``stats()``
KEPT = 50
@dataclass
class _Prepared(Routed):
    step: int = 0  # (its ``stage`` is the rung)
    sample: Array | None = None  # this rank's gradient on the sample, then its squares per tensor
    audited: Sample | None = None
    fresh: bool = False  # the first step of a window
    decide: bool = False  # the last step of a window


class Governed(Stages):
    """``method``, governed: see the module. ``budget``: the largest cost allowed (``BUDGET``).
    ``start``: the rung a tensor starts at (0: the method), climbing a rung after each ``hold``
    steps within budget (DiLoCo's exchange starts on 8-bit codes: its first outer steps carry its
    largest updates). ``delay``: ``DELAY``'s."""

    def __init__(self, method: Compressor, budget: float = BUDGET, every: int = EVERY, window: int = WINDOW,
                 hold: int = HOLD, start: int = 0, delay: int = DELAY):
        super().__init__(method)  # what it declares where it says nothing else: the method's
        self.budget = check_float("budget", budget, above=0)
        self.below = ladder()
        self.every = check_int("every", every, 1)
        self.window = check_int("window", window, 1)
        if self.window > self.every:
            raise ValueError(f"governor window ({self.window} steps) is longer than its period ({self.every})")
        self.hold, self.delay = check_int("hold", hold, 1), check_int("delay", delay, 1)
        self.start = check_int("start", start, 0, LEVELS - 1)
        self._steps = StepCount()
        self._tensors: dict[str, TensorRung] = {}
        self._windows: dict[str, Window] = {}   # first key of the bucket -> its open window
        self._plans: dict[str, Plan] = {}       # first key of the bucket -> when it is audited
        self.decisions: list[dict[str, Any]] = []
        self.audits: list[tuple[int, int, float]] = []  # (step, level, cost) of the latest windows
        self.audit_bytes = 0.0
        self._runaway_seen = False
        #: the optimizer scales each coordinate by its own magnitude: ``ADAPTIVE_SHARE`` of the
        #: budget holds (set by ``gradcomp.torch`` at the first step of an Adam-like optimizer)
        self.adaptive = False
        self._costs: dict[str, float] = {}  # each tensor's cost at its last audit (stats only)
        self._samples: dict[tuple, Sample] = {}  # layout -> audited coordinates
        self._claims = ClaimCheck()  # loaded rungs whose tensor no bucket of the next step carries

    # -- what it declares: the method's (``Stages``: where the rungs differ, what holds for all) ----
    @property
    def method(self) -> Compressor:
        """The governed method: the first rung."""
        return self.inner

    @property
    def levels(self) -> list[Compressor]:
        return [self.method, *self.below]

    @property
    def stages(self) -> list[Compressor]:
        return self.levels

    def last_stages(self) -> dict[str, int]:
        return {k: t.last for k, t in self._tensors.items()}

    def config(self) -> dict[str, Any]:
        return {"method": self.method, "budget": self.budget, "every": self.every, "window": self.window,
                "hold": self.hold, **({"start": self.start} if self.start else {}),
                **({"delay": self.delay} if self.delay != DELAY else {})}

    def describe(self) -> str:
        return f"{self.method.describe()} governed (budget {self.budget:g})"

    @property
    def step(self) -> int:
        return self._steps.count

    # -- one bucket -------------------------------------------------------------------------------
    def _tensor(self, key: str) -> TensorRung:
        t = self._tensors.get(key)
        if t is None:
            t = self._tensors[key] = TensorRung(hold=self.hold)
            if self.start:
                t.level = t.before = self.start
                t.retry = self.step + self.hold
            elif self.adaptive:  # a tensor first seen under an adaptive optimizer starts a rung down
                t.level = t.before = 1
                t.hold, t.retry = ADAPTIVE_HOLD, self.step + ADAPTIVE_HOLD
        return t

    def adapt(self) -> None:
        """The optimizer scales each coordinate by its own magnitude (``adaptive``): from two
        steps on, every bucket runs a rung down and tries the method after ``ADAPTIVE_HOLD``
        steps, kept where it holds ``ADAPTIVE_SHARE`` of the budget. Call it between steps, on
        every rank alike (``gradcomp.torch`` does, at an Adam-like optimizer's first step)."""
        if self.adaptive:
            return
        self.adaptive = True
        for t in self._tensors.values():
            if t.at(self.step) == 0:
                t.move(1, self.step, ADAPTIVE_HOLD, self.delay)
        self._note(self.step, list(self._tensors), RUNGS[1], math.nan,
                   "an adaptive optimizer (Adam-like) steps these tensors: the method must earn its rung")

    @property
    def limit(self) -> float:
        """The cost allowed now: ``budget``, or its ``ADAPTIVE_SHARE`` under an adaptive optimizer."""
        return self.budget * (ADAPTIVE_SHARE if self.adaptive else 1.0)

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> _Prepared:
        step = self._steps.take(bucket)
        if self._claims.pending:
            self._claims.saw(bucket, [Rungs(self._tensors)], "governed compressor")
        tensors = [self._tensor(k) for k in bucket.keys]
        level = max((t.at(step) for t in tensors), default=0)
        # each rung may get some of a step's buckets and not the last: stamped with the step
        bucket = hand_over(self, self.levels, [t.last for t in tensors], level, bucket, workspace).routed(step)
        for t in tensors:
            t.last = level
            t.steps[level] += 1
        job = _Prepared(level, bucket, None, step)
        plan = self._plan(bucket, step) if comm.size > 1 else None
        if plan is not None and (plan.seen or step >= plan.opens):
            job.fresh, plan.seen = plan.seen == 0, plan.seen + 1
            job.decide = plan.seen == self.window
            if job.decide:
                plan.seen, plan.opens = 0, step + 1 + self.every - self.window
            job.audited = self._sample(bucket)
            xp = array_module(bucket.buffer)
            values = np.asarray(to_host(bucket.buffer[xp.asarray(job.audited.where)]), np.float64)
            squares = np.add.reduceat(values * values, job.audited.starts[:-1]) if values.size else values
            job.sample = xp.asarray(np.concatenate([values, squares]))
        job.inner = self.levels[level].prepare(bucket, comm, workspace)
        if plan is not None:
            regime = digest(repr(self.regime(job)))
            if plan.regime not in (-1, regime):  # what reduces it changed: audit the new one now
                plan.seen, plan.opens = 0, step + 1
            plan.regime = regime
        return job

    def _plan(self, bucket: Bucket, step: int) -> Plan | None:
        """The bucket's audit plan (none for a scatter bucket, each rank holding a row of the
        mean, or an empty one; the caller asks for none on one rank, where the exact mean has no
        spread to weigh compression against): its first window closes at the end of a period."""
        if bucket.scatter or not bucket.numel:
            return None
        first = bucket.keys[0] if bucket.keys else ""
        plan = self._plans.get(first)
        if plan is None:
            start = self.every - self.window
            plan = self._plans[first] = Plan(step + (start - step) % self.every)
        return plan

    def finish(self, bucket: Bucket, comm: Communicator, prepared: _Prepared) -> Array:
        out = super().finish(bucket, comm, prepared)
        if prepared.sample is not None:
            self._audit(prepared, comm, out)
        return out

    def _audit(self, prepared: _Prepared, comm: Communicator, out: Array) -> None:
        """One audited step of a bucket: the exact mean on the sample, the window's sums, and at
        the window's end the decision."""
        assert prepared.audited is not None
        before, _ = method_traffic(comm)
        with timeline.span("audit", "audit"):
            total = comm.allreduce(prepared.sample, overwrite=True)
        after, _ = method_traffic(comm)
        self.audit_bytes += after - before
        total = np.asarray(to_host(total), np.float64)
        n = comm.size
        where, starts = prepared.audited.where, prepared.audited.starts
        exact = total[:where.size] / n
        own = sums(exact * exact, starts) if where.size else exact  # exactly rounded: the same on any CPU
        spread = np.maximum(total[where.size:] / n - own, 0.0)  # per tensor: mean over ranks of |g_r - mean|^2
        keys = prepared.bucket.keys
        first = keys[0] if keys else ""
        w = self._windows.get(first)
        if prepared.fresh or w is None or w.keys != tuple(keys) or w.d.size != exact.size:
            w = self._windows[first] = Window(tuple(keys), np.zeros(exact.size), np.zeros(spread.size))
        got = np.asarray(to_host(out[array_module(out).asarray(where)]), np.float64)
        w.d += got - exact
        w.e += spread / n
        w.steps += 1
        if prepared.decide:
            del self._windows[first]
            self._decide(prepared, w)

    def _decide(self, prepared: _Prepared, w: Window) -> None:
        """At a window's end: a rung over budget steps down (a failed try of the rung above goes
        back, holding twice as long); a rung within it stays, and a successful try is kept."""
        assert prepared.audited is not None
        each = tensor_costs(w.d, w.e, prepared.audited.starts)
        cost, at = window_cost(each)
        worst = w.keys[int(prepared.audited.tensors[at])] if at >= 0 else ""
        step, ran = prepared.step, prepared.stage
        limit = self.limit
        over = cost > limit
        why = (f"compression added {cost:.3g}x the exact mean's noise to {worst!r} over {w.steps} steps "
               f"({'over' if over else 'within'} budget {limit:g}{' under an adaptive optimizer' if self.adaptive else ''})")
        moved = []
        for i, c in zip(prepared.audited.tensors, each):
            self._costs[w.keys[i]] = float(c)
        for key in w.keys:
            t = self._tensor(key)
            if t.since > step:  # a decision already taken applies after this window (a short one)
                continue
            tried = ran < t.level  # the rung above, tried after its hold
            if over and ran < LEVELS - 1:
                t.move(ran + 1, step, 2 * t.hold if tried else self.hold, self.delay)
                moved.append(key)
            elif not over and tried:
                t.move(ran, step, self.hold, self.delay)
                moved.append(key)
        if moved:
            self._note(step, moved, RUNGS[self._tensor(moved[0]).level], cost, why)
        self.audits.append((int(step), int(ran), float(cost)))
        del self.audits[:-KEPT]
        timeline.instant("audit", "decision", step=int(step), rung=RUNGS[ran], cost=float(cost), budget=limit,
                         over=over, worst=worst, tensors=len(w.keys), bytes=self.audit_bytes)

    def _step_down_all(self, step: int, why: str) -> None:
        for key, t in self._tensors.items():
            if t.at(step) < LEVELS - 1:
                t.move(t.at(step) + 1, step, self.hold, self.delay)
        self._note(step, list(self._tensors), "one rung down", math.nan, why)

    def _note(self, step: int, keys: Sequence[str], to: str, cost: float, why: str) -> None:
        self.decisions.append({"step": int(step), "tensors": list(keys)[:8], "to": to, "cost": float(cost),
                               "why": why})
        del self.decisions[:-KEPT]
        timeline.instant("rung change", "decision", step=int(step), to=to, cost=float(cost), budget=self.limit,
                         tensors=list(keys), why=why)

    def after_runaway(self, prepared: Any) -> None:
        """Every bucket a rung down, once (the guard watches this governor, or the optimizer's
        exchange around it: on every rank at the same bucket, so at the same step)."""
        if not self._runaway_seen and isinstance(prepared, _Prepared):
            self._runaway_seen = True
            self._step_down_all(prepared.step, "the divergence guard saw a residual run away")

    def agreement_state(self, bucket: Bucket, prepared: _Prepared | None) -> dict[str, Any]:
        if prepared is None:
            return {"step": self.step}
        return {"step": prepared.step, "level": prepared.stage, "audit": prepared.sample is not None,
                "adaptive": self.adaptive, **self.stage_agreement(prepared, f"level{prepared.stage}")}

    # -- what it says and keeps -------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        s = super().stats()
        steps = [sum(t.steps[i] for t in self._tensors.values()) for i in range(LEVELS)]
        s["governor"] = {
            "budget": self.budget,
            "limit": self.limit,
            "levels": {k: RUNGS[t.at(self.step)] for k, t in self._tensors.items()},
            "tensor_steps": dict(zip(RUNGS, steps)),
            "last_cost": dict(self._costs),
            "decisions": list(self.decisions),
            "audits": list(self.audits),
            "audit_bytes": self.audit_bytes,
            "audit_share": self.audit_bytes / s["bytes_sent"] if s["bytes_sent"] else 0.0,
        }
        # the method's own keys too (its recipe, warm-up end, ...); the traffic is counted here
        return {**{k: v for k, v in self.method.stats().items() if k not in s}, **s}

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": self.step, "audit_bytes": self.audit_bytes,
                               "runaway_seen": int(self._runaway_seen), "adaptive": int(self.adaptive)}
        for key, t in sorted(self._tensors.items()):
            out[f"tensor/{key}"] = t.row()
        for first, w in sorted(self._windows.items()):
            out[f"window/{first}/keys"] = "\n".join(w.keys)
            out[f"window/{first}/d"] = w.d.copy()
            out[f"window/{first}/e"] = np.concatenate([[float(w.steps)], w.e])  # steps, then per tensor
        for first, plan in sorted(self._plans.items()):
            out[f"plan/{first}"] = plan.row()
        return {**out, **stage_states(self.levels, "level")}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        state = dict(state)
        owner = "governed compressor"
        step = take_int(state, "step", owner)
        audit_bytes = float(np.asarray(state.pop("audit_bytes", 0.0)))
        runaway = bool(take_int(state, "runaway_seen", owner)) if "runaway_seen" in state else False
        adaptive = bool(take_int(state, "adaptive", owner)) if "adaptive" in state else False
        tensors: dict[str, TensorRung] = {}
        windows: dict[str, Window] = {}
        for name in [k for k in state if k.startswith("tensor/")]:
            row = check_array(state.pop(name), name, owner, shape=(6 + LEVELS,), dtypes=("int64",))
            level, since, before, retry, hold, last = (int(v) for v in row[:6])
            if not (0 <= level < LEVELS and 0 <= before < LEVELS and -1 <= last < LEVELS and hold >= 1):
                raise ValueError(f"{owner} state: {name!r} holds {row.tolist()}: the rung, the one before "
                                 f"and the last are below {LEVELS} (last -1: none yet), the hold at least 1")
            tensors[name[len("tensor/"):]] = TensorRung(level, since, before, retry, hold, last,
                                                     [int(v) for v in row[6:]])
        for name in [k for k in state if k.startswith("window/") and k.endswith("/keys")]:
            first = name[len("window/"):-len("/keys")]
            keys = tuple(str(np.asarray(state.pop(name))).split("\n"))
            d = check_array(state.pop(f"window/{first}/d", None), f"window/{first}/d", owner, dtypes=("float64",), ndim=1)
            e = check_array(state.pop(f"window/{first}/e", None), f"window/{first}/e", owner, dtypes=("float64",),
                            ndim=1)
            if e.size < 2:
                raise ValueError(f"{owner} state: 'window/{first}/e' holds {e.size} values: the window's steps, then "
                                 "each audited tensor's variance")
            windows[first] = Window(keys, np.asarray(d, np.float64).copy(), np.asarray(e[1:], np.float64).copy(),
                                     int(e[0]))
        plans: dict[str, Plan] = {}
        for name in [k for k in state if k.startswith("plan/")]:
            row = check_array(state.pop(name), name, owner, shape=(3,), dtypes=("int64",))
            plans[name[len("plan/"):]] = Plan(*(int(v) for v in row))
        parts = take_stage_states(self.levels, state, "level")
        reject_leftovers(state, owner)
        load_stage_states(self.levels, parts, shapes)
        self._steps, self.audit_bytes, self._runaway_seen, self.adaptive = StepCount(step), audit_bytes, runaway, adaptive
        self._tensors, self._windows, self._plans = tensors, windows, plans
        self._claims.loaded()

    def _sample(self, bucket: Bucket) -> Sample:
        """The audited coordinates of ``bucket``, as many as ``SHARE`` of the method's bytes over
        a period pays for (float64 values, sent ``window`` times). Kept per layout."""
        key = (bucket.numel, tuple(map(tuple, bucket.shapes)))
        found = self._samples.get(key)
        if found is None:
            n = bucket.numel
            try:
                t = self.method.traffic(bucket.shapes, 2, bucket.buffer.dtype.itemsize)
                sent = sum(part.message_bytes for part in (t,) + t.extra)
            except TypeError:  # a method that does not declare its traffic: one in a thousand
                sent = n * 4 / 1000 * self.window / (SHARE * self.every)
            count = min(n, max(MIN_SAMPLES, int(SHARE * sent * self.every / (8 * self.window))))
            found = self._samples[key] = Sample.of(bucket, count)
        return found
