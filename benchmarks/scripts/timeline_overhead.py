"""What the timeline costs the DDP hook's step: the same DDP model with the timeline off and on,
side by side in one job.

    mpiexec -n 2 python benchmarks/scripts/timeline_overhead.py --method onebit --caps 25,1 --blocks 8

Every rank builds, per bucket cap, one DDP model over ResNet-50-shaped, heavy-tailed gradients
(``benchmarks.shapes``, the synthetic backward of ``benchmarks.paths``, as ``hookspeed.py``) with
the method registered (``gradcomp.torch.register``), warms it up, then times blocks of ``--steps``
steps with the timeline off and on, alternating which goes first (a barrier before each step; the
slowest rank's time). An "on" block starts the timeline (``gradcomp.timeline.start``) before its
first step and stops it after its last, so the writer thread's work for all but the last step
falls inside the block, as in a run that leaves it on. Prints the medians and means per step.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mpi4py import MPI

import gradcomp
from benchmarks.paths import _start_torch, _torch_classes
from benchmarks.shapes import heavy_tailed, model_shapes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="onebit")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--caps", default="25,1", help="DDP bucket caps in MB, comma-separated")
    p.add_argument("--blocks", type=int, default=8, help="blocks per setting (off and on each)")
    p.add_argument("--steps", type=int, default=4, help="steps per block")
    p.add_argument("--warmup", type=int, default=4)
    args = p.parse_args()

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import gradcomp.torch as gt
    from gradcomp import timeline

    world = MPI.COMM_WORLD
    _start_torch()
    shapes = model_shapes(args.model)
    grads = heavy_tailed(shapes, seed=world.rank)
    consts = [torch.from_numpy(g) for g in grads]
    storage = [torch.zeros(g.shape) for g in grads]
    Module = _torch_classes()["module"]
    folder = tempfile.mkdtemp(prefix="gradcomp-timeline-")
    if world.rank == 0:
        print(f"{world.size} ranks, {args.method}, {args.model}; {args.blocks} blocks of {args.steps} steps "
              f"off and on; ms per step (slowest rank)")
    for cap in (float(c) for c in args.caps.split(",")):
        model = DistributedDataParallel(Module(storage, consts), bucket_cap_mb=cap, gradient_as_bucket_view=True)
        gt.register(model, gradcomp.make(args.method))

        def step(m=model):
            m.zero_grad(set_to_none=True)
            m().backward()

        for _ in range(args.warmup):
            step()
        times: dict[str, list[float]] = {"off": [], "on": []}
        events = 0
        for block in range(2 * args.blocks):
            mode = ("off", "on")[(block + block // 2) % 2]  # off on on off off on ...
            if mode == "on":
                timeline.start(os.path.join(folder, f"cap{cap}-block{block}"))
            for _ in range(args.steps):
                world.Barrier()
                t0 = time.perf_counter()
                step()
                t = world.allreduce(time.perf_counter() - t0, op=MPI.MAX)
                times[mode].append(t)
            if mode == "on":
                written = timeline.stop()
                if written:
                    events += len(timeline.read(written))
        if world.rank == 0:
            off, on = (statistics.median(times[k]) for k in ("off", "on"))
            buckets = events / (args.blocks * args.steps)
            print(f"cap {cap:5g} MB: off {1e3 * off:7.1f}  on {1e3 * on:7.1f}  ({100 * (on / off - 1):+.1f}%)   "
                  f"means off {1e3 * statistics.fmean(times['off']):.1f} on {1e3 * statistics.fmean(times['on']):.1f}"
                  f"   events per step {buckets:.0f}", flush=True)


if __name__ == "__main__":
    main()
