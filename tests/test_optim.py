"""gradcomp.optim (DGC, OneBitAdam) under real mpiexec: references written out here, the
conformance kit's optimizer checks, bad input."""
from __future__ import annotations

import numpy as np
import pytest

from gradcomp.conformance import run as run_kit
from tests.mpi_launch import run_ranks


# ---------------------------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------------------------
def _problem(rank: int, step: int, shapes):
    rng = np.random.default_rng([rank, step])
    return [rng.standard_t(3, s).astype(np.float32) for s in shapes]


def rank_dgc_matches_its_definition():
    """One rank, one bucket: DGC's update equals the paper's algorithm written out in NumPy
    (momentum correction, top-k of the accumulation, factor masking), bit for bit."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    shapes = [(20, 30), (30,)]
    params = [np.zeros(s, np.float32) for s in shapes]
    ref_p = [p.copy() for p in params]
    opt = gc.optim.DGC(params, lr=0.1, momentum=0.9, ratio=0.05, warmup=0, comm=comm)
    n = sum(int(np.prod(s)) for s in shapes)
    k = int(np.ceil(0.05 * n))
    u = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    for step in range(25):
        grads = _problem(comm.rank, step, shapes)
        opt.step(grads)
        g = np.concatenate([x.reshape(-1) for x in grads])
        u *= np.float32(0.9)
        u += g
        v += u
        sent = np.sort(np.argpartition(np.abs(v), n - k)[n - k:])
        update = np.zeros(n, np.float32)
        update[sent] = v[sent]
        v[sent] = 0
        u[sent] = 0
        flat = np.concatenate([p.reshape(-1) for p in ref_p])
        flat -= np.float32(0.1) * update
        ref_p = [flat[:600].reshape(20, 30), flat[600:]]
        for a, b in zip(params, ref_p):
            assert np.array_equal(a, b), f"step {step}: DGC differs from its definition"
        assert np.array_equal(np.concatenate([x.reshape(-1) for x in opt.u]), u), f"step {step}: velocity"
    print(f"rank {comm.rank}: DGC == definition", flush=True)


def rank_onebit_adam_freezes_the_variance():
    """One rank, an exact exchange: OneBitAdam is AdamW for ``warmup`` steps, then Adam with the
    variance (and its bias correction) frozen at the warm-up's last value."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    shapes = [(8, 5), (5,)]
    params = [np.ones(s, np.float32) for s in shapes]
    ref = [p.astype(np.float64) for p in params]
    b1, b2, eps, lr, wd, warm = 0.9, 0.99, 1e-8, 0.01, 0.1, 6
    opt = gc.optim.OneBitAdam(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd, warmup=warm,
                              compressor=gc.Allreduce(), comm=comm)
    m = [np.zeros(s) for s in shapes]
    v = [np.zeros(s) for s in shapes]
    for step in range(15):
        grads = _problem(0, step, shapes)
        opt.step(grads)
        t = step + 1
        for i, g in enumerate(grads):
            g = g.astype(np.float64)
            m[i] = b1 * m[i] + (1 - b1) * g
            if t <= warm:
                v[i] = b2 * v[i] + (1 - b2) * g * g
            second = 1 - b2 ** min(t, warm)
            ref[i] *= 1 - lr * wd
            ref[i] -= lr / (1 - b1 ** t) * m[i] / (np.sqrt(v[i] / second) + eps)
        for a, b in zip(params, ref):
            assert np.allclose(a, b, rtol=2e-5, atol=1e-6), f"step {step}: {np.abs(a - b).max()}"
    assert opt.phase() == "frozen variance"
    print(f"rank {comm.rank}: OneBitAdam == reference", flush=True)


def test_dgc_matches_its_definition():
    run_ranks(1, "tests.test_optim:rank_dgc_matches_its_definition")


def test_onebit_adam_freezes_the_variance():
    run_ranks(1, "tests.test_optim:rank_onebit_adam_freezes_the_variance")


# ---------------------------------------------------------------------------------------------
# the kit: replicas, checkpoints, agreement at 1-3 ranks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["dgc:warmup=8", "dgc:warmup=8,stages=2,ratio=0.05", "onebitadam:warmup=6",
                                  "onebitadam:warmup=4,local_momentum=True,compressor='topk:warmup=0'"])
def test_optimizers_conform(spec):
    failures = [o for o in run_kit(f"optimizer:{spec}", ranks=(1, 2, 3), timeout=600) if not o.ok]
    assert not failures, "\n".join(f"{o.ranks} ranks: {o.failed}" for o in failures)


# ---------------------------------------------------------------------------------------------
# bad input: a clear error, at once
# ---------------------------------------------------------------------------------------------
def rank_bad_input():
    import gradcomp as gc

    comm = gc.MPICommunicator()
    p = [np.zeros((3, 4), np.float32)]
    cases = [(lambda: gc.optim.DGC([], comm=comm), "empty parameter list"),
             (lambda: gc.optim.DGC([np.zeros(3, np.int32)], comm=comm), "floating point"),
             (lambda: gc.optim.DGC([np.zeros((4, 4), np.float32)[:, ::2]], comm=comm), "in place"),
             (lambda: gc.optim.DGC(p, ratio=0, comm=comm), "ratio"),
             (lambda: gc.optim.DGC(p, lr=[0.1, 0.2], comm=comm), "one per parameter"),
             (lambda: gc.optim.OneBitAdam(p, betas=(0.9,), comm=comm), "betas"),
             (lambda: gc.optim.OneBitAdam(p, warmup=0, comm=comm), "warmup"),
             (lambda: gc.optim.OneBitAdam(p, compressor=3, comm=comm), "compressor")]
    for build, words in cases:
        try:
            build()
        except (ValueError, TypeError) as exc:
            assert words in str(exc), f"{words!r} not in {exc}"
        else:
            raise AssertionError(f"accepted: {words}")
    opt = gc.optim.DGC(p, comm=comm)
    for grads, words in (([], "expected 1 gradients"), ([np.zeros(12, np.float32)], "shape")):
        try:
            opt.step(grads)
        except ValueError as exc:
            assert words in str(exc), f"{words!r} not in {exc}"
        else:
            raise AssertionError(f"step accepted: {words}")
    print(f"rank {comm.rank}: bad input refused", flush=True)


def test_bad_input_is_refused():
    run_ranks(2, "tests.test_optim:rank_bad_input")
