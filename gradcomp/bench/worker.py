"""One benchmark job, run on every rank: ``mpiexec -n N python -m gradcomp.bench.worker ...``.

Every rank fills the layers of a model with its own heavy-tailed gradients, packs them into
~25 MB buckets, and runs each method for whole training steps (all buckets submitted, then all
awaited, as DDP does). A step's time is the slowest rank's, after a barrier; the reported time is
the median over ``--repeats`` steps that follow ``--warmup`` untimed ones (PowerSGD compresses from
its third step on, so the timed steps are compressed). By default the timed steps go round-robin
over the methods, so that a burst of load from other processes slows every method alike;
``--order blocks`` times each method's steps together instead, as a training run repeats one method
(on a VM, fresh pages from another method's allocations can cost a method hundreds of ms a step). The relative error is measured against the
exact mean (a float64 MPI allreduce of everyone's data) on the first timed step.

gradcomp methods talk over mpi4py (``MPICommunicator``); PyTorch's hooks over a gloo process group
started from the same MPI job (``gradcomp.torch.init_process_group``), on the same buckets, each
bucket handed to the hook as a GradBucket look-alike (buffer, index, is_last, gradients); the
single-collective hooks get every bucket at once (as DDP gives them), PowerSGD one bucket at a time
(see ``run``: its callback-launched rounds would otherwise interleave differently on different
ranks). gradcomp's communicator runs buckets one after another on its worker anyway. Both sides
get the buckets as DDP hands them to a hook, theirs to overwrite (gradcomp: ``Bucket.scratch``),
and both have them restored before each step, outside the clock. Bytes on
the wire: gradcomp's communicator counts them; for the hooks, the torch.distributed collectives
they call are counted with the same bandwidth-optimal formulas (``gradcomp.comm.wire_bytes``).
torch runs one thread per rank, like gradcomp's BLAS (ranks share the cores).

Rank 0 prints ``@progress DONE TOTAL NAME`` lines (for the driver's progress bar) and writes the
results as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import numpy as np

from ..bucket import pack
from ..comm import MPICommunicator, wire_bytes
from .methods import METHODS, select
from .shapes import heavy_tailed, model_shapes, numel


def _progress(rank, done, total, name):
    if rank == 0:
        print(f"@progress {done} {total} {name}", flush=True)


class _TorchBytes:
    """Counts what the hooks hand to torch.distributed collectives (bandwidth-optimal bytes), by
    wrapping the module functions they call; the real collectives still run."""

    def __init__(self, size):
        import torch.distributed as dist

        self.dist, self.size, self.bytes, self.calls = dist, size, 0.0, 0
        self._saved = {}

    def __enter__(self):
        d = self.dist
        self._saved = {}
        for name, kind in (("all_reduce", "allreduce"), ("all_gather", "allgather"),
                           ("all_gather_into_tensor", "allgather")):
            real = getattr(d, name)
            self._saved[name] = real

            def counted(*args, _real=real, _kind=kind, _name=name, **kw):
                t = args[1] if _name in ("all_gather", "all_gather_into_tensor") else args[0]
                if _name == "all_gather_into_tensor":
                    t = args[1]
                self.bytes += wire_bytes(_kind, t.numel() * t.element_size(), self.size)
                self.calls += 1
                return _real(*args, **kw)
            setattr(d, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(self.dist, name, real)


def _rel_error(outs, exact):
    num = sum(float(np.sum((np.asarray(o, dtype=np.float64) - e) ** 2)) for o, e in zip(outs, exact))
    den = sum(float(np.sum(e ** 2)) for e in exact)
    return float(np.sqrt(num / den)) if den > 0 else 0.0


class _Case:
    """One method ready to step: ``run_step()`` reduces every bucket once and returns the means."""

    def __init__(self, name, kind, label, same_as, step, before=None):
        self.name, self.kind, self.label, self.same_as = name, kind, label, same_as
        self._step, self._before = step, before

    def prepare(self):
        """Untimed, before each step: restore the buffers a method overwrites."""
        if self._before:
            self._before()

    def run_step(self, timed=False):
        return self._step()

    def begin(self):
        """Called once before the timed steps (traffic counters start here)."""

    def traffic(self, steps):
        return 0.0, 0.0


class _GradcompCase(_Case):
    def __init__(self, m, comp, step, before):
        super().__init__(m.name, m.kind, repr(comp), m.same_as, step, before)
        self.comp = comp

    def begin(self):
        self._s0 = self.comp.stats()

    def traffic(self, steps):
        s1 = self.comp.stats()
        n = max(s1["steps"] - self._s0["steps"], 1)
        return ((s1["bytes_sent"] - self._s0["bytes_sent"]) / n,
                (s1["rounds"] - self._s0["rounds"]) / n)


def _gradcomp_case(m, buckets, comm, shared):
    """The buckets as DDP hands them to a hook: the hook's to overwrite (``Bucket.scratch``, as
    PyTorch's hooks overwrite theirs), one set of working copies shared by every gradcomp method
    and restored before each step, outside the clock."""
    comp = m.build()
    if "work" not in shared:
        shared["work"] = [b.with_buffer(b.buffer.copy(), scratch=True) for b in buckets]
    work = shared["work"]

    def restore():
        for w, b in zip(work, buckets):
            np.copyto(w.buffer, b.buffer)

    def step():
        futures = [comp.reduce(w, comm) for w in work]
        return [f.result() for f in futures]
    return _GradcompCase(m, comp, step, restore)


class _TorchCase(_Case):
    def __init__(self, m, step, before, size):
        super().__init__(m.name, m.kind, m.label, m.same_as, step, before)
        self.counter = _TorchBytes(size)

    def run_step(self, timed=False):
        if not timed:
            return self._step()
        with self.counter:
            return self._step()

    def traffic(self, steps):
        return self.counter.bytes / steps, self.counter.calls / steps


def _torch_setup(buckets, shared):
    import torch

    if not shared:
        from ..torch import init_process_group

        torch.set_num_threads(1)
        init_process_group("gloo")
        # one set of bucket tensors for every hook: each step starts from the same gradients
        shared["tensors"] = [torch.from_numpy(b.buffer.copy()) for b in buckets]
        shared["originals"] = [torch.from_numpy(b.buffer) for b in buckets]


def _torch_case(m, buckets, size, shared):
    from .hookbucket import HookBucket

    _torch_setup(buckets, shared)
    tensors, originals = shared["tensors"], shared["originals"]
    state, hook = m.build(size)
    ducks = [HookBucket(t, b.index, b.shapes, b.is_last) for t, b in zip(tensors, buckets)]

    def restore():  # the hooks write into the bucket
        for d, t, o in zip(ducks, tensors, originals):
            t.copy_(o)
            d.set_buffer(t)

    if "powersgd" in m.name or "quantize" in m.name:
        # Multi-round hooks launch their later collectives from completion callbacks on gloo's
        # threads; with several buckets in flight the ranks can then issue them in different
        # orders (gloo aborts: "Received data size doesn't match"). One bucket at a time keeps
        # every rank's order the same.
        def step():
            return [hook(state, d).wait().numpy() for d in ducks]
    else:  # one collective per call, issued here: all buckets in flight, as DDP does
        def step():
            futures = [hook(state, d) for d in ducks]
            return [f.wait().numpy() for f in futures]
    return _TorchCase(m, step, restore, size)


def run(args) -> dict:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    comm = MPICommunicator()
    methods = select(args.methods, with_torch=None if args.torch == "auto" else args.torch == "on")
    shapes = model_shapes(args.model)
    grads = heavy_tailed(shapes, seed=args.seed + rank)
    buckets = [b for b, _ in pack(grads, args.bucket_mb)]
    del grads
    exact = []
    for b in buckets:
        e = b.buffer.astype(np.float64)
        world.Allreduce(MPI.IN_PLACE, e, op=MPI.SUM)
        e /= size
        exact.append(e)
    # Phase 1, per method: build it and run the warm-up steps (the progress bar follows this).
    # Phase 2: the timed steps, round-robin over the methods (repeat 1 of every method, then
    # repeat 2 ...), so that load from other processes on a shared machine hits every method alike.
    total = len(methods) + 2
    _progress(rank, 0, total, "memcpy")
    cases = [_Case("memcpy", "baseline", "memcpy of the buckets", None,
                   lambda: [b.buffer.copy() for b in buckets])]
    results = []
    torch_state, work_state = {}, {}
    for i, m in enumerate(methods):
        try:
            if m.kind == "gradcomp" and m.transport == "gloo":
                _torch_setup(buckets, torch_state)
                if "comm" not in torch_state:
                    from ..torch import TorchCommunicator

                    torch_state["comm"] = TorchCommunicator()
                case = _gradcomp_case(m, buckets, torch_state["comm"], work_state)
            elif m.kind == "gradcomp":
                case = _gradcomp_case(m, buckets, comm, work_state)
            else:
                case = _torch_case(m, buckets, size, torch_state)
            for _ in range(args.warmup):
                case.prepare()
                case.run_step()
            cases.append(case)
        except Exception as exc:  # a PyTorch hook whose own arithmetic fails (the same on every rank)
            if m.kind == "gradcomp":
                raise
            world.Barrier()
            results.append(dict(method=m.name, kind=m.kind, label=m.label, same_as=m.same_as,
                                error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
        _progress(rank, i + 1, total, m.name)
    for case in cases:
        case.begin()
    times = {c.name: [] for c in cases}
    errors = {}
    if args.order == "blocks":
        schedule = [(case, rep) for case in cases for rep in range(args.repeats)]
    else:
        schedule = [(case, rep) for rep in range(args.repeats) for case in cases]
    for case, rep in schedule:
        if args.order == "blocks" and rep == 0:
            case.prepare()
            case.run_step()  # one more untimed step: the previous method's memory churn settles
        case.prepare()  # restoring overwritten buckets is not part of the step
        world.Barrier()
        t0 = time.perf_counter()
        outs = case.run_step(timed=True)
        times[case.name].append(time.perf_counter() - t0)
        if rep == 0:  # after the clock; kept as one number (BERT-sized copies of every method's
            # results would not fit in memory)
            errors[case.name] = 0.0 if case.kind == "baseline" else _rel_error(outs, exact)
        # Let go of this step's results before the next one, as training reuses its gradient
        # memory: kept alive, the next step's results need fresh pages, and on this VM first
        # touching 100 MB costs up to 400 ms (that was every method's second timed step).
        del outs
    _progress(rank, total - 1, total, "timed steps")
    for case in cases:
        slowest = np.array(times[case.name])
        world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        nbytes, rounds = case.traffic(args.repeats)
        err = errors[case.name]
        results.append(dict(method=case.name, kind=case.kind, label=case.label, same_as=case.same_as,
                            times_s=slowest.tolist(), time_s=float(np.median(slowest)),
                            bytes_per_rank=nbytes, rounds_per_step=rounds, rel_error=err))
    order = ["memcpy"] + [m.name for m in methods]
    results.sort(key=lambda r: order.index(r["method"]))
    _progress(rank, total, total, "done")
    comm.close()
    if "comm" in torch_state:
        torch_state["comm"].close()
    return dict(model=args.model, ranks=size, numel=numel(shapes), buckets=len(buckets),
                bucket_mb=args.bucket_mb, repeats=args.repeats, warmup=args.warmup, order=args.order,
                host=platform.node(), cpus=os.cpu_count(), network=os.environ.get("GRADCOMP_NETWORK", ""),
                results=_with_ratios(results, numel(shapes), size))


def _with_ratios(results, n, size):
    by = {r["method"]: r for r in results if "time_s" in r}
    fp32_bytes = wire_bytes("allreduce", 4 * n, size)
    for r in results:
        if "time_s" not in r:
            continue
        for base in ("memcpy", "allreduce", "fp16"):
            if base in by and by[base]["time_s"] > 0:
                r[f"time_vs_{base}"] = r["time_s"] / by[base]["time_s"]
        if r["method"] != "memcpy":
            r["compression_ratio"] = fp32_bytes / r["bytes_per_rank"] if r["bytes_per_rank"] else None
        twin = by.get(r.get("same_as") or "")
        if twin is not None:
            r["time_vs_same_method"] = r["time_s"] / twin["time_s"]
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gradcomp.bench.worker",
                                description="one benchmark job on every rank of an mpiexec launch")
    p.add_argument("--model", default="resnet50", help="resnet50, bert-base or tiny")
    p.add_argument("--methods", default="all", help=f"comma-separated from: all, gradcomp, torch, "
                   f"{', '.join(METHODS)}")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 2 for PowerSGD)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=("round-robin", "blocks"), default="round-robin",
                   help="timed steps round-robin over the methods (spreads load from other "
                        "processes over all methods alike) or each method's steps in one block "
                        "(steady state, as in training: no allocation churn from the other "
                        "methods between steps)")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    if args.warmup < 3:
        print("warning: fewer than 3 warm-up steps: PowerSGD (start_iter=2) is timed before it "
              "compresses", file=sys.stderr)
    result = run(args)
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
