"""End-to-end check of gradcomp's CUDA paths on one GPU with 2 ranks.

    .venv/bin/python benchmarks/scripts/gpu_check.py            # relaunches itself: mpiexec -n 2 ... --ranks
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/scripts/gpu_check.py --ranks

Without CUDA, CuPy or torch with CUDA it prints why and exits 0 (nothing to check here).

What runs, on every rank, each line reported PASS / SKIP / FAIL on rank 0 (exit status 1 on FAIL):

1. CuPy buckets through ``MPICommunicator`` with ``cuda_aware=False`` (staged through host memory)
   and ``cuda_aware=True`` (device pointers handed to MPI; only when the MPI library says it is
   CUDA-aware, since a library that is not would crash, or ``GPU_CHECK_FORCE_CUDA_AWARE=1``): every
   registered compressor on float32 and float16 CuPy buckets, results on the GPU, equal on both
   ranks, and equal (within float32 rounding, or bit for bit where the method is deterministic
   element-wise) to the same compressor on NumPy copies of the same buckets.
2. The same buckets through ``gradcomp.torch.TorchCommunicator`` (nccl when there is one GPU per
   rank, gloo otherwise: nccl refuses two ranks on one GPU).
3. DDP on ``cuda`` through ``gradcomp.torch.register``, with the backward pass on a non-default
   torch stream (so the hook's stream synchronization matters), over MPI and over torch.distributed:
   gradients equal to hook-less DDP on the same GPU within float32 rounding, parameters identical on
   both ranks.
"""
from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))


def missing() -> str | None:
    """Why the CUDA paths cannot run here, or None."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'gradcomp[cuda]', e.g. cupy-cuda12x)"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA device visible to CuPy"
    except Exception as exc:  # no driver
        return f"CUDA is not usable from CuPy ({exc})"
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "this torch build has no CUDA (or sees no device)"
    return None


class Report:
    def __init__(self, rank: int):
        self.rank, self.failed = rank, 0

    def __call__(self, status: str, what: str):
        if status == "FAIL":
            self.failed += 1
        if self.rank == 0 or status == "FAIL":
            print(f"[rank {self.rank}] {status}: {what}", flush=True)

    def run(self, what: str, fn):
        try:
            note = fn()
            self("PASS", what + (f" ({note})" if note else ""))
        except SkipCheck as exc:
            self("SKIP", f"{what}: {exc}")
        except Exception:
            self("FAIL", f"{what}\n{traceback.format_exc()}")


class SkipCheck(Exception):
    pass


def same_on_ranks(world, host_array) -> bool:
    a = np.ascontiguousarray(host_array).reshape(-1).view(np.uint8)
    rows = np.empty((world.Get_size(), a.size), np.uint8)
    world.Allgather(a, rows)
    return bool((rows == rows[0]).all())


def tolerance(name: str, dtype) -> float:
    """GPU vs NumPy, relative to the largest value: float32 rounding for exact methods; an 8-bit
    code may land one step apart where GPU and CPU round a chunk's scale differently."""
    if "quantize" in name:
        return 1e-2
    if "bf16" in name:
        return 1e-2
    if "fp16" in name or dtype == np.float16:
        return 2e-3
    return 1e-5


def check_buckets(comm, world, label: str):
    """Every registered compressor on CuPy buckets vs the same on NumPy copies."""
    import cupy

    import gradcomp as gc

    rng = np.random.default_rng(world.Get_rank())
    layout = [(64, 48), (48,), (32, 3, 3), (1000,)]
    n = sum(int(np.prod(s)) for s in layout)
    host_comm = gc.MPICommunicator(cuda_aware=False)
    notes = []
    for name in sorted(gc.REGISTRY):
        for dtype in (np.float32, np.float16):
            steps = []
            dev_c, host_c = gc.make(name), gc.make(name)
            for step in range(3):
                g = (rng.standard_normal(n) * 0.1).astype(dtype)
                dev = dev_c.reduce(gc.Bucket(cupy.asarray(g), 0, layout), comm).result()
                ref = host_c.reduce(gc.Bucket(g.copy(), 0, layout), host_comm).result()
                assert isinstance(dev, cupy.ndarray), f"{name}: result left the GPU ({type(dev)})"
                assert dev.dtype == g.dtype and dev.shape == g.shape
                got = cupy.asnumpy(dev)
                assert same_on_ranks(world, got), f"{name} {dtype.__name__}: ranks differ"
                err = np.abs(got.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30)
                steps.append(err)
            tol = tolerance(name, dtype)
            assert max(steps) <= tol, f"{name} {dtype.__name__} over {label}: GPU vs NumPy {max(steps):.3g}"
        notes.append(name)
    return f"{len(notes)} compressors x float32/float16"


def check_ddp(comm_kind: str, world):
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    import gradcomp
    import gradcomp.torch as gt
    from examples.torch_ddp import DigitsCNN, digits

    dev = torch.device("cuda", torch.cuda.current_device())
    x, y, _, _ = digits()
    rank = world.Get_rank()

    def train(register):
        torch.manual_seed(0)
        model = DistributedDataParallel(DigitsCNN().to(dev), bucket_cap_mb=0.01)
        state = register(model) if register else None
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        stream = torch.cuda.Stream()
        grads = []
        for it in range(6):
            xb = x[(2 * it + rank) * 16:(2 * it + rank + 1) * 16].to(dev)
            yb = y[(2 * it + rank) * 16:(2 * it + rank + 1) * 16].to(dev)
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # gradients written on a non-default stream
                F.cross_entropy(model(xb), yb).backward()
            torch.cuda.current_stream().wait_stream(stream)
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).cpu().numpy())
            opt.step()
            opt.zero_grad()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu().numpy()
        return grads, params, state

    comm = gradcomp.default_communicator() if comm_kind == "mpi" else gt.TorchCommunicator()
    plain, _, _ = train(None)
    ours, params, state = train(lambda m: gt.register(m, gradcomp.Allreduce(), comm))
    assert state.buckets_reduced > 6
    assert same_on_ranks(world, params), "parameters differ across ranks"
    for it, (a, b) in enumerate(zip(ours, plain)):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err <= 1e-5, f"iteration {it}: hook vs hook-less DDP differ by {err:.3g}"
    _, p16, _ = train(lambda m: gt.register(m, gradcomp.FP16(gradcomp.Allreduce()), comm))
    assert np.isfinite(p16).all() and same_on_ranks(world, p16)
    return repr(comm)


def rank_side():
    import torch

    import gradcomp as gc
    import gradcomp.torch as gt
    from gradcomp.comm import detect_cuda_aware

    torch.set_num_threads(1)
    n_gpus = torch.cuda.device_count()
    backend = "nccl" if n_gpus >= 2 else "gloo"  # nccl refuses two ranks on one GPU
    launch = gt.init_process_group(backend=backend)
    import cupy
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cupy.cuda.Device(launch.device.index).use()
    report = Report(launch.rank)
    report("INFO", f"{launch.size} ranks, {n_gpus} GPU(s), torch backend {backend}, "
                   f"MPI says CUDA-aware: {detect_cuda_aware(None)}")

    report.run("CuPy buckets, MPICommunicator(cuda_aware=False), host-staged",
               lambda: check_buckets(gc.MPICommunicator(cuda_aware=False), world, "MPI staged"))

    def aware():
        forced = os.environ.get("GPU_CHECK_FORCE_CUDA_AWARE") == "1"
        if not (detect_cuda_aware(None) or forced):
            raise SkipCheck("this MPI library is not CUDA-aware (GPU_CHECK_FORCE_CUDA_AWARE=1 forces it)")
        return check_buckets(gc.MPICommunicator(cuda_aware=True), world, "MPI CUDA-aware")

    report.run("CuPy buckets, MPICommunicator(cuda_aware=True), device pointers to MPI", aware)
    report.run(f"CuPy buckets, TorchCommunicator ({backend})",
               lambda: check_buckets(gt.TorchCommunicator(), world, f"torch {backend}"))
    report.run("DDP on cuda, hook over MPI, backward on a side stream", lambda: check_ddp("mpi", world))
    report.run(f"DDP on cuda, hook over TorchCommunicator ({backend}), backward on a side stream",
               lambda: check_ddp("torch", world))
    failed = np.array([report.failed], np.int64)
    world.Allreduce(MPI.IN_PLACE, failed)
    if launch.rank == 0:
        print("GPU CHECK " + ("FAILED" if failed[0] else "PASSED"), flush=True)
    torch.distributed.destroy_process_group()
    return int(failed[0])


def main(argv):
    if "--ranks" in argv:
        sys.exit(1 if rank_side() else 0)
    why = missing()
    if why:
        print(f"gpu_check: SKIPPED, nothing to check on this machine: {why}.")
        return 0
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", "2", sys.executable,
           str(Path(__file__).resolve()), "--ranks"]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    print("gpu_check:", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, timeout=float(os.environ.get("GPU_CHECK_TIMEOUT", 480))).returncode
    except subprocess.TimeoutExpired:
        print("gpu_check: FAILED, the 2-rank job did not finish in time (hang)")
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
