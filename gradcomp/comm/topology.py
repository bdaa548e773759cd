"""Topology: which ranks share a host, agreed by every rank, and the communicators it implies.

Inside a host, ranks share a fast local path (shared memory, NVLink); hosts meet through a network
10-100x slower. ``Topology`` says which ranks are together: hosts in order of their lowest rank,
each host's ranks in rank order (``members``). Where it comes from, first match wins:

1. ``GRADCOMP_RANKS_PER_HOST=L``: ranks ``h*L .. h*L+L-1`` form host ``h`` (simulations, such as
   ``benchmarks/capped.sh`` with ``CAPPED_HOSTS``, and launches where MPI cannot tell);
2. ``GRADCOMP_HOST=NAME`` set per rank (a launcher's host name, any string): ranks with the same
   name share a host;
3. under torchrun (and not mpiexec), ``LOCAL_WORLD_SIZE``: consecutive blocks of that size, as
   torchrun numbers its ranks;
4. MPI's own answer: ``Split_type(COMM_TYPE_SHARED)`` (the ranks that can share memory); over
   another transport (``TorchCommunicator``), the host name.

Every rank computes its view and the views are compared (one allgather of a digest): a rank that
disagrees (another ``GRADCOMP_RANKS_PER_HOST``, say) makes ``detect`` raise ``CollectiveError`` on
every rank, naming each rank's view.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ..bucket import digest
from .pipeline import CollectiveError
from .protocol import launched_by_mpi


@dataclass(frozen=True)
class Topology:
    """Hosts and the ranks on each, the same on every rank."""
    rank: int
    members: tuple[tuple[int, ...], ...]  # world ranks of each host, hosts by lowest rank
    source: str = ""                      # where it came from (see the module docstring)

    @property
    def size(self) -> int:
        return sum(len(m) for m in self.members)

    @property
    def hosts(self) -> int:
        return len(self.members)

    @property
    def host(self) -> int:
        return next(h for h, m in enumerate(self.members) if self.rank in m)

    @property
    def local_rank(self) -> int:
        return self.members[self.host].index(self.rank)

    @property
    def local_size(self) -> int:
        return len(self.members[self.host])

    @property
    def regular(self) -> bool:
        """Every host has the same number of ranks (a hierarchical schedule needs it: local rank
        l of every host forms one cross-host group)."""
        return len({len(m) for m in self.members}) == 1

    def describe(self) -> str:
        sizes = sorted({len(m) for m in self.members})
        per = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
        return f"{self.hosts} host(s) x {per} rank(s) ({self.source})"


def _blocks(size: int, per_host: int, source: str, rank: int) -> Topology:
    if per_host < 1:
        raise ValueError(f"gradcomp: {source} must be >= 1, got {per_host}")
    members = tuple(tuple(range(h, min(h + per_host, size))) for h in range(0, size, per_host))
    return Topology(rank, members, source)


#: every rank's row of an int64 array, stacked (``(size,) + shape``): the one collective the
#: detection needs, over mpi4py or any other transport
Gather = Callable[[np.ndarray], np.ndarray]


def local_view(rank: int, size: int, gather: Gather, shared: Callable[[], int] | None = None) -> Topology:
    """This rank's view of the topology, before agreement. ``shared``: the lowest rank this one
    shares memory with, where the transport can tell (MPI's ``COMM_TYPE_SHARED``); otherwise
    ranks with the same host name share a host."""
    env = os.environ.get("GRADCOMP_RANKS_PER_HOST", "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"gradcomp: GRADCOMP_RANKS_PER_HOST must be a whole number, got {env!r}")
        return _blocks(size, int(env), "GRADCOMP_RANKS_PER_HOST", rank)
    name = os.environ.get("GRADCOMP_HOST", "")
    if name:
        return _grouped(_gather_ints(gather, digest(name)), rank, "GRADCOMP_HOST")
    local_world = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local_world.isdigit() and not launched_by_mpi():
        return _blocks(size, int(local_world), "torchrun LOCAL_WORLD_SIZE", rank)
    if shared is not None:
        return _grouped(_gather_ints(gather, shared()), rank, "MPI COMM_TYPE_SHARED")
    return _grouped(_gather_ints(gather, digest(socket.gethostname())), rank, "host name")


def _gather_ints(gather: Gather, value: int) -> list[int]:
    return [int(v) for v in np.asarray(gather(np.array([value], np.int64))).reshape(-1)]


def _grouped(keys: list[int], rank: int, source: str) -> Topology:
    """Ranks with equal keys share a host; hosts ordered by their lowest rank."""
    hosts: dict[int, list[int]] = {}
    for r, k in enumerate(keys):
        hosts.setdefault(k, []).append(r)
    members = tuple(sorted((tuple(m) for m in hosts.values()), key=lambda m: m[0]))
    return Topology(rank, members, source)


def detect(comm: Any) -> Topology:
    """The agreed topology of ``comm`` (an mpi4py communicator); ``CollectiveError`` on every rank
    when the ranks' views differ."""
    from mpi4py import MPI

    def gather(row: np.ndarray) -> np.ndarray:
        out = np.zeros((comm.Get_size(),) + row.shape, row.dtype)
        comm.Allgather(row, out)
        return out

    def shared() -> int:
        group = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
        lowest = group.allreduce(comm.Get_rank(), op=MPI.MIN)
        group.Free()
        return lowest

    return agreed(comm.Get_rank(), comm.Get_size(), gather, shared)


def agreed(rank: int, size: int, gather: Gather, shared: Callable[[], int] | None = None) -> Topology:
    """The topology every rank agrees on (``local_view``, then one allgather of a digest of it);
    ``CollectiveError`` on every rank, naming each rank's view, when they differ. Collective."""
    try:
        mine, problem = local_view(rank, size, gather, shared), ""
    except ValueError as exc:
        mine, problem = Topology(rank, ((rank,),), "?"), str(exc)
    text = problem or repr(mine.members)
    views = _gather_ints(gather, digest(text) & 0x7FFFFFFFFFFFFFFF)
    if len(set(views)) > 1:
        texts = _gather_texts(gather, f"{mine.describe()}: {text}")
        per_rank = "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts))
        raise CollectiveError(f"gradcomp: the ranks disagree on the topology ({per_rank})")
    return mine


def _gather_texts(gather: Gather, text: str) -> list[str]:
    """Every rank's ``text``: the lengths, then the bytes padded to the longest (as int64s)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = _gather_ints(gather, data.shape[0])
    padded = np.zeros(max(lengths), np.int64)
    padded[:data.shape[0]] = data
    rows = np.asarray(gather(padded))
    return [bytes(rows[r, :n].astype(np.uint8)).decode(errors="replace") for r, n in enumerate(lengths)]
