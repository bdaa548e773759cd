"""``auto``: each bucket's method picked from measurements of this job's link and this machine.

The best method depends on the link (compression that wins at 1 Gbit/s loses at 100 Gbit/s), on
the bucket (int8's per-chunk scales weigh on a tiny bucket, latency dominates small ones) and on
what the method's compute costs here. ``Auto`` measures all three once:

* **the link**: timed allreduces of a few sizes, up to the first bucket's, on the real
  communicator, each started together (``_probe``); every rank's medians are gathered and the
  slowest taken, so every rank fits the same latency and bandwidth (the alpha-beta model of
  ``cost``). On one host this is the link the exchange is priced on;
* **the compute**: each candidate's whole reduction of a bucket of the first bucket's layout (its
  tensors' shapes, repeated or cut to 4-32 MiB: out of the caches, as real buckets are; PowerSGD's
  cost is its matrices') on a one-rank communicator (the kernel cost
  without a peer), and the share of it in its local stage, timed on rank 0
  while the others wait; or a table loaded from a JSON file (``table=``: ``{"int8": seconds per
  float32 byte, ...}``, or ``[seconds, share]`` pairs; e.g. from ``gradcomp.bench.kernels``).
  A two-stage code's owner stage re-encodes the whole bucket on one rank and 1/N of it on N
  (``cost.Model.rank_cpu``);
* **the topology**: ``MPICommunicator.topology`` (how many ranks share each host's link and cores).
  On several hosts of several ranks every candidate is also priced in the hierarchical schedule
  (``Hierarchical``: exact inside the host, the method across it; labelled ``hier-NAME``), with
  the link inside a host probed too (every host's, the slowest agreed) and a memory pass timed:
  a flat-only choice there lost to the fixed methods' own default schedule (BENCHMARKS.md,
  section 9).
  On one host there is no link to spare: shared memory moves bytes at memory speed, so a
  method's casts and codes cost about what they save, and fp32 beat every compressed method
  there (BENCHMARKS.md, sections 1 and 9). So a one-host job keeps the first allowed method
  (``allreduce`` by default) unless a ``table`` says otherwise, and since the topology decides,
  it measures nothing: no probe traffic, no timing; ``stats()`` says so per bucket.
  ``predict=True`` measures anyway, for ``stats()`` to hold every candidate's prediction
  (BENCHMARKS.md, section 1, compares them with measured steps), and still keeps the first method.

(measured at the first bucket's ordered stage, after every rank agreed on the configuration). For
each bucket layout it then predicts every candidate's time with ``cost.Model`` and takes the
fastest in the reducer's pipeline (``cost.pipelined``: a candidate's local stage, its encode,
overlaps the previous bucket's exchange, so it is ranked by its time per bucket in a run of
buckets like this one, not by its seconds alone); ties within 2% go to the earlier candidate
(less compressed: ``allowed`` is in order of increasing compression). The choice depends only on agreed inputs, so every rank makes the same
one; it is part of what ranks agree on before each bucket (its state), it is checkpointed, and it
is kept: ``replan()`` (on every rank) or a change of layout (DDP's bucket rebuild) chooses again.
Residuals move with their tensors when a tensor's method changes (``Schedule``'s hand-over).

Candidates are the registered names that met the convergence targets as hook-level methods
(BENCHMARKS.md, section 6): ``allreduce``, ``fp16``, ``bf16``, ``int8``, ``int4``. ``allowed``
restricts or widens the set (``auto:allowed=fp16,int8,powersgd``: any registry spec). ``stats()``
says, per bucket, what was chosen, the predicted seconds of every candidate, and why.
"""
from __future__ import annotations

import json
import math
import time
import weakref
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..arrays import Array
from ..bucket import Bucket, digest
from ..comm import Communicator, Workspace
from ..comm.base import note_probe
from ..compressors.base import Compressor, run_stage, sends_part
from ..compressors.hierarchical import Hierarchical
from ..state import reject_leftovers
from . import cost

#: the candidates by default: the hook-level methods within the convergence targets
DEFAULT_ALLOWED = ("allreduce", "fp16", "bf16", "int8", "int4")
#: message sizes of the link probe (float32 values) and its repeats
PROBE_SIZES = (1024, 65536, 1048576)
PROBE_REPEATS = 5
#: a candidate wins only by more than this fraction (else the earlier, less compressed one)
TIE = 0.02
#: the compute is timed on a bucket of the first bucket's layout, within these bounds (float32
#: values; ``_timed_shapes``): a bucket that fits in the caches would time a memory-bound method
#: (fp16's casts) at cache speed, several times faster than on a real bucket
TIMED_MIN, TIMED_MAX = 1 << 20, 1 << 23
#: candidates are ranked by their time per bucket in a pipeline of this many buckets like it
#: (``cost.pipelined``): a local stage that overlaps the previous bucket's exchange is worth less
#: than its seconds
PACED_BUCKETS = 4


#: measurements per communicator (see ``Auto.measure``)
_MEASURED: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()


@dataclass
class _Routed:
    choice: int
    bucket: Bucket
    inner: Any


class Auto(Compressor):
    """Per-bucket choice among ``allowed`` from measured costs (see the module docstring)."""

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
        self._measured: dict[str, Any] | None = None
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
                shapes: Sequence[tuple[int, ...]] | None = None) -> dict[str, Any]:
        """The link, the compute table and the topology, agreed by every rank (collective). Kept
        per communicator and candidate list: every ``auto`` of a job sees the same numbers, so
        equal layouts get equal choices. ``numel``: the largest probe (the first bucket's size:
        how fast large messages move depends on their size, through shared memory most);
        ``shapes``: its tensors' shapes, the layout the compute is timed on (PowerSGD's cost is
        its matrices'; a flat vector it sends as it is). The compute is timed on rank 0 alone,
        while the others wait: timed on every rank at once, the ranks sharing a core would slow
        each other, and the model multiplies by that sharing (``cost.Cluster.contention``)
        itself."""
        key = (self.allowed, self.table, self.predict)
        known = _MEASURED.setdefault(comm, {})
        if key in known:
            return known[key]
        topo = getattr(comm, "topology", None)
        hosts, per_host = (topo.hosts, topo.local_size) if topo is not None else (comm.size, 1)
        if self._topology_decides(hosts, comm.size):
            known[key] = {"decided": True, "hosts": hosts, "per_host": per_host}
            return known[key]
        before, rounds = comm.bytes_sent, getattr(comm, "collectives", 0)  # the measurement's own traffic
        link = _probe(comm, max(numel, PROBE_SIZES[-1]))
        if self.table:
            compute, shares = _load_table(self.table)
        else:
            timed = _timed_shapes(shapes or [(numel,)])
            # fp32's compute (its division) is in the probed link already, as ``cost.fit`` has it:
            # not timed, zero below
            methods = [n for n in self.allowed if n != "allreduce"]
            compute, shares = _time_candidates(methods, timed) if comm.rank == 0 else ({}, {})
        names = list(self.allowed)
        memory = _memory_pass() if comm.rank == 0 else 0.0
        worst = np.max(comm.allgather(np.array([[compute.get(n, 0.0) for n in names] + [memory],
                                                [shares.get(n, 0.0) for n in names] + [0.0]])), axis=0)
        compute = {n: float(v) for n, v in zip(names, worst[0])}
        shares = {n: float(v) for n, v in zip(names, worst[1])}
        levels = comm.split_by_host() if hosts > 1 and per_host > 1 and hasattr(comm, "split_by_host") else None
        # the link inside a host, where a hierarchical schedule would use it: every host's probed,
        # the slowest agreed
        inside = _probe(levels[0], numel, agree=comm) if levels else None
        known[key] = {"link": link, "compute": compute, "prepare_share": shares, "hosts": hosts,
                      "per_host": per_host, "contention": _contention(comm), "inside": inside,
                      "memory_pass": float(worst[0][-1])}
        # not the method's bytes (a probe of 25 MB messages had read the digits MLP's whole-run
        # compression as 0.7x), whichever compressor counts the stage: reported apart in stats()
        self._probe_bytes += comm.bytes_sent - before
        note_probe(comm, comm.bytes_sent - before, getattr(comm, "collectives", 0) - rounds)
        return known[key]

    def _topology_decides(self, hosts: int, size: int) -> bool:
        """One host of several ranks, no ``table``: the first allowed method, whatever a cost
        model would predict (module docstring), so nothing is probed or timed unless ``predict``
        asks for the predictions. (The probe had sent 26.8 MB, against 30.8 MB for the whole
        800-step run it was to plan, on the digits MLP at 2 ranks.)"""
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
        if m.get("decided"):
            return self._keep_first(key, bucket, comm)
        hosts, per_host = m["hosts"], m["per_host"]
        several = m["inside"] is not None  # several hosts of several ranks: both schedules
        # cores_per_host such that per_host / cores_per_host is how many ranks share a core here
        cluster = cost.Cluster(hosts, per_host, m["link"], cores_per_host=per_host / m["contention"])
        # on one host the exchange runs inside it: over the probed link, not the model's default
        model = cost.Model(m["compute"], prepare_share=m["prepare_share"], local_pass=m["memory_pass"],
                           local=m["link"] if hosts == 1 else m["inside"])
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
            stages[label] = (0.0, cpu, total) if hier else (local / m["contention"], cpu, total)
            times[label] = total
            paced[label] = cost.pipelined([stages[label]] * PACED_BUCKETS) / PACED_BUCKETS
        one_host = hosts == 1 and comm.size > 1 and not self.table
        best = order[0]
        for c in order:
            if not one_host and paced[self._labels[c]] < paced[self._labels[best]] * (1 - TIE):
                best = c
        self._choices[key] = best
        self._why[key] = {"bucket": bucket.index, "numel": bucket.numel, "chosen": self._labels[best],
                          "predicted_s": times, "pipelined_s": paced, "stages_s": stages,
                          "why": (f"one host ({comm.size} ranks): no link to spare, the first allowed "
                                  "method" if one_host else
                                  f"fastest predicted in the pipeline on a link of "
                                  f"{m['link'].beta * 8 / 1e9:.3g} Gbit/s, "
                                  f"{m['link'].alpha * 1e6:.0f} us latency, {comm.size} ranks"
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
        if k is None:  # a new layout: chosen on the wire thread, once every rank agreed to go on
            return _Routed(-1, bucket, None)
        return self._route(k, bucket, comm, workspace)

    def _route(self, k: int, bucket: Bucket, comm: Communicator, workspace: Workspace) -> _Routed:
        chosen = self._options[k]
        handed: dict[str, Array] = {}
        for key in bucket.keys:
            before = self._last.get(key)
            if before is not None and before != k:
                handed.update(self._options[before].take_residual([key]))
            self._last[key] = k
        if handed:
            from ..schedule import with_residuals

            bucket = with_residuals(self, bucket, handed, workspace)
        return _Routed(k, bucket, chosen.prepare(bucket, comm, workspace))

    def finish(self, bucket: Bucket, comm: Communicator, prepared: _Routed) -> Array:
        if prepared.choice < 0:
            prepared = self._route(self._choose(bucket, comm), bucket, comm, comm.workspace)
        return run_stage(self._options[prepared.choice], prepared.bucket, comm, prepared.inner)

    def agreement_state(self, bucket: Bucket, prepared: _Routed | None) -> dict[str, Any]:
        if prepared is None:
            return {"choices": digest(repr(sorted(self._choices.items())))}
        if prepared.choice < 0:
            return {"method": "to be chosen"}
        label = self._labels[prepared.choice]
        inner = self._options[prepared.choice].agreement_state(prepared.bucket, prepared.inner)
        return {"method": label, **{f"{label}.{k}": v for k, v in inner.items()}}

    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        out: dict[str, Array] = {}
        for key in keys:
            k = self._last.get(key)
            if k is not None:
                out.update(self._options[k].take_residual([key]))
        return out

    def residuals(self, keys: Iterable[str]) -> dict[str, Array]:
        out: dict[str, Array] = {}
        for key in keys:
            k = self._last.get(key)
            if k is not None:
                out.update(self._options[k].residuals([key]))
        return out

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        s["choices"] = list(self._why.values())
        s["probe_bytes_sent"] = self._probe_bytes
        if self._measured is not None and not self._measured.get("decided"):
            link = self._measured["link"]
            s["link"] = {"alpha_s": link.alpha, "beta_bytes_per_s": link.beta}
            s["compute_s_per_byte"] = dict(self._measured["compute"])
            s["local_stage_share"] = dict(self._measured["prepare_share"])
        return s

    # -- checkpoints -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, k in sorted(self._choices.items()):
            out[f"choice/{key}"] = k
        for key, k in sorted(self._last.items()):
            out[f"last/{key}"] = k
        for k, comp in enumerate(self._options):
            for name, value in comp.state_dict().items():
                out[f"cand{k}/{name}"] = value
        return out

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
        parts: list[dict[str, Any]] = [{} for _ in self._options]
        for key in list(state):
            head, sep, rest = key.partition("/")
            number = head[len("cand"):]
            if head.startswith("cand") and number.isdigit() and int(number) < len(self._options) and sep:
                parts[int(number)][rest] = state.pop(key)
        reject_leftovers(state, owner)
        saved = [c.state_dict() for c in self._options]
        try:
            for comp, part in zip(self._options, parts):
                comp.load_state_dict(part, shapes)
        except ValueError:
            for comp, old in zip(self._options, saved):
                comp.load_state_dict(old, shapes)
            raise
        self._choices, self._last = choices, last
        self._why = {}


def _contention(comm: Communicator) -> float:
    """How many ranks share each of this machine's cores, at least 1; the largest over ranks.
    A machine's ranks are those with its name (``MPI.Get_processor_name``), not MPI's
    shared-memory nodes: ``bench/capped.sh`` makes each emulated host a node of its own, while
    all of them share this machine's cores."""
    import os
    import socket

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        from mpi4py import MPI

        name = MPI.Get_processor_name()
    except ImportError:
        name = socket.gethostname()
    names = comm.allgather(np.array([digest(name)], dtype=np.uint64)).reshape(-1)
    here = int(np.count_nonzero(names == names[comm.rank]))
    mine = max(1.0, here / cores)
    return float(np.max(comm.allgather(np.array([mine]))))


def _probe(comm: Communicator, largest: int = PROBE_SIZES[-1], agree: Communicator | None = None) -> cost.Link:
    """Latency and bandwidth of ``comm``'s allreduce, the slowest rank's, the same on every rank,
    from buckets of ``PROBE_SIZES`` and ``largest`` float32 values. Each is reduced as the
    reducer reduces an fp32 bucket (``Allreduce``'s ordered stage: the agreement, the allreduce in
    place, the division): a bare ``comm.allreduce`` that allocated its result read shared memory
    at 0.7-0.8x the reducer's speed, one in place at 1.3-1.6x (the reducer's agreement and
    division cost 2-7 ms a 25 MB bucket). So fp32's own compute is in the link (``measure``).
    Each timed bucket starts right after a one-value allreduce, so that the ranks enter it
    together (unsynchronised, a rank's clock also ran while it waited for a later one: the
    probe read shared memory at half its speed); each rank keeps the median of its repeats per
    size, and the slowest rank's medians are fitted."""
    from ..compressors.allreduce import Allreduce

    if comm.size == 1:
        return cost.Link(0.0, float("inf"))
    sizes = sorted(set(PROBE_SIZES) | {largest})
    sync = np.zeros(1, np.float32)
    fp32 = Allreduce()
    medians = []
    for i, n in enumerate(sizes):
        x = np.zeros(n, np.float32)  # zeros: summed in place, they stay zeros
        bucket = Bucket(x, i, [(n,)], scratch=True)
        fp32.checked_run(bucket, comm)  # warm
        times = []
        for _ in range(PROBE_REPEATS):
            comm.allreduce(sync)
            start = time.perf_counter()
            fp32.checked_run(bucket, comm)
            times.append(time.perf_counter() - start)
        medians.append(float(np.median(times)))
    # the slowest rank's medians; ``agree``: of every rank there (each host's link inside it)
    worst = np.max((comm if agree is None else agree).allgather(np.array(medians)), axis=0)
    N = comm.size
    t = cost.Traffic("allreduce", 0.0)
    cluster = cost.Cluster(N, 1, cost.Link(0, 1))
    pairs = [(cost.messages(t, cluster, False), cost.rank_bytes(cost.Traffic("allreduce", 4.0 * n), N))
             for n in sizes]
    alpha, inv_beta = cost._least_squares(pairs, [float(w) for w in worst])
    return cost.Link(max(alpha, 0.0), 1.0 / inv_beta if inv_beta > 0 else float("inf"))


def _memory_pass(numel: int = TIMED_MAX // 2, repeats: int = 5) -> float:
    """Seconds per float32 byte of one pass over memory (a copy, out of the caches): what a
    hierarchical schedule's exact stages inside the host cost besides their messages
    (``cost.Model.local_pass``)."""
    src = np.ones(numel, np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
    return best / (4 * numel)


def _timed_shapes(shapes: Sequence[Sequence[int]], lo: int = TIMED_MIN, hi: int = TIMED_MAX
                  ) -> list[tuple[int, ...]]:
    """``shapes`` repeated until they hold ``lo`` values, cut at ``hi`` (a tensor that crosses
    it keeps its trailing dimensions and loses rows): a bucket of the measured bucket's layout,
    large enough to be out of the caches."""
    out: list[tuple[int, ...]] = []
    total = 0
    if not any(math.prod(s) for s in shapes):
        return [(lo,)]
    while total < lo:
        for shape in shapes:
            shape = tuple(int(d) for d in shape)
            row = math.prod(shape[1:])
            rows = min(shape[0] if shape else 1, (hi - total) // max(row, 1))
            if rows <= 0:
                return out or [(hi,)]
            out.append((rows, *shape[1:]))
            total += rows * row
            if rows < (shape[0] if shape else 1):
                return out
    return out


def _time_candidates(names: Sequence[str], shapes: Sequence[tuple[int, ...]] = ((1 << 20,),),
                     repeats: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """Seconds per float32 byte of each method's whole reduction of one bucket of ``shapes`` on
    one rank, and the share of it in the local stage (``prepare``, which the pipeline overlaps)."""
    from mpi4py import MPI

    from ..comm.mpi import MPICommunicator
    from ..registry import make, steady

    alone = MPICommunicator(MPI.COMM_SELF, blas_threads=None)
    numel = sum(math.prod(s) for s in shapes)
    g = np.random.default_rng(0).standard_t(3, numel).astype(np.float32)
    out, shares = {}, {}
    try:
        for name in names:
            comp = make(steady(name))
            best, local, rest = float("inf"), float("inf"), float("inf")
            warm = max(3, comp.warmup_steps)
            for i in range(repeats + warm):
                bucket = Bucket(g.copy(), 0, shapes, scratch=True)
                start = time.perf_counter()
                comp.reduce(bucket, alone).result()
                took = time.perf_counter() - start
                bucket = Bucket(g.copy(), 0, shapes, scratch=True)  # the two stages, timed apart
                start = time.perf_counter()
                prepared = comp.prepare(bucket, alone, alone.workspace)
                middle = time.perf_counter()
                run_stage(comp, bucket, alone, prepared)
                if i >= warm:  # past the compiles, the first allocations and the warm-up steps
                    # (PowerSGD's start_iter=2: exact, nothing to do on one rank: had timed it at
                    # 0.04 ns a byte)
                    best = min(best, took)
                    local, rest = min(local, middle - start), min(rest, time.perf_counter() - middle)
            out[name] = best / (4 * numel)
            shares[name] = local / (local + rest) if local + rest > 0 else 0.0
    finally:
        alone.close()
    return out, shares


def _load_table(path: str) -> tuple[dict[str, float], dict[str, float]]:
    """A compute table: method -> seconds per float32 byte, or ``[seconds per byte, share of
    them in the local stage]``."""
    with open(path) as f:
        data = json.load(f)

    def entry(v: Any) -> bool:
        number = (int, float)
        return isinstance(v, number) or (isinstance(v, list) and len(v) == 2
                                         and all(isinstance(x, number) for x in v) and 0 <= v[1] <= 1)

    if not isinstance(data, dict) or not all(entry(v) for v in data.values()):
        raise ValueError(f"auto: {path} must hold a JSON object of method -> seconds per float32 byte "
                         "(or [seconds per byte, local-stage share from 0 to 1])")
    compute = {str(k): float(v[0] if isinstance(v, list) else v) for k, v in data.items()}
    shares = {str(k): float(v[1]) for k, v in data.items() if isinstance(v, list)}
    return compute, shares
