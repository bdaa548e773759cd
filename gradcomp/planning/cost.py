"""The cost model: what a method costs per step on a cluster, flat or hierarchical, as code.

An alpha-beta model (Hockney): a message of ``b`` bytes over a link costs ``alpha + b / beta``.
Per bucket of ``n`` float32 values, a method is described by its traffic (``Traffic``: which
collective and how many bytes of message, from the compressor's own declaration: a codec's
``collective`` and ``message_size``, PowerSGD's factor sizes for the bucket's shapes) and by its
compute per byte of gradient (measured on this machine: the repository's ``benchmarks/kernels.py``).
A cluster is ``hosts`` hosts of ``per_host`` ranks, each host one link to the others (``network``)
and a fast path inside (``local``).

What crosses one host's link, per bucket, in one direction (``host_link_bytes``), with N ranks,
H hosts, L ranks per host and M the message bytes (for allreduce: the summed vector):

================  ==============================  ============================
collective         flat (ranks in host order)      hierarchical (1/L per rank)
================  ==============================  ============================
allreduce (ring)   2 (N-1)/N M                     2 (H-1)/H M
two-stage          2 L (N-L)/N M                   2 (H-1)/H M
allgather (ring)   (N-1) M                         (H-1) M
================  ==============================  ============================

A flat ring (gradcomp's allreduce; MPI's allgather of large messages) crosses each host boundary
once, so a host link carries one rank's ring traffic: for an allgather, every other rank's
message; an alltoall sends from every rank of the host to every rank elsewhere. (MPI's own
algorithms for messages under ``MPICommunicator.large_allreduce_bytes`` cross the boundary in
other patterns: the formulas hold for large messages.) Hierarchical
adds an exact reduce-scatter and allgather of the bucket inside the host: ``(L-1)/L`` of it
sent by each rank in each, ``2 (L-1)/L`` (``local_bytes``, as ``Hierarchical``'s
``local_bytes_sent`` counts them), priced at ``IN_HOST_COST`` times a one-host allreduce's
bytes over ``local``. The step is the sum over buckets of latency, the link time, the local
time and the compute (no overlap assumed: on a busy machine compute and the network's kernel work
share the cores). ``benchmarks/fit.py`` (in the repository, not the package) finds the link
constants and each method's compute from measured steps; ``predict`` then gives any shape.
``gradcomp.planning.auto`` reads the same model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from ..compressors.contract import Traffic

KINDS = ("allreduce", "allgather", "two-stage")


@dataclass(frozen=True)
class Link:
    """``alpha`` seconds per message, ``beta`` bytes per second (one direction)."""
    alpha: float
    beta: float

    def time(self, nbytes: float, messages: float) -> float:
        return messages * self.alpha + nbytes / self.beta


@dataclass(frozen=True)
class Cluster:
    hosts: int
    per_host: int
    network: Link                   # each host's link to the others
    local: Link = Link(5e-6, 5e9)   # inside a host
    cores_per_host: float | None = None  # None: a core per rank

    @property
    def ranks(self) -> int:
        return self.hosts * self.per_host

    def contention(self) -> float:
        """How many ranks share a core (compute slows by this much), at least 1."""
        if not self.cores_per_host:
            return 1.0
        return max(1.0, self.per_host / self.cores_per_host)


def traffic(compressor: Any, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Traffic:
    """``compressor``'s traffic on a bucket of tensors of ``shapes`` (float32) exchanged over
    ``ranks``, as it declares it (``Compressor.traffic``); steady state."""
    declared = getattr(compressor, "traffic", None)
    if declared is None:
        raise TypeError(f"the cost model does not know {type(compressor).__name__}")
    return declared(shapes, ranks, itemsize)


def host_link_bytes(t: Traffic, cluster: Cluster, hierarchical: bool) -> float:
    """Bytes through one host's link in one direction for one bucket (see the module table)."""
    N, H, L = cluster.ranks, cluster.hosts, cluster.per_host
    total = 0.0
    for part in (t,) + t.extra:
        M = part.message_bytes
        if hierarchical and L > 1 and H > 1:
            total += {"allreduce": 2 * (H - 1) / H, "two-stage": 2 * (H - 1) / H, "allgather": H - 1}[part.kind] * M
        else:
            total += {"allreduce": 2 * (N - 1) / N, "two-stage": 2 * L * (N - L) / N,
                      "allgather": N - 1}[part.kind] * M
    return total


#: what the hierarchical schedule's exact stages inside a host cost, in bytes of the link inside
#: the host (the one a one-host allreduce runs over) per byte they send: about twice. They are two
#: collectives on a communicator of their own, a division and copies besides their messages, and
#: each host runs them at once on the shared cores. Fitted on the hierarchical runs of
#: BENCHMARKS.md, section 9; without it the model prices hierarchical onebit, topk, randomk and
#: PowerSGD well under their measured steps
IN_HOST_COST = 2.0


def local_bytes(numel: float, per_host: int) -> float:
    """Bytes one rank sends inside its host for one bucket of ``numel`` float32 values on the
    hierarchical schedule: a reduce-scatter and an allgather, ``(L-1)/L`` of the bucket each."""
    return 2 * (per_host - 1) / per_host * numel * 4


def wire_bytes(t: Traffic, cluster: Cluster, hierarchical: bool) -> float:
    """Bytes of one bucket over the link that bounds its exchange: a host's link to the others
    (``host_link_bytes``), or on one host each rank's own share of the exchange (``rank_bytes``),
    which crosses no host boundary."""
    if cluster.hosts == 1:
        return rank_bytes(t, cluster.ranks)
    return host_link_bytes(t, cluster, hierarchical)


def rank_bytes(t: Traffic, ranks: int) -> float:
    """Bytes one rank sends for one bucket on a flat exchange over ``ranks`` (bandwidth-optimal
    algorithms, as the communicators count them)."""
    total = 0.0
    for part in (t,) + t.extra:
        M = part.message_bytes
        total += {"allreduce": 2 * (ranks - 1) / ranks, "two-stage": 2 * (ranks - 1) / ranks,
                  "allgather": ranks - 1}[part.kind] * M
    return total


def exchange_peers(cluster: Cluster, hierarchical: bool) -> int:
    """How many ranks one exchange of the method spans: every rank flat, one per host where the
    hierarchical schedule runs (several hosts of several ranks)."""
    if hierarchical and cluster.per_host > 1 and cluster.hosts > 1:
        return cluster.hosts
    return cluster.ranks


def messages(t: Traffic, cluster: Cluster, hierarchical: bool) -> float:
    """Latency terms per bucket (sequential message steps over the network)."""
    peers = exchange_peers(cluster, hierarchical)
    # bandwidth-optimal schedules take a step per peer: a ring allreduce 2 (P-1), an alltoall and
    # an allgather (pairwise or ring) P-1 each, the two-stage codes both
    steps = {"allreduce": 2 * (peers - 1), "two-stage": 2 * (peers - 1), "allgather": peers - 1}
    return float(sum(steps[p.kind] * p.pieces for p in (t,) + t.extra)) + 1.0  # + the agreement


@dataclass
class Model:
    """Link constants and each method's compute (seconds per byte of float32 gradient, one rank
    on its own core: worker and owner stages together). ``local``: the link inside a host, where
    a fit measured it (else the cluster's). ``prepare_share``: how much of each method's compute
    is its local stage, which overlaps the previous bucket's exchange (``pipelined``)."""
    compute: dict[str, float]
    local_pass: float = 0.0  # seconds per byte of one memory pass (hierarchical's local stages)
    local: Link | None = None
    #: the fraction of each method's compute in its local stage (``pipelined``; 0: none known)
    prepare_share: dict[str, float] = field(default_factory=dict)

    def step(self, method: str, t: Traffic, numel: int, buckets: int, cluster: Cluster,
             hierarchical: bool) -> float:
        """Predicted seconds per training step of ``numel`` float32 values in ``buckets`` buckets.
        On one host, the flat exchange runs over the local link."""
        per = numel / buckets
        hier = hierarchical and cluster.per_host > 1 and cluster.hosts > 1
        local_link = self.local or cluster.local
        over = local_link if cluster.hosts == 1 else cluster.network
        wire = over.time(wire_bytes(t, cluster, hier), messages(t, cluster, hier))
        local = 0.0
        if hier:
            L = cluster.per_host
            local = local_link.time(IN_HOST_COST * local_bytes(per, L), 2 * (L - 1))
            local += 2 * self.local_pass * per * 4
        return buckets * (wire + local + self.rank_cpu(method, t, per, cluster, hierarchical))

    def cpu(self, method: str, numel: float, cluster: Cluster, hierarchical: bool) -> float:
        """Seconds of compute for one bucket of ``numel`` float32 values: the method's seconds per
        byte, slowed by the ranks sharing a core; hierarchical, each rank encodes 1/L of it."""
        hier = hierarchical and cluster.per_host > 1 and cluster.hosts > 1
        share = 1.0 / cluster.per_host if hier else 1.0
        return self.compute.get(method, 0.0) * numel * 4 * share * cluster.contention()

    def rank_cpu(self, method: str, t: Traffic, numel: float, cluster: Cluster, hierarchical: bool) -> float:
        """``cpu`` less what a two-stage code's owner stage does not re-encode on ``t``'s exchange:
        where ``prepare_share`` is known, the compute was timed on one rank (``auto``), whose
        owner stage re-encodes the whole bucket; on P ranks each re-encodes the 1/P it owns. The
        re-encode costs what the worker's encode does, the local stage: ``share (1 - 1/P)`` of
        the timing is not spent. (int4's CPU seconds per rank, the bench worker's ``cpu_s`` of
        ``--methods int4`` uncapped under ``mpiexec -n 2`` against ``-n 1``: 0.69; this predicts
        0.69.) A fitted model has no shares: its compute is per rank already."""
        cpu = self.cpu(method, numel, cluster, hierarchical)
        if t.kind != "two-stage":
            return cpu
        peers = exchange_peers(cluster, hierarchical)
        return cpu * (1.0 - self.prepare_share.get(method, 0.0) * (1.0 - 1.0 / max(peers, 1)))

    def step_of(self, method: str, parts: Sequence[tuple[Traffic, int]], cluster: Cluster,
                hierarchical: bool) -> float:
        """Predicted seconds per step of buckets given as ``(traffic, numel)`` each."""
        return sum(self.step(method, t, n, 1, cluster, hierarchical) for t, n in parts)

    def stages(self, method: str, t: Traffic, numel: int, cluster: Cluster, hierarchical: bool
               ) -> tuple[float, float, float]:
        """One bucket's ``(local, cpu, total)`` seconds, flat: ``local`` is the compute of its
        local stage (the encode, on the pipeline's compute thread: ``prepare_share`` of the
        compute), ``cpu`` all its compute, ``total`` as ``step``."""
        local = self.prepare_share.get(method, 0.0) * self.cpu(method, numel, cluster, hierarchical)
        return local, self.rank_cpu(method, t, numel, cluster, hierarchical), self.step(method, t, numel, 1, cluster, hierarchical)


def pipelined(buckets: Sequence[tuple[float, float, float]], depth: int = 1) -> float:
    """Seconds per step of buckets, in order, each ``(local, cpu, total)`` (``Model.stages``),
    through the reducer's pipeline: bucket k's local stage runs on the compute thread while the
    wire thread finishes bucket k-1 (its collectives and the rest of its compute), at most
    ``depth`` buckets ahead. A two-machine flow shop (bucket k's local stage starts once bucket
    k-1's has ended and bucket k-depth-1 is finished; its rest once its local stage and bucket
    k-1 have ended) -- but both threads share the rank's cores, so the step is never below all
    the compute, ``sum(cpu)``. With ``local = 0`` (no local stage, or a table without shares)
    it is the plain sum of the totals."""
    local_end = 0.0
    ends: list[float] = []
    for k, (local, _, total) in enumerate(buckets):
        start = max(local_end, ends[k - depth - 1] if k - depth - 1 >= 0 else 0.0)
        local_end = start + local
        ends.append(max(ends[-1] if ends else 0.0, local_end) + total - local)
    return max(ends[-1] if ends else 0.0, sum(cpu for _, cpu, _ in buckets))


def _least_squares(rows: list[tuple[float, float]], ys: list[float]) -> tuple[float, float]:
    """(a, b) minimizing sum (a x + b y - z)^2 over rows (x, y) and targets z; with one row, a = 0."""
    if len(rows) == 1:
        x, y = rows[0]
        return 0.0, ys[0] / y
    sxx = sum(x * x for x, _ in rows)
    syy = sum(y * y for _, y in rows)
    sxy = sum(x * y for x, y in rows)
    sxz = sum(x * z for (x, _), z in zip(rows, ys))
    syz = sum(y * z for (_, y), z in zip(rows, ys))
    det = sxx * syy - sxy * sxy
    if abs(det) < 1e-30 * max(sxx * syy, 1e-300):
        return 0.0, syz / syy
    a = (sxz * syy - syz * sxy) / det
    b = (syz * sxx - sxz * sxy) / det
    if a < 0:  # latency cannot be negative: the bandwidth alone
        return 0.0, syz / syy
    return a, b
