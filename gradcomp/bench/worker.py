"""One benchmark job, run on every rank: ``mpiexec -n N python -m gradcomp.bench.worker ...``.

Every rank fills the layers of a model with its own heavy-tailed gradients, packs them into
~25 MB buckets, and runs each method for whole training steps (all buckets submitted, then all
awaited, as DDP does). A step's time is the slowest rank's, after a barrier; the reported time is
the median over ``--repeats`` steps that follow ``--warmup`` untimed ones (PowerSGD compresses from
its third step on, so the timed steps are compressed). The relative error is measured against the
exact mean (a float64 MPI allreduce of everyone's data) on the first timed step.

gradcomp methods talk over mpi4py (``MPICommunicator``); PyTorch's hooks over a gloo process group
started from the same MPI job (``gradcomp.torch.init_process_group``), on the same buckets, each
bucket handed to the hook as a GradBucket look-alike (buffer, index, is_last, gradients); the
single-collective hooks get every bucket at once (as DDP gives them), PowerSGD one bucket at a time
(see ``run``: its callback-launched rounds would otherwise interleave differently on different
ranks). gradcomp's communicator runs buckets one after another on its worker anyway. Bytes on
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


class _DuckBucket:
    """What PyTorch's hooks read from a ``dist.GradBucket`` (which Python cannot construct)."""

    def __init__(self, tensor, index, shapes, is_last):
        self._tensor = tensor
        self._index = index
        self._is_last = is_last
        self._views = []
        off = 0
        for s in shapes:
            n = int(np.prod(s))
            self._views.append(tensor[off:off + n].view(s))
            off += n

    def buffer(self):
        return self._tensor

    def set_buffer(self, tensor):
        self._tensor = tensor

    def index(self):
        return self._index

    def is_last(self):
        return self._is_last

    def gradients(self):
        return self._views

    def parameters(self):
        return self._views


class _TorchBytes:
    """Counts what the hooks hand to torch.distributed collectives (bandwidth-optimal bytes), by
    wrapping the module functions they call; the real collectives still run."""

    def __init__(self, size):
        import torch.distributed as dist

        self.dist, self.size, self.bytes, self.calls = dist, size, 0.0, 0
        self._saved = {}

    def __enter__(self):
        d = self.dist
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


def _time_steps(world, step, warmup, repeats, before=None):
    """(per-step times: slowest rank, first timed step's outputs)."""
    for _ in range(warmup):
        if before:
            before()
        step()
    times, first = [], None
    for i in range(repeats):
        if before:
            before()
        world.Barrier()
        t0 = time.perf_counter()
        outs = step()
        times.append(time.perf_counter() - t0)
        if i == 0:
            first = outs
    from mpi4py import MPI

    slowest = np.array(times)
    world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
    return slowest.tolist(), first


def _rel_error(outs, exact):
    num = sum(float(np.sum((np.asarray(o, dtype=np.float64) - e) ** 2)) for o, e in zip(outs, exact))
    den = sum(float(np.sum(e ** 2)) for e in exact)
    return float(np.sqrt(num / den)) if den > 0 else 0.0


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
    total = len(methods) + 1
    _progress(rank, 0, total, "memcpy")

    def memcpy_step():
        return [b.buffer.copy() for b in buckets]
    memcpy_times, _ = _time_steps(world, memcpy_step, args.warmup, args.repeats)
    results = [dict(method="memcpy", kind="baseline", label="memcpy of the buckets",
                    times_s=memcpy_times, time_s=float(np.median(memcpy_times)),
                    bytes_per_rank=0.0, rel_error=0.0, same_as=None)]
    _progress(rank, 1, total, "memcpy")

    torch_ready = False
    for i, m in enumerate(methods):
        if m.kind == "gradcomp":
            comp = m.build()

            def step(comp=comp):
                futures = [comp.reduce(b, comm) for b in buckets]
                return [f.result() for f in futures]
            for _ in range(args.warmup):
                step()
            s0 = comp.stats()
            times, first = _time_steps(world, step, 0, args.repeats)
            s1 = comp.stats()
            steps = max(s1["steps"] - s0["steps"], 1)
            nbytes = (s1["bytes_sent"] - s0["bytes_sent"]) / steps
            rounds = (s1["rounds"] - s0["rounds"]) / steps
            label = repr(comp)
        else:
            import torch

            if not torch_ready:
                from ..torch import init_process_group

                torch.set_num_threads(1)
                init_process_group("gloo")
                torch_ready = True
            state, hook = m.build(size)
            tensors = [torch.from_numpy(b.buffer.copy()) for b in buckets]
            originals = [torch.from_numpy(b.buffer) for b in buckets]
            ducks = [_DuckBucket(t, b.index, b.shapes, b.is_last) for t, b in zip(tensors, buckets)]

            def restore():  # the hooks write into the bucket: give each step the same gradients
                for d, t, o in zip(ducks, tensors, originals):
                    t.copy_(o)
                    d.set_buffer(t)

            if "powersgd" in m.name or "quantize" in m.name:
                # Multi-round hooks launch their later collectives from completion callbacks on
                # gloo's threads; with several buckets in flight the ranks can then issue them in
                # different orders (gloo aborts: "Received data size doesn't match"). One bucket
                # at a time keeps every rank's order the same.
                def step(state=state, hook=hook):
                    return [hook(state, d).wait().numpy() for d in ducks]
            else:  # one collective per call, issued here: all buckets in flight, as DDP does
                def step(state=state, hook=hook):
                    futures = [hook(state, d) for d in ducks]
                    return [f.wait().numpy() for f in futures]
            try:
                for _ in range(args.warmup):
                    restore()
                    step()
                with _TorchBytes(size) as counter:
                    times, first = _time_steps(world, step, 0, args.repeats, before=restore)
            except Exception as exc:  # the same on every rank: the hook's own arithmetic fails
                world.Barrier()
                results.append(dict(method=m.name, kind=m.kind, label=m.label, same_as=m.same_as,
                                    error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
                _progress(rank, i + 2, total, m.name)
                continue
            nbytes = counter.bytes / args.repeats
            rounds = counter.calls / args.repeats
            label = m.label
        results.append(dict(method=m.name, kind=m.kind, label=label, same_as=m.same_as,
                            times_s=times, time_s=float(np.median(times)), bytes_per_rank=nbytes,
                            rounds_per_step=rounds, rel_error=_rel_error(first, exact)))
        _progress(rank, i + 2, total, m.name)
    comm.close()
    return dict(model=args.model, ranks=size, numel=numel(shapes), buckets=len(buckets),
                bucket_mb=args.bucket_mb, repeats=args.repeats, warmup=args.warmup,
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
