"""Where gradcomp's allreduce should switch from MPI_Allreduce to its ring reduce-scatter +
allgather: both on the same buffers, side by side, by size, float32 and float16.

    benchmarks/capped.sh 1gbit 4 .venv/bin/python benchmarks/scripts/allreduce_threshold.py      # as root

Rank 0 prints a table: median milliseconds per allreduce of each size for ``MPI_Allreduce`` (what
``MPICommunicator`` uses below ``large_allreduce_bytes``) and for the ring (above it), and their
ratio. ``MPICommunicator.large_allreduce_bytes`` (256 KiB by default) is where the ring starts
to win. No thresholds are asserted: this is a measurement.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

import gradcomp as gc


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-kib", default="16,64,128,256,512,1024,4096,25600")
    p.add_argument("--repeats", type=int, default=9)
    args = p.parse_args()
    mpi = gc.MPICommunicator(large_allreduce_bytes=1 << 62)   # always MPI_Allreduce
    ring = gc.MPICommunicator(large_allreduce_bytes=0)         # always the ring
    rows = []
    for kib in (int(s) for s in args.sizes_kib.split(",")):
        for dtype in (np.float32, np.float16):
            n = kib * 1024 // np.dtype(dtype).itemsize
            x = np.random.default_rng(mpi.rank).standard_normal(n).astype(dtype)
            times: dict[str, list[float]] = {"mpi": [], "ring": []}
            for _ in range(args.repeats):
                for name, comm in (("mpi", mpi), ("ring", ring)):
                    comm.comm.Barrier()
                    t0 = time.perf_counter()
                    comm.allreduce(x)
                    times[name].append(time.perf_counter() - t0)
            worst = {k: max(mpi.comm.allgather(statistics.median(v))) for k, v in times.items()}
            rows.append((kib, np.dtype(dtype).name, 1e3 * worst["mpi"], 1e3 * worst["ring"]))
    if mpi.rank == 0:
        print(f"{mpi.size} ranks; median ms per allreduce (slowest rank)\n")
        print("| KiB | dtype | MPI_Allreduce | ring RS + allgather | ring / MPI |")
        print("|---:|---|---:|---:|---:|")
        for kib, dtype, a, b in rows:
            print(f"| {kib} | {dtype} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    mpi.close()
    ring.close()


if __name__ == "__main__":
    main()
