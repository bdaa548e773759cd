"""One benchmark job, run on every rank: ``mpiexec -n N python -m gradcomp.bench.worker ...``.

It measures what users get, on one of two paths (``--path``):

``reducer``: the README's NumPy path. Every rank keeps gradient arrays of the model's shapes
(heavy-tailed, its own), refilled in place before each step, outside the clock (``np.copyto``
from a saved copy: that stands in for the backward pass). A gradcomp method's step is
``GradientReducer(arrays, gradcomp.make(spec), comm).step()``, one reducer per method, built once.
PyTorch's hooks are called on the same bucket layout through ``HookBucket`` (a GradBucket
stand-in; their bucket tensors are restored before each step, outside the clock): the
single-collective hooks get every bucket at once (as DDP gives them), PowerSGD and quantization
one bucket at a time (their callback-launched rounds would otherwise interleave differently on
different ranks). Baseline row ``memcpy``: the refill itself.

``ddp``: the DDP hook path. Every method gets its own ``torch.nn.parallel.DistributedDataParallel``
(gloo, CPU, ``bucket_cap_mb``, DDP's other defaults) over a module holding ``nn.Parameter``s of the
model's shapes (the parameter storage is shared by all models; DDP's buckets are each model's own).
Its backward is synthetic and cheap, the same work for every method: a custom autograd function
hands back, as each parameter's gradient, a tensor over the rank's fixed heavy-tailed gradient
array, which autograd takes as ``.grad`` without a copy, as it takes the fresh gradients of a real
backward. The arrays are refilled before each step, outside the clock, as on the reducer path
(DDP writes the means into ``.grad``, here those arrays). So the step's allocations are DDP's and
the hook's, not a model's (``--backward fresh`` clones the gradients every step instead, as a real
backward allocates them). A step is ``zero_grad(set_to_none=True)`` + forward + backward, timed
whole: DDP runs the hooks during the backward and waits for them before it returns. Rows:
``backward`` (the same module without DDP: the compute and autograd's bookkeeping alone, no
communication), ``ddp`` (DDP without a hook: its built-in allreduce, the reference), every
gradcomp spec through ``gradcomp.torch.register(model, gradcomp.make(spec))`` (MPI under mpiexec;
``gloo-`` methods over ``TorchCommunicator``), and PyTorch's hooks through
``model.register_comm_hook``. Models are built once and warmed up (DDP rebuilds its buckets after
the first step).

On both paths: a step's time is the slowest rank's, after a barrier; the reported time is the
median over ``--repeats`` steps that follow ``--warmup`` untimed ones (PowerSGD specs run with
``start_iter=2``, so 3 warm-up steps make every timed step a compressed one). Minor page faults
(``getrusage(RUSAGE_SELF).ru_minflt``, all threads of the rank) are counted around every timed
step: ``faults_per_step`` is the median over steps of the largest count of any rank (gradcomp's
steady state should allocate nothing; with glibc's defaults every fresh allocation of tens of MB
costs first-touch faults). By default the timed steps go round-robin over the methods, so that a
burst of load from other processes slows every method alike; ``--order blocks`` builds, warms up
and times one method at a time (as a training run repeats one method; also only one method's
memory is alive at a time, which BERT-sized runs with many methods need). The relative error is
measured against the exact mean (a float64 MPI allreduce of everyone's gradients) on the first
timed step, outside the clock; on the ``ddp`` path also against DDP's own result
(``rel_diff_vs_ddp``). Bytes on the wire: gradcomp's compressors count them
(``Compressor.stats()``); for PyTorch's hooks, the torch.distributed collectives they call are
counted with the same bandwidth-optimal formulas (``gradcomp.comm.wire_bytes``); DDP's own
allreduce by that formula. torch runs one thread per rank, like gradcomp's BLAS (ranks share the
cores).

Rank 0 prints ``@progress DONE TOTAL NAME`` lines (for the driver's progress bar) and writes the
results as JSON to ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time

import numpy as np

from ..bucket import group, pack
from ..comm import MPICommunicator, wire_bytes
from .methods import select
from .shapes import heavy_tailed, model_shapes, numel

PATHS = ("reducer", "ddp")


def _progress(rank, done, total, name):
    if rank == 0:
        print(f"@progress {done} {total} {name}", flush=True)


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


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
                self.bytes += wire_bytes(_kind, t.numel() * t.element_size(), self.size)
                self.calls += 1
                return _real(*args, **kw)
            setattr(d, name, counted)
        return self

    def __exit__(self, *exc):
        for name, real in self._saved.items():
            setattr(self.dist, name, real)


_CHUNK = 1 << 20


def _rel_diff(outs, refs) -> float:
    """``||outs - refs|| / ||refs||`` over all arrays, in float64, a chunk at a time (no
    model-sized temporaries)."""
    num = den = 0.0
    for o, e in zip(outs, refs):
        o, e = np.asarray(o).reshape(-1), np.asarray(e).reshape(-1)
        for s in range(0, e.size, _CHUNK):
            ref = e[s:s + _CHUNK].astype(np.float64, copy=False)
            d = o[s:s + _CHUNK].astype(np.float64) - ref
            num += float(d @ d)
            den += float(ref @ ref)
    return float(np.sqrt(num / den)) if den > 0 else 0.0


# -- cases: one method ready to step ---------------------------------------------------------------
class _Case:
    """``prepare()`` (untimed) then ``step()`` (timed); ``outputs()``: the mean per gradient array
    after the step; ``release()`` (untimed) after the error has been measured."""

    kind = "baseline"

    def __init__(self, name, label, method=None):
        self.name, self.label, self.method = name, label, method
        if method is not None:
            self.kind, self.same_as, self.spec = method.kind, method.same_as, method.spec
        else:
            self.same_as = self.spec = None
        self.compressor = None

    def prepare(self):
        pass

    def step(self):
        raise NotImplementedError

    def outputs(self) -> list:
        return []

    def release(self):
        pass

    def begin(self):
        """Called once before the timed steps (traffic counters start here)."""

    def timed(self):
        """Context of a timed step (the PyTorch hooks' byte counter)."""
        return _Nothing()

    def traffic(self, steps):
        return 0.0, 0.0

    def close(self):
        pass


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class _GradcompTraffic:
    def begin(self):
        self._s0 = self.compressor.stats()

    def traffic(self, steps):
        s1 = self.compressor.stats()
        n = max(s1["steps"] - self._s0["steps"], 1)
        return ((s1["bytes_sent"] - self._s0["bytes_sent"]) / n,
                (s1["rounds"] - self._s0["rounds"]) / n)


class _HookTraffic:
    def begin(self):
        self.counter = _TorchBytes(self.size)

    def timed(self):
        return self.counter

    def traffic(self, steps):
        return self.counter.bytes / steps, self.counter.calls / steps


# -- the reducer path -------------------------------------------------------------------------------
class ReducerPath:
    """Persistent gradient arrays (refilled before each step) and what every method shares."""

    name = "reducer"

    def __init__(self, args, grads, size):
        self.args, self.size = args, size
        self.grads = grads
        self.saved = [g.copy() for g in grads]
        self.comm = MPICommunicator()
        self.shared: dict = {}
        self._hook_buckets = None

    def refill(self):
        for g, s in zip(self.grads, self.saved):
            np.copyto(g, s)

    def baselines(self) -> list[_Case]:
        return [_Memcpy(self)]

    def reference(self) -> str | None:
        return None

    def case(self, m) -> _Case:
        if m.kind == "gradcomp":
            return _ReducerCase(self, m)
        return _HookBucketCase(self, m)

    def hook_buckets(self):
        """The gradients in buckets (``gradcomp.bucket.pack``: the reducer's layout), as torch
        tensors that every PyTorch hook reduces, restored from the saved gradients before each step."""
        if self._hook_buckets is None:
            import torch

            _start_torch()
            self._hook_buckets = [(b, members, torch.from_numpy(b.buffer))
                                  for b, members in pack(self.saved, self.args.bucket_mb)]
        return self._hook_buckets

    def close(self):
        self.comm.close()
        for comm in self.shared.values():
            comm.close()


class _Memcpy(_Case):
    def __init__(self, path):
        super().__init__("memcpy", "refill of the gradient arrays (np.copyto: stands in for backward)")
        self.path = path

    def step(self):
        self.path.refill()


class _ReducerCase(_GradcompTraffic, _Case):
    def __init__(self, path, m):
        from ..reducer import GradientReducer

        super().__init__(m.name, m.label, m)
        self.path = path
        self.compressor = m.build()
        if m.transport == "gloo":
            _start_torch()  # TorchCommunicator needs the process group
        comm = m.communicator(path.shared) or path.comm
        self.reducer = GradientReducer(path.grads, self.compressor, comm, path.args.bucket_mb)
        # views: the gradients live in the reducer's buffers (reducer.gradients, the README's
        # recommended form); own: the user's own arrays, copied in and out by step()
        self.arrays = self.reducer.gradients if path.args.reducer_arrays == "views" else path.grads

    def prepare(self):
        for g, s in zip(self.arrays, self.path.saved):
            np.copyto(g, s)

    def step(self):
        self.reducer.step(self.arrays)

    def outputs(self):
        return self.arrays

    def close(self):
        self.reducer = None


class _HookBucketCase(_HookTraffic, _Case):
    def __init__(self, path, m):
        from .hookbucket import HookBucket

        super().__init__(m.name, m.label, m)
        self.path, self.size = path, path.size
        self.buckets = path.hook_buckets()
        self.state, self.hook = m.build(path.size)
        self.ducks = [HookBucket(t, b.index, b.shapes, b.is_last) for b, _, t in self.buckets]
        # Multi-round hooks launch their later collectives from completion callbacks on gloo's
        # threads; with several buckets in flight the ranks can then issue them in different
        # orders (gloo aborts: "Received data size doesn't match"). One bucket at a time keeps
        # every rank's order the same. Single-collective hooks: all buckets in flight, as DDP does.
        self.one_at_a_time = "powersgd" in m.name or "quantize" in m.name
        self.results = None

    def prepare(self):  # the hooks write into the bucket
        from ..bucket import copy_in

        for (b, members, t), duck in zip(self.buckets, self.ducks):
            copy_in(b, self.path.saved, members)
            duck.set_buffer(t)

    def step(self):
        if self.one_at_a_time:
            self.results = [self.hook(self.state, d).wait() for d in self.ducks]
        else:
            futures = [self.hook(self.state, d) for d in self.ducks]
            self.results = [f.wait() for f in futures]

    def outputs(self):
        out = [None] * len(self.path.grads)
        for (b, members, _), result in zip(self.buckets, self.results):
            for view, i in zip(b.views(result.numpy()), members):
                out[i] = view.reshape(self.path.grads[i].shape)
        return out

    def release(self):
        self.results = None


# -- the DDP path -------------------------------------------------------------------------------------
def _start_torch():
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        from ..torch import init_process_group

        torch.set_num_threads(1)
        init_process_group("gloo")


_TORCH_CLASSES = {}


def _torch_classes():
    """(the autograd function, the module class), defined once torch is imported."""
    if not _TORCH_CLASSES:
        import torch

        class FixedGradient(torch.autograd.Function):
            """loss = 0, d loss / d params[i] = consts[i]. The gradients are handed over as new
            tensors over the consts' memory, which autograd's AccumulateGrad then takes as
            ``.grad`` without a copy (nothing else refers to them): the backward costs autograd's
            bookkeeping only, the same for every method."""

            @staticmethod
            def forward(ctx, consts, fresh, *params):
                ctx.consts, ctx.fresh = consts, fresh
                return params[0].new_zeros(())

            @staticmethod
            def backward(ctx, grad_output):
                if ctx.fresh:  # --backward fresh: new gradient tensors every step
                    return (None, None, *(c.clone() for c in ctx.consts))
                return (None, None, *(c.detach() for c in ctx.consts))

        class Gradients(torch.nn.Module):
            """Parameters of the model's shapes over shared storage; gradients ``consts``."""

            def __init__(self, storage, consts, fresh=False):
                super().__init__()
                self.params = torch.nn.ParameterList([torch.nn.Parameter(s) for s in storage])
                self.consts, self.fresh = consts, fresh

            def forward(self):
                return FixedGradient.apply(self.consts, self.fresh, *self.params)

        _TORCH_CLASSES.update(function=FixedGradient, module=Gradients)
    return _TORCH_CLASSES


class DDPPath:
    name = "ddp"

    def __init__(self, args, grads, size):
        import torch

        _start_torch()
        self.args, self.size = args, size
        self.numel = sum(g.size for g in grads)
        self.grads = grads  # each rank's own gradients, refilled before each step
        self.saved = [g.copy() for g in grads]
        self.consts = [torch.from_numpy(g) for g in grads]
        self.storage = [torch.zeros(g.shape) for g in grads]  # parameter values, for every model
        self.shared: dict = {}

    def refill(self):
        for g, s in zip(self.grads, self.saved):
            np.copyto(g, s)

    def module(self):
        return _torch_classes()["module"](self.storage, self.consts, self.args.backward == "fresh")

    def ddp(self):
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(self.module(), bucket_cap_mb=self.args.bucket_mb)

    def baselines(self) -> list[_Case]:
        return [_Backward(self), _DDPCase(self, None)]

    def reference(self) -> str | None:
        return "ddp"

    def case(self, m) -> _Case:
        return _DDPCase(self, m)

    def close(self):
        for comm in self.shared.values():
            comm.close()


class _ModelCase(_Case):
    def prepare(self):
        self.path.refill()  # DDP wrote the last step's means into them

    def step(self):
        self.model.zero_grad(set_to_none=True)
        loss = self.model()
        loss.backward()

    def outputs(self):
        return [p.grad.numpy() for p in self.model.parameters()]

    def release(self):
        self.model.zero_grad(set_to_none=True)

    def close(self):
        self.model = None


class _Backward(_ModelCase):
    def __init__(self, path):
        super().__init__("backward", "forward + backward without DDP (the compute alone)")
        self.path = path
        self.model = path.module()


class _DDPCase(_ModelCase):
    def __init__(self, path, m):
        self.path, self.size = path, path.size
        if m is None:
            super().__init__("ddp", "DDP without a hook (its built-in allreduce, the reference)")
            self.kind = "torch"
        else:
            super().__init__(m.name, m.label, m)
        self.model = path.ddp()
        if m is None:
            return
        if m.kind == "gradcomp":
            from ..torch import register

            self.compressor = m.build()
            register(self.model, self.compressor, comm=m.communicator(path.shared))
        else:
            state, hook = m.build(path.size)
            self.model.register_comm_hook(state, hook)

    def begin(self):
        if self.method is None:
            return
        if self.method.kind == "gradcomp":
            _GradcompTraffic.begin(self)
        else:
            _HookTraffic.begin(self)

    def timed(self):
        if self.method is not None and self.method.kind == "torch":
            return self.counter
        return _Nothing()

    def traffic(self, steps):
        if self.method is None:  # DDP's own allreduce, not seen from Python: by the formula
            return wire_bytes("allreduce", 4.0 * self.path.numel, self.size), None
        if self.method.kind == "gradcomp":
            return _GradcompTraffic.traffic(self, steps)
        return _HookTraffic.traffic(self, steps)


# -- the job --------------------------------------------------------------------------------------------
def _exact_mean(world, grads):
    from mpi4py import MPI

    exact = []
    for g in grads:
        e = g.astype(np.float64)
        world.Allreduce(MPI.IN_PLACE, e, op=MPI.SUM)
        e /= world.Get_size()
        exact.append(e)
    return exact


def _settings() -> dict:
    """MPICH and glibc allocator variables set in the environment (not a default configuration)."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith(("MPIR_CVAR_", "MALLOC_"))}


def run(args) -> dict:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    methods = select(args.methods, with_torch=None if args.torch == "auto" else args.torch == "on",
                     path=args.path)
    if args.path == "ddp" and args.torch == "off":
        raise SystemExit("gradcomp.bench.worker: --path ddp needs torch (got --torch off)")
    shapes = model_shapes(args.model)
    grads = heavy_tailed(shapes, seed=args.seed + rank)
    exact = _exact_mean(world, grads)
    path = ReducerPath(args, grads, size) if args.path == "reducer" else DDPPath(args, grads, size)
    reference_name = path.reference()
    reference = None  # the reference method's first timed result (ddp path)
    total = len(methods) + 2
    _progress(rank, 0, total, "baselines")
    results = []
    times, faults, errors, diffs = {}, {}, {}, {}

    def open_case(i, m):
        """The method built and warmed up, or None (its failure recorded)."""
        try:
            case = path.case(m)
            for _ in range(args.warmup):
                case.prepare()
                case.step()
                case.release()
            return case
        except Exception as exc:  # a PyTorch hook whose own arithmetic fails (the same on every rank)
            if m.kind == "gradcomp":
                raise
            world.Barrier()
            results.append(dict(method=m.name, kind=m.kind, label=m.label, same_as=m.same_as,
                                error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
            return None
        finally:
            _progress(rank, i + 1, total, m.name)

    def timed_step(case, rep):
        nonlocal reference
        case.prepare()  # restoring overwritten gradients is not part of the step
        world.Barrier()
        with case.timed():
            f0 = _minor_faults()
            t0 = time.perf_counter()
            case.step()
            t = time.perf_counter() - t0
            f = _minor_faults() - f0
        times[case.name].append(t)
        faults[case.name].append(f)
        if rep == 0:  # after the clock, kept as numbers (a copy per method would not fit in memory)
            if case.kind == "baseline":
                errors[case.name] = 0.0
            else:
                outs = case.outputs()
                errors[case.name] = _rel_diff(outs, exact)
                if case.name == reference_name:
                    reference = [np.array(o, copy=True) for o in outs]
                elif reference is not None and case.kind != "baseline":
                    diffs[case.name] = _rel_diff(outs, reference)
                del outs
        # Let go of this step's results before the next one, as training reuses its gradient memory
        case.release()

    baselines = path.baselines()
    for case in baselines:
        for _ in range(args.warmup):
            case.prepare()
            case.step()
            case.release()
    cases = list(baselines)
    for case in cases:
        times[case.name], faults[case.name] = [], []
    if args.order == "blocks":
        closed = []
        for case in cases:
            case.begin()
            for rep in range(args.repeats):
                timed_step(case, rep)
        for i, m in enumerate(methods):
            case = open_case(i, m)
            if case is None:
                continue
            times[case.name], faults[case.name] = [], []
            case.prepare()
            case.step()  # one more untimed step: the previous method's memory churn settles
            case.release()
            case.begin()
            for rep in range(args.repeats):
                timed_step(case, rep)
            closed.append(_summary(case, args.repeats))
            case.close()
        finished = [_summary(c, args.repeats) for c in cases] + closed
    else:
        for i, m in enumerate(methods):
            case = open_case(i, m)
            if case is not None:
                cases.append(case)
                times[case.name], faults[case.name] = [], []
        for case in cases:
            case.begin()
        for rep in range(args.repeats):
            for case in cases:
                timed_step(case, rep)
        finished = [_summary(c, args.repeats) for c in cases]
    _progress(rank, total - 1, total, "timed steps")
    for row in finished:
        name = row["method"]
        slowest = np.array(times[name])
        world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        most = np.array(faults[name], dtype=np.int64)
        world.Allreduce(MPI.IN_PLACE, most, op=MPI.MAX)
        row.update(times_s=slowest.tolist(), time_s=float(np.median(slowest)),
                   faults=most.tolist(), faults_per_step=float(np.median(most)),
                   rel_error=errors[name])
        if name in diffs:
            row["rel_diff_vs_" + reference_name] = diffs[name]
        results.append(row)
    order = [c.name for c in baselines] + [m.name for m in methods]
    results.sort(key=lambda r: order.index(r["method"]))
    for case in cases:
        case.close()
    path.close()
    _progress(rank, total, total, "done")
    n = numel(shapes)
    by = {r["method"]: r for r in results}
    job = dict(model=args.model, ranks=size, path=args.path, numel=n,
               buckets=len(group(grads, args.bucket_mb)), bucket_mb=args.bucket_mb,
               repeats=args.repeats, warmup=args.warmup, order=args.order, host=platform.node(),
               cpus=os.cpu_count(), network=os.environ.get("GRADCOMP_NETWORK", ""),
               settings=_settings(), tag=args.tag or "", reducer_arrays=args.reducer_arrays,
               backward=args.backward if args.path == "ddp" else None,
               results=_with_ratios(results, n, size))
    if "backward" in by and "time_s" in by["backward"]:
        job["compute_s"] = by["backward"]["time_s"]
    if "torch" in sys.modules:  # (importing it only to say which would cost seconds)
        job["torch"] = sys.modules["torch"].__version__
    if args.tag:
        _apply_tag(job["results"], args.tag)
    return job


def _summary(case, steps) -> dict:
    nbytes, rounds = case.traffic(steps)
    row = dict(method=case.name, kind=case.kind, label=case.label, same_as=case.same_as,
               bytes_per_rank=nbytes, rounds_per_step=rounds)
    if case.spec is not None:
        row["spec"] = case.spec
    if case.compressor is not None:
        row["compressor"] = repr(case.compressor)
        row["label"] = case.label or row["compressor"]
    return row


def _apply_tag(rows, tag):
    """Method names become ``NAME (TAG)`` (baselines keep theirs): rows of a run under a special
    setting (``--tag "MPICH ring, tuned"``) never pass for the default ones in a report."""
    for r in rows:
        if r.get("kind") == "baseline":
            continue
        r["method"] = f"{r['method']} ({tag})"
        if r.get("same_as"):
            r["same_as"] = f"{r['same_as']} ({tag})"


def _with_ratios(results, n, size):
    by = {r["method"]: r for r in results if "time_s" in r}
    fp32_bytes = wire_bytes("allreduce", 4 * n, size)
    for r in results:
        if "time_s" not in r:
            continue
        for base in ("memcpy", "backward", "ddp", "allreduce", "fp16"):
            if base in by and by[base]["time_s"] > 0:
                r[f"time_vs_{base}"] = r["time_s"] / by[base]["time_s"]
        if r["kind"] != "baseline":
            r["compression_ratio"] = fp32_bytes / r["bytes_per_rank"] if r["bytes_per_rank"] else None
        twin = by.get(r.get("same_as") or "")
        if twin is not None:
            r["time_vs_same_method"] = r["time_s"] / twin["time_s"]
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m gradcomp.bench.worker",
                                description="one benchmark job on every rank of an mpiexec launch")
    p.add_argument("--reducer-arrays", choices=("views", "own"), default="views",
                   help="reducer path: gradients in GradientReducer.gradients (views into its "
                        "buffers, the README's form) or in arrays of their own (copied in and out)")
    p.add_argument("--path", choices=PATHS, default="reducer",
                   help="reducer: GradientReducer on NumPy arrays (the README path); ddp: "
                        "DistributedDataParallel with each method as its comm hook")
    p.add_argument("--model", default="resnet50", help="resnet50, bert-base or tiny")
    p.add_argument("--methods", default="all",
                   help="comma-separated: all, gradcomp, torch, everything, compressor specs "
                        "(NAME[:key=value,...] from gradcomp.REGISTRY; gloo-SPEC over gloo), "
                        "torch-* hooks, mpi-allreduce (see gradcomp.bench.methods)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 3 for PowerSGD)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=("round-robin", "blocks"), default="round-robin",
                   help="timed steps round-robin over the methods (spreads load from other "
                        "processes over all methods alike) or each method built, warmed up and "
                        "timed in one block (steady state, as in training; one method's memory "
                        "alive at a time)")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--backward", choices=("handover", "fresh"), default="handover",
                   help="ddp path: the synthetic backward hands autograd tensors over the fixed "
                        "gradients, taken as .grad without a copy (default: the step's "
                        "allocations are DDP's and the hook's), or clones them every step "
                        "(fresh: a new 4-bytes-per-parameter gradient each step, as a real "
                        "backward allocates, with its page faults and memory traffic)")
    p.add_argument("--tag", default="", help="append ' (TAG)' to every method name in the results "
                   "(a run under a non-default setting, e.g. 'MPICH ring, tuned')")
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
