"""PowerSGD: parity with PyTorch's powerSGD_hook, checkpoint/restart, orthogonalization, variants.

The PyTorch comparison runs the real ``powerSGD_hook`` on a real gloo process group inside each MPI
rank (rank and size from MPI, rendezvous on 127.0.0.1 with a port rank 0 picks and broadcasts),
next to gradcomp on the same gradients. Both sides start from the same Q: ``TorchSeededPowerSGD``
overrides ``PowerSGD.fresh_q`` to replay PyTorch's draw (``torch.manual_seed(rng.randint(1e9))``
from a ``RandomState(seed)``, then ``torch.randn`` per matrix in its shape-grouped order), consuming
the compressor's own generator exactly as PyTorch consumes ``PowerSGDState.rng``.
"""
from __future__ import annotations

import hashlib
import io
import math
import os
import socket
import sys

import ml_dtypes
import numpy as np
import pytest

import gradcomp as gc
from gradcomp.powersgd import PowerSGD, gram_schmidt_segments, orthogonalize, should_compress
from gradcomp.powersgd import Plan


def _Plan(shapes, numel, rank, rate, batched, batch_same_shape):
    """A plan with positional keys, as a bucket without keys gets."""
    return Plan(shapes, [f"0.{i}" for i in range(len(shapes))], numel, rank, rate, batched,
                batch_same_shape)
from tests.mpi_launch import leave_before_torch_teardown, run_ranks

# One "model": two buckets per step, like DDP (bucket 1 first, bucket 0 last).
LAYOUT_A = [(24, 16), (24,), (8, 4, 3, 3), (10, 3), (6, 5, 4), (8,)]  # (10, 3) stays uncompressed
LAYOUT_B = [(40, 12), (12,), (16, 20), (16, 20), (7, 9)]


def numel(layout):
    return sum(math.prod(s) for s in layout)


def digest(a) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).view(np.uint8).tobytes()).hexdigest()


def same_everywhere(comm, a) -> bool:
    return len(set(comm.comm.allgather(digest(a)))) == 1  # test-side check only


def step_buckets(rng, dtype=np.float32, scale=1.0):
    """(index, layout, is_last, gradient) for one step, DDP order."""
    return [(1, LAYOUT_B, False, (rng.standard_normal(numel(LAYOUT_B)) * scale).astype(dtype)),
            (0, LAYOUT_A, True, (rng.standard_normal(numel(LAYOUT_A)) * scale).astype(dtype))]


# ---------------------------------------------------------------------------------------------
# PyTorch side
# ---------------------------------------------------------------------------------------------
class TorchSeededPowerSGD(PowerSGD):
    """gradcomp's PowerSGD with PyTorch's initial Q (only ``fresh_q`` differs). PyTorch draws in
    the bucket's dtype (``torch.randn(..., dtype=float16)`` under fp16_compress_wrapper)."""

    draw_dtype = "float32"

    def fresh_q(self, matrices):
        import torch

        seed = self._rng.randint(1_000_000_000)  # what PowerSGDState.rng gives torch.manual_seed
        by_shape: dict[tuple, list[int]] = {}
        for i, (n, m, _) in enumerate(matrices):
            by_shape.setdefault((n, m), []).append(i)
        out = [None] * len(matrices)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            for members in by_shape.values():
                for i in members:
                    _, m, r = matrices[i]
                    q = torch.randn(1, m, r, dtype=getattr(torch, self.draw_dtype))
                    out[i] = q.to(torch.float64).numpy()[0]
        return out


def init_gloo(comm):
    """torch.distributed on gloo with MPI's rank and size; rank 0 picks a free port."""
    import torch.distributed as dist

    port = np.zeros(1, np.int64)
    if comm.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port[0] = s.getsockname()[1]
    comm.comm.Bcast(port, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{int(port[0])}",
                            rank=comm.rank, world_size=comm.size)
    return dist


def rank_torch_parity(configs, steps):
    import torch

    from benchmarks.hookbucket import HookBucket
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (PowerSGDState,
                                                                           powerSGD_hook)

    torch.set_num_threads(1)
    comm = gc.MPICommunicator()
    dist = init_gloo(comm)
    for cfg in configs:
        fp16 = cfg.pop("fp16", False)
        tol = cfg.pop("tol")
        state = PowerSGDState(process_group=None, matrix_approximation_rank=cfg["rank"],
                              start_powerSGD_iter=2, min_compression_rate=2,
                              use_error_feedback=cfg.get("error_feedback", True),
                              warm_start=cfg.get("warm_start", True), random_seed=cfg.get("seed", 0))
        ours = TorchSeededPowerSGD(start_iter=2, **cfg)
        ours.draw_dtype = "float16" if fp16 else "float32"
        hook = default_hooks.fp16_compress_wrapper(powerSGD_hook) if fp16 else powerSGD_hook
        comp = gc.FP16(ours) if fp16 else ours
        rng = np.random.default_rng([11, comm.rank])
        worst = 0.0
        for step in range(steps):
            for index, layout, is_last, g in step_buckets(rng):
                tb = HookBucket(torch.from_numpy(g.copy()), index, layout, is_last)
                ref = hook(state, tb).wait().to(torch.float32).numpy()
                got = comp.reduce(gc.Bucket(g, index, layout, is_last), comm).result()
                assert got.dtype == np.float32 and same_everywhere(comm, got)
                rel = float(np.abs(got - ref).max() / np.abs(ref).max())
                worst = max(worst, rel)
                where = f"{cfg} fp16={fp16} step {step} bucket {index}"
                if step < 2 and not fp16:  # warm-up: both are exactly the divided allreduce
                    assert np.array_equal(got, ref), where
                assert rel <= tol, f"{where}: relative difference {rel:.3g} > {tol}"
        assert ours.step == state.iter == steps
        assert ours.stats()["compressed_steps"] == steps - 2
        if comm.rank == 0:
            print(f"parity {cfg} fp16={fp16}: worst relative difference {worst:.2e}", flush=True)
    assert dist.is_initialized()
    leave_before_torch_teardown(comm)  # (tests.mpi_launch)




PARITY_CONFIGS = [
    dict(rank=1, tol=1e-5), dict(rank=2, tol=1e-5), dict(rank=4, tol=1e-5),  # rank 4: QR
    dict(rank=2, warm_start=False, tol=1e-5), dict(rank=2, seed=7, tol=1e-5),
    dict(rank=2, fp16=True, tol=2e-2),  # fp16_compress_wrapper(powerSGD_hook): half rounding
]


@pytest.mark.parametrize("nranks", [1, 2])
def test_parity_with_torch_powerSGD_hook(nranks):
    """Same gradients, settings and initial Q: within 1e-5 relative over 5 compressed steps with
    error feedback and warm start on (2 warm-up steps first), at 1 and 2 ranks."""
    pytest.importorskip("torch")
    out = run_ranks(nranks, "tests.powersgd.test_powersgd:rank_torch_parity", PARITY_CONFIGS, 7, timeout=240)
    assert out.count("parity") == len(PARITY_CONFIGS)


# ---------------------------------------------------------------------------------------------
# Checkpoint / restart
# ---------------------------------------------------------------------------------------------
BUILDERS = {
    "fused": lambda: gc.PowerSGD(rank=2, start_iter=2),
    "qr": lambda: gc.PowerSGD(rank=3, start_iter=2, seed=3),
    "one-round": lambda: gc.PowerSGD(rank=2, start_iter=2, rounds=1),
    "batched": lambda: gc.BatchedPowerSGD(rank=2, start_iter=2),
    "fp16": lambda: gc.FP16(gc.PowerSGD(rank=1, start_iter=3, error_dtype="float32")),
    "cold": lambda: gc.PowerSGD(rank=1, start_iter=2, warm_start=False),
    "schedule": lambda: gc.Schedule([(0, gc.Allreduce()), (2, gc.FP16(gc.Allreduce())),
                                      (3, gc.PowerSGD(rank=2, start_iter=2)),
                                      (9, gc.PowerSGD(rank=1, start_iter=2, rounds=1))]),
}


def roundtrip(state: dict) -> dict:
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def rank_checkpoint(names, stop_at, steps):
    comm = gc.MPICommunicator()
    for name in names:
        rng = np.random.default_rng([5, comm.rank])
        grads = [step_buckets(rng) for _ in range(steps)]
        straight = BUILDERS[name]()
        expected = [[straight.reduce(gc.Bucket(g, i, lay, last), comm).result()
                     for i, lay, last, g in step] for step in grads]
        first = BUILDERS[name]()
        for step in grads[:stop_at]:
            for i, lay, last, g in step:
                first.reduce(gc.Bucket(g, i, lay, last), comm).result()
        saved = roundtrip(first.state_dict())
        del first
        resumed = BUILDERS[name]()
        resumed.load_state_dict(saved)
        for k, step in enumerate(grads[stop_at:], start=stop_at):
            for (i, lay, last, g), want in zip(step, expected[k]):
                got = resumed.reduce(gc.Bucket(g, i, lay, last), comm).result()
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                    f"{name}: restarted run differs at step {k} bucket {i}"
        end_a, end_b = roundtrip(straight.state_dict()), roundtrip(resumed.state_dict())
        assert sorted(end_a) == sorted(end_b)
        for key in end_a:
            assert np.array_equal(end_a[key], end_b[key]), f"{name}: state {key} differs"
        assert any("residual/" in k for k in end_a) or name == "schedule"


def test_checkpoint_restart_is_bit_identical():
    """Stop after 5 steps (3 compressed), save with numpy.savez, load with allow_pickle=False into a
    new compressor, continue: every later output and the final state equal the uninterrupted run's."""
    run_ranks(2, "tests.powersgd.test_powersgd:rank_checkpoint", sorted(BUILDERS), 5, 12)


def test_load_rejects_other_configuration():
    state = gc.PowerSGD(rank=2, start_iter=2).state_dict()
    with pytest.raises(ValueError, match="another configuration"):
        gc.PowerSGD(rank=1, start_iter=2).load_state_dict(state)
    with pytest.raises(ValueError, match="PowerSGD state: unexpected keys"):
        gc.PowerSGD(rank=2, start_iter=2).load_state_dict(dict(state, junk=1))


# ---------------------------------------------------------------------------------------------
# Behaviour on real ranks
# ---------------------------------------------------------------------------------------------
def reduce_steps(comp, comm, grads_per_step, layout, index=0):
    outs = []
    for g in grads_per_step:
        outs.append(comp.reduce(gc.Bucket(g, index, layout, True), comm).result())
    return outs


def rank_zero_gradients():
    """A zero layer (all-zero P and Q columns) gives zeros, never NaN, with and without QR, and
    the layer recovers (its warm-start factor is redrawn) when its gradient comes back."""
    comm = gc.MPICommunicator()
    layout = [(32, 20), (20,), (16, 30)]
    rng = np.random.default_rng(comm.rank)
    for comp in (gc.PowerSGD(rank=2, start_iter=2), gc.PowerSGD(rank=4, start_iter=2),
                 gc.PowerSGD(rank=2, start_iter=2, rounds=1), gc.FP16(gc.PowerSGD(rank=2, start_iter=2))):
        for step in range(10):
            g = rng.standard_normal(numel(layout)).astype(np.float32)
            if step < 6:
                g[:640] = 0  # the first matrix's gradient vanishes on every rank
            if step in (4, 5):
                g[:] = 0  # then the whole model's
            out = comp.reduce(gc.Bucket(g, 0, layout), comm).result()
            assert np.isfinite(out).all(), f"{comp!r}: NaN from a zero gradient at step {step}"
            assert same_everywhere(comm, out)
            if step < 6:
                assert not out[:640].any(), f"{comp!r}: zero layer came back non-zero"
            elif step >= 7:
                assert np.abs(out[:640]).max() > 0.01, f"{comp!r}: layer stuck at zero at step {step}"


def rank_exact_cases():
    """Cases where one power-iteration step is exact, checked against the float64 mean:
    rank-1 means at rank 1, the batched square at full rank, past the warm-up."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(0)  # same u, v on every rank
    layout = [(30, 40), (40,), (12, 6, 2)]
    u, v = rng.standard_normal(30), rng.standard_normal(40)
    w, z = rng.standard_normal(12), rng.standard_normal(12)
    # (one round without error feedback: its first step's residual would tilt the next Q)
    for comp in (gc.PowerSGD(rank=1, start_iter=2),
                 gc.PowerSGD(rank=1, start_iter=2, rounds=1, error_feedback=False)):
        for step in range(6):
            scale = 1.0 + comm.rank + step  # rank-dependent scale, same direction: the mean is rank 1
            g = np.concatenate([np.outer(u, v).ravel() * scale, rng.standard_normal(40),
                                np.outer(w, z).ravel() * -scale]).astype(np.float32)
            mean = comm.allgather(g).astype(np.float64).mean(axis=0)
            out = comp.reduce(gc.Bucket(g, 0, layout), comm).result()
            rel = np.abs(out - mean).max() / np.abs(mean).max()
            # one round alternates: its first compressed step projects onto a random Q
            if not (comp.rounds == 1 and step == 2):
                assert rel < 1e-5, f"{comp!r} step {step}: {rel:.3g}"
            assert same_everywhere(comm, out)
        assert comp.stats()["rounds_per_compressed_step"] == comp.rounds
    # BatchedPowerSGD past warm-up: rank = side and a lenient rate make the factorization exact
    n = 500
    side = math.isqrt(n - 1) + 1
    comp = gc.BatchedPowerSGD(rank=side, start_iter=2, min_compression_rate=0.1)
    for step in range(5):
        g = rng.standard_normal(n).astype(np.float32) + comm.rank
        mean = comm.allgather(g).astype(np.float64).mean(axis=0)
        out = comp.reduce(gc.Bucket(g, 0, [(20, 25)]), comm).result()
        assert out.shape == (n,) and np.abs(out - mean).max() < 1e-4 * np.abs(mean).max()
    assert comp.stats()["compressed_steps"] == 3


def rank_batched_low_rank():
    """BatchedPowerSGD (rank 1) compresses and keeps a residual once past the warm-up; with error
    feedback the running sum of its outputs tracks the running sum of the means."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng([1, comm.rank])
    comp = gc.BatchedPowerSGD(rank=1, start_iter=2)
    total_out, total_mean = np.zeros(1000), np.zeros(1000)
    for step in range(30):
        g = rng.standard_normal(1000).astype(np.float32)
        mean = comm.allgather(g).astype(np.float64).mean(axis=0)
        out = comp.reduce(gc.Bucket(g, 0), comm).result()
        assert np.isfinite(out).all() and same_everywhere(comm, out)
        total_out += out
        total_mean += mean
    s = comp.stats()
    assert s["compressed_steps"] == 28 and s["compression_rate"] > 10
    # error feedback: what is still owed is only the (bounded) residual, not 28 steps of loss
    lag = np.linalg.norm(total_out - total_mean) / np.linalg.norm(total_mean)
    assert lag < 0.9, lag
    residual = comp.state_dict()["residual/0.0"]
    assert residual.shape == (1000,) and np.abs(residual).max() > 0


def rank_non_finite_recovers():
    """NaN on one rank in a compressed layer: that layer is NaN on every rank, memory is dropped on
    every rank, and the next step is finite and still bit-identical everywhere."""
    comm = gc.MPICommunicator()
    layout = [(32, 20), (20,), (16, 30)]
    rng = np.random.default_rng([2, comm.rank])
    for comp in (gc.PowerSGD(rank=2, start_iter=2), gc.PowerSGD(rank=2, start_iter=2, rounds=1)):
        inner = comp
        for step in range(8):
            g = rng.standard_normal(numel(layout)).astype(np.float32)
            if step == 4 and comm.rank == comm.size - 1:
                g[5] = np.nan
            out = comp.reduce(gc.Bucket(g, 0, layout), comm).result()
            assert same_everywhere(comm, out)
            if step == 4:
                assert np.isnan(out[:640]).any()
                assert np.isnan(out[:640]).all() or comp.rounds == 1
                assert np.isfinite(out[640:660]).all()  # the uncompressed vector is untouched
                kept = inner.state_dict()
                assert not any(k.startswith(("residual/", "q/", "p/")) for k in kept), sorted(kept)
            else:
                assert np.isfinite(out).all(), f"step {step}"


def rank_layout_change_resets():
    """A bucket index whose layout changes starts afresh (no stale residual of the wrong size)."""
    comm = gc.MPICommunicator()
    comp = gc.PowerSGD(rank=2, start_iter=2)
    rng = np.random.default_rng([3, comm.rank])
    for step, layout in enumerate([[(20, 30)]] * 4 + [[(30, 20), (7,)]] * 3 + [[(20, 30)]]):
        g = rng.standard_normal(numel(layout)).astype(np.float32)
        out = comp.reduce(gc.Bucket(g, 0, layout), comm).result()
        assert np.isfinite(out).all() and same_everywhere(comm, out)
        if step >= 2:
            kept = {k: v.shape for k, v in comp.state_dict().items() if k.startswith("residual/")}
            for i, shape in enumerate(layout):  # each tensor's residual has its current shape
                assert kept[f"residual/0.{i}"] == tuple(shape), kept


def rank_dtypes():
    """float64 stays float64 (computed in float64); bfloat16 and float16 round where PyTorch would."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng([4, comm.rank])
    layout = [(24, 16), (16,)]
    for dtype in (np.float64, ml_dtypes.bfloat16, np.float16):
        comp = gc.PowerSGD(rank=16, start_iter=2, min_compression_rate=0.5)  # full rank: exact
        for step in range(4):
            g = rng.standard_normal(numel(layout)).astype(dtype)
            mean = comm.allgather(g).astype(np.float64).mean(axis=0)
            out = comp.reduce(gc.Bucket(g, 0, layout), comm).result()
            assert out.dtype == np.dtype(dtype) and same_everywhere(comm, out)
            tol = 1e-10 if dtype == np.float64 else 0.05
            err = np.abs(out.astype(np.float64) - mean).max() / np.abs(mean).max()
            assert err < tol, f"{np.dtype(dtype).name} step {step}: {err:.3g}"


def rank_batch_same_shape():
    """Fusing consecutive same-shape products (LAYOUT_B's two 16x20 tensors) changes nothing."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng([8, comm.rank])
    plain = gc.PowerSGD(rank=2, start_iter=2)
    fused = gc.PowerSGD(rank=2, start_iter=2, batch_same_shape=True)
    assert any(b[1] == 2 for b in _Plan(LAYOUT_B, numel(LAYOUT_B), 2, 2, False, True).batches)
    for step in range(6):
        for index, layout, last, g in step_buckets(rng):
            a = plain.reduce(gc.Bucket(g, index, layout, last), comm).result()
            b = fused.reduce(gc.Bucket(g, index, layout, last), comm).result()
            assert np.allclose(a, b, rtol=1e-5, atol=1e-6 * np.abs(a).max()), f"step {step}"
            assert same_everywhere(comm, b)


def rank_compiled_products():
    """The compiled products (``gradcomp.kernels.lowrank``) against the matmul path, over 6 steps with
    memory: within float32 rounding of each other for every variant, bit-identical on every rank.
    A scratch bucket (DDP's) receives the result itself, with the same bits as a bucket that is
    not scratch, whose input stays untouched."""
    from gradcomp import kernels

    comm = gc.MPICommunicator()
    variants = [dict(rank=1), dict(rank=2), dict(rank=4), dict(rank=5, min_compression_rate=1),
                dict(rank=2, rounds=1), dict(rank=4, error_feedback=False),
                dict(rank=2, warm_start=False)]
    for kwargs in variants:
        rng = np.random.default_rng([9, comm.rank])
        compiled = gc.PowerSGD(start_iter=2, **kwargs)
        scratch = gc.PowerSGD(start_iter=2, **kwargs)
        matmul = gc.PowerSGD(start_iter=2, **kwargs)
        for step in range(6):
            for index, layout, last, g in step_buckets(rng):
                given = g.copy()
                a = compiled.reduce(gc.Bucket(g, index, layout, last), comm).result()
                assert np.array_equal(g, given), "a bucket that is not scratch was modified"
                work = g.copy()
                b = scratch.reduce(gc.Bucket(work, index, layout, last, scratch=True), comm).result()
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{kwargs} step {step}"
                assert np.shares_memory(b, work), "the scratch bucket should take the result"
                available, kernels.available = kernels.available, lambda: False
                try:
                    c = matmul.reduce(gc.Bucket(g, index, layout, last), comm).result()
                finally:
                    kernels.available = available
                err = np.abs(a - c).max() / np.abs(c).max()
                assert err < 1e-5, f"{kwargs} step {step}: compiled vs matmul {err:.3g}"
                assert same_everywhere(comm, a)


def rank_quantized_factors():
    """``factor_bits=8``: P and Q go as 8-bit codes, the uncompressed tensors exactly. Replicas
    stay bit-identical; error feedback keeps what the codes miss (the outputs plus the mean of the
    residuals add up to the summed means); the output is close to float factors' and not equal to
    it; the stats count the codes' bytes."""
    comm = gc.MPICommunicator()
    layout = LAYOUT_A
    n = numel(layout)
    plan = _Plan(layout, n, 4, 2, False, False)
    for kwargs in (dict(), dict(rounds=1)):
        quantized = gc.PowerSGD(rank=4, start_iter=2, factor_bits=8, **kwargs)
        floats = gc.PowerSGD(rank=4, start_iter=2, **kwargs)
        rng = np.random.default_rng([10, comm.rank])
        total_out, total_mean = np.zeros(n), np.zeros(n)
        for step in range(8):
            g = (rng.standard_normal(n) + np.linspace(-3, 3, n)).astype(np.float32)
            total_mean += comm.allgather(g).astype(np.float64).mean(axis=0)
            out = quantized.reduce(gc.Bucket(g, 0, layout), comm).result()
            assert same_everywhere(comm, out), f"{kwargs} step {step}"
            total_out += out
            reference = floats.reduce(gc.Bucket(g, 0, layout), comm).result()
            if step == 2 and comm.size > 1:  # the first compressed step: the same input and basis
                err = np.abs(out - reference).max() / np.abs(reference).max()
                assert 0 < err < 0.05, f"{kwargs}: int8 factors against float factors {err:.3g}"
        state = quantized.state_dict()
        residual = np.concatenate([state[f"residual/0.{i}"].ravel() for i in range(len(layout))])
        owed = comm.allgather(residual.astype(np.float64)).mean(axis=0)
        lag = np.abs(total_out + owed - total_mean).max() / np.abs(total_mean).max()
        assert lag < 1e-5, f"{kwargs}: error feedback lost {lag:.3g} of the sum"
        codes = -(-quantized._factor_codec.message_size(plan.p_size) // 4)
        codes_q = -(-quantized._factor_codec.message_size(plan.q_size) // 4)
        factors = 6 * (codes + codes_q) if quantized.rounds == 2 else 3 * (codes + codes_q)
        assert quantized.stats()["numel_after"] == 6 * plan.n_unc + factors, quantized.stats()
    assert gc.PowerSGD(rank=2, factor_bits=8).config()["factor_bits"] == 8
    assert "factor_bits" not in gc.PowerSGD(rank=2).config()  # older checkpoints still load


@pytest.mark.parametrize("check", ["rank_zero_gradients", "rank_batch_same_shape", "rank_compiled_products", "rank_exact_cases", "rank_batched_low_rank",
                                   "rank_non_finite_recovers", "rank_layout_change_resets",
                                   "rank_dtypes", "rank_quantized_factors"])
@pytest.mark.parametrize("nranks", [1, 3])
def test_on_ranks(check, nranks):
    run_ranks(nranks, f"tests.powersgd.test_powersgd:{check}")


def rank_rounds_and_stats():
    comm = gc.MPICommunicator()
    rng = np.random.default_rng([6, comm.rank])
    n_a = numel(LAYOUT_A)
    plan = _Plan(LAYOUT_A, n_a, 2, 2, False, False)
    for rounds in (2, 1):
        comp = gc.PowerSGD(rank=2, start_iter=2, rounds=rounds)
        for _ in range(6):
            comp.reduce(gc.Bucket(rng.standard_normal(n_a).astype(np.float32), 0, LAYOUT_A), comm).result()
        s = comp.stats()
        assert s["rounds_per_compressed_step"] == rounds, s
        assert s["numel_before"] == 4 * n_a
        if rounds == 2:
            assert s["numel_after"] == 4 * plan.numel_after
        else:
            assert s["numel_after"] == 4 * plan.n_unc + 2 * (plan.p_size + plan.q_size)
        assert s["compression_rate"] == pytest.approx(s["numel_before"] / s["numel_after"])
        assert comp.compression_stats() == (s["compression_rate"], s["numel_before"], s["numel_after"])
    assert comm.size == 4


def test_rounds_per_step_and_compression_stats():
    """Fused: 2 collectives per compressed step (PyTorch: 3); alternating: 1. 4 ranks."""
    run_ranks(4, "tests.powersgd.test_powersgd:rank_rounds_and_stats")


# ---------------------------------------------------------------------------------------------
# In-process unit tests (no communication)
# ---------------------------------------------------------------------------------------------
def test_start_iter_must_exceed_one_with_memory():
    for kw in (dict(), dict(error_feedback=False), dict(warm_start=False)):
        for start in (0, 1):
            with pytest.raises(ValueError, match=r"start_iter must be > 1 .*rebuilt after the first step"):
                gc.PowerSGD(start_iter=start, **kw)
    gc.PowerSGD(start_iter=0, error_feedback=False, warm_start=False)  # nothing remembered: fine
    gc.PowerSGD(start_iter=2)


@pytest.mark.parametrize("kwargs, words", [
    (dict(rank=0), "rank must be >= 1"),
    (dict(rank=1.5), "rank must be an integer"),
    (dict(rank=True), "rank must be an integer"),
    (dict(rank=float("inf")), "rank must be an integer"),
    (dict(rounds=3), "rounds .* must be <= 2"),
    (dict(rounds=True), "rounds .* must be an integer"),
    (dict(error_feedback=1), "error_feedback must be True or False"),
    (dict(rounds=1, warm_start=False), "warm start by construction"),
    (dict(min_compression_rate=0), "min_compression_rate"),
    (dict(orthogonalization_epsilon=-1), "orthogonalization_epsilon"),
    (dict(error_dtype="int8"), "error_dtype"),
])
def test_bad_configuration_is_named(kwargs, words):
    with pytest.raises(ValueError, match=words):
        gc.PowerSGD(start_iter=2, **kwargs)


def test_repr_names_every_field():
    text = repr(gc.PowerSGD(rank=3, start_iter=5, seed=4, rounds=1))
    for field in ("rank=3", "start_iter=5", "seed=4", "rounds=1", "error_feedback=True",
                  "warm_start=True", "min_compression_rate=2.0", "batch_same_shape=False", "error_dtype=None"):
        assert field in text
    assert repr(gc.BatchedPowerSGD(start_iter=2)).startswith("BatchedPowerSGD(rank=1")


def test_which_tensors_are_compressed():
    # PyTorch's rule: (n + m) * r * rate < n * m, with r = min(n, m, rank); vectors never
    assert should_compress(24, 16, 2, 2) and not should_compress(10, 3, 2, 2)
    plan = _Plan([(24, 16), (24,), (10, 3), (4,), (2, 2, 2)], 24 * 16 + 24 + 30 + 4 + 8, 2, 2, False, False)
    assert [(t.n, t.m, t.r) for t in plan.matrices] == [(24, 16, 2)]
    assert plan.runs == [(384, 384 + 24 + 30 + 4 + 8)]  # adjacent uncompressed tensors merged
    assert plan.numel_after == 66 + (24 + 16) * 2
    empty = _Plan([(0,)], 0, 2, 2, True, False)
    assert not empty.matrices and empty.n_unc == 0
    square = _Plan([(511,)], 511, 1, 2, True, False)
    assert [(t.n, t.m) for t in square.matrices] == [(23, 23)] and square.padded == 529


def test_gram_schmidt_matches_qr_and_keeps_zero_columns_zero():
    rng = np.random.default_rng(0)
    blocks = [rng.standard_normal((n, 2)) for n in (5, 9, 3)]
    blocks[1][:, 0] = 0  # an all-zero column
    plan = _Plan([(5, 50), (9, 50), (3, 50)], 850, 2, 0.1, False, False)
    region = np.empty(plan.p_size)
    for t, b in zip(plan.matrices, blocks):
        region[t.p_off:t.p_off + t.n * 2] = b.ravel()
    assert orthogonalize(region, plan.p_groups, use_qr=False) == [1]  # block 1 kept a zero column
    assert np.isfinite(region).all()
    for t, b in zip(plan.matrices, blocks):
        got = region[t.p_off:t.p_off + t.n * 2].reshape(t.n, 2)
        if not b[:, 0].any():
            assert not got[:, 0].any()  # stays zero instead of NaN
            assert np.allclose(np.abs(got[:, 1]), np.abs(b[:, 1] / np.linalg.norm(b[:, 1])))
        else:
            q = np.linalg.qr(b)[0]
            assert np.allclose(np.abs(got), np.abs(q), atol=1e-12)  # equal up to column signs


def test_qr_branch_for_rank_above_two_and_zero_block():
    rng = np.random.default_rng(1)
    plan = _Plan([(8, 40), (8, 40), (6, 40)], 880, 4, 0.1, False, False)
    region = rng.standard_normal(plan.p_size).astype(np.float32)
    region[:32] = 0  # first block all zero
    orthogonalize(region, plan.p_groups, use_qr=True)
    assert np.isfinite(region).all()
    for t in plan.matrices:
        p = region[t.p_off:t.p_off + t.n * t.r].reshape(t.n, t.r)
        assert np.allclose(p.T @ p, np.eye(t.r), atol=1e-5)


def test_gram_schmidt_epsilon():
    a = np.array([[3.0], [4.0], [0.0], [0.0]])
    gram_schmidt_segments(a, np.array([0, 2]), np.array([0, 0, 1, 1]), epsilon=1.0)
    assert np.allclose(a[:, 0], [0.5, 2 / 3, 0, 0])
