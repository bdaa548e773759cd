"""What the benchmark worker steps: the two paths (``--path``) and, on each, one case per method.

A path holds what every method of a job shares: the rank's gradient arrays, refilled in place
before each step, and the communicators (``ReducerPath``: ``GradientReducer`` over NumPy arrays;
``DDPPath``: a ``DistributedDataParallel`` model per method over a synthetic backward). A case is
one method ready to step: ``prepare()`` (untimed), ``step()`` (timed), ``outputs()`` (the means,
measured outside the clock), and its traffic (``Compressor.stats()`` for gradcomp's compressors,
the torch.distributed collectives PyTorch's hooks call, counted by ``_TorchBytes``). What is
measured and how is in ``benchmarks.worker``'s docstring; the job loop is there too.
"""
from __future__ import annotations

import argparse
from typing import Any, Literal

import numpy as np

from gradcomp.bucket import Bucket, pack
from gradcomp.comm import MPICommunicator, wire_bytes

from .methods import Method

PATHS = ("reducer", "ddp")


class _TorchBytes:
    """Counts what the hooks hand to torch.distributed collectives (bandwidth-optimal bytes), by
    wrapping the module functions they call; the real collectives still run."""

    def __init__(self, size: int):
        import torch.distributed as dist

        self.dist, self.size, self.bytes, self.calls = dist, size, 0.0, 0
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> _TorchBytes:
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

    def __exit__(self, *exc: object) -> None:
        for name, real in self._saved.items():
            setattr(self.dist, name, real)


# -- cases: one method ready to step ---------------------------------------------------------------
class Case:
    """``prepare()`` (untimed) then ``step()`` (timed); ``outputs()``: the mean per gradient array
    after the step; ``release()`` (untimed) after the error has been measured."""

    kind = "baseline"
    same_as: str | None
    spec: str | None
    compressor: Any  # a gradcomp method's compressor, else None
    size: int        # set by the cases whose traffic is counted by _TorchBytes
    counter: _TorchBytes
    _s0: dict[str, Any]

    def __init__(self, name: str, label: str, method: Method | None = None):
        self.name, self.label, self.method = name, label, method
        if method is not None:
            self.kind, self.same_as, self.spec = method.kind, method.same_as, method.spec
        else:
            self.same_as = self.spec = None
        self.compressor = None

    def prepare(self) -> None:
        pass

    def step(self) -> None:
        raise NotImplementedError

    def outputs(self) -> list:
        return []

    def release(self) -> None:
        pass

    def begin(self) -> None:
        """Called once before the timed steps (traffic counters start here)."""

    def timed(self) -> Any:
        """Context of a timed step (the PyTorch hooks' byte counter)."""
        return _Nothing()

    def traffic(self, steps: int) -> tuple[float, float | None]:
        return 0.0, 0.0

    def close(self) -> None:
        pass


class _Nothing:
    def __enter__(self) -> _Nothing:
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        return False


def _compressor_begin(case: Case) -> None:
    case._s0 = case.compressor.stats()


def _compressor_traffic(case: Case) -> tuple[float, float]:
    """(bytes, collectives) per step since ``begin``, as the compressor counted them."""
    s1 = case.compressor.stats()
    n = max(s1["steps"] - case._s0["steps"], 1)
    return ((s1["bytes_sent"] - case._s0["bytes_sent"]) / n,
            (s1["rounds"] - case._s0["rounds"]) / n)


def _hook_begin(case: Case) -> None:
    case.counter = _TorchBytes(case.size)


def _hook_traffic(case: Case, steps: int) -> tuple[float, float]:
    """(bytes, collectives) per step of the timed steps, as ``_TorchBytes`` counted them."""
    return case.counter.bytes / steps, case.counter.calls / steps


class _GradcompTraffic(Case):
    def begin(self) -> None:
        _compressor_begin(self)

    def traffic(self, steps: int) -> tuple[float, float]:
        return _compressor_traffic(self)


class _HookTraffic(Case):
    def begin(self) -> None:
        _hook_begin(self)

    def timed(self) -> _TorchBytes:
        return self.counter

    def traffic(self, steps: int) -> tuple[float, float]:
        return _hook_traffic(self, steps)


# -- the reducer path -------------------------------------------------------------------------------
class ReducerPath:
    """Persistent gradient arrays (refilled before each step) and what every method shares."""

    name = "reducer"

    def __init__(self, args: argparse.Namespace, grads: list[np.ndarray], size: int):
        self.args, self.size = args, size
        self.grads = grads
        self.saved = [g.copy() for g in grads]
        self.comm = MPICommunicator()
        self.shared: dict = {}
        self._hook_buckets: list[tuple[Bucket, list[int], Any]] | None = None

    def refill(self) -> None:
        for g, s in zip(self.grads, self.saved):
            np.copyto(g, s)

    def baselines(self) -> list[Case]:
        return [_Memcpy(self)]

    def reference(self) -> str | None:
        return None

    def case(self, m: Method) -> Case:
        if m.kind == "gradcomp":
            return _ReducerCase(self, m)
        return _HookBucketCase(self, m)

    def hook_buckets(self) -> list[tuple[Bucket, list[int], Any]]:
        """The gradients in buckets (``gradcomp.bucket.pack``: the reducer's layout), as torch
        tensors that every PyTorch hook reduces, restored from the saved gradients before each step."""
        if self._hook_buckets is None:
            import torch

            _start_torch()
            self._hook_buckets = [(b, members, torch.from_numpy(b.buffer))
                                  for b, members in pack(self.saved, self.args.bucket_mb)]
        return self._hook_buckets

    def close(self) -> None:
        self.comm.close()
        for comm in self.shared.values():
            comm.close()


class _Memcpy(Case):
    def __init__(self, path: ReducerPath):
        super().__init__("memcpy", "refill of the gradient arrays (np.copyto: stands in for backward)")
        self.path = path

    def step(self) -> None:
        self.path.refill()


class _ReducerCase(_GradcompTraffic, Case):
    def __init__(self, path: ReducerPath, m: Method):
        from gradcomp.reducer import GradientReducer

        super().__init__(m.name, m.label, m)
        self.path = path
        self.compressor = m.build()
        if m.transport == "gloo":
            _start_torch()  # TorchCommunicator needs the process group
        comm = m.communicator(path.shared) or path.comm
        self.reducer: GradientReducer | None = GradientReducer(path.grads, self.compressor, comm,
                                                               path.args.bucket_mb, m.hierarchical)
        # views: the gradients live in the reducer's buffers (reducer.gradients, the README's
        # recommended form); own: the user's own arrays, copied in and out by step()
        self.arrays = self.reducer.gradients if path.args.reducer_arrays == "views" else path.grads

    def prepare(self) -> None:
        for g, s in zip(self.arrays, self.path.saved):
            np.copyto(g, s)

    def step(self) -> None:
        assert self.reducer is not None  # not closed
        self.reducer.step(self.arrays)

    def outputs(self) -> list:
        return self.arrays

    def close(self) -> None:
        self.reducer = None


class _HookBucketCase(_HookTraffic, Case):
    def __init__(self, path: ReducerPath, m: Method):
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
        self.results: list | None = None

    def prepare(self) -> None:  # the hooks write into the bucket
        from gradcomp.bucket import copy_in

        for (b, members, t), duck in zip(self.buckets, self.ducks):
            copy_in(b, self.path.saved, members)
            duck.set_buffer(t)

    def step(self) -> None:
        if self.one_at_a_time:
            self.results = [self.hook(self.state, d).wait() for d in self.ducks]
        else:
            futures = [self.hook(self.state, d) for d in self.ducks]
            self.results = [f.wait() for f in futures]

    def outputs(self) -> list:
        out: list = [None] * len(self.path.grads)
        assert self.results is not None  # after a step
        for (b, members, _), result in zip(self.buckets, self.results):
            for view, i in zip(b.views(result.numpy()), members):
                out[i] = view.reshape(self.path.grads[i].shape)
        return out

    def release(self) -> None:
        self.results = None


# -- the DDP path -------------------------------------------------------------------------------------
def _start_torch() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_initialized():
        from gradcomp.torch import init_process_group

        torch.set_num_threads(1)
        init_process_group("gloo")


_TORCH_CLASSES: dict[str, Any] = {}


def _torch_classes() -> dict[str, Any]:
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

    def __init__(self, args: argparse.Namespace, grads: list[np.ndarray], size: int):
        import torch

        _start_torch()
        self.args, self.size = args, size
        self.numel = sum(g.size for g in grads)
        self.grads = grads  # each rank's own gradients, refilled before each step
        self.saved = [g.copy() for g in grads]
        self.consts = [torch.from_numpy(g) for g in grads]
        self.storage = [torch.zeros(g.shape) for g in grads]  # parameter values, for every model
        self.shared: dict = {}

    def refill(self) -> None:
        for g, s in zip(self.grads, self.saved):
            np.copyto(g, s)

    def module(self) -> Any:
        return _torch_classes()["module"](self.storage, self.consts, self.args.backward == "fresh")

    def ddp(self) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(self.module(), bucket_cap_mb=self.args.bucket_mb,
                                       gradient_as_bucket_view=self.args.bucket_view == "on")

    def baselines(self) -> list[Case]:
        return [_Backward(self), _DDPBuckets(self), _DDPCase(self, None)]

    def reference(self) -> str | None:
        return "ddp"

    def case(self, m: Method) -> Case:
        return _DDPCase(self, m)

    def close(self) -> None:
        for comm in self.shared.values():
            comm.close()


class _ModelCase(Case):
    path: DDPPath
    model: Any  # the torch module (DDP or not); None once closed

    def prepare(self) -> None:
        self.path.refill()  # DDP wrote the last step's means into them

    def step(self) -> None:
        self.model.zero_grad(set_to_none=True)
        loss = self.model()
        loss.backward()

    def outputs(self) -> list:
        return [p.grad.numpy() for p in self.model.parameters()]

    def release(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def close(self) -> None:
        self.model = None


class _Backward(_ModelCase):
    def __init__(self, path: DDPPath):
        super().__init__("backward", "forward + backward without DDP (the compute alone)")
        self.path = path
        self.model = path.module()


def _return_bucket(state: Any, bucket):  # (unannotated: DDP checks a hook's annotations)
    """A comm hook that communicates nothing: its Future is the bucket as it came."""
    import torch

    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class _DDPBuckets(_ModelCase):
    """DDP whose hook returns each bucket at once: the backward plus what DDP itself does around
    any hook (copying every gradient into its bucket, calling the hook, finishing the backward).
    The reducer path's step does none of it (its gradients live in its buckets already, refilled
    outside the clock), so a method's DDP step less this row is what compares with its reducer
    step (``time_less_ddp_buckets_s``)."""

    def __init__(self, path: DDPPath):
        super().__init__("ddp-buckets", "DDP with a hook that returns the bucket (DDP's own copy "
                         "of the gradients into its buckets, no communication)")
        self.path = path
        self.model = path.ddp()
        self.model.register_comm_hook(None, _return_bucket)


class _DDPCase(_ModelCase):
    def __init__(self, path: DDPPath, m: Method | None):
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
            from gradcomp.torch import register

            self.compressor = m.build()
            register(self.model, self.compressor, comm=m.communicator(path.shared),
                     hierarchical=m.hierarchical)
        else:
            state, hook = m.build(path.size)
            self.model.register_comm_hook(state, hook)

    def begin(self) -> None:
        if self.method is None:
            return
        if self.method.kind == "gradcomp":
            _compressor_begin(self)
        else:
            _hook_begin(self)

    def timed(self) -> Any:
        if self.method is not None and self.method.kind == "torch":
            return self.counter
        return _Nothing()

    def traffic(self, steps: int) -> tuple[float, float | None]:
        if self.method is None:  # DDP's own allreduce, not seen from Python: by the formula
            return wire_bytes("allreduce", 4.0 * self.path.numel, self.size), None
        if self.method.kind == "gradcomp":
            return _compressor_traffic(self)
        return _hook_traffic(self, steps)
