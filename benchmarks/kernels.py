"""Kernel throughput, one process: each method's compute on one buffer, against memcpy and its floor.

A compressor on a one-rank communicator (``MPI.COMM_SELF``) still compresses, moves its message
through MPI and decompresses, but nothing waits for a peer: what is left is the kernel cost. The
buffer is a flat float32 array of heavy-tailed values (default 100 MB), reduced as a scratch bucket
(as ``GradientReducer`` and the DDP hook hand them over: the mean is written into it), refilled
before every step outside the timing. Every method is timed alternately with a warm memcpy of the
same bytes (``np.copyto`` into a buffer allocated once), median of the repeats each, so the ratio
``vs_memcpy`` holds on a busy machine; ``floor_s`` is the method's memory-traffic floor
(``floors``) at the bandwidth of those memcpys, ``vs_floor`` the measured time over it. ``cpu_s``
is the process's CPU time (user + system, all threads) per step, the same against memcpy's CPU
time in ``cpu_vs_memcpy``: less disturbed by other processes than wall time.

``--model resnet50`` also times a whole ``GradientReducer.step()`` of every method on ResNet-50's
shapes (25.6 M values in buckets of 25 MiB, the README's path) against a memcpy of all of it.

Also measured: the float32 -> float16 -> float32 round trip by NumPy's ``astype``, by
``gradcomp.arrays.cast`` and by PyTorch (1 thread, and its default thread count), and the
per-channel int8 round trip (the quantizers' ``quantize`` and ``dequantize`` kernels, into
preallocated parameters, codes and accumulator).

The methods (``--methods``): ``floors`` (the default) constructs the codecs directly (``METHODS``);
anything else is a list of compressor specs (``benchmarks.methods.select``).
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np

from gradcomp.arrays import cast
from gradcomp.bucket import Bucket

from . import floors


def _methods() -> dict[str, Callable[[], Any]]:
    """The methods of the floors table, constructed directly (registered names are recipes whose
    warm-ups would time something else)."""
    import gradcomp as gc
    from gradcomp.compressors.quantize import QuantizePerChannel, QuantizePerTensor

    ef = gc.ErrorFeedback
    return {
        "allreduce": gc.Allreduce,
        "fp16": gc.FP16,
        "bf16": gc.BF16,
        "quantize-tensor": QuantizePerTensor,
        "quantize-channel": QuantizePerChannel,
        "int8": lambda: ef(gc.QuantizedAllreduce(bits=8)),
        "int8-noef": lambda: gc.QuantizedAllreduce(bits=8),
        "int4": lambda: ef(gc.QuantizedAllreduce(bits=4, exact_zero=True)),  # as registered
        "int4-noef": lambda: gc.QuantizedAllreduce(bits=4, exact_zero=True),
        "onebit": lambda: ef(gc.OneBit()),
        "onebit-worker": lambda: ef(gc.OneBit(), owner_feedback=False),
        "onebit-noef": gc.OneBit,
        "topk": lambda: ef(gc.TopK(0.01)),
        "topk-noef": lambda: gc.TopK(0.01),
        "randomk": lambda: ef(gc.RandomK(0.01)),
        "randomk-noef": lambda: gc.RandomK(0.01),
        "powersgd rank 4": lambda: gc.PowerSGD(rank=4, start_iter=2),
    }


#: names of ``_methods()`` (the default ``--methods floors``)
METHODS = ("allreduce", "fp16", "bf16", "quantize-tensor", "quantize-channel", "int8", "int8-noef",
           "int4", "int4-noef", "onebit", "onebit-worker", "onebit-noef", "topk", "topk-noef",
           "randomk", "randomk-noef", "powersgd rank 4")


class _Task:
    """One timed thing: ``fn`` after ``before`` (untimed), and its floor (bytes) where known."""

    def __init__(self, name: str, fn: Callable[[], Any], before: Callable[[], Any] | None = None,
                 traffic: floors.Passes | None = None, nbytes: float = 0.0):
        self.name, self.fn, self.before, self.traffic, self.nbytes = name, fn, before, traffic, nbytes


def _alternating(task: _Task, memcpy: Callable[[], Any], repeats: int) -> dict[str, Any]:
    """Median wall and CPU time of ``task`` and of ``memcpy``, timed in turns."""
    wall, cpu, base_wall, base_cpu = [], [], [], []
    for _ in range(repeats):
        c0, t0 = time.process_time(), time.perf_counter()
        memcpy()
        base_wall.append(time.perf_counter() - t0)
        base_cpu.append(time.process_time() - c0)
        if task.before:
            task.before()
        c0, t0 = time.process_time(), time.perf_counter()
        task.fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    row: dict[str, Any] = dict(kernel=task.name, time_s=float(np.median(wall)),
                               memcpy_s=float(np.median(base_wall)), times_s=[float(t) for t in wall],
                               cpu_s=float(np.median(cpu)), memcpy_cpu_s=float(np.median(base_cpu)))
    row["vs_memcpy"] = row["time_s"] / row["memcpy_s"]
    row["cpu_vs_memcpy"] = row["cpu_s"] / row["memcpy_cpu_s"] if row["memcpy_cpu_s"] else float("nan")
    if task.traffic is not None:
        bandwidth = floors.memcpy_bandwidth(row["memcpy_s"], task.nbytes)
        row["floor_memcpys"] = floors.memcpys(task.traffic, task.nbytes)
        row["floor_s"] = floors.seconds(task.traffic, bandwidth)
        row["vs_floor"] = row["time_s"] / row["floor_s"] if row["floor_s"] else None
        row["cpu_vs_floor"] = (row["cpu_vs_memcpy"] / row["floor_memcpys"]) if row["floor_memcpys"] else None
    return row


def _builders(methods: str) -> list[tuple[str, Callable[[], Any]]]:
    if methods == "floors":
        table = _methods()
        return [(name, table[name]) for name in METHODS]
    names = [m.strip() for m in methods.split(",")]
    table = _methods()
    if names and all(m in table for m in names):
        return [(m, table[m]) for m in names]
    from .methods import select

    return [(f"{m.name} ({m.label})" if m.label else m.name, m.build)
            for m in select(methods, with_torch=False)]


def _bucket_tasks(x: np.ndarray, methods: str, comm: Any) -> list[_Task]:
    """Each method's ``run`` on ``x`` as one scratch bucket (PowerSGD: one tall matrix)."""
    n = x.shape[0]
    buf = np.empty_like(x)
    tasks = []
    for name, build in _builders(methods):
        comp = build()
        if "powersgd" in name:  # a matrix to work on: the buffer as a tall (n/1024, 1024) layer
            height = n // 1024
            shapes: list[tuple[int, ...]] = [(height, 1024)]
            bucket = Bucket(buf[:height * 1024], 0, shapes, True, scratch=True)
        else:
            shapes = [(n,)]
            bucket = Bucket(buf, 0, shapes, True, scratch=True)

        def refill(b: Bucket = bucket) -> None:
            np.copyto(b.buffer, x[:b.numel])
        for _ in range(3):  # PowerSGD compresses from its third step
            refill()
            comp.run(bucket, comm)
        traffic = floors.floor(comp, bucket.numel, x.dtype, 1, shapes)
        tasks.append(_Task(f"{name} on 1 rank", partial(comp.run, bucket, comm), refill, traffic, x.nbytes))
    return tasks


def _reducer_tasks(model: str, methods: str, comm: Any, bucket_mb: float = 25.0) -> tuple[list[_Task], int]:
    """Each method's ``GradientReducer.step()`` on ``model``'s shapes, and the bytes of them."""
    from gradcomp.reducer import GradientReducer

    from .shapes import model_shapes

    shapes = model_shapes(model)
    rng = np.random.default_rng(1)
    grads = [(rng.standard_t(3, s) * 1e-3).astype(np.float32) for s in shapes]
    nbytes = sum(g.nbytes for g in grads)
    tasks = []
    for name, build in _builders(methods):
        comp = build()
        reducer = GradientReducer([g.copy() for g in grads], comp, comm, bucket_cap_mb=bucket_mb)
        views = reducer.gradients

        def refill(v: list = views) -> None:
            for dst, src in zip(v, grads):
                np.copyto(dst, src)
        for _ in range(3):
            refill()
            reducer.step()
        traffic: floors.Passes | None = floors.NONE
        for bucket, _members in reducer.buckets:
            t = floors.floor(comp, bucket.numel, bucket.dtype, 1, bucket.shapes)
            traffic = None if t is None or traffic is None else traffic + t
        tasks.append(_Task(f"{name}, {model} GradientReducer.step, 1 rank", reducer.step, refill,
                           traffic, nbytes))
    return tasks, nbytes


def measure(mb: float = 100.0, repeats: int = 9, methods: str = "floors",
            progress: Callable[[str], Any] | None = None, model: str | None = None,
            extras: bool = True) -> list[dict]:
    """Rows of ``{"kernel", "time_s", "vs_memcpy", ...}`` (memcpy first; see the module)."""
    n = int(mb * 2**20 / 4)
    rng = np.random.default_rng(0)
    x = (rng.standard_t(3, n) * 1e-3).astype(np.float32)
    dst = np.empty_like(x)

    def memcpy() -> None:
        np.copyto(dst, x)

    tasks: list[_Task] = [_Task("memcpy", memcpy)]
    if extras:
        tasks += _extra_tasks(x)

    from mpi4py import MPI

    from gradcomp.comm import MPICommunicator

    comm = MPICommunicator(MPI.COMM_SELF)
    tasks += _bucket_tasks(x, methods, comm)
    model_bytes = 0
    if model:
        model_tasks, model_bytes = _reducer_tasks(model, methods, comm)
        tasks += model_tasks
    rows: list[dict[str, Any]] = []
    for task in tasks:
        if task.before:
            task.before()
        task.fn()  # first touch, imports, caches
        if model_bytes and task.nbytes == model_bytes:  # against a memcpy of the model's bytes
            src = np.empty(model_bytes // 4, np.float32)
            out = np.empty_like(src)
            src[...] = 1.0
            rows.append(_alternating(task, partial(np.copyto, out, src), repeats))
        else:
            rows.append(_alternating(task, memcpy, repeats))
        if task.name == "memcpy":  # the baseline: both halves timed the same copy, so it is 1 by definition
            rows[-1].update(time_s=rows[-1]["memcpy_s"], cpu_s=rows[-1]["memcpy_cpu_s"], vs_memcpy=1.0,
                            cpu_vs_memcpy=1.0)
        if progress:
            progress(task.name)
    comm.close()
    for r in rows:
        r["mb"] = mb
    torch_rows = [r for r in rows if r["kernel"].startswith("fp16 round trip, torch")]
    ours = next((r for r in rows if r["kernel"] == "fp16 round trip, gradcomp cast"), None)
    for r in torch_rows:
        if ours is not None:
            r["gradcomp_cast_vs_this"] = ours["time_s"] / r["time_s"]
    return rows


def _extra_tasks(x: np.ndarray) -> list[_Task]:
    n = x.shape[0]
    tasks = [_Task("fp16 round trip, numpy astype", lambda: x.astype(np.float16).astype(np.float32)),
             _Task("fp16 round trip, gradcomp cast", lambda: cast(cast(x, np.float16), np.float32))]
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
        tasks.append(_Task("fp16 round trip, torch 1 thread", torch_rt(1)))
        tasks.append(_Task(f"fp16 round trip, torch {default_threads} threads", torch_rt(default_threads)))

    from gradcomp import QuantizePerChannel
    from gradcomp.comm import Workspace

    codec = QuantizePerChannel(bits=8, channel_size=512)  # the public codec: its encode / decode
    message = np.empty(codec.message_size(n), np.uint8)   # are the chunk kernels, and two views
    acc = np.zeros(n, np.float32)
    space = Workspace()

    def int8_rt() -> None:  # into a preallocated accumulator, as a decode adds every rank's codes into one
        codec.encode(x, message, space)
        codec.decode(message, acc, space, add=True)
    tasks.append(_Task("int8 per-channel round trip (quantize + dequantize, add)", int8_rt))
    return tasks


def count(methods: str = "floors", model: str | None = None, extras: bool = True) -> int:
    """How many rows ``measure`` produces (for a progress bar)."""
    extra = 0
    if extras:
        extra = 3
        try:
            import torch  # noqa: F401
            extra += 2
        except ImportError:
            pass
    per = len(_builders(methods))
    return 1 + extra + per * (2 if model else 1)


def table(rows: Sequence[dict]) -> str:
    """The rows with a floor as a Markdown table: measured, floor, ratio (wall and CPU time)."""
    out = ["| method | ms | floor ms | / floor | / memcpy | floor / memcpy | CPU / floor |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "floor_s" not in r:
            continue
        ratio = f"{r['vs_floor']:.2f}" if r.get("vs_floor") else "-"
        cpu = f"{r['cpu_vs_floor']:.2f}" if r.get("cpu_vs_floor") else "-"
        out.append(f"| {r['kernel']} | {r['time_s'] * 1e3:.1f} | {r['floor_s'] * 1e3:.1f} | {ratio} | "
                   f"{r['vs_memcpy']:.2f} | {r['floor_memcpys']:.2f} | {cpu} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import os

    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels",
                                description="kernel throughput against memcpy and the memory-traffic floor "
                                            "(one process)")
    p.add_argument("--mb", type=float, default=100.0)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--methods", default="floors",
                   help="'floors' (the codecs constructed directly), names from it, or compressor specs")
    p.add_argument("--model", default=None, help="also time GradientReducer.step() on this model's shapes")
    p.add_argument("--no-extras", dest="extras", action="store_false",
                   help="leave out the cast and round-trip rows")
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    total = count(args.methods, args.model, args.extras)
    done = [0]

    def progress(name: str) -> None:
        done[0] += 1
        print(f"@progress {done[0]} {total} {name}", flush=True)
    rows = measure(args.mb, args.repeats, args.methods, progress, args.model, args.extras)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(dict(kernels=rows), f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
