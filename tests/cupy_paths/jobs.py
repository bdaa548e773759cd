"""Rank-side functions of ``test_cupy_paths`` (run under ``mpiexec`` by ``tests.mpi_launch``, with
the CuPy stand-in installed: ``tests.cupy_paths.env``). ``GRADCOMP_CUDA_AWARE`` picks the MPI
branch: 0 stages device buffers through the host, 1 hands them to MPI (the stand-in's
``__cuda_array_interface__`` carries host pointers, so MPICH on a CPU moves the right bytes).
"""
from __future__ import annotations

import os
import warnings
from concurrent.futures import Future
from typing import Any

import ml_dtypes
import numpy as np

import cupy
import gradcomp as gc
from gradcomp.conformance import checks as kit_checks
from gradcomp.conformance.signals import LAYOUT, numel, savez_round_trip
from gradcomp.registry import steady

warnings.filterwarnings("ignore", "gradcomp: randomk is not recommended", RuntimeWarning)

DTYPES = (np.float32, np.float16, ml_dtypes.bfloat16, np.float64)
#: NumPy's PowerSGD takes P = MQ and Q = M^T P from the compiled kernels, which reassociate the
#: sums (DESIGN.md, "Same bits on any CPU"), and P Q^T in their order; the CuPy branch uses
#: matmul for all three. Their results agree within DESIGN's tolerance per dtype, relative to the
#: largest value.
REASSOCIATED = {"float32": 1e-4, "float64": 1e-9}
#: Top-k picks among equal magnitudes as its sort does (NumPy's introselect, CuPy's kernels):
#: half-precision buckets tie at the threshold, and the kept sets differ there, both valid.
TIES = {"float16", "bfloat16"}


def aware() -> bool:
    return os.environ.get("GRADCOMP_CUDA_AWARE") == "1"


def communicators() -> tuple[gc.MPICommunicator, gc.MPICommunicator]:
    """(host reference, the communicator the device buckets go through)."""
    dev = gc.MPICommunicator()  # GRADCOMP_CUDA_AWARE decides (the branch choice is checked too)
    assert dev.cuda_aware is aware(), f"GRADCOMP_CUDA_AWARE={os.environ.get('GRADCOMP_CUDA_AWARE')}: {dev!r}"
    return gc.MPICommunicator(cuda_aware=False), dev


def to_device(a: np.ndarray) -> Any:
    """``a`` on the device, strided as ``a`` is; big-endian stays on the host (CuPy has none)."""
    if not a.dtype.isnative:
        return a
    if a.ndim == 1 and not a.flags.c_contiguous and a.strides[0] % a.itemsize == 0 and a.strides[0] > 0:
        step = a.strides[0] // a.itemsize
        return cupy.asarray(np.repeat(a, step))[::step]
    return cupy.asarray(a)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint8),
                                                 np.ascontiguousarray(b).view(np.uint8))


def relative(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64), b.astype(np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)) if a.size else 0.0


def agrees(name: str, got: np.ndarray, want: np.ndarray) -> bool:
    """The same bits, or for PowerSGD (``REASSOCIATED``) within DESIGN's tolerance."""
    tol = REASSOCIATED.get(got.dtype.name, 0) if "powersgd" in name else 0
    return same_bits(got, want) or (tol > 0 and relative(got, want) <= tol)


def no_hazards() -> None:
    assert not cupy._fake.hazards, f"device memory reached MPI unsynchronized: {cupy._fake.hazards[:3]}"


# ---------------------------------------------------------------------------------------------
# the conformance kit on device buckets
# ---------------------------------------------------------------------------------------------
def on_device(comp: gc.Compressor) -> gc.Compressor:
    """``comp``, whose ``reduce`` moves host buffers (the kit's checks build some themselves) to
    the device and hands the mean back on the host; device buckets pass straight through."""
    real = comp.reduce

    def reduce(bucket, comm=None):
        buffer = getattr(bucket, "buffer", bucket)
        if isinstance(buffer, cupy.ndarray) or not isinstance(buffer, np.ndarray):
            return real(bucket, comm)
        moved = to_device(buffer)
        if isinstance(bucket, gc.Bucket):
            moved = gc.Bucket(moved, bucket.index, bucket.shapes, bucket.is_last, bucket.scratch,
                              bucket.keys, bucket.scatter)
        done: Future = Future()

        def back(f):
            try:
                out = f.result()
                assert isinstance(out, cupy.ndarray), f"the mean left the device: {type(out)}"
                done.set_result(out.get())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's result()
                done.set_exception(exc)
        real(moved, comm).add_done_callback(back)
        return done

    comp.reduce = reduce  # type: ignore[method-assign]
    return comp


class DeviceKit(kit_checks.Kit):
    """The kit's checks with every bucket on the device: the mean must come back there, of the
    input's length and dtype, and a bucket that is not scratch must be left as it was."""

    def reduce(self, comp, g, index=0, layout=None, last=True, scratch=False):
        dev = cupy.asarray(g)
        given = dev.copy()
        out = comp.reduce(gc.Bucket(dev, index, layout, last, scratch=scratch), self.comm).result()
        assert isinstance(out, cupy.ndarray), f"the mean left the device: {type(out)}"
        assert out.dtype == g.dtype and out.shape == g.shape, f"mean {out.shape} {out.dtype} for {g.shape} {g.dtype}"
        if not scratch:
            assert bool(cupy.array_equal(dev.view(np.uint8), given.view(np.uint8))), "the input buffer was modified"
        return out.get()


#: (name, check) that fail on device buckets for a reason outside the CuPy branches, and the
#: words of the error: 1-bit's reduce-scatter rows (n / ranks values) need not be a multiple of
#: 8 values, which ``kernels.signcodes.encode`` (NumPy and CuPy alike: ``GRADCOMP_JIT=0`` fails
#: the same way) assumes. When it is fixed this job says so, and the entry goes.
KNOWN = {("onebit", "scatter"): "cannot reshape"}


#: what the kit runs for a name where ``steady(name)`` is not it: auto's default candidates include
#: int8, whose 50-step warm-up would make auto's run the longest here, for no other branch (on
#: one host auto keeps its first candidate and measures nothing)
KIT_SPECS = {"auto": "auto:allowed=allreduce,fp16,bf16,int4"}


def conformance(names: list[str], checks: list[str], steps: int, long: int) -> None:
    """The kit's ``checks`` for every registered name (past its warm-up, as the kit's own test
    runs them), on device buckets. ``steps``/``long`` shorten the kit's runs: the values are the
    NumPy path's (``compare``), whose accuracy the NumPy conformance run establishes."""
    kit_checks.STEPS, kit_checks.LONG = steps, long
    _, comm = communicators()
    for name in names:
        spec = KIT_SPECS.get(name, steady(name))
        kit = DeviceKit(lambda spec=spec: on_device(gc.make(spec)), comm)
        for check in checks:
            known = KNOWN.get((name, check))
            try:
                kit_checks.CHECKS[check](kit)
            except (AssertionError, gc.CollectiveError) as exc:
                if known is None or known not in str(exc):
                    raise AssertionError(f"{name}, check {check!r} on device buckets: {exc}") from exc
            else:
                assert known is None, f"{name}, check {check!r} passes now: drop it from KNOWN"
    no_hazards()
    if comm.rank == 0:
        print(f"conformance on device buckets: {len(names)} names x {len(checks)} checks passed", flush=True)
    comm.close()


# ---------------------------------------------------------------------------------------------
# CuPy path == NumPy path
# ---------------------------------------------------------------------------------------------
def compare(names: list[str], steps: int = 4) -> None:
    """Every name on device buckets and on NumPy copies of them, side by side for ``steps``
    steps of two buckets (a layout, a prime length; float32 a third, past the ring's threshold),
    in every dtype, inside a ``Schedule`` that hands the residuals over, and as reduce-scatter
    buckets where the method has that form: the same bits (see ``REASSOCIATED`` and ``TIES`` for
    the two exceptions and why)."""
    host, dev = communicators()
    rank, size = dev.rank, dev.size
    for name in names:
        for dtype in DTYPES:
            kind = np.dtype(dtype).name
            a, b = gc.make(steady(name)), gc.make(steady(name))
            rng = np.random.default_rng([rank, 7])
            worst = 0.0
            # float32 also past the ring's threshold, and for top-k past its sampled selection's
            large = (1 << 18) + 1 if name.startswith("topk") else 70_001
            sizes = [(LAYOUT, numel(LAYOUT)), (None, 1009)] + ([(None, large)] if kind == "float32" else [])
            for step in range(steps):
                for i, (layout, n) in enumerate(sizes):
                    g = (rng.standard_normal(n) * 0.1).astype(dtype)
                    if step == 0 and layout is not None:
                        g[:24 * 16] = 0  # a tensor without gradient (PowerSGD's zero columns)
                    last = i == len(sizes) - 1
                    want = a.reduce(gc.Bucket(g.copy(), i, layout, last), host).result()
                    got = b.reduce(gc.Bucket(cupy.asarray(g), i, layout, last), dev).result()
                    assert isinstance(got, cupy.ndarray), f"{name} {kind}: the mean left the device"
                    got = got.get()
                    if not same_bits(got, want):
                        worst = max(worst, relative(got, want) or np.inf)
            if worst and not ("powersgd" in name and worst <= REASSOCIATED.get(kind, 0)) \
                    and not (name == "topk" and kind in TIES):
                raise AssertionError(f"{name} {kind}: the CuPy path's means differ from NumPy's "
                                     f"(relative {worst:.3g})")
            if kind == "float32":  # a schedule hands the residuals over, on the device
                a = gc.Schedule([(0, gc.Allreduce()), (1, gc.make(steady(name))), (1 + steps, gc.Allreduce())])
                b = gc.Schedule([(0, gc.Allreduce()), (1, gc.make(steady(name))), (1 + steps, gc.Allreduce())])
                for step in range(steps + 3):
                    g = (rng.standard_normal(numel(LAYOUT)) * 0.1).astype(dtype)
                    want = a.reduce(gc.Bucket(g.copy(), 0, LAYOUT), host).result()
                    got = b.reduce(gc.Bucket(cupy.asarray(g), 0, LAYOUT), dev).result().get()
                    assert agrees(name, got, want), \
                        f"Schedule with {name}: step {step} differs from NumPy's ({relative(got, want):.3g})"
            a, b = gc.make(steady(name)), gc.make(steady(name))
            if a.scatters and kind == "float32" and (name, "scatter") not in KNOWN:
                n = numel(LAYOUT) + (-numel(LAYOUT) % size)
                for step in range(steps):
                    g = (rng.standard_normal(n) * 0.1).astype(dtype)
                    want = a.reduce(gc.Bucket(g.copy(), 9, [(n,)], scatter=True), host).result()
                    got = b.reduce(gc.Bucket(cupy.asarray(g), 9, [(n,)], scatter=True), dev).result()
                    assert isinstance(got, cupy.ndarray) and got.shape == (n // size,)
                    assert same_bits(got.get(), want), f"{name}: reduce-scatter rows differ from NumPy's"
    no_hazards()
    _check_branch(dev)
    if rank == 0:
        print(f"CuPy == NumPy for {len(names)} names (cuda_aware={dev.cuda_aware})", flush=True)
    host.close()
    dev.close()


def _check_branch(dev: gc.MPICommunicator) -> None:
    """The branch MPI took: device pointers handed over (CUDA-aware), or host copies only."""
    x = cupy.asarray(np.arange(100_000, dtype=np.float32))
    cupy.cuda.Device().synchronize()
    cupy._fake.reset()
    out = dev.allreduce(x)
    assert isinstance(out, cupy.ndarray)
    fake = cupy._fake
    if dev.cuda_aware:
        assert fake.cai_exports > 0 and fake.d2h_bytes == 0, (fake.cai_exports, fake.d2h_bytes)
    else:
        assert fake.cai_exports == 0 and fake.d2h_bytes >= x.nbytes, (fake.cai_exports, fake.d2h_bytes)
    assert bool(cupy.array_equal(out, x * np.float32(dev.size)))


# ---------------------------------------------------------------------------------------------
# MPICommunicator's collectives on device arrays
# ---------------------------------------------------------------------------------------------
def collectives() -> None:
    """Every collective of ``MPICommunicator`` on device arrays, host-staged and CUDA-aware,
    against the same on host arrays (three ranks: the ring reduce-scatter takes two steps), small
    and past the ring's threshold, float32 and float16, given and scratch buffers."""
    host = gc.MPICommunicator(cuda_aware=False)
    # MPI cannot run a Python operation on device memory: a CUDA-aware allreduce of float16 sums
    # by the ring at every size, the host by MPI_Allreduce below the ring's threshold, in another
    # order (the same bits on every rank either way); the ring on the host is the reference then
    ring = gc.MPICommunicator(cuda_aware=False, large_allreduce_bytes=0)
    rank, size = host.rank, host.size
    for dev in (gc.MPICommunicator(cuda_aware=False), gc.MPICommunicator(cuda_aware=True)):
        rng = np.random.default_rng(rank)
        for dtype, n in ((np.float32, 30), (np.float32, 70_001), (np.float16, 30), (np.float16, 140_001)):
            x = rng.standard_normal(n).astype(dtype)
            d = cupy.asarray(x)
            summed = ring if dev.cuda_aware and dtype == np.float16 else host
            pairs = [("allreduce", summed.allreduce(x.copy()), dev.allreduce(d)),
                     ("allreduce overwrite", summed.allreduce(x.copy(), overwrite=True),
                      dev.allreduce(d.copy(), overwrite=True)),
                     ("reduce_scatter", host.reduce_scatter(x.copy()), dev.reduce_scatter(d)),
                     ("allgather", host.allgather(x), dev.allgather(d)),
                     ("broadcast", host.broadcast(x, root=1), dev.broadcast(d, root=1))]
            counts, _ = host.partition(n)
            pairs.append(("reduce_scatter out=", host.reduce_scatter(x.copy(), out=np.empty(counts[rank], dtype)),
                          dev.reduce_scatter(d, out=cupy.empty(counts[rank], dtype))))
            block = x[:counts[rank]]
            pairs.append(("allgather_blocks", host.allgather_blocks(block, np.empty(n, dtype)),
                          dev.allgather_blocks(cupy.asarray(block), cupy.empty(n, dtype))))
            m = n - n % size
            pairs.append(("alltoall", host.alltoall(x[:m].copy()), dev.alltoall(cupy.asarray(x[:m]))))
            pairs.append(("alltoall out=", host.alltoall(x[:m].copy(), out=np.empty(m, dtype)),
                          dev.alltoall(cupy.asarray(x[:m]), out=cupy.empty(m, dtype))))
            pairs.append(("allgather out=", host.allgather(x, out=np.empty(size * n, dtype)),
                          dev.allgather(d, out=cupy.empty(size * n, dtype))))
            for what, want, got in pairs:
                where = f"{what}, {np.dtype(dtype).name} x {n}, cuda_aware={dev.cuda_aware}"
                assert isinstance(got, cupy.ndarray), f"{where}: the result left the device"
                assert got.shape == want.shape, f"{where}: shape {got.shape}, on the host {want.shape}"
                assert same_bits(got.get(), want), f"{where}: values differ from the host's"
            assert same_bits(d.get(), x), "an input buffer was modified"
        dev.close()
    no_hazards()
    if rank == 0:
        print("collectives on device arrays agree with the host's (staged and CUDA-aware)", flush=True)
    host.close()
    ring.close()


# ---------------------------------------------------------------------------------------------
# GradientReducer and the optimizers on CuPy arrays
# ---------------------------------------------------------------------------------------------
def reducer_and_optimizers() -> None:
    host, dev = communicators()
    rank = dev.rank
    shapes = [(40, 30), (30,), (), (7, 3, 5), (2000,)]
    for name in ("allreduce", "int8", "topk", "powersgd"):
        rng = np.random.default_rng([rank, 11])
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        dgrads = [cupy.asarray(g) for g in grads]
        ra = gc.GradientReducer(grads, gc.make(steady(name)), host, bucket_cap_mb=0.005)
        rb = gc.GradientReducer(dgrads, gc.make(steady(name)), dev, bucket_cap_mb=0.005)
        views = rb.gradients  # reduce where the gradients live (no copy in or out)
        for step in range(5):
            fresh = [rng.standard_normal(s).astype(np.float32) for s in shapes]
            for g, f in zip(grads, fresh):
                g[...] = f
            for v, f in zip(views, fresh):
                v[...] = cupy.asarray(f)
            ra.step()
            rb.step()
            for i, (g, v) in enumerate(zip(grads, views)):
                assert isinstance(v, cupy.ndarray)
                assert agrees(name, v.get(), g), f"GradientReducer({name}): array {i}, step {step}"
        saved = savez_round_trip(rb.state_dict())  # plain host arrays, loadable on the device
        again = gc.GradientReducer([cupy.asarray(g) for g in grads], gc.make(steady(name)), dev, bucket_cap_mb=0.005)
        again.load_state_dict(saved)
    arrays = [cupy.asarray(np.full(s, rank + 1.0, np.float32)) for s in shapes]
    out = gc.allreduce_gradients(arrays, gc.Allreduce(), dev)
    assert out is arrays and all(bool((a == 1.5).all()) for a in arrays)
    _optimizers(host, dev)
    no_hazards()
    if rank == 0:
        print("GradientReducer and optimizers on CuPy arrays agree with NumPy", flush=True)
    host.close()
    dev.close()


def _optimizers(host, dev) -> None:
    from gradcomp.conformance.optimizers import INNER_LR, OptimizerKit, optimizer_factory

    for spec in ("dgc:warmup=2", "onebitadam:warmup=3", "diloco:sync_every=3,overlap=1",
                 "diloco:sync_every=3,compressor=sparseloco"):
        build = optimizer_factory(spec)
        kit = OptimizerKit(build, host)
        hp, dp = kit.start(), [cupy.asarray(p) for p in kit.start()]
        ho, do = build(hp, host), build(dp, dev)
        lr = kit.lr(ho)
        for step in range(10):
            hg = kit.grads(hp, kit.rank, step)
            dg = [cupy.asarray(g) for g in kit.grads([p.get() for p in dp], kit.rank, step)]
            if isinstance(ho, gc.optim.DiLoCo):
                for p, g in zip(hp, hg):
                    p -= np.float32(INNER_LR) * g
                for p, g in zip(dp, dg):
                    p -= np.float32(INNER_LR) * g
                ho.step(lr=lr)
                do.step(lr=lr)
            else:
                ho.step(hg, lr=lr)
                do.step(dg, lr=lr)
            for i, (a, b) in enumerate(zip(hp, dp)):
                assert isinstance(b, cupy.ndarray)
                assert same_bits(b.get(), a), f"{spec}: parameter {i} differs from NumPy's at step {step}"
        saved = savez_round_trip(do.state_dict())  # plain host arrays
        resumed_params = [cupy.asarray(p) for p in kit.start()]  # built from the common start,
        resumed = build(resumed_params, dev)  # then given this rank's parameters, as the kit does
        for p, q in zip(resumed_params, dp):
            p[...] = q
        resumed.load_state_dict(saved)


# ---------------------------------------------------------------------------------------------
# the DDP hook and TorchCommunicator with CuPy arrays (torch on the CPU)
# ---------------------------------------------------------------------------------------------
_TORCH_COMMS: list = []


def after_rank_success() -> None:
    """(``tests.mpi_launch``) A job that started torch.distributed leaves past its teardown
    (``leave_before_torch_teardown``)."""
    if _TORCH_COMMS:
        from tests.mpi_launch import leave_before_torch_teardown

        leave_before_torch_teardown(*_TORCH_COMMS)


def torch_paths(names: list[str]) -> None:
    """The DDP hook's CuPy path and ``TorchCommunicator``'s staging of CuPy buffers, on the CPU.

    No CUDA tensor exists here, so the hook is handed what ``as_array`` makes of a CUDA tensor,
    a device array over the bucket's memory (``cupy._fake.view_host_memory`` of a CPU bucket):
    from there on the hook runs its CuPy path (device bucket, scratch write-back, the final
    synchronize, the replay of loaded layouts through ``concatenate``). What needs CUDA tensors
    themselves (``cupy.from_dlpack``, ``wait_for_torch``, a CUDA ``torch.futures.Future``) is
    left to ``benchmarks/scripts/gpu_check.py``. Gradients must equal the NumPy path's bit for bit."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import gradcomp.torch as gt
    import gradcomp.torch.hook as hook_module

    torch.set_num_threads(1)
    launch = gt.init_process_group(backend="gloo")
    host, dev = communicators()
    tcomm = gt.TorchCommunicator()
    _TORCH_COMMS.extend([host, dev, tcomm])
    rank = launch.rank
    plain_as_array = hook_module.as_array

    def device_view(tensor):
        assert not tensor.is_cuda and tensor.dtype == torch.float32
        return cupy._fake.view_host_memory(tensor.detach().numpy())

    def train(name, comm, device, iters=3, resume=None):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
        model = DistributedDataParallel(net, bucket_cap_mb=0.001)  # two buckets after the rebuild
        state = gt.register(model, gc.make(steady(name)), comm)
        if resume is not None:
            state.load_state_dict(resume)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        hook_module.as_array = device_view if device else plain_as_array
        grads = []
        try:
            for it in range(iters):
                g = torch.Generator().manual_seed(1000 * rank + it)
                x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
                F.cross_entropy(model(x), y).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())
                opt.step()
                opt.zero_grad()
        finally:
            hook_module.as_array = plain_as_array
        return grads, state

    for name in names:
        for comm in (dev, tcomm):
            ref = host if comm is dev else tcomm
            want, saved = train(name, ref, device=False)
            got, state = train(name, comm, device=True)
            assert state.buckets_reduced > 3, f"{name}: the hook ran on {state.buckets_reduced} buckets"
            for it, (a, b) in enumerate(zip(got, want)):
                assert agrees(name, a, b), f"DDP hook, {name} over {comm!r}: iteration {it} differs from NumPy's"
            # resumed: the first step's bucket is cut into the loaded layouts (``_replay_parts``)
            state_dict = saved.state_dict()
            want, _ = train(name, ref, device=False, iters=2, resume=state_dict)
            got, _ = train(name, comm, device=True, iters=2, resume=state_dict)
            for it, (a, b) in enumerate(zip(got, want)):
                assert agrees(name, a, b), f"DDP hook resumed, {name} over {comm!r}: iteration {it} differs"
    # TorchCommunicator's collectives on device buckets (gloo stages them through the host)
    rng = np.random.default_rng(rank)
    for name in names:
        a, b = gc.make(steady(name)), gc.make(steady(name))
        for step in range(2):
            g = rng.standard_normal(numel(LAYOUT)).astype(np.float32)
            want = a.reduce(gc.Bucket(g.copy(), 0, LAYOUT), host).result()
            got = b.reduce(gc.Bucket(cupy.asarray(g), 0, LAYOUT), tcomm).result()
            assert isinstance(got, cupy.ndarray), f"{name} over {tcomm!r}: the mean left the device"
            assert agrees(name, got.get(), want), f"{name} over {tcomm!r}: step {step} differs from MPI on the host"
    no_hazards()
    if rank == 0:
        print(f"DDP hook and TorchCommunicator on CuPy buckets: {len(names)} names", flush=True)
