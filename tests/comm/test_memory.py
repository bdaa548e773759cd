"""The steady state allocates nothing: minor page faults per step after warm-up (getrusage),
counted, not timed. A fresh 16 MiB array costs about 4,000 faults on first touch; a step of the
reducer path with Allreduce, FP16, PowerSGD or int8 must stay far below that."""
from __future__ import annotations

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

SPECS = ["allreduce", "fp16", "powersgd:rank=4,start_iter=2", "int8:warmup=0"]


def rank_faults(spec, views):
    import resource

    import gradcomp as gc

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    shapes = [(1024, 1024), (1024,), (512, 2048), (2048,), (256, 3, 3, 512)] * 2
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    saved = [g.copy() for g in grads]
    reducer = gc.GradientReducer(grads, gc.make(spec), comm, bucket_cap_mb=8)
    arrays = reducer.gradients if views else grads
    faults = []
    for step in range(8):
        for a, s in zip(arrays, saved):
            np.copyto(a, s)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        reducer.step(arrays)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    total_mb = sum(g.nbytes for g in grads) / 2**20
    steady = max(faults[3:])
    if comm.rank == 0:
        print(f"{spec} views={views}: {total_mb:.0f} MiB, faults per step {faults}", flush=True)
    # a fresh copy of the gradients would be ~256 faults per MiB
    assert steady <= 0.02 * 256 * total_mb, f"{spec}: {faults} page faults per step"


@pytest.mark.parametrize("views", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_steady_state_allocates_nothing(spec, views):
    out = run_ranks(2, "tests.comm.test_memory:rank_faults", spec, views, timeout=180)
    assert "faults per step" in out


def rank_large_temporaries(spec, buckets):
    """``buckets`` buckets of one 40M-value tensor each (160 MB, far over the default cap, as GPT-2's
    embedding): their temporaries of 4 MB and more come from the pipeline's shared pool, lent for
    a job and shared by its slots and codecs, so no slot keeps one of its own, the pool keeps at
    most twice what was lent at once, and steady steps allocate nothing."""
    import resource

    import gradcomp as gc
    from gradcomp.comm.pipeline import LARGE_BYTES

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(40 * 2**20).astype(np.float32) for _ in range(buckets)]
    saved = [g.copy() for g in grads]
    reducer = gc.GradientReducer(grads, gc.make(spec), comm, bucket_cap_mb=25)
    assert len(reducer.buckets) == buckets, reducer.buckets
    faults = []
    for step in range(6):
        for g, s in zip(reducer.gradients, saved):
            np.copyto(g, s)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        reducer.step(reducer.gradients)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    pipeline = comm._pipeline
    shared = pipeline.shared
    pooled = {kind: (len(free), shared._most[kind]) for kind, free in shared._free.items()}
    kept = [buf.nbytes for ws in pipeline.workspaces for buf in ws._buffers.values()]
    if comm.rank == 0:
        print(f"{spec}, {buckets} large buckets: pooled {sorted(pooled.values())}, faults per step {faults}",
              flush=True)
    assert pooled and all(n <= 2 * most for n, most in pooled.values()), pooled
    assert max(kept, default=0) < LARGE_BYTES, f"{spec}: a slot keeps a large temporary of its own"
    assert not any(ws._lent for ws in pipeline.workspaces), f"{spec}: a finished job still holds its loans"
    assert max(faults[3:]) <= 0.02 * 256 * 160 * buckets, f"{spec}: {faults} page faults per step"


@pytest.mark.parametrize("spec, buckets", [("int8:warmup=0", 1), ("int8:warmup=0", 2)])
def test_large_temporaries_are_lent_once(spec, buckets):
    out = run_ranks(2, "tests.comm.test_memory:rank_large_temporaries", spec, buckets, timeout=180)
    assert "large buckets" in out


def test_shared_buffers_lend_the_smallest_that_fits():
    """The pool's own rules, with several free buffers (they are told apart by place, never
    compared as arrays): the smallest free buffer that fits, never one over twice the request, and
    at most twice as many kept free as were ever lent at once."""
    from gradcomp.comm.pipeline import SharedBuffers

    pool, kind = SharedBuffers(), ("<f4", "None")
    lent = [pool.take(kind, n, lambda n=n: np.zeros(n, np.float32)) for n in (100, 300, 200)]
    for buf in lent:
        pool.give(kind, buf)
    assert pool.take(kind, 150, lambda: None) is lent[2]  # 200 fits; 300 is over twice 150
    assert pool.take(kind, 90, lambda: None) is lent[0]
    fresh = pool.take(kind, 400, lambda: np.zeros(400, np.float32))
    assert fresh.shape == (400,) and all(fresh is not b for b in lent)
    for buf in (lent[0], lent[2], fresh):
        pool.give(kind, buf)
    assert sorted(b.shape[0] for b in pool._free[kind]) == [100, 200, 300, 400]
    for n in range(1, 9):  # never more than 3 lent at once: at most 6 kept
        pool.give(kind, pool.take(kind, 1000 * n, lambda n=n: np.zeros(1000 * n, np.float32)))
    assert len(pool._free[kind]) == 6 and pool.nbytes() == 4 * sum(b.shape[0] for b in pool._free[kind])


def test_a_job_asking_again_gets_its_loan():
    """Within a job, a key asked for again (smaller, or under the pool's size) is the same buffer
    as its first answer, lent or kept (``Workspace``'s promise); once the job is released, the
    other slot's job borrows that buffer instead of allocating one."""
    from gradcomp.comm.pipeline import LARGE_BYTES, SharedBuffers, Workspace

    shared = SharedBuffers()
    first, second = Workspace(shared), Workspace(shared)
    owner, big = object(), LARGE_BYTES // 4
    lent = first.array(owner, "x", big, np.float32)
    for n in (big, big // 2, 10):
        again = first.array(owner, "x", n, np.float32)
        assert again.shape == (n,) and np.shares_memory(again, lent), n
    assert not first._buffers, "a slot kept a buffer of its own for a key it had on loan"
    first.release()
    other = second.array(object(), "y", big, np.float32)  # any owner and name of the dtype
    assert np.shares_memory(other, lent)


def flat_bytes(reducers) -> int:
    """The bytes of the flat buffers ``reducers`` keep (buckets in a window share them)."""
    held = {}
    for reducer in reducers:
        for bucket, _ in reducer.buckets:
            base = bucket.buffer if bucket.buffer.base is None else bucket.buffer.base
            held[id(base)] = base.nbytes
    return sum(held.values())


def rank_window(spec):
    """A reducer with ``window=2`` keeps two buckets' flat buffers (per dtype), not the model's,
    and averages the arrays each step passes with the same bits as one that keeps them all."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    shapes = [(300, 200), (700,), (64, 64, 3), (5000,), (128, 128), (31,), (900, 20)]
    dtypes = [np.float32, np.float32, np.float64, np.float32, np.float64, np.float32, np.float32]
    like = [np.zeros(s, d) for s, d in zip(shapes, dtypes)]
    whole = gc.GradientReducer(like, gc.make(spec), comm, bucket_cap_mb=0.1)
    windowed = gc.GradientReducer(like, gc.make(spec), comm, bucket_cap_mb=0.1, window=2)
    assert len(windowed.buckets) >= 5, len(windowed.buckets)
    largest = {np.dtype(d): max(b.buffer.nbytes for b, _ in windowed.buckets if b.buffer.dtype == d)
               for d in set(dtypes)}
    assert flat_bytes([windowed]) <= 2 * sum(largest.values()), (flat_bytes([windowed]), largest)
    for step in range(6):
        grads = [(rng.standard_normal(s) * (step + 1)).astype(d) for s, d in zip(shapes, dtypes)]
        mine = [g.copy() for g in grads]
        expect = whole.step([g.copy() for g in grads])
        out = windowed.step(mine)
        assert out is mine
        for i, (a, b) in enumerate(zip(out, expect)):
            assert np.array_equal(a, b), f"{spec} step {step}: array {i} differs from the whole reducer"
    for refused in (lambda: windowed.gradients, windowed.start, windowed.step):
        with pytest.raises(ValueError, match="window"):
            refused()
    if comm.rank == 0:
        print(f"{spec}: window of 2 == whole", flush=True)


@pytest.mark.parametrize("spec", ["int8:warmup=0", "onebit", "powersgd:rank=2,start_iter=2"])
def test_a_window_of_buckets_averages_as_the_whole(spec):
    out = run_ranks(2, "tests.comm.test_memory:rank_window", spec, timeout=180)
    assert "window of 2 == whole" in out
