"""What ``auto`` measures once per job before it chooses: the link, the compute and the topology.

* **the link**: timed allreduces of a few sizes, up to the first bucket's, on the real
  communicator, each started together (``probe_link``), sized to the link (a slow link stops at
  small sizes: a few seconds at most on any link); every rank's medians are gathered and the
  slowest taken, so every rank fits the same latency and bandwidth (the alpha-beta model of
  ``cost``). On one host this is the link the exchange is priced on;
* **the compute**: each candidate's whole reduction of a bucket of the first bucket's layout (its
  tensors' shapes, repeated or cut to 4-32 MiB: out of the caches, as real buckets are; PowerSGD's
  cost is its matrices') on a one-rank communicator (the kernel cost without a peer), and the
  share of it in its local stage, timed on rank 0 while the others wait (``time_candidates``); or
  a table loaded from a JSON file (``load_table``: ``{"int8": seconds per float32 byte, ...}``, or
  ``[seconds, share]`` pairs; e.g. from ``benchmarks.kernels``). A two-stage code's owner stage
  re-encodes the whole bucket on one rank and 1/N of it on N (``cost.Model.rank_cpu``);
* **the topology**: ``MPICommunicator.topology`` (how many ranks share each host's link and cores,
  ``ranks_per_core``). On several hosts of several ranks the link inside a host is probed too
  (every host's, the slowest agreed) and a memory pass is timed, for the hierarchical schedule.

Everything is agreed by every rank (each figure is the slowest rank's), so every rank predicts the
same costs and makes the same choice. The probe's traffic is marked as a measurement on the
communicator (``note_probe``): it is no method's traffic.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..bucket import Bucket, digest
from ..comm import Communicator
from ..comm.protocol import note_probe
from ..compressors.contract import run_stage
from . import cost

#: the link probe's first size and its default largest (float32 values), its repeats per size,
#: about how long it may take in all, and a size's time at which its fit is precise enough
#: (``probe_link``)
PROBE_SIZES = (1024, 1048576)
PROBE_REPEATS = 5
PROBE_BUDGET_S, PROBE_ENOUGH_S = 2.0, 0.25
#: the compute is timed on a bucket of the first bucket's layout, within these bounds (float32
#: values; ``timed_shapes``): a bucket that fits in the caches would time a memory-bound method
#: (fp16's casts) at cache speed, several times faster than on a real bucket
TIMED_MIN, TIMED_MAX = 1 << 20, 1 << 23


@dataclass
class Measurements:
    """The link, the compute and the topology of one job, the same on every rank.

    Attributes:
        hosts: how many hosts the job's ranks run on.
        ranks_per_host: ranks on each host.
        link: latency (seconds per message) and bandwidth (bytes per second) of an allreduce over
            all ranks, fp32's own compute included.
        compute_s_per_byte: each allowed method's compute, in seconds per float32 byte of
            gradient (``allreduce``: 0, its compute is in ``link``).
        local_stage_share: the fraction (0 to 1) of each method's compute spent in its local
            stage, which the pipeline overlaps with the previous bucket's exchange; a method
            missing here has none known.
        ranks_per_core: how many ranks share each core of a machine, at least 1.
        link_inside_host: the link between the ranks of one host, where a hierarchical schedule
            would use it (several hosts of several ranks), else None.
        memory_pass_s_per_byte: seconds per float32 byte of one pass over memory, what the exact
            stages of a hierarchical schedule cost besides their messages.
        probe_bytes_sent: bytes this rank sent to measure the link (no method's traffic).
    """

    hosts: int
    ranks_per_host: int
    link: cost.Link
    compute_s_per_byte: dict[str, float]
    local_stage_share: dict[str, float]
    ranks_per_core: float
    link_inside_host: cost.Link | None
    memory_pass_s_per_byte: float
    probe_bytes_sent: float = 0.0


def topology(comm: Communicator) -> tuple[int, int]:
    """``(hosts, ranks per host)`` of ``comm``: its ``topology`` where it has one, else one rank
    per host."""
    topo = getattr(comm, "topology", None)
    return (topo.hosts, topo.local_size) if topo is not None else (comm.size, 1)


def measure(comm: Communicator, allowed: Sequence[str], table: str | None, numel: int = PROBE_SIZES[-1],
            shapes: Sequence[tuple[int, ...]] | None = None) -> Measurements:
    """Measure the link, the compute of the methods ``allowed`` and the topology (collective).

    Args:
        comm: the job's communicator; every rank must call this together.
        allowed: the candidate methods' registry names.
        table: a compute table's JSON file (see ``load_table``) used instead of timing, or None.
        numel: the largest probe, in float32 values (the first bucket's size: how fast large
            messages move depends on their size, through shared memory most).
        shapes: the first bucket's tensor shapes, the layout the compute is timed on (PowerSGD's
            cost is its matrices'; a flat vector it sends as it is).

    The compute is timed on rank 0 alone, while the others wait: timed on every rank at once, the
    ranks sharing a core would slow each other, and the model multiplies by that sharing
    (``cost.Cluster.contention``) itself.
    """
    hosts, per_host = topology(comm)
    before, rounds = comm.bytes_sent, comm.collectives  # the measurement's own traffic
    link = probe_link(comm, max(numel, PROBE_SIZES[-1]))
    if table:
        compute, shares = load_table(table)
    else:
        timed = timed_shapes(shapes or [(numel,)])
        # fp32's compute (its division) is in the probed link already, as ``cost.fit`` has it:
        # not timed, zero below
        methods = [n for n in allowed if n != "allreduce"]
        compute, shares = time_candidates(methods, timed) if comm.rank == 0 else ({}, {})
    names = list(allowed)
    memory = memory_pass() if comm.rank == 0 else 0.0
    worst = np.max(comm.allgather(np.array([[compute.get(n, 0.0) for n in names] + [memory],
                                            [shares.get(n, 0.0) for n in names] + [0.0]])), axis=0)
    levels = comm.split_by_host() if hosts > 1 and per_host > 1 and hasattr(comm, "split_by_host") else None
    # the link inside a host, where a hierarchical schedule would use it: every host's probed, the
    # slowest agreed
    inside = probe_link(levels[0], numel, agree=comm) if levels else None
    measured = Measurements(
        hosts=hosts, ranks_per_host=per_host, link=link,
        compute_s_per_byte={n: float(v) for n, v in zip(names, worst[0])},
        local_stage_share={n: float(v) for n, v in zip(names, worst[1])},
        ranks_per_core=ranks_per_core(comm), link_inside_host=inside,
        memory_pass_s_per_byte=float(worst[0][-1]))
    # the probe's large messages are not the method's bytes: whichever compressor counts the stage
    # this runs in leaves them out, and ``stats()`` reports them apart
    measured.probe_bytes_sent = comm.bytes_sent - before
    note_probe(comm, measured.probe_bytes_sent, comm.collectives - rounds)
    return measured


def ranks_per_core(comm: Communicator) -> float:
    """How many ranks share each of this machine's cores, at least 1; the largest over ranks.

    A machine's ranks are those with its name (``MPI.Get_processor_name``), not MPI's
    shared-memory nodes: ``benchmarks/capped.sh`` makes each emulated host a node of its own,
    while all of them share this machine's cores.
    """
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


def probe_link(comm: Communicator, largest: int = PROBE_SIZES[-1], agree: Communicator | None = None,
               budget_s: float | None = None) -> cost.Link:
    """Latency and bandwidth of ``comm``'s allreduce, the slowest rank's, the same on every rank.

    Args:
        comm: the communicator whose allreduce is timed (collective).
        largest: the largest bucket probed, in float32 values.
        agree: the communicator over which the slowest rank is agreed (every host's link inside
            it, probed on a host's own communicator); None: ``comm``.
        budget_s: about how long the probe may take (default ``PROBE_BUDGET_S``).

    Probes are sized to the link: sizes grow by 4 from ``PROBE_SIZES[0]`` towards ``largest``,
    and the ladder stops once a size takes ``PROBE_ENOUGH_S`` (its bandwidth term dominates, the
    fit is precise enough) or the next one would not fit in the budget; a size whose first run
    takes long gets fewer repeats. A fast link probes up to ``largest`` in well under a second;
    a 1 Mbit/s one stops after a few kilobytes instead of sending megabytes. Every such decision
    is taken from times agreed as the slowest rank's, so every rank probes the same sizes.

    Each size is reduced as the reducer reduces an fp32 bucket (``Allreduce``'s ordered stage: the
    agreement, the allreduce in place, the division), not by a bare ``comm.allreduce``, whose
    allocation of a result moves shared memory at another speed than the reducer does; so fp32's
    own compute is in the link (``measure``). Each timed bucket starts right after a one-value
    allreduce, so that the ranks enter it together (unsynchronised, a rank's clock also runs while
    it waits for a later one); each rank keeps the median of its repeats per size, and the slowest
    rank's medians are fitted.
    """
    from ..compressors.allreduce import Allreduce

    if comm.size == 1:
        return cost.Link(0.0, float("inf"))
    over = comm if agree is None else agree
    budget = PROBE_BUDGET_S if budget_s is None else budget_s
    sync = np.zeros(1, np.float32)
    fp32 = Allreduce()
    sizes: list[int] = []
    worst: list[float] = []
    spent = 0.0
    n = PROBE_SIZES[0]
    while True:
        x = np.zeros(n, np.float32)  # zeros: summed in place, they stay zeros
        bucket = Bucket(x, len(sizes), [(n,)], scratch=True)
        comm.allreduce(sync)
        start = time.perf_counter()
        fp32.checked_run(bucket, comm)  # warm, and a first estimate of this size's time
        first = slowest(over, time.perf_counter() - start)
        repeats = int(min(PROBE_REPEATS, max(1, (budget - spent - first) // max(first, 1e-9) // 2)))
        times = []
        for _ in range(repeats):
            comm.allreduce(sync)
            start = time.perf_counter()
            fp32.checked_run(bucket, comm)
            times.append(time.perf_counter() - start)
        median = slowest(over, float(np.median(times)))
        sizes.append(n)
        worst.append(median)
        spent += first + repeats * median
        grown = min(4 * n, largest) if n < largest else 0
        # the next size's time, at worst the same rate: 2 runs of it must fit
        if not grown or (len(sizes) >= 2 and (median >= PROBE_ENOUGH_S
                                              or spent + 2 * median * grown / n > budget)):
            break
        n = grown
    N = comm.size
    t = cost.Traffic("allreduce", 0.0)
    cluster = cost.Cluster(N, 1, cost.Link(0, 1))
    pairs = [(cost.messages(t, cluster, False), cost.rank_bytes(cost.Traffic("allreduce", 4.0 * n), N))
             for n in sizes]
    alpha, inv_beta = cost._least_squares(pairs, worst)
    return cost.Link(max(alpha, 0.0), 1.0 / inv_beta if inv_beta > 0 else float("inf"))


def slowest(comm: Communicator, seconds: float) -> float:
    """The largest of every rank's ``seconds`` (collective): a time every rank decides from alike."""
    return float(np.max(comm.allgather(np.array([seconds]))))


def memory_pass(numel: int = TIMED_MAX // 2, repeats: int = 5) -> float:
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


def timed_shapes(shapes: Sequence[Sequence[int]], lo: int = TIMED_MIN, hi: int = TIMED_MAX
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


def time_candidates(names: Sequence[str], shapes: Sequence[tuple[int, ...]] = ((1 << 20,),),
                    repeats: int = 3) -> tuple[dict[str, float], dict[str, float]]:
    """Time each method's reduction of one bucket on one rank.

    Args:
        names: registry names of the methods to time.
        shapes: the bucket's tensor shapes.
        repeats: timed repeats per method, after its warm-up.

    Returns:
        Seconds per float32 byte of each method's whole reduction (the best repeat), and the
        share of it in the local stage (``prepare``, which the pipeline overlaps).
    """
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
                    # (PowerSGD's exact warm-up has nothing to compute on one rank)
                    best = min(best, took)
                    local, rest = min(local, middle - start), min(rest, time.perf_counter() - middle)
            out[name] = best / (4 * numel)
            shares[name] = local / (local + rest) if local + rest > 0 else 0.0
    finally:
        alone.close()
    return out, shares


def load_table(path: str) -> tuple[dict[str, float], dict[str, float]]:
    """A compute table from the JSON file ``path``: an object of method -> seconds per float32
    byte, or ``[seconds per byte, share of them in the local stage]``.

    Returns:
        The seconds per byte of each method, and the local-stage shares of those given one.
    """
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
