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


def rank_dgc_matches_its_definition(form: str):
    """One rank, one bucket: DGC's update equals its algorithm written out in NumPy, bit for bit.
    ``local``: the paper's (momentum correction, top-k of the accumulation, factor masking);
    ``global``: top-k of gradient plus residual, then momentum SGD on the sent values."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    shapes = [(20, 30), (30,)]
    params = [np.zeros(s, np.float32) for s in shapes]
    ref_p = [p.copy() for p in params]
    opt = gc.optim.DGC(params, lr=0.1, momentum=0.9, ratio=0.05, warmup=0, comm=comm, momentum_form=form)
    n = sum(int(np.prod(s)) for s in shapes)
    k = int(np.ceil(0.05 * n))
    u = np.zeros(n, np.float32)
    v = np.zeros(n, np.float32)
    for step in range(25):
        grads = _problem(comm.rank, step, shapes)
        g = np.concatenate([x.reshape(-1) for x in grads])  # (step averages the gradients in place)
        opt.step(grads)
        if form == "local":
            u *= np.float32(0.9)
            u += g
            v += u
        else:
            v += g
        sent = np.sort(np.argpartition(np.abs(v), n - k)[n - k:])
        update = np.zeros(n, np.float32)
        update[sent] = v[sent]
        v[sent] = 0
        if form == "local":
            u[sent] = 0
        else:
            u *= np.float32(0.9)
            u += update
            update = u
        flat = np.concatenate([p.reshape(-1) for p in ref_p])
        flat -= np.float32(0.1) * update
        ref_p = [flat[:600].reshape(20, 30), flat[600:]]
        for a, b in zip(params, ref_p):
            assert np.array_equal(a, b), f"step {step}: DGC ({form}) differs from its definition"
        assert np.array_equal(np.concatenate([x.reshape(-1) for x in opt.u]), u), f"step {step}: velocity"
    print(f"rank {comm.rank}: DGC ({form}) == definition", flush=True)


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
                              compressor=gc.Allreduce(), warmup_compressor="allreduce", comm=comm)
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


def rank_onebit_adam_lossy_warmup():
    """``warmup_compressor``: the warm-up's gradients travel through it (fewer bytes than fp32),
    and its residual, a gradient's error, is dropped at the freeze instead of being handed to the
    momentum's exchange (other units): the first frozen step is the definition's, exactly averaged
    here, to float32 rounding."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    shapes = [(64, 40), (40,)]
    params = [np.ones(s, np.float32) for s in shapes]
    b1, warm = 0.9, 5
    opt = gc.optim.OneBitAdam(params, lr=0.01, betas=(b1, 0.99), warmup=warm, compressor=gc.Allreduce(),
                              warmup_compressor="int8:warmup=0", comm=comm)
    assert "int8" in opt.config()["warmup_compressor"]
    for step in range(warm):
        opt.step(_problem(comm.rank, step, shapes))
    stats = opt.stats()
    assert stats["bytes_sent"] < stats["reference_bytes"] / 3, stats
    kept = opt.warmup_compressor.residuals(opt._keys)
    assert kept and any(np.abs(r).max() > 0 for r in kept.values()), "int8 kept no residual in the warm-up"
    # rank 0's checkpoint loaded on every rank would hand them its residuals: refused elsewhere
    from_rank_0 = comm.comm.bcast(opt.state_dict(), root=0)  # test-side transport
    twin = gc.optim.OneBitAdam([np.ones(s, np.float32) for s in shapes], lr=0.01, betas=(b1, 0.99),
                               warmup=warm, compressor=gc.Allreduce(), warmup_compressor="int8:warmup=0",
                               comm=comm)
    if comm.rank == 0:
        twin.load_state_dict(from_rank_0)
    else:
        with pytest.raises(ValueError, match="saved by rank 0 of 2, and this is rank 1 of 2"):
            twin.load_state_dict(from_rank_0)
    twin.load_state_dict(opt.state_dict())  # its own
    before = [m.astype(np.float64) for m in opt.m]
    grads = _problem(comm.rank, warm, shapes)
    opt.step(grads)
    second = 1 - 0.99 ** warm
    for i, (m, d, live) in enumerate(zip(opt.m, opt._denominators(second), opt._live(second))):
        mean = np.mean([_problem(r, warm, shapes)[i].astype(np.float64) for r in range(comm.size)], axis=0)
        expect = (b1 * before[i] + (1 - b1) * mean) * live
        assert np.allclose(m, expect, rtol=1e-4, atol=1e-6 * np.abs(expect).max()), \
            f"tensor {i}: first frozen momentum off by {np.abs(m - expect).max()} (a handed-over residual?)"
    left = opt.warmup_compressor.residuals(opt._keys)
    assert all(not np.any(r) for r in left.values()), "the warm-up's residual outlived the freeze"
    # a checkpoint of an exact warm-up (the default before warmup_compressor) says how to resume it
    exact = gc.optim.OneBitAdam([np.ones(s, np.float32) for s in shapes], warmup=warm,
                                warmup_compressor="allreduce", comm=comm)
    exact.step(_problem(comm.rank, 0, shapes))
    saved = exact.state_dict()
    assert "warmup_compressor" not in str(saved["config"])  # described as before it existed
    try:
        gc.optim.OneBitAdam([np.ones(s, np.float32) for s in shapes], warmup=warm, comm=comm).load_state_dict(saved)
    except ValueError as exc:
        assert "warmup_compressor='allreduce'" in str(exc), exc
    else:
        raise AssertionError("an exact warm-up's checkpoint loaded into an int8 warm-up")
    gc.optim.OneBitAdam([np.ones(s, np.float32) for s in shapes], warmup=warm, warmup_compressor="allreduce",
                        comm=comm).load_state_dict(saved)
    print(f"rank {comm.rank}: lossy warm-up ok", flush=True)


def test_onebit_adam_lossy_warmup():
    run_ranks(2, "tests.optim.test_optim:rank_onebit_adam_lossy_warmup")


@pytest.mark.parametrize("form", ["global", "local"])
def test_dgc_matches_its_definition(form):
    run_ranks(1, "tests.optim.test_optim:rank_dgc_matches_its_definition", form)


def test_onebit_adam_freezes_the_variance():
    run_ranks(1, "tests.optim.test_optim:rank_onebit_adam_freezes_the_variance")


# ---------------------------------------------------------------------------------------------
# the kit: replicas, checkpoints, agreement at 1-3 ranks
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["dgc:warmup=8", "dgc:warmup=8,stages=2,ratio=0.05", "dgc:warmup='auto'",
                                  "onebitadam", "onebitadam:warmup=6",
                                  "onebitadam:warmup=5,warmup_compressor='int8:warmup=0'",
                                  "onebitadam:warmup=4,local_momentum=True,compressor='topk:warmup=0'",
                                  "diloco:sync_every=3", "diloco:sync_every=4,fragments=2,overlap=1,compressor='int4'",
                                  "diloco:sync_every=4,fragments=2,overlap=4,keep_local=True"])
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
             (lambda: gc.optim.OneBitAdam(p, compressor=3, comm=comm), "compressor"),
             (lambda: gc.optim.OneBitAdam(p, warmup_compressor=3, comm=comm), "warmup_compressor")]
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
    run_ranks(2, "tests.optim.test_optim:rank_bad_input")
