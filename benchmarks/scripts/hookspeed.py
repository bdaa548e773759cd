"""Where the DDP hook path's step time goes, against the NumPy reducer, side by side in one job.

    mpiexec -n 2 python benchmarks/scripts/hookspeed.py --methods onebit:warmup=0 --repeats 9

Every rank builds, per method, the three cases below over the same ResNet-50-shaped, heavy-tailed
gradients (``benchmarks.shapes``) and times them round-robin (a barrier before each step; the
slowest rank's time; medians):

* ``reducer``: ``GradientReducer.step()`` on its own buffers (``.gradients``, the README form;
  the worker's ``--path reducer``): the gradients are already in the buckets, nothing is copied.
* ``reducer-ddp-layout``: the same over DDP's bucket layout (DDP fills buckets from the last
  parameter backwards and closes one once it reaches the cap: here 4 buckets of 21-26 MB against
  the reducer's 5, whose last is 8 MB).
* ``reducer+copy``: ``GradientReducer.step(arrays)`` on arrays of their own: the gradients are
  copied into the buckets and the means back out (``--reducer-arrays own``).
* ``ddp``: zero_grad + forward + backward of a DDP model (``gradient_as_bucket_view=True``) whose
  synthetic backward hands over the same gradients (``benchmarks.paths``, the worker's
  ``--path ddp``), the method registered with ``gradcomp.torch.register``. DDP copies every
  gradient into its bucket before it calls the hook (its C++ ``copy_grad_to_bucket``).
* ``ddp-nocopy``: the same, but the backward hands over DDP's own bucket views (captured after
  DDP rebuilt its buckets), so DDP copies nothing: the hook path with the gradients already in
  the buckets, as the ``reducer`` case has them.
* ``ddp-buckets`` (once, not per method): DDP with a hook that returns the bucket at once (the
  worker's ``ddp-buckets`` row): the backward and DDP's copy, no communication.

Inside the ``ddp`` step it records timestamps: backward's start, each hook call's start and end,
each compressor Future's completion (on the wire thread) and backward's return. From them:
``to_1st_hook`` (autograd plus DDP copying the first bucket's gradients into it), ``in_hooks``
(the hooks' own Python time), ``reduce`` (first hook call to last Future done), ``after`` (last
Future done to backward's return: the torch Future callbacks and DDP's finalize).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from mpi4py import MPI

import gradcomp
from benchmarks.paths import _start_torch, _torch_classes
from benchmarks.shapes import heavy_tailed, model_shapes
from gradcomp.reducer import GradientReducer


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--methods", default="onebit:warmup=0,powersgd:rank=4,start_iter=2")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", default="resnet50")
    p.add_argument("--bucket-view", choices=("on", "off"), default="on")
    args = p.parse_args()
    specs = _split(args.methods)

    import torch
    from torch.nn.parallel import DistributedDataParallel

    import gradcomp.torch as gt

    world = MPI.COMM_WORLD
    rank = world.rank
    _start_torch()
    shapes = model_shapes(args.model)
    grads = heavy_tailed(shapes, seed=rank)
    saved = [g.copy() for g in grads]
    consts = [torch.from_numpy(g) for g in grads]
    storage = [torch.zeros(g.shape) for g in grads]
    comm = gradcomp.comm.MPICommunicator()
    Module = _torch_classes()["module"]

    def refill(arrays):
        for a, s in zip(arrays, saved):
            np.copyto(a, s)

    cases = []  # (name, prepare, step, timeline or None)
    for spec in specs:
        red = GradientReducer(grads, gradcomp.make(spec), comm)
        views = red.gradients
        tlr: dict = dict(hooks=[], done=[])
        _time_reduce(red.compressor, tlr)

        def rstep(r=red, tl=tlr):
            tl["t0"] = time.perf_counter()
            r.step()
            tl["t1"] = time.perf_counter()
        cases.append((f"{spec} reducer", lambda v=views: refill(v), rstep, tlr))
        # the reducer over DDP's bucket layout (DDP fills its buckets from the last parameter
        # backwards and closes one once it reaches the cap: fewer, larger buckets)
        red3 = GradientReducer(grads, gradcomp.make(spec), comm, buckets=_ddp_groups(grads, 25.0))
        views3 = red3.gradients
        cases.append((f"{spec} reducer-ddp-layout", lambda v=views3: refill(v), lambda r=red3: r.step(), None))
        red2 = GradientReducer(grads, gradcomp.make(spec), comm)
        own = [s.copy() for s in saved]
        cases.append((f"{spec} reducer+copy", lambda o=own: refill(o), lambda r=red2, o=own: r.step(o), None))
        model = DistributedDataParallel(Module(storage, consts), bucket_cap_mb=25,
                                        gradient_as_bucket_view=args.bucket_view == "on")
        tl: dict = dict(hooks=[], done=[])
        _register(gt, model, gradcomp.make(spec), tl)

        def step(m=model, tl=tl):
            m.zero_grad(set_to_none=True)
            loss = m()
            tl["t0"] = time.perf_counter()
            loss.backward()
            tl["t1"] = time.perf_counter()
        cases.append((f"{spec} ddp", lambda: refill(grads), step, tl))
        # the same, with the backward handing over DDP's own bucket views (captured once DDP
        # has rebuilt its buckets): DDP then copies nothing into its buckets
        model2 = DistributedDataParallel(Module(storage, consts), bucket_cap_mb=25,
                                         gradient_as_bucket_view=True)
        tl2: dict = dict(hooks=[], done=[])
        _register(gt, model2, gradcomp.make(spec), tl2)
        held: list = []

        def step2(m=model2, tl=tl2, held=held):
            m.zero_grad(set_to_none=True)
            loss = m()
            tl["t0"] = time.perf_counter()
            loss.backward()
            tl["t1"] = time.perf_counter()
            tl["n"] = tl.get("n", 0) + 1
            if not held and tl["n"] == 2:  # DDP rebuilt its buckets after step 1
                held.extend(q.grad for q in m.parameters())
                m.module.consts = held
        cases.append((f"{spec} ddp-nocopy", lambda h=held: refill([t.numpy() for t in h] if h else grads), step2, tl2))

    # DDP around a hook that returns the bucket at once (the worker's ddp-buckets row)
    from benchmarks.paths import _return_bucket
    base = DistributedDataParallel(Module(storage, consts), bucket_cap_mb=25,
                                   gradient_as_bucket_view=args.bucket_view == "on")
    base.register_comm_hook(None, _return_bucket)

    def bstep(m=base):
        m.zero_grad(set_to_none=True)
        m().backward()
    cases.insert(0, ("ddp-buckets (no communication)", lambda: refill(grads), bstep, None))
    times: dict[str, list[float]] = {c[0]: [] for c in cases}
    parts: dict[str, dict[str, list[float]]] = {}
    for rep in range(args.warmup + args.repeats):
        for name, prepare, step, tl in cases:
            prepare()
            if tl is not None:
                tl.update(hooks=[], done=[], submits=[])
            world.Barrier()
            t0 = time.perf_counter()
            step()
            t = time.perf_counter() - t0
            t = world.allreduce(t, op=MPI.MAX)
            if rep == args.warmup and rank == 0 and tl is not None and tl.get("submits"):
                print(f"{name}: bucket sizes (MB, in submission order)",
                      [round(n * 4 / 2**20, 1) for _, _, n in tl["submits"]])
            if rep >= args.warmup:
                times[name].append(t)
                if tl is not None:
                    d = parts.setdefault(name, {})
                    for k, v in _breakdown(tl).items():
                        d.setdefault(k, []).append(v)
    if rank == 0:
        print(f"{world.size} ranks, {args.repeats} repeats, medians in ms (slowest rank's step)")
        for name, ts in times.items():
            # the mean too: a governed method's audit steps sit above the median
            line = (f"{name:45s} {1e3 * statistics.median(ts):7.1f}   (min {1e3 * min(ts):6.1f}, "
                    f"mean {1e3 * statistics.fmean(ts):6.1f})")
            if name in parts:
                line += "   " + "  ".join(f"{k} {1e3 * statistics.median(v):.1f}" for k, v in parts[name].items())
            print(line)
        for spec in specs:
            r, c, d, n = (statistics.median(times[f"{spec} {k}"])
                          for k in ("reducer", "reducer+copy", "ddp", "ddp-nocopy"))
            b = statistics.median(times["ddp-buckets (no communication)"])
            print(f"{spec}: ddp / reducer {d / r:.2f}   ddp / reducer+copy {d / c:.2f}   "
                  f"ddp-nocopy / reducer {n / r:.2f}   (ddp - ddp-buckets) / reducer {(d - b) / r:.2f}")
        sys.stdout.flush()
    comm.close()


def _register(gt, model, compressor, tl: dict):
    """What ``gradcomp.torch.register`` does on one host, from public pieces (``gt.comm_hook``, a
    ``HookState`` keyed by parameter name), with the hook and the compressor's reduce wrapped to
    record timestamps in ``tl`` (rank-local). (On several hosts ``register`` would also pick the
    hierarchical schedule; this script runs on one.)"""
    state, hook = gt.comm_hook(compressor)
    named = list(model.module.named_parameters())
    state.names = {id(p): name for name, p in named}
    state.shapes = {name: tuple(p.shape) if p.dim() else (1,) for name, p in named}

    def gradcomp_hook(state, bucket):
        a = time.perf_counter()
        out = hook(state, bucket)
        tl["hooks"].append((a, time.perf_counter()))
        return out
    model.register_comm_hook(state, gradcomp_hook)
    _time_reduce(state.compressor, tl)
    return state


def _time_reduce(compressor, tl: dict) -> None:
    reduce = compressor.reduce

    def timed_reduce(bucket, comm):
        a = time.perf_counter()
        fut = reduce(bucket, comm)
        tl["submits"].append((a, time.perf_counter(), bucket.buffer.size))
        fut.add_done_callback(lambda _f: tl["done"].append(time.perf_counter()))
        return fut
    compressor.reduce = timed_reduce


def _breakdown(tl: dict) -> dict[str, float]:
    out = {}
    hooks, done = tl["hooks"], tl["done"]
    if hooks:
        out["to_1st_hook"] = hooks[0][0] - tl["t0"]
        out["in_hooks"] = sum(b - a for a, b in hooks)
    subs = tl["submits"]
    if subs:
        out["submit"] = sum(b - a for a, b, _ in subs)
        out["n"] = len(subs) / 1e3
    if done:
        first = hooks[0][0] if hooks else tl["t0"]
        out["reduce"] = max(done) - first
        out["after"] = tl["t1"] - max(done)
    return out


def _ddp_groups(grads, cap_mb: float) -> list[list[int]]:
    groups, cur, size = [], [], 0
    for i in reversed(range(len(grads))):
        cur.append(i)
        size += grads[i].nbytes
        if size >= cap_mb * 2**20:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    return groups


def _split(methods: str) -> list[str]:
    """Split a comma list of specs whose options also use commas (name:key=v,key=v,name2...)."""
    out: list[str] = []
    for piece in methods.split(","):
        if out and "=" in piece and ":" not in piece:
            out[-1] += "," + piece
        else:
            out.append(piece)
    return out


if __name__ == "__main__":
    main()
