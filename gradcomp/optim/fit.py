"""``DiLoCo(..., compressor="auto")``: the outer exchange chosen to fit the link under the local steps.

A sparser exchange costs less link time per outer step but more steps to the same loss; the one to
choose is the one that reaches a loss soonest. At the first outer step every rank has timed its
inner steps (the intervals between ``DiLoCo.step`` calls: their median, the slowest rank's) and the
link is probed (``planning.measurements.probe_link``, sized to the link: about two seconds at most
on any link, a 1 Mbit/s one included). Each candidate's exchange of every fragment's buckets (a
sparse one's: a bucket per tensor, as it runs) is priced on that link as ``auto`` prices a bucket
(``planning.cost``: a latency per message step and the bytes through a host's link, which carries
its ranks' share, as the candidate declares its traffic), and its time to a loss predicted as

    STEPS[candidate] * (sync_every * inner step + max(0, exchange - overlap * inner step))

per ``sync_every`` steps: ``STEPS`` is how many more steps than ``int8`` the candidate needed to
reach DDP's final loss on the repository's LM (measured, BENCHMARKS.md section 12), and an
exchange hides under the ``overlap`` steps it runs behind. The least wins; a candidate within
``TIE`` of a denser one loses to it. Candidates, densest first: ``CANDIDATES``.

The choice is taken from agreed values only (the same on every rank), joins every bucket's
agreement (``FittedExchange``'s state), is checkpointed, and ``DiLoCo.stats()["fit"]`` reports
it with every candidate's predicted seconds and the reason. The outer optimizer's defaults
follow the chosen exchange (Nesterov for the dense codes, SparseLoCo's lr 1 without momentum for
the sparse ones, unless ``lr=``/``momentum=`` were given), and so do the buckets: one per tensor
for a sparse choice, as for a named sparse exchange (``DiLoCo.plan``).
"""
from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from .. import timeline
from ..bucket import Bucket
from ..comm import Communicator, Workspace
from ..compressors.contract import Compressor, run_stage
from ..compressors.wrapper import Wrapper
from ..planning import cost
from ..planning.measurements import probe_link, slowest, topology
from ..registry import make, steady
from ..state import reject_leftovers, take_int
from .optimizer import per_param
from .sparseloco import exchange

#: the candidates, densest first: 8- and 4-bit codes (two stages), then SparseLoCo's exchange at
#: 1/16 and 1/64 of each chunk (bytes per float32 value: about 0.5, 0.25, 0.031, 0.0071). 1/256 is
#: left out: on the LM below it ended its 3000-step schedule 9% above DDP's final loss, never
#: reaching it (a time to that loss it does not have); name it to use it.
CANDIDATES = ("int8", "int4", "sparseloco:density=0.0625", "sparseloco")
#: steps to DDP's final loss on the repository's LM relative to int8's (4 ranks, H = 20, a
#: 3000-step schedule, evaluated every 20 steps; BENCHMARKS.md section 12): int8 and int4 reached
#: it at step 1400, sparseloco (a bucket per tensor) at 1/16 at 1900, at 1/64 at 2320.
STEPS = {"int8": 1.0, "int4": 1.0, "sparseloco:density=0.0625": 1900 / 1400, "sparseloco": 2320 / 1400}
#: a candidate must be this much faster than a denser one to be chosen over it
TIE = 0.02


def build(spec: str) -> tuple[Compressor, dict[str, float] | None]:
    """A candidate and its outer defaults (None: DiLoCo's own)."""
    sparse = exchange(spec)
    if sparse is not None:
        return sparse
    return make(steady(spec, keep_given=True)), None


class FittedExchange(Wrapper):
    """One of ``allowed`` (registry names or local-steps exchanges, densest first), chosen once by
    ``choose`` (see the module docstring); every bucket before the choice is refused."""

    def __init__(self, allowed: Sequence[str] = CANDIDATES):
        built = [build(spec) for spec in allowed]
        super().__init__(built[0][0])
        self.allowed = tuple(allowed)
        self.options = [c for c, _ in built]
        self.outer = [o for _, o in built]
        self.chosen = -1
        self.why: dict[str, Any] = {}

    def config(self) -> dict[str, Any]:
        return {"allowed": self.allowed}

    def choose(self, k: int, why: Mapping[str, Any] | None = None) -> None:
        self.chosen = k
        self.inner = self.options[k]
        self.why = dict(why or {})

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Any:
        if self.chosen < 0:
            raise RuntimeError("FittedExchange: no exchange chosen yet (DiLoCo chooses it at its first outer step)")
        return self.inner.prepare(bucket, comm, workspace)

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Any) -> Any:
        return run_stage(self.inner, bucket, comm, prepared)

    def agreement_state(self, bucket: Bucket, prepared: Any) -> dict[str, Any]:
        return {"chosen": self.chosen, **self.inner.agreement_state(bucket, prepared)}

    def stats(self) -> dict[str, Any]:
        return self.inner.stats()

    def state_dict(self) -> dict[str, Any]:
        if self.chosen < 0:
            return {}
        return {"chosen": self.chosen, **{f"chosen/{k}": v for k, v in self.inner.state_dict().items()}}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        state = dict(state)
        owner = "FittedExchange"
        if not state:
            self.chosen, self.inner = -1, self.options[0]
            return
        k = take_int(state, "chosen", owner)
        if not 0 <= k < len(self.options):
            raise ValueError(f"{owner} state: 'chosen' is {k}, but there are {len(self.options)} candidates")
        inner = {name[len("chosen/"):]: state.pop(name) for name in [n for n in state if n.startswith("chosen/")]}
        reject_leftovers(state, owner)
        self.options[k].load_state_dict(inner, shapes)
        self.choose(k, {"chosen": self.allowed[k], "why": "loaded from a checkpoint"})


def predict(candidate: Compressor, buckets: Sequence[Sequence[Sequence[int]]], cluster: cost.Cluster) -> float:
    """Seconds of one exchange of ``buckets`` (each a list of tensor shapes) over ``cluster``'s
    network, as ``auto`` prices a flat schedule (``cost.wire_bytes``: a host's link carries every
    rank of the host's share)."""
    total = 0.0
    for shapes in buckets:
        t = cost.traffic(candidate, shapes, cluster.ranks)
        total += cluster.network.time(cost.wire_bytes(t, cluster, False), cost.messages(t, cluster, False))
    return total


def fit(exchange: FittedExchange, buckets: Sequence[Sequence[Sequence[int]]], cluster: cost.Cluster,
        step_s: float, sync_every: int, overlap: int) -> int:
    """The option predicted to reach a loss soonest (see the module docstring); its index, with
    the predictions and the reason kept in ``exchange.why``. The codes are priced on ``buckets``
    (DiLoCo's), a sparse option on the bucket per tensor it runs on (``Fitting.apply``)."""
    own = [[shape] for bucket in buckets for shape in bucket]
    seconds = {spec: predict(c, buckets if defaults is None else own, cluster)
               for spec, c, defaults in zip(exchange.allowed, exchange.options, exchange.outer)}
    compute = sync_every * step_s
    hidden = overlap * step_s
    paced = {spec: STEPS.get(spec, 1.0) * (compute + max(0.0, t - hidden)) for spec, t in seconds.items()}
    k = 0
    for j, spec in enumerate(exchange.allowed):
        if paced[spec] < paced[exchange.allowed[k]] * (1 - TIE):
            k = j
    chosen = exchange.allowed[k]
    reason = (f"the least predicted time to a loss: {paced[chosen]:.3g} s per {sync_every} inner steps' "
              f"progress of int8 ({compute:.3g} s of compute, {seconds[chosen]:.3g} s of exchange"
              + (f", {hidden:.3g} s of it hidden under {overlap} overlapped steps" if overlap else "")
              + f", {STEPS.get(chosen, 1.0):.3g}x int8's steps)")
    exchange.choose(k, {"chosen": chosen, "why": reason, "predicted_s": seconds, "paced_s": paced,
                        "inner_step_s": step_s, "hosts": cluster.hosts, "ranks_per_host": cluster.per_host,
                        "link": {"alpha_s": cluster.network.alpha, "beta_bytes_per_s": cluster.network.beta}})
    return k


class Fitting:
    """What ``DiLoCo(compressor="auto")`` keeps until its first outer step: the intervals between
    its ``step`` calls (its inner steps), and whether the outer optimizer's settings were given."""

    def __init__(self, lr_given: bool, momentum_given: bool, dense: Mapping[str, float]):
        self.lr_given, self.momentum_given = lr_given, momentum_given
        self.dense = dict(dense)  # the outer defaults of the options that set none (DiLoCo's own)
        self.intervals: list[float] = []
        self._last: float | None = None
        self.probe_bytes = 0.0

    def tick(self) -> None:
        """One inner step ended (``DiLoCo.step`` was called)."""
        now = time.perf_counter()
        if self._last is not None:
            self.intervals.append(now - self._last)
        self._last = now

    def run(self, outer: Any) -> None:
        """Measure, choose for every fragment of ``outer`` (a ``DiLoCo``, nothing in flight) and
        apply the chosen exchange's outer defaults (collective: every rank at its first outer step)."""
        comm = outer.comm
        step_s = slowest(comm, float(np.median(self.intervals)) if self.intervals else 0.0)
        before = comm.bytes_sent
        total = sum(int(p.size) for p in outer.params)
        largest = max(1, min(total, int(outer.bucket_cap_mb * (1 << 20) / 4)))
        link = probe_link(comm, largest)
        self.probe_bytes += comm.bytes_sent - before
        exchanges = outer.fitted
        buckets = [[tuple(s) for s in bucket.shapes] for r in outer.reducers for bucket, _ in r.buckets]
        hosts, per_host = topology(comm)
        k = fit(exchanges[0], buckets, cost.Cluster(hosts, per_host, link), step_s, outer.sync_every, outer.overlap)
        for other in exchanges[1:]:
            other.choose(k, exchanges[0].why)
        self.apply(outer, k)
        why = exchanges[0].why
        timeline.instant("exchange fitted", "decision", step=outer.steps, chosen=why["chosen"], reason=why["why"],
                         inner_step_s=step_s, probe_bytes=self.probe_bytes)

    def apply(self, outer: Any, k: int) -> None:
        """The outer optimizer's defaults of option ``k`` (where not given), and its buckets: one
        per tensor for a sparse one, as for a named sparse exchange (``DiLoCo.plan``; the
        compressors, and what a checkpoint loaded into them, stay)."""
        sparse = outer.fitted[0].outer[k] is not None
        if sparse != outer.per_tensor:
            outer.plan(sparse)
        defaults = outer.fitted[0].outer[k] or self.dense
        if not self.lr_given:
            outer.lr = per_param("lr", defaults["lr"], len(outer.params))
        if not self.momentum_given:
            outer.momentum = defaults["momentum"]

    def stats(self, outer: Any) -> dict[str, Any]:
        return {**outer.fitted[0].why, "probe_bytes_sent": self.probe_bytes}
