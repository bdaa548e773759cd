"""``auto``: each bucket's method picked from measurements of this job's link and this machine.

The best method depends on the link (compression that wins at 1 Gbit/s loses at 100 Gbit/s), on
the bucket (int8's per-chunk scales weigh on a tiny bucket, latency dominates small ones) and on
what the method's compute costs here. ``Auto`` measures all three once (``measurements``: the
link's latency and bandwidth, each candidate's compute, the topology), at the first bucket's
ordered stage, after every rank agreed on the configuration.

On several hosts of several ranks every candidate is also priced in the hierarchical schedule
(``Hierarchical``: exact inside the host, the method across it; labelled ``hier-NAME``): a
flat-only choice there lost to the fixed methods' own default schedule (BENCHMARKS.md, section 9).
On one host there is no link to spare: shared memory moves bytes at memory speed, so a method's
casts and codes cost about what they save, and fp32 beat every compressed method there
(BENCHMARKS.md, sections 1 and 9). So a one-host job keeps the first allowed method (``allreduce``
by default) unless a ``table`` says otherwise, and since the topology decides, it measures
nothing: no probe traffic, no timing; ``stats()`` says so per bucket. ``predict=True`` measures
anyway, for ``stats()`` to hold every candidate's prediction (BENCHMARKS.md, section 1, compares
them with measured steps), and still keeps the first method.

For each bucket layout it then predicts every candidate's time with ``cost.Model`` and takes the
fastest in the reducer's pipeline (``cost.pipelined``: a candidate's local stage, its encode,
overlaps the previous bucket's exchange, so it is ranked by its time per bucket in a run of
buckets like this one, not by its seconds alone); ties within 2% go to the earlier candidate
(less compressed: ``allowed`` is in order of increasing compression). The choice depends only on
agreed inputs, so every rank makes the same one; it is part of what ranks agree on before each
bucket (its state), it is checkpointed, and it is kept: ``replan()`` (on every rank) or a change
of layout (DDP's bucket rebuild) chooses again. Residuals move with their tensors when a tensor's
method changes (``Schedule``'s hand-over).

Candidates are the registered names that met the convergence targets as hook-level methods
(BENCHMARKS.md, section 6): ``allreduce``, ``fp16``, ``bf16``, ``int8``, ``int4``. ``allowed``
restricts or widens the set (``auto:allowed=fp16,int8,powersgd``: any registry spec). ``stats()``
says, per bucket, what was chosen, the predicted seconds of every candidate, and why.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .. import timeline
from ..arrays import Array
from ..bucket import Bucket, StepCount, digest
from ..comm import Communicator, Workspace
from ..compressors.contract import Compressor, run_stage, sends_part
from ..compressors.hierarchical import Hierarchical
from ..schedule import from_last, hand_over, load_stage_states, stage_states, take_stage_states
from ..state import reject_leftovers
from . import cost
from .measurements import PROBE_SIZES, Measurements, measure, topology

#: the candidates by default: the hook-level methods within the convergence targets
DEFAULT_ALLOWED = ("allreduce", "fp16", "bf16", "int8", "int4")
#: a candidate wins only by more than this fraction (else the earlier, less compressed one)
TIE = 0.02
#: candidates are ranked by their time per bucket in a pipeline of this many buckets like it
#: (``cost.pipelined``): a local stage that overlaps the previous bucket's exchange is worth less
#: than its seconds
PACED_BUCKETS = 4


#: measurements per communicator and candidate list (see ``Auto.measure``); None: the topology
#: decided, nothing was measured
_MEASURED: "weakref.WeakKeyDictionary[Any, dict[tuple, Measurements | None]]" = weakref.WeakKeyDictionary()


@dataclass
class _Routed:
    """A bucket's chosen option (an index of ``Auto._options``; -1: not chosen yet), the bucket
    (with residuals handed over from another option) and that option's local-stage result."""
    choice: int
    bucket: Bucket
    inner: Any
    step: int = 0  # (this compressor's: options get some of a step's buckets, ``StepCount``)


class Auto(Compressor):
    """Per-bucket choice among ``allowed`` from measured costs (see the module docstring).

    Args:
        allowed: the candidates' registry specs, in order of increasing compression (a sequence,
            or one comma-separated string); a tie goes to the earlier one.
        table: a JSON compute table (``measurements.load_table``) used instead of timing the
            candidates; with one, a one-host job chooses by the model too.
        predict: measure and predict where the topology decides alone (one host), for
            ``stats()`` to hold every candidate's prediction; the choice stays the first method.
    """

    def __init__(self, allowed: Sequence[str] | str = DEFAULT_ALLOWED, table: str | None = None,
                 predict: bool = False):
        super().__init__()
        from ..params import check_bool
        from ..registry import make

        names = [a.strip() for a in allowed.split(",")] if isinstance(allowed, str) else [str(a) for a in allowed]
        if not names or "auto" in [n.partition(":")[0] for n in names]:
            raise ValueError(f"auto: allowed must name one or more methods other than auto, got {allowed!r}")
        self.allowed = tuple(names)
        self.table = table
        self.predict = check_bool("auto predict", predict)
        self.candidates = [make(n) for n in names]
        # every candidate in both schedules: flat (``candidates``, choices 0..n-1) and
        # hierarchical (n..2n-1), which only a topology of several hosts of several ranks offers
        self._options: list[Compressor] = self.candidates + [Hierarchical(make(n)) for n in names]
        self._labels = list(names) + [f"hier-{n}" for n in names]
        self._choices: dict[str, int] = {}      # layout digest -> option (an index of _options)
        self._why: dict[str, dict[str, Any]] = {}
        self._last: dict[str, int] = {}          # tensor key -> option that reduced it last
        self._steps = StepCount()               # (the stamp on what each option gets)
        self._measured: Measurements | None = None  # None: not measured yet, or nothing to measure
        self._probe_bytes = 0.0                  # what this auto's measurement sent

    def config(self) -> dict[str, Any]:
        # predict only when set: it changes no choice, and checkpoints saved before it still load
        return {"allowed": self.allowed, "table": self.table, **({"predict": True} if self.predict else {})}

    @property
    def error_feedback_on(self) -> bool:
        return any(c.error_feedback_on for c in self.candidates)

    @property
    def partial_update(self) -> bool:  # type: ignore[override]
        """Whether a candidate it may choose sends only part of each gradient (the Adam advice)."""
        return any(sends_part(c) for c in self.candidates)

    @property
    def warmup_steps(self) -> int:
        return max(c.warmup_steps for c in self.candidates)

    # -- measurement ---------------------------------------------------------------------------
    def measure(self, comm: Communicator, numel: int = PROBE_SIZES[-1],
                shapes: Sequence[tuple[int, ...]] | None = None) -> Measurements | None:
        """The link, the compute table and the topology, agreed by every rank (collective).

        Args:
            comm: the job's communicator.
            numel: the largest probe, in float32 values (the first bucket's size).
            shapes: the first bucket's tensor shapes, the layout the compute is timed on.

        Returns:
            The measurements (``measurements.measure``), or None where the topology decides
            (one host of several ranks, no ``table``, no ``predict``): then nothing is measured.

        Kept per communicator and candidate list: every ``auto`` of a job sees the same numbers,
        so equal layouts get equal choices.
        """
        key = (self.allowed, self.table, self.predict)
        known = _MEASURED.setdefault(comm, {})
        if key not in known:
            hosts, _ = topology(comm)
            if self._topology_decides(hosts, comm.size):
                known[key] = None
            else:
                known[key] = measured = measure(comm, self.allowed, self.table, numel, shapes)
                self._probe_bytes += measured.probe_bytes_sent
        return known[key]

    def _topology_decides(self, hosts: int, size: int) -> bool:
        """One host of several ranks, no ``table``: the first allowed method, whatever a cost
        model would predict (module docstring), so nothing is probed or timed unless ``predict``
        asks for the predictions: on a small model the probe alone sends about as much as the
        whole run it is to plan."""
        return hosts == 1 and size > 1 and not self.table and not self.predict

    def replan(self) -> None:
        """Choose again at every layout's next bucket (call on every rank, between steps); the
        link and compute are measured again too."""
        self._choices.clear()
        self._why.clear()
        self._measured = None
        _MEASURED.clear()

    def _choose(self, bucket: Bucket, comm: Communicator) -> int:
        """The candidate for ``bucket``'s layout; the first time (on the wire thread, after the
        agreement: the measurement is collective) measured and predicted."""
        key = f"{bucket.layout_key():x}"
        if key in self._choices:
            return self._choices[key]
        m = self._measured if self._measured is not None else self.measure(comm, bucket.numel, bucket.shapes)
        self._measured = m
        if m is None:
            return self._keep_first(key, bucket, comm)
        hosts, per_host = m.hosts, m.ranks_per_host
        several = m.link_inside_host is not None  # several hosts of several ranks: both schedules
        # cores_per_host such that per_host / cores_per_host is how many ranks share a core here
        cluster = cost.Cluster(hosts, per_host, m.link, cores_per_host=per_host / m.ranks_per_core)
        # on one host the exchange runs inside it: over the probed link, not the model's default
        model = cost.Model(m.compute_s_per_byte, prepare_share=m.local_stage_share,
                           local_pass=m.memory_pass_s_per_byte,
                           local=m.link if hosts == 1 else m.link_inside_host)
        n = len(self.allowed)
        order = []  # options in tie order: the allowed order, each name's default schedule first
        for k, comp in enumerate(self.candidates):
            schedules = [False, True] if several else [False]
            if several and comp.hierarchical_pays():
                schedules.reverse()
            order += [k + n * hier for hier in schedules]
        stages, times, paced = {}, {}, {}
        for c in order:
            k, hier = c % n, c >= n
            label, name = self._labels[c], self.allowed[k]
            t = cost.traffic(self.candidates[k], bucket.shapes, comm.size)
            local, cpu, total = model.stages(name, t, bucket.numel, cluster, hierarchical=hier)
            # a hierarchical schedule runs wholly on the wire thread: no local stage to overlap. The
            # overlap also needs a core: with c ranks on each, a rank's compute thread finds one
            # 1/c of the time
            stages[label] = (0.0, cpu, total) if hier else (local / m.ranks_per_core, cpu, total)
            times[label] = total
            paced[label] = cost.pipelined([stages[label]] * PACED_BUCKETS) / PACED_BUCKETS
        one_host = hosts == 1 and comm.size > 1 and not self.table
        best = order[0]
        for c in order:
            if not one_host and paced[self._labels[c]] < paced[self._labels[best]] * (1 - TIE):
                best = c
        self._choices[key] = best
        timeline.instant("auto choice", "decision", bucket=bucket.index, numel=bucket.numel, method=self._labels[best],
                         predicted_s=paced[self._labels[best]])
        self._why[key] = {"bucket": bucket.index, "numel": bucket.numel, "chosen": self._labels[best],
                          "predicted_s": times, "pipelined_s": paced, "stages_s": stages,
                          "why": (f"one host ({comm.size} ranks): no link to spare, the first allowed "
                                  "method" if one_host else
                                  f"fastest predicted in the pipeline on a link of "
                                  f"{m.link.beta * 8 / 1e9:.3g} Gbit/s, "
                                  f"{m.link.alpha * 1e6:.0f} us latency, {comm.size} ranks"
                                  + (f" on {hosts} hosts (flat and hierarchical)" if several else ""))}
        return best

    def _keep_first(self, key: str, bucket: Bucket, comm: Communicator) -> int:
        """The first allowed method, flat, for ``bucket``'s layout, on the topology alone."""
        self._choices[key] = 0
        self._why[key] = {"bucket": bucket.index, "numel": bucket.numel, "chosen": self._labels[0],
                          "predicted_s": {}, "pipelined_s": {}, "stages_s": {},
                          "why": (f"one host ({comm.size} ranks): no link to spare, the first allowed "
                                  "method; decided by the topology, so nothing was probed or timed "
                                  "(auto:predict=True measures and predicts anyway)")}
        return 0

    # -- the two stages, routed --------------------------------------------------------------------
    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> _Routed:
        k = self._choices.get(f"{bucket.layout_key():x}")
        step = self._steps.take(bucket)
        if k is None:  # a new layout: chosen on the wire thread, once every rank agreed to go on
            return _Routed(-1, bucket, None, step)
        return self._route(k, bucket, step, comm, workspace)

    def _route(self, k: int, bucket: Bucket, step: int, comm: Communicator, workspace: Workspace) -> _Routed:
        bucket = hand_over(self, self._options, [self._last.get(key, -1) for key in bucket.keys], k, bucket,
                           workspace).routed(step)
        self._last.update(dict.fromkeys(bucket.keys, k))
        return _Routed(k, bucket, self._options[k].prepare(bucket, comm, workspace), step)

    def finish(self, bucket: Bucket, comm: Communicator, prepared: _Routed) -> Array:
        if prepared.choice < 0:
            prepared = self._route(self._choose(bucket, comm), bucket, prepared.step, comm, comm.workspace)
        return run_stage(self._options[prepared.choice], prepared.bucket, comm, prepared.inner)

    def agreement_state(self, bucket: Bucket, prepared: _Routed | None) -> dict[str, Any]:
        if prepared is None:
            return {"choices": digest(repr(sorted(self._choices.items())))}
        if prepared.choice < 0:
            return {"method": "to be chosen"}
        label = self._labels[prepared.choice]
        inner = self._options[prepared.choice].agreement_state(prepared.bucket, prepared.inner)
        return {"method": label, **{f"{label}.{k}": v for k, v in inner.items()}}

    def regime(self, prepared: _Routed | None) -> tuple:
        if prepared is None or prepared.choice < 0:
            return ()  # chosen on the wire thread: the guard sees the choice from the next step on
        return (prepared.choice,) + self._options[prepared.choice].regime(prepared.inner)

    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        return from_last(self._options, self._last, keys, take=True)

    def residuals(self, keys: Iterable[str]) -> dict[str, Array]:
        return from_last(self._options, self._last, keys, take=False)

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["choices"] = list(self._why.values())
        s["probe_bytes_sent"] = self._probe_bytes
        if self._measured is not None:
            link = self._measured.link
            s["link"] = {"alpha_s": link.alpha, "beta_bytes_per_s": link.beta}
            s["compute_s_per_byte"] = dict(self._measured.compute_s_per_byte)
            s["local_stage_share"] = dict(self._measured.local_stage_share)
        return s

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, k in sorted(self._choices.items()):
            out[f"choice/{key}"] = k
        for key, k in sorted(self._last.items()):
            out[f"last/{key}"] = k
        return {**out, **stage_states(self._options, "cand")}

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        from ..state import take_int

        state = dict(state)
        owner = "Auto"
        choices: dict[str, int] = {}
        last: dict[str, int] = {}
        for name in [k for k in state if k.startswith(("choice/", "last/"))]:
            k = take_int(state, name, owner)
            if k >= len(self._options):
                raise ValueError(f"{owner} state: {name!r} names option {k}, but there are {len(self._options)} "
                                 f"({len(self.candidates)} candidates, flat and hierarchical)")
            (choices if name.startswith("choice/") else last)[name.partition("/")[2]] = k
        parts = take_stage_states(self._options, state, "cand")
        reject_leftovers(state, owner)
        load_stage_states(self._options, parts, shapes)
        self._choices, self._last = choices, last
        self._why = {}
