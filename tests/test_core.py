"""Transport, buckets, allreduce_gradients and the core compressors' specific promises."""
from __future__ import annotations

import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest

import gradcomp as gc
from gradcomp.bucket import pack, unpack
from gradcomp.comm import detect_cuda_aware, wire_bytes
from tests.mpi_launch import run_ranks
from gradcomp.conformance.signals import digest


def everyone(comm, value):
    return comm.comm.allgather(value)  # test-side check only; the library never pickles


def bound(name, inputs, dtype):
    return gc.make(name).error_bound(inputs, dtype)


# ---------------------------------------------------------------------------------------------
# single process: local validation and parameters
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("buffer, words", [
    (np.ones(4, np.int64), "float16/bfloat16/float32/float64|one of"),
    (np.ones((2, 2), np.float32), "1-D"),
    (np.ones(8, np.float32)[::2], "contiguous"),
    ([1.0, 2.0], "NumPy or CuPy array"),
])
def test_bucket_rejects_bad_buffers(buffer, words):
    with pytest.raises(ValueError, match=words):
        gc.Bucket(buffer)


def test_bucket_layout():
    buf = np.arange(10, dtype=np.float32)
    b = gc.Bucket(buf, index=3, shapes=[(2, 3), (4,)], is_last=False)
    assert b.offsets() == [0, 6, 10]
    views = b.views()
    assert views[0].shape == (2, 3) and views[1].tolist() == [6, 7, 8, 9]
    assert np.shares_memory(views[0], buf)
    assert b.layout_key() != gc.Bucket(buf, shapes=[(3, 2), (4,)]).layout_key()
    with pytest.raises(ValueError, match="hold 9 values"):
        gc.Bucket(buf, shapes=[(3, 3)])
    with pytest.raises(ValueError, match="index"):
        gc.Bucket(buf, index=-1)


@pytest.mark.parametrize("factory, words", [
    (lambda: gc.QuantizePerChannel(bits=0), "bits"),
    (lambda: gc.QuantizePerChannel(bits=9), "bits"),
    (lambda: gc.QuantizePerChannel(bits=2.5), "bits"),
    (lambda: gc.QuantizePerChannel(channel_size=0), "channel_size"),
    (lambda: gc.QuantizePerTensor(bits=-1), "bits"),
    (lambda: gc.make("no-such-method"), "unknown compressor"),
    (lambda: pack([np.ones(3, np.float32)], bucket_cap_mb=0), "bucket_cap_mb"),
])
def test_invalid_parameters(factory, words):
    with pytest.raises(ValueError, match=words):
        factory()


def test_cast_wrapper_needs_a_compressor():
    with pytest.raises(TypeError, match="wraps a gradcomp Compressor"):
        gc.FP16("allreduce")


def test_pack_and_unpack_round_trip():
    arrays = [np.full((3, 4), 1, np.float32), np.float32(2) * np.ones(5, np.float32),
              np.ones(2, np.float64), np.array(7.0, np.float32)]
    packed = pack(arrays, bucket_cap_mb=56 / 2**20)  # 56 bytes: forces a split
    assert [b.index for b, _ in packed] == list(range(len(packed)))
    assert [b.is_last for b, _ in packed] == [False] * (len(packed) - 1) + [True]
    assert {b.dtype.name for b, _ in packed} == {"float32", "float64"}
    for bucket, members in packed:
        unpack(bucket.buffer * 10, bucket, arrays, members)
    assert arrays[0][2, 3] == 10 and arrays[1][4] == 20 and arrays[3] == 70


def test_tensor_store_keeps_one_object_per_layout():
    """A layout asked for again (an equal list, built anew each step) finds its region, and every
    tensor's home holds that layout's one object: compared by identity, not element by element,
    which made each step quadratic in a bucket's tensors (auto's timing of 58,000 small tensors
    ran for many minutes)."""
    from gradcomp.state import TensorStore

    store = TensorStore()
    placements = [(f"t{i}", 4 * i, (4,)) for i in range(2000)]
    flat, missing = store.region(list(placements), 8000, np.float32)
    assert len(missing) == 2000
    flat[...] = np.arange(8000, dtype=np.float32)
    again, missing = store.region([(k, o, tuple(s)) for k, o, s in placements], 8000, np.float32)
    assert again is flat and missing == []
    (layout,) = store._layouts
    assert all(home[0] is layout for home in store._home.values())
    part, missing = store.region(placements[:3], 12, np.float32)  # another layout: values move over
    assert missing == [] and np.array_equal(part, np.arange(12, dtype=np.float32))
    store.region(placements[:3], 12, np.float32)
    assert len(store._layouts) == 2  # the first still holds the other 1997 tensors
    store.pop([k for k, _, _ in placements[3:]])
    store.region(placements[:3], 12, np.float32)
    assert len(store._layouts) == 1 and len(store._regions) == 1  # the empty layout was collected


def test_wire_bytes_model():
    assert wire_bytes("allreduce", 100, 4) == 150
    assert wire_bytes("allgather", 100, 4) == 300
    assert wire_bytes("alltoall", 100, 4) == 75
    assert wire_bytes("allreduce", 100, 1) == 0


def test_cuda_aware_override(monkeypatch):
    monkeypatch.setenv("GRADCOMP_CUDA_AWARE", "1")
    assert detect_cuda_aware() is True
    assert detect_cuda_aware(False) is False
    monkeypatch.setenv("GRADCOMP_CUDA_AWARE", "0")
    assert detect_cuda_aware() is False
    monkeypatch.delenv("GRADCOMP_CUDA_AWARE")
    assert detect_cuda_aware() is False  # MPICH from PyPI is built without CUDA


def test_import_pulls_in_neither_torch_nor_cupy():
    code = ("import sys, numpy as np, gradcomp as gc\n"
            "c = gc.MPICommunicator()\n"
            "gc.allreduce_gradients([np.ones(3, np.float32)], gc.FP16(gc.Allreduce()), c)\n"
            "bad = [m for m in ('torch', 'cupy', 'jax', 'optax') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# multi-rank: the communicator
# ---------------------------------------------------------------------------------------------
def rank_collectives():
    comm = gc.MPICommunicator()
    n, r = comm.size, comm.rank
    x = np.arange(12, dtype=np.float32) + r
    futures = [comm.iallreduce(x * k) for k in range(1, 6)]  # queued, answered in order
    for k, f in enumerate(futures, start=1):
        expect = k * (np.arange(12) * n + n * (n - 1) / 2)
        assert np.array_equal(f.result(), expect.astype(np.float32))
    assert np.array_equal(x, np.arange(12, dtype=np.float32) + r), "input modified"
    g = comm.allgather(np.array([r, r * 10], np.int64))
    assert g.tolist() == [[i, i * 10] for i in range(n)]
    sent = np.repeat(np.arange(n, dtype=np.float64) + 100 * r, 3)  # block j goes to rank j
    got = comm.alltoall(sent)
    assert got.shape == (n, 3) and (got == (r + 100 * np.arange(n))[:, None]).all()
    if n > 1:  # refused before it reaches the worker, which stays usable
        with pytest.raises(ValueError, match="divisible"):
            comm.ialltoall(np.ones(3 * n + 1))
    b = comm.broadcast(np.full(4, r, np.float32), root=n - 1)
    assert (b == n - 1).all()
    # float16 / bfloat16 sums: exact for small integers, bit-identical on every rank
    for dt in (np.float16, ml_dtypes.bfloat16):
        h = (np.arange(1001) % 7 + r).astype(dt)
        s = comm.allreduce(h)
        assert s.dtype == np.dtype(dt)
        assert np.array_equal(s.astype(np.float64), (np.arange(1001) % 7) * n + n * (n - 1) / 2)
    before = comm.bytes_sent
    comm.allreduce(np.ones(1000, np.float32))
    assert comm.bytes_sent - before == pytest.approx(wire_bytes("allreduce", 4000, n))
    # overwrite=True reduces into the caller's scratch; the default never touches the input
    for dt in (np.float32, np.float16):
        y = np.full(300, r + 1, dt)
        s = comm.allreduce(y)
        assert s is not y and (y == r + 1).all()
        s = comm.allreduce(y, overwrite=True)
        assert s.base is y or s is y, "not reduced in place"
        assert (y == n * (n + 1) / 2).all()
    # Allreduce divides and reduces a scratch bucket (a DDP bucket, a cast copy) in place, and
    # leaves anything else alone
    for scratch in (False, True):
        buf = np.full(600, 2.0 * n * (r + 1), np.float32)
        out = gc.Allreduce().reduce(gc.Bucket(buf, scratch=scratch), comm).result()
        assert np.array_equal(out, np.full(600, n * (n + 1.0), np.float32))
        assert np.shares_memory(out, buf) == scratch
        assert scratch or (buf == 2.0 * n * (r + 1)).all()
        buf = np.full(600, 2.0 * n * (r + 1), np.float32)  # the half wrappers widen into it too
        out = gc.FP16(gc.Allreduce()).reduce(gc.Bucket(buf, scratch=scratch), comm).result()
        assert out.dtype == np.float32 and np.array_equal(out, np.full(600, n * (n + 1.0), np.float32))
        assert np.shares_memory(out, buf) == scratch
    # the half wrappers reuse their half copy from the pipeline's workspaces for every bucket and
    # step (no fresh pages per bucket); what they return never aliases it, whatever the sizes
    for wrapper in (gc.FP16, gc.BF16):
        comp = wrapper(gc.Allreduce())
        outs, pools = [], []
        for step, size in enumerate([600, 900, 300, 900, 600]):
            buf = np.full(size, 2.0 * n * (r + 1 + step), np.float32)
            outs.append((comp.reduce(gc.Bucket(buf, index=step % 2), comm).result(), step))
            pools.append(workspace_buffers(comm))
        assert all(p == pools[1] for p in pools[1:]), "a new temporary after the largest bucket"
        for out, step in outs:  # earlier results are intact after later buckets went through
            assert np.array_equal(out, np.full(out.size, n * (n + 1.0) + 2.0 * n * step, np.float32))


def workspace_buffers(comm):
    """Identity of every temporary in the communicator's workspaces."""
    return {(i, key): id(buf) for i, ws in enumerate(comm._pipeline.workspaces)
            for key, buf in ws._buffers.items()}


def rank_blas_pinned(expected):
    from threadpoolctl import threadpool_info

    gc.MPICommunicator(blas_threads=1 if expected == 1 else None)
    blas = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
    assert blas, "no BLAS found"
    if expected == 1:
        assert all(t == 1 for t in blas), blas


def rank_failure_ends_job():
    """Rank 1 fails between two collectives and then carries on as if nothing happened; the
    abort timer must end the job instead of leaving rank 0 blocked forever."""
    import time

    comm = gc.MPICommunicator()

    class FailsOnRankOne(gc.Allreduce):
        def run(self, bucket, comm):
            comm.allreduce(bucket.buffer)
            if comm.rank == 1:
                raise RuntimeError("simulated failure inside a compressor")
            return comm.allreduce(bucket.buffer)

    f = FailsOnRankOne().reduce(np.ones(8, np.float32), comm)
    if comm.rank == 1:
        with pytest.raises(RuntimeError, match="simulated failure"):
            f.result()
        with pytest.raises(gc.CommunicatorBroken):
            comm.allreduce(np.ones(2, np.float32))
        time.sleep(120)  # a careless user: the abort timer must fire
    else:
        f.result()  # blocked until the job is aborted


def test_collectives_ordered_and_correct():
    for n in (1, 2, 3, 4):
        run_ranks(n, "tests.test_core:rank_collectives")


@pytest.mark.parametrize("expected", [1, "default"])
def test_blas_pinning(expected):
    run_ranks(2, "tests.test_core:rank_blas_pinned", expected)


def test_failure_on_one_rank_ends_the_job():
    out = run_ranks(2, "tests.test_core:rank_failure_ends_job", timeout=60, expect_failure=True,
                    env={"GRADCOMP_ABORT_GRACE_S": "2"})
    assert "simulated failure" in out and "Aborting the job" in out


# ---------------------------------------------------------------------------------------------
# multi-rank: allreduce_gradients and the compressors' own promises
# ---------------------------------------------------------------------------------------------
def rank_allreduce_gradients(name):
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    shapes = [(30, 20), (20,), (), (5, 4, 3), (1000,), (7,)]
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    grads.append(rng.standard_normal(11))  # a float64 array gets a bucket of its own
    originals = [g.copy() for g in grads]
    ids = [id(g) for g in grads]
    result = gc.allreduce_gradients(grads, gc.make(name), comm, bucket_cap_mb=0.002)
    assert result is grads and [id(g) for g in grads] == ids, "not written in place"
    # bounds per bucket (quantization chunks run across array borders), unpacked per array
    limits = [np.zeros(o.shape) for o in originals]
    for bucket, members in pack(originals, bucket_cap_mb=0.002):
        inputs = np.stack(everyone(comm, bucket.buffer))
        unpack(bound(name, inputs, bucket.dtype), bucket, limits, members)
    for g, o, limit in zip(grads, originals, limits):
        assert g.shape == o.shape and g.dtype == o.dtype
        assert len(set(everyone(comm, digest(g)))) == 1
        ref = np.stack(everyone(comm, o)).astype(np.float64).mean(0)
        err = np.abs(g - ref)
        assert (err <= limit).all(), (name, err.max(), limit.max())
    # mismatched lists: every rank raises, nothing hangs, and the communicator stays usable
    odd = [np.ones(3 + (comm.rank == comm.size - 1), np.float32)]
    if comm.size > 1:
        with pytest.raises(gc.CollectiveError, match=r"array 0 differs across ranks .*\(4,\)"):
            gc.allreduce_gradients(odd, gc.make(name), comm)
    wrong = [np.ones(3, np.int32 if comm.rank == comm.size - 1 else np.float32)]
    with pytest.raises(gc.CollectiveError, match="cannot be bucketed"):
        gc.allreduce_gradients(wrong, gc.make(name), comm)
    assert gc.allreduce_gradients([np.ones(3, np.float32)], gc.make(name), comm)[0].tolist() == [1, 1, 1]


def rank_reducer_views_step():
    """The class docstring's usage: fill ``reducer.gradients`` in place, call ``step()`` with no
    arguments; the means land in those arrays (not the construction arrays' stale values)."""
    comm = gc.MPICommunicator()
    initial = [np.zeros((6, 5), np.float32), np.zeros(7, np.float32)]
    reducer = gc.GradientReducer(initial, gc.Allreduce(), comm, bucket_cap_mb=1)
    grads = reducer.gradients
    for step in range(3):
        for i, g in enumerate(grads):
            g[...] = (comm.rank + 1) * (step + 1) * (i + 1)
        out = reducer.step()
        expected = (comm.size + 1) / 2 * (step + 1)
        for i, g in enumerate(grads):
            assert np.array_equal(g, np.full(g.shape, expected * (i + 1), np.float32)), (step, i, g)
            assert out[i] is g
    # a bucket plan of one's own (DDP's: the last array first), and plans that are refused
    initial.append(np.zeros(3, np.float64))
    reducer = gc.GradientReducer(initial, gc.Allreduce(), comm, buckets=[[2], [1, 0]])
    assert [members for _, members in reducer.buckets] == [[2], [1, 0]]
    mine = [np.full(a.shape, comm.rank + 1, a.dtype) for a in initial]
    for a in reducer.step(mine):
        assert np.array_equal(a, np.full(a.shape, (comm.size + 1) / 2, a.dtype)), a
    for plan, words in (([[0, 1]], r"missing \[2\]"), ([[0, 1, 1], [2]], r"repeated or out of range \[1\]"),
                        ([[0, 1, 2]], "mixes dtypes"), ([[0], [], [1], [2]], "bucket 1 of buckets is empty")):
        with pytest.raises(ValueError, match=words):
            gc.GradientReducer(initial, gc.Allreduce(), comm, buckets=plan)


def rank_different_compressors():
    comm = gc.MPICommunicator()
    comp = gc.Allreduce() if comm.rank == 0 else gc.FP16(gc.Allreduce())
    with pytest.raises(gc.CollectiveError, match="compressor differs"):
        comp.reduce(np.ones(10, np.float32), comm).result()


def rank_heavy_tailed():
    """On heavy-tailed values one outlier stretches the per-tensor scale over all 6M values;
    per 512-value channel it only stretches its own channel."""
    comm = gc.MPICommunicator()
    x = np.random.default_rng(comm.rank).standard_t(2, 6_000_000).astype(np.float32)
    ref = sum(comm.comm.allgather(x.astype(np.float64))) / comm.size
    errors = {}
    for comp in (gc.QuantizePerTensor(), gc.QuantizePerChannel()):
        out = comp.reduce(x, comm).result()
        errors[type(comp).__name__] = float(np.sqrt(np.mean((out - ref) ** 2)))
    if comm.rank == 0:
        print("RMS error", errors)
    assert errors["QuantizePerChannel"] * 10 < errors["QuantizePerTensor"], errors


def rank_large_length(name):
    comm = gc.MPICommunicator()
    n = 2**24 + 3
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    out = gc.make(name).reduce(x, comm).result()
    assert out.shape == (n,) and out.dtype == np.float32
    assert len(set(everyone(comm, digest(out)))) == 1
    head, tail = slice(0, 4096), slice(n - 4099, n)  # spot-check both ends against the reference
    for part in (head, tail):
        inputs = np.stack(everyone(comm, x[part]))
        err = np.abs(out[part] - inputs.astype(np.float64).mean(0))
        limit = bound(name, inputs, np.float32)
        if name.startswith("quantize"):  # the per-tensor range is the whole bucket's
            span = max(everyone(comm, float(x.max() - x.min())))
            limit = np.maximum(limit, span / 255 / 2 * 1.001) if name.startswith("quantize-tensor") else limit
        assert (err <= limit).all(), (name, err.max())


def rank_stats_ratios():
    comm = gc.MPICommunicator()
    x = np.ones(2**16, np.float32)
    n = comm.size
    ratios = {}
    for name in ("allreduce", "allgather", "fp16", "quantize-channel"):
        comp = gc.make(name)
        comp.reduce(x, comm).result()
        ratios[name] = comp.stats()["compression_ratio"]
    assert ratios["allreduce"] == pytest.approx(1.0)
    assert ratios["allgather"] == pytest.approx(2 / n)
    assert ratios["fp16"] == pytest.approx(2.0, rel=1e-3)
    assert ratios["quantize-channel"] == pytest.approx(8 / n * 512 / 520, rel=1e-3)


@pytest.mark.parametrize("name", ["allreduce", "fp16", "quantize-channel", "allgather"])
def test_allreduce_gradients(name):
    run_ranks(3, "tests.test_core:rank_allreduce_gradients", name)


def test_reducer_views_then_step():
    run_ranks(3, "tests.test_core:rank_reducer_views_step")


def test_ranks_with_different_compressors_raise():
    run_ranks(2, "tests.test_core:rank_different_compressors")


def test_per_channel_beats_per_tensor_on_heavy_tails():
    run_ranks(2, "tests.test_core:rank_heavy_tailed", timeout=300)


@pytest.mark.parametrize("name", ["allreduce", "bf16", "quantize-tensor:warmup=0", "quantize-channel"])
def test_length_2_pow_24_plus_3(name):
    run_ranks(2, "tests.test_core:rank_large_length", name, timeout=300)


def test_stats_compression_ratios():
    run_ranks(4, "tests.test_core:rank_stats_ratios")
