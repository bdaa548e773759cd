"""Time the two ways gradcomp sums a float16 bucket over ranks, beside the fp32 allreduce.

    bench/capped.sh 1gbit 4 .venv/bin/python scripts/half_sum_compare.py
    MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=auto bench/capped.sh 1gbit 4 .venv/bin/python scripts/half_sum_compare.py

``op16``: ``comm.allreduce`` on float16 (MPI's allreduce with gradcomp's user-defined operation);
``a2a16``: ``sum_by_alltoall`` (the device-buffer path); ``mpi16``: MPI's own ``MPI_FLOAT16_T``
sum where the MPI library has one (MPICH 5 does; it converts in software, see BENCHMARKS.md);
``f32``: the fp32 allreduce of the same values. Medians of 3 timed repeats after one warm-up,
printed by rank 0, with whether ``mpi16`` gave ``op16``'s bits.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

import gradcomp as gc
from gradcomp.comm import sum_by_alltoall

comm = gc.MPICommunicator()
x = (np.random.default_rng(comm.rank).standard_normal(12_800_000) * 0.01).astype(np.float16)
y = x.astype(np.float32)


def mpi16():
    out = x.copy()
    comm.comm.Allreduce(MPI.IN_PLACE, [out, MPI.FLOAT16_T], op=MPI.SUM)
    return out


runs = {"op16": lambda: comm.allreduce(x), "a2a16": lambda: sum_by_alltoall(comm, x),
        "f32": lambda: comm.allreduce(y)}
if MPI.FLOAT16_T != MPI.DATATYPE_NULL:
    runs["mpi16"] = mpi16
    same_bits = np.array_equal(mpi16().view(np.uint16), comm.allreduce(x).view(np.uint16))
times = {k: [] for k in runs}
for _ in range(4):
    for name, run in runs.items():
        comm.comm.Barrier()
        start = time.perf_counter()
        run()
        times[name].append(time.perf_counter() - start)
if comm.rank == 0:
    print({k: round(statistics.median(v[1:]), 3) for k, v in times.items()})
    if "mpi16" in runs:
        print("mpi16 bits equal op16's:", same_bits)
