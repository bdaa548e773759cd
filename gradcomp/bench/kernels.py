"""Kernel throughput, one process: each method's compute on one buffer, as a multiple of memcpy.

A compressor on a one-rank communicator (``MPI.COMM_SELF``) still compresses, moves its message
through MPI and decompresses, but nothing waits for a peer: what is left is the kernel cost. The
buffer is a flat float32 array of heavy-tailed values (default 100 MB, as in the issue's round-trip
figures), and every time is a median of repeats measured in the same run as the memcpy it is
divided by. Also measured here: the float32 -> float16 -> float32 round trip by NumPy's ``astype``,
by ``gradcomp.arrays.cast`` and by PyTorch (1 thread, and its default thread count), and the
per-channel int8 round trip (the quantizers' ``quantize`` and ``dequantize`` kernels, into
preallocated parameters, codes and accumulator).
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable

import numpy as np

from ..arrays import cast
from ..bucket import Bucket
from .methods import select


def _median_time(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if before:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def measure(mb: float = 100.0, repeats: int = 7, methods: str = "gradcomp",
            progress: Callable[[str], Any] | None = None) -> list[dict]:
    """Rows of ``{"kernel", "time_s", "vs_memcpy"}`` (memcpy first)."""
    n = int(mb * 2**20 / 4)
    rng = np.random.default_rng(0)
    x = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    tasks: list[tuple[str, Callable[[], Any]]] = [("memcpy", lambda: x.copy())]

    tasks.append(("fp16 round trip, numpy astype", lambda: x.astype(np.float16).astype(np.float32)))
    tasks.append(("fp16 round trip, gradcomp cast", lambda: cast(cast(x, np.float16), np.float32)))
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]  # no torch: no torch rows
    if torch is not None:
        t = torch.from_numpy(x)
        default_threads = torch.get_num_threads()

        def torch_rt(threads: int) -> Callable[[], None]:
            def fn() -> None:
                torch.set_num_threads(threads)
                try:
                    t.half().float()
                finally:
                    torch.set_num_threads(default_threads)
            return fn
        tasks.append(("fp16 round trip, torch 1 thread", torch_rt(1)))
        tasks.append((f"fp16 round trip, torch {default_threads} threads", torch_rt(default_threads)))

    from ..compressors.quantize.kernels import chunk_count, dequantize, quantize

    width = 512
    params = np.empty((2, chunk_count(n, width)), np.float32)
    codes = np.empty(n, np.uint8)
    acc = np.zeros(n, np.float32)

    def int8_rt() -> None:  # into a preallocated accumulator, as a decode adds every rank's codes into one
        quantize(x, params, codes, width, 255)
        dequantize(acc, params, codes, width, add=True)
    tasks.append(("int8 per-channel round trip (quantize + dequantize, add)", int8_rt))

    from mpi4py import MPI

    from ..comm import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF)
    bucket = Bucket(x, 0, [(n,)], True)
    for m in select(methods, with_torch=False):
        comp = m.build()
        if "powersgd" in m.name:  # a matrix to work on: the buffer as a tall (n/1024, 1024) layer
            height = n // 1024
            bucket = Bucket(x[:height * 1024], 0, [(height, 1024)], True)
        else:
            bucket = Bucket(x, 0, [(n,)], True)
        for _ in range(3):  # PowerSGD compresses from its third step
            comp.run(bucket, comm)
        label = f"{m.name} ({m.label})" if m.label else m.name
        tasks.append((f"{label} on 1 rank", partial(comp.run, bucket, comm)))

    rows: list[dict[str, Any]] = []
    for i, (name, fn) in enumerate(tasks):
        fn()  # first touch, imports, caches
        rows.append(dict(kernel=name, time_s=_median_time(fn, repeats)))
        if progress:
            progress(name)
    comm.close()
    base = rows[0]["time_s"]
    for r in rows:
        r["vs_memcpy"] = r["time_s"] / base
        r["mb"] = mb
    torch_rows = [r for r in rows if r["kernel"].startswith("fp16 round trip, torch")]
    ours = next(r for r in rows if r["kernel"] == "fp16 round trip, gradcomp cast")
    for r in torch_rows:
        r["gradcomp_cast_vs_this"] = ours["time_s"] / r["time_s"]
    return rows


def count(methods: str = "gradcomp") -> int:
    """How many rows ``measure`` produces (for a progress bar)."""
    try:
        import torch  # noqa: F401
        extra = 2
    except ImportError:
        extra = 0
    return 4 + extra + len(select(methods, with_torch=False))


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python -m gradcomp.bench.kernels",
                                description="kernel throughput as a multiple of memcpy (one process)")
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--methods", default="gradcomp")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    total = count(args.methods)
    done = [0]

    def progress(name: str) -> None:
        done[0] += 1
        print(f"@progress {done[0]} {total} {name}", flush=True)
    rows = measure(args.mb, args.repeats, args.methods, progress)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(kernels=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
