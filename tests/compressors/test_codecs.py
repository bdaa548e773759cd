"""What the two-stage quantizers and the sparsifiers promise beyond the conformance kit: traffic
flat in the number of ranks, the coordinates they send, bit packing."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gradcomp as gc
from gradcomp.kernels.affine import pack4, unpack4
from tests.mpi_launch import run_ranks


def test_pack4_round_trip():
    codes = np.random.default_rng(0).integers(0, 16, 1000).astype(np.uint8)
    packed = np.empty(500, np.uint8)
    pack4(codes, packed)
    back = np.empty(1000, np.uint8)
    unpack4(packed, back)
    assert np.array_equal(back, codes) and packed.nbytes * 2 == codes.nbytes


def rank_traffic():
    """Bytes per rank of the two-stage methods: 2(N-1)/N of one message (bits/32 of the float32
    bucket plus chunk parameters), whatever N; the allgather quantizer's grows as (N-1)."""
    comm = gc.MPICommunicator()
    n, size = 512 * 96, comm.size
    x = np.random.default_rng(comm.rank).standard_normal(n).astype(np.float32)
    expected = {"int8:feedback=none,warmup=0": n + 8 * n / 512, "int4:feedback=none": n / 2 + 8 * n / 512,
                "int4:feedback=none,chunk=128": n / 2 + 8 * n / 128,
                "onebit:warmup=0,feedback=none": n / 8 + 4 * n / 512,
                # each slice's top 2%: int32 positions and float32 values (n is whole in every N)
                "topk:stages=2,ratio=0.02,warmup=0,feedback=none": 8 * math.ceil(0.02 * n / size) * size}
    for name, message in expected.items():
        comp = gc.make(name)
        comp.reduce(x, comm).result()
        sent = comp.stats()["bytes_sent"]
        assert sent == pytest.approx(2 * (size - 1) / size * message), (name, sent)
    comp = gc.make("quantize-channel")
    comp.reduce(x, comm).result()
    assert comp.stats()["bytes_sent"] == pytest.approx((size - 1) * (n + 8 * n / 512))


def test_quantizer_chunk_size():
    """A smaller chunk follows a heavy-tailed gradient more closely; the default stays out of the
    configuration, so checkpoints saved before ``chunk`` existed still load."""
    from mpi4py import MPI

    comm = gc.MPICommunicator(MPI.COMM_SELF)
    g = np.random.default_rng(0).standard_t(3, 64 * 1024).astype(np.float32)
    errors = {}
    for chunk in (64, 512, 4096):
        comp = gc.QuantizedAllreduce(bits=4, chunk=chunk)
        out = comp.reduce(gc.Bucket(g.copy(), 0), comm).result()
        errors[chunk] = float(np.abs(out - g).mean())
        assert comp.message_size(g.size) == g.size // 2 + 8 * g.size // chunk
    assert errors[64] < 0.6 * errors[512] < 0.6 * errors[4096], errors
    assert gc.QuantizedAllreduce(bits=4).describe() == "QuantizedAllreduce(bits=4)"
    assert repr(gc.make("int4:chunk=128")) == "int4(warmup=0, feedback='both', chunk=128)"
    assert repr(gc.make("int4")) == "int4(warmup=0, feedback='both')"  # 512 values a chunk
    with pytest.raises(ValueError, match="chunk"):
        gc.QuantizedAllreduce(bits=4, chunk=100)
    comm.close()


def test_int4_grid_holds_zero():
    """The registered int4 puts zero on every chunk's grid: a zero gradient coordinate is sent as
    exactly 0, and a small one goes out as zeros until its residual reaches a step (the old
    min-max grid, ``exact_zero=False``, sends both a rounding error every step); error feedback
    delivers the small one's sum on both grids."""
    from mpi4py import MPI

    comm = gc.MPICommunicator(MPI.COMM_SELF)
    g = np.random.default_rng(0).standard_normal(512 * 4).astype(np.float32) * np.float32(1e-2)
    g[::512] = 1.0  # each chunk's range: a step of about 0.07
    g[5], g[7] = 0.0, 1e-3
    steps = 200
    sent = {}
    for spec in ("int4", "int4:exact_zero=False"):
        comp = gc.make(spec)
        sent[spec] = np.stack([comp.reduce(gc.Bucket(g.copy(), 0, scratch=True), comm).result().copy()
                               for _ in range(steps)])
        assert abs(float(sent[spec][:, 7].sum()) - steps * 1e-3) < 0.08, spec  # within a step
    zero, old = sent["int4"], sent["int4:exact_zero=False"]
    assert not zero[:, 5].any() and np.count_nonzero(zero[:, 7]) <= 0.05 * steps
    assert np.count_nonzero(old[:, 5]) > 0.5 * steps and np.count_nonzero(old[:, 7]) > 0.5 * steps
    assert repr(gc.make("int4")) == "int4(warmup=0, feedback='both')"
    assert repr(gc.make("int4:exact_zero=False")) == "int4(warmup=0, feedback='both', exact_zero=False)"
    assert gc.QuantizedAllreduce(bits=4, exact_zero=True).config() == {"bits": 4, "exact_zero": True}
    old_state = gc.make("int4:exact_zero=False").state_dict()
    with pytest.raises(ValueError, match="saved by"):  # a state of the old grid is not taken for the new
        gc.make("int4").load_state_dict(old_state)
    gc.make("int4:exact_zero=False").load_state_dict(old_state)  # the README's way to resume it
    with pytest.raises(ValueError, match="exact_zero"):
        gc.QuantizedAllreduce(bits=4, exact_zero=1)
    comm.close()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_two_stage_traffic_is_flat_in_ranks(n):
    run_ranks(n, "tests.compressors.test_codecs:rank_traffic")


def rank_sparsifiers():
    """top-k without feedback sends each rank's k largest magnitudes; random-k sends the same k
    coordinates on every rank (no indices travel), different ones each step."""
    comm = gc.MPICommunicator()
    n = 10_000
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal(n).astype(np.float32)
    out = gc.make("topk:warmup=0,feedback=none").reduce(x, comm).result()
    everyone = np.stack(comm.comm.allgather(x))
    k = math.ceil(0.01 * n)
    expect = np.zeros(n)
    for row in everyone:
        top = np.argsort(np.abs(row))[-k:]
        expect[top] += row[top]
    assert np.allclose(out, expect / comm.size, atol=1e-6)
    comp = gc.make("randomk:warmup=0,feedback=none")
    first = comp.reduce(gc.Bucket(x.copy(), 0), comm).result()
    second = comp.reduce(gc.Bucket(x.copy(), 0), comm).result()
    chosen = np.flatnonzero(first)
    assert chosen.size == k and np.flatnonzero(second).size == k
    assert not np.array_equal(chosen, np.flatnonzero(second)), "the same coordinates two steps running"
    assert np.allclose(first[chosen], everyone[:, chosen].mean(axis=0), atol=1e-6)


def test_sparsifiers_send_what_they_promise():
    run_ranks(3, "tests.compressors.test_codecs:rank_sparsifiers")


TWO_STAGE = ["int8:warmup=0", "int4", "onebit:warmup=0,feedback=both", "int8:feedback=none,warmup=0", "int4:feedback=none",
             "onebit:warmup=0,feedback=none"]


def _compiled_and_numpy_bits(name, comm):
    """Run ``name`` for 6 steps (NaN, infinities and signed zeros in step 3) with the compiled
    kernels and with them hidden; assert every output and every state entry has the same bits."""
    from unittest import mock

    from gradcomp.kernels import affine, signcodes

    rng = np.random.default_rng(1 + comm.rank)
    steps = []
    for k in range(6):
        x = rng.standard_t(3, 512 * 7 + 130).astype(np.float32)
        if k == 3:
            x[600:700] = np.nan
            x[1600] = np.inf
            x[2048:2560:3] = -0.0
            x[2049:2560:3] = 0.0
        steps.append(x)

    def run(compiled):
        comp = gc.make(name)
        with mock.patch.object(affine, "compiled", affine.compiled if compiled else lambda *a: None), \
                mock.patch.object(signcodes, "compiled", signcodes.compiled if compiled else lambda *a: None):
            outs = [comp.reduce(gc.Bucket(x.copy(), 0, scratch=True), comm).result().copy() for x in steps]
        return outs, comp.state_dict()

    fast, fast_state = run(True)
    slow, slow_state = run(False)
    for k, (a, b) in enumerate(zip(fast, slow)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name}: step {k} differs"
    for key in slow_state:
        assert np.array_equal(np.asarray(fast_state[key]), np.asarray(slow_state[key])), (name, key)


@pytest.mark.parametrize("name", TWO_STAGE)
def test_compiled_and_numpy_kernels_give_the_same_bits(name):
    """The fused error-feedback kernels against the NumPy sequence, step after step: every rank
    must compute the same bits whichever kernels it has."""
    from gradcomp import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    _compiled_and_numpy_bits(name, gc.MPICommunicator(pipeline_depth=0))


def rank_compiled_and_numpy_bits():
    from gradcomp import kernels

    assert kernels.available(), "the test checks for the kernels before launching"
    comm = gc.MPICommunicator()
    for name in TWO_STAGE:
        _compiled_and_numpy_bits(name, comm)


def rank_pieces_give_the_bits_of_whole_slices():
    """Buckets large enough to be cut into pieces (the owner stage of one overlapping the next
    one's transfer) give the bits of one piece per slice, outputs and state, NaN included."""
    from unittest import mock

    from gradcomp.compressors import pieces as pieces_module

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(3 + comm.rank)
    n = comm.size * 4 * pieces_module.PIECE_CHUNKS * 512 + 3000  # 4 pieces per slice, a tail
    steps = [rng.standard_t(3, n).astype(np.float32) for _ in range(3)]
    steps[1][5000:5100] = np.nan
    for name in TWO_STAGE:
        def run(pieces):
            comp = gc.make(name)
            with mock.patch.object(pieces_module, "MAX_PIECES", pieces):
                outs = [comp.reduce(gc.Bucket(x.copy(), 0, scratch=True), comm).result().copy() for x in steps]
            return outs, comp.state_dict(), comp.stats()

        whole, whole_state, whole_stats = run(1)
        cut, cut_state, cut_stats = run(4)
        for k, (a, b) in enumerate(zip(cut, whole)):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"{name}: step {k} differs"
        for key in whole_state:
            a, b = np.asarray(cut_state[key]), np.asarray(whole_state[key])
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), (name, key)
        assert cut_stats["bytes_sent"] == whole_stats["bytes_sent"], name
        assert cut_stats["rounds"] == 4 * whole_stats["rounds"], name  # one alltoall + allgather a piece


def test_pieces_give_the_bits_of_whole_slices():
    run_ranks(3, "tests.compressors.test_codecs:rank_pieces_give_the_bits_of_whole_slices")


def test_compiled_and_numpy_kernels_give_the_same_bits_on_three_ranks():
    """The same at 3 ranks, where the slice owner averages three messages (its one-pass stage
    against the steps) and the slices have tails."""
    from gradcomp import kernels

    if not kernels.available():
        pytest.skip("numba kernels unavailable")
    run_ranks(3, "tests.compressors.test_codecs:rank_compiled_and_numpy_bits")


@pytest.mark.parametrize("case", ["heavy-tailed", "mostly-zero", "constant", "nan", "small"])
def test_topk_selection_on_large_buckets(case):
    """top-k's sampled threshold (buckets of 2**18 values and more) picks a true top k, the same
    positions as a full argpartition where magnitudes are distinct, NaN counted as largest, and
    falls back to the full sort where the estimate fails (ties, NaN)."""
    from gradcomp.comm import Workspace
    from gradcomp.compressors.sparsifiers import TopK, kept

    rng = np.random.default_rng(7)
    n = 700_001 if case != "small" else 5_000
    x = {"heavy-tailed": rng.standard_t(2, n), "small": rng.standard_t(2, n),
         "mostly-zero": np.where(rng.random(n) < 0.002, rng.standard_normal(n), 0.0),
         "constant": np.full(n, -3.0),
         "nan": np.where(rng.random(n) < 0.2, np.nan, rng.standard_normal(n))}[case].astype(np.float32)
    k = kept(n, 0.01)
    top = TopK()._top(x, k, Workspace())
    key = np.where(np.isnan(x), np.inf, np.abs(x))
    chosen = np.zeros(n, bool)
    chosen[top] = True
    assert top.shape == (k,) and np.all(np.diff(top) > 0)
    assert key[chosen].min() >= key[~chosen].max()
    if case in ("heavy-tailed", "small"):
        assert np.array_equal(top, np.sort(np.argpartition(np.abs(x), n - k)[n - k:]))


@pytest.mark.parametrize("name", ["topk", "randomk"])
def test_sparse_feedback_in_one_pass_equals_the_steps(monkeypatch, name):
    codec = {"topk": gc.TopK, "randomk": gc.RandomK}[name]
    """The sparsifiers' ``encode_with_feedback`` (residual updated without decoding) gives the
    bits of the runner's steps (add, encode, decode, subtract, settle), over several steps of error
    feedback, a NaN and an Inf among them."""
    comm = gc.MPICommunicator(pipeline_depth=0)
    rng = np.random.default_rng(3)
    steps = [rng.standard_t(3, 300_000).astype(np.float32) for _ in range(4)]
    steps[2][[5, 70_000]] = [np.nan, np.inf]

    def run(fused):
        comp = gc.ErrorFeedback(codec())
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(type(comp.inner), "encode_with_feedback", lambda *a: False)
            outs = [comp.reduce(gc.Bucket(x.copy(), 0, scratch=True), comm).result().copy() for x in steps]
        return outs, comp.state_dict()

    (fast, fast_state), (slow, slow_state) = run(True), run(False)
    for k, (a, b) in enumerate(zip(fast, slow)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"step {k} differs"
    for key in slow_state:
        assert np.array_equal(np.asarray(fast_state[key]), np.asarray(slow_state[key])), key
    comm.close()
