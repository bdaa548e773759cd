"""MPICH alone, without gradcomp: one ResNet-50 step's five bucket sizes, summed by plain
``MPI_Allreduce`` in float32 and in float16 (MPI's allreduce with a user-defined sum, the way
gradcomp adds half precision on the host). The float16/float32 ratio is the floor that any
compressor sending float16 over this MPI can reach on the link.

    benchmarks/capped.sh 1gbit 4 .venv/bin/python benchmarks/scripts/mpi_floor.py

Prints, on rank 0, each step's time in ms (the first of each kind includes connection set-up) and
the ratio of the medians.
"""
import statistics
import time

import numpy as np
from mpi4py import MPI

from gradcomp.arrays import add_into

SIZES = [6308928, 6172672, 5511168, 5515264, 2049000]  # ResNet-50 in ~25 MB buckets
STEPS = 6

world = MPI.COMM_WORLD


def add(inbuf, inoutbuf, datatype):
    add_into(np.frombuffer(inoutbuf, dtype=np.float16), np.frombuffer(inbuf, dtype=np.float16))


half_sum = MPI.Op.Create(add, commute=True)
medians = {}
for dtype in (np.float16, np.float32):
    rng = np.random.default_rng(world.rank)
    bufs = [(rng.standard_normal(n) * 0.01).astype(dtype) for n in SIZES]
    outs = [np.empty_like(b) for b in bufs]
    times = []
    for _ in range(STEPS):
        world.Barrier()
        start = time.perf_counter()
        for b, o in zip(bufs, outs):
            if dtype is np.float16:
                world.Allreduce([b.view(np.uint16), MPI.UINT16_T], [o.view(np.uint16), MPI.UINT16_T],
                                op=half_sum)
            else:
                world.Allreduce(b, o)
        times.append(time.perf_counter() - start)
    medians[dtype.__name__] = statistics.median(times[1:])
    if world.rank == 0:
        print(dtype.__name__, [round(t * 1000) for t in times], flush=True)
if world.rank == 0:
    print(f"float16 / float32 step: {medians['float16'] / medians['float32']:.3f}")
half_sum.Free()
