"""Per-step PowerSGD compute on ResNet-50's parameter shapes: gradcomp vs PyTorch, one process.

    python benchmarks/scripts/powersgd_speed.py [--ranks 1 2 4] [--repeats 7] [--threads 1]
    mpiexec -n 4 python benchmarks/scripts/powersgd_speed.py --count-rounds   # collectives per step

``--count-rounds`` instead reduces a few small buckets with each registered PowerSGD variant on
however many ranks it is launched with and prints the collectives per compressed step and the
compression rate from ``stats()``, for comparison with PyTorch's three allreduces per bucket.

One process (world size 1), so the collectives are copies and what is measured is the compression
arithmetic plus each side's bookkeeping: gradcomp's ``PowerSGD.reduce`` on an ``MPICommunicator``
against PyTorch's own ``powerSGD_hook`` on a one-rank gloo group, same buckets (ResNet-50's
25,557,032 gradients in reverse parameter order, 25 MiB buckets as DDP makes them), same settings
(error feedback and warm start on, ``min_compression_rate=2``), same BLAS thread count. Both are
past their warm-up and first compressed step when the timing starts; each repeat times one full
step of each side, alternating, and the table reports medians and their ratio (gradcomp / PyTorch,
below 1 means gradcomp is faster). No thresholds: this is a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # benchmarks/ (the checkout)

import gradcomp as gc  # noqa: E402
from gradcomp.bucket import pack  # noqa: E402


def resnet50_shapes() -> list[tuple[int, ...]]:
    """Parameter shapes of torchvision's resnet50 in registration order (conv, bn weight/bias...)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    inplanes = 64
    for planes, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            shapes += [(planes, inplanes, 1, 1), (planes,), (planes,),
                       (planes, planes, 3, 3), (planes,), (planes,),
                       (planes * 4, planes, 1, 1), (planes * 4,), (planes * 4,)]
            if b == 0:
                shapes += [(planes * 4, inplanes, 1, 1), (planes * 4,), (planes * 4,)]
            inplanes = planes * 4
    shapes += [(1000, 2048), (1000,)]
    assert sum(math.prod(s) for s in shapes) == 25_557_032
    return shapes


def start_gloo():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    return dist


def count_rounds(buckets_per_step: int = 1, steps: int = 20) -> None:
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    shapes = [(128, 64), (128,), (64, 32, 3, 3), (64,)]
    n = sum(math.prod(s) for s in shapes)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"| variant ({comm.size} ranks) | collectives per compressed step | compression rate |")
    say("|---|---:|---:|")
    for name in [k for k in gc.REGISTRY if "powersgd" in k]:
        comp = gc.make(name)
        for _ in range(steps):
            comp.reduce(gc.Bucket(rng.standard_normal(n).astype(np.float32), 0, shapes), comm).result()
        s = getattr(comp, "inner", comp).stats()
        say(f"| {name} | {s['rounds_per_compressed_step']:g} | {s['compression_rate']:.1f} |")
    comm.close()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1, help="BLAS / torch threads on both sides")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--count-rounds", action="store_true", help="count collectives instead (mpiexec)")
    args = p.parse_args(argv)
    if args.count_rounds:
        count_rounds()
        return False

    import torch
    from threadpoolctl import threadpool_limits
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

    from benchmarks.hookbucket import HookBucket

    torch.set_num_threads(args.threads)
    comm = gc.MPICommunicator(blas_threads=args.threads)
    threadpool_limits(args.threads)
    start_gloo()

    shapes = list(reversed(resnet50_shapes()))  # DDP buckets gradients in reverse order
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    buckets = [b for b, _ in pack(arrays, args.bucket_cap_mb)]
    del arrays
    sources = [torch.from_numpy(b.buffer) for b in buckets]  # shares memory, read-only use
    work = [s.clone() for s in sources]

    def ours_step(comp):
        futures = [comp.reduce(b, comm) for b in buckets]
        return [f.result() for f in futures]

    def torch_step(state):
        for w, s in zip(work, sources):
            w.copy_(s)  # the hook overwrites its input; refill before the clock starts
        t0 = time.perf_counter()
        for b, w in zip(buckets, work):
            powerSGD_hook(state, HookBucket(w, b.index, b.shapes, b.is_last)).wait()
        return time.perf_counter() - t0

    print(f"ResNet-50: {sum(b.numel for b in buckets):,} gradients in {len(buckets)} buckets of "
          f"<= {args.bucket_cap_mb:g} MiB; {args.threads} BLAS thread(s); numpy {np.__version__}, "
          f"torch {torch.__version__}; medians of {args.repeats} steps\n")
    print("| rank | gradcomp ms/step | PyTorch ms/step | ratio | compression rate (ours / torch) |")
    print("|---:|---:|---:|---:|---:|")
    for r in args.ranks:
        ours = gc.PowerSGD(rank=r, start_iter=2)
        state = PowerSGDState(process_group=None, matrix_approximation_rank=r, start_powerSGD_iter=2)
        for _ in range(3):  # two warm-up steps and the first compressed one (allocations)
            ours_step(ours)
            torch_step(state)
        t_ours, t_torch = [], []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            ours_step(ours)
            t_ours.append(time.perf_counter() - t0)
            t_torch.append(torch_step(state))
        mo, mt = statistics.median(t_ours), statistics.median(t_torch)
        rate_ours, rate_torch = ours.compression_stats()[0], state.compression_stats()[0]
        print(f"| {r} | {1e3 * mo:.1f} | {1e3 * mt:.1f} | {mo / mt:.2f} | {rate_ours:.1f} / {rate_torch:.1f} |",
              flush=True)
    return True  # no destroy_process_group(): see the note at the bottom


if __name__ == "__main__" and main():
    # PyTorch 2.13 sometimes aborts in destroy_process_group() or at interpreter exit after
    # powerSGD_hook ran on gloo ("terminate called ... Resource deadlock avoided": a thread joining
    # itself; seen about 1 run in 10, also in a script without gradcomp or MPI). Everything is
    # printed by now: leave without the teardown.
    sys.stdout.flush()
    os._exit(0)
