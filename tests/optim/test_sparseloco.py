"""SparseLoCo's exchange for local steps: the chunked top-k codec against a plain reference, and
``DiLoCo(compressor="sparseloco")`` under real mpiexec against the method's definition, its bytes,
its defaults, bit-identical replicas and a bit-exact resume."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from gradcomp.comm import Workspace
from gradcomp.compressors.chunked_topk import ChunkedTopK, pack, unpack
from tests.mpi_launch import run_ranks


def reference(x: np.ndarray, density: float, chunk: int, bits: int) -> np.ndarray:
    """What ``ChunkedTopK`` sends of ``x``, chunk by chunk: the ``k`` largest magnitudes (ties: the
    first positions), each to the nearest of ``(j + 1/2) s``, ``s`` = the largest over ``L - 1/2``."""
    k = min(chunk, max(1, round(density * chunk)))
    levels = 1 << (bits - 1)
    out = np.zeros_like(x)
    for lo in range(0, x.size, chunk):
        part = x[lo:lo + chunk]
        order = np.argsort(-np.abs(part), kind="stable")[:k]
        s = np.float32(np.abs(part[order]).max() / np.float32(levels - 0.5))
        for i in order:
            j = min(int(np.floor(np.abs(part[i]) / s)) if s > 0 else 0, levels - 1)
            out[lo + i] = np.float32(np.sign(part[i]) or 1.0) * (np.float32(j) + np.float32(0.5)) * s
    return out


def _roundtrip(codec: ChunkedTopK, x: np.ndarray) -> np.ndarray:
    message = np.zeros(codec.message_size(x.size), np.uint8)
    ws = Workspace()
    codec.encode(x, message, ws)
    out = np.full(x.size, 7.0, np.float32)
    codec.decode(message, out, ws)
    return out


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("n,chunk,density", [(4096, 4096, 1 / 64), (5000, 4096, 1 / 64), (1000, 64, 0.1),
                                             (3, 64, 0.1), (130, 16, 0.5)])
def test_chunked_topk_matches_its_definition(n, chunk, density, bits):
    rng = np.random.default_rng(n + bits)
    x = (rng.standard_normal(n) * rng.integers(1, 8, n)).astype(np.float32)
    x[::7] = np.round(x[::7])  # ties among the magnitudes
    codec = ChunkedTopK(density=density, chunk=chunk, bits=bits)
    np.testing.assert_array_equal(_roundtrip(codec, x), reference(x, density, chunk, bits))
    k = codec.k
    chunks = -(-n // chunk)
    assert codec.message_size(n) == 4 * chunks + -(-chunks * k * bits // 8) + \
        -(-chunks * k * max(1, int(np.ceil(np.log2(chunk)))) // 8)


def test_chunked_topk_bytes_zeros_and_nan():
    codec = ChunkedTopK()
    assert codec.k == 64 and codec.message_size(4096) == 4 + 16 + 96  # 141x under float32
    np.testing.assert_array_equal(_roundtrip(codec, np.zeros(9000, np.float32)), 0)
    x = np.random.default_rng(0).standard_normal(3 * 4096).astype(np.float32)
    x[5000] = np.nan
    out = _roundtrip(codec, x)
    chunk = out[4096:8192]
    assert np.isnan(out[5000]) and np.isnan(chunk[out[4096:8192] != 0]).all()
    assert np.isfinite(out[:4096]).all() and np.isfinite(out[8192:]).all()


def test_pack_unpack():
    rng = np.random.default_rng(1)
    for bits in (1, 2, 4, 12, 13):
        v = rng.integers(0, 1 << bits, 1001).astype(np.uint32)
        packed = np.zeros(-(-v.size * bits // 8), np.uint8)
        pack(v, bits, packed)
        np.testing.assert_array_equal(unpack(packed, bits, v.size), v)


def test_exchange_names_and_defaults():
    import gradcomp as gc
    from gradcomp.comm.mpi import MPICommunicator
    from mpi4py import MPI

    comm = MPICommunicator(MPI.COMM_SELF)
    try:
        params = [np.ones((64, 64), np.float32)]
        outer = gc.optim.DiLoCo(params, compressor="sparseloco", comm=comm)
        assert outer.momentum == 0.0 and outer.lr == [1.0]
        assert "decay=0.95" in outer.config()["compressor"] and "Governed" not in outer.config()["compressor"]
        mine = gc.optim.DiLoCo([np.ones(10, np.float32)], compressor="sparseloco:density=0.03,bits=4",
                               lr=0.8, momentum=0.3, comm=comm)
        assert mine.momentum == 0.3 and mine.lr == [0.8] and "bits=4" in mine.config()["compressor"]
        with pytest.raises(ValueError, match="does not take.*dense"):
            gc.optim.DiLoCo([np.ones(10, np.float32)], compressor="sparseloco:dense=1", comm=comm)
        assert gc.optim.DiLoCo([np.ones(10, np.float32)], comm=comm).momentum == 0.5  # int8's defaults
    finally:
        comm.close()


# ---------------------------------------------------------------------------------------------
# ranks
# ---------------------------------------------------------------------------------------------
N, H = 3 * 4096 + 100, 4


def rank_sparseloco_matches_its_definition():
    """One tensor, H local steps of a noisy quadratic per rank, then SparseLoCo's outer step:
    ``e = beta e + delta``, ``sent`` = the reference's chunked top-k of ``e``, ``e -= sent``,
    ``synced -= mean(sent)``: every rank's accumulator and the synced parameters follow it
    exactly; the replicas are the same bits after each outer step."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(0)
    params = [rng.standard_normal(N).astype(np.float32)]
    outer = gc.optim.DiLoCo(params, sync_every=H, compressor="sparseloco:density=0.02,chunk=4096", comm=comm)
    synced = params[0].copy()
    e = np.zeros(N, np.float32)
    for step in range(1, 5 * H + 1):
        noise = np.random.default_rng([comm.rank, step]).standard_normal(N).astype(np.float32)
        params[0] -= np.float32(0.1) * (params[0] - np.float32(comm.rank) + noise)
        local = params[0].copy()
        outer.step()
        if step % H:
            continue
        e = np.float32(0.95) * e + (synced - local)
        sent = reference(e, 0.02, 4096, 2)
        e = e - sent
        everyone = comm.allgather(sent)
        mean = everyone[0].copy()
        for r in range(1, comm.size):
            mean += everyone[r]
        mean /= np.float32(comm.size)
        synced = synced - mean
        np.testing.assert_array_equal(params[0], synced, err_msg=f"step {step}")
        np.testing.assert_array_equal(outer.compressor.residuals(["0"])["0"], e, err_msg=f"step {step}")
        digest = hashlib.sha256(params[0].tobytes()).digest()[:8]
        table = comm.allgather(np.frombuffer(digest, np.int64).copy())
        assert (table == table[0]).all(), f"step {step}: replicas differ"
    print(f"rank {comm.rank}: ok", flush=True)


def test_sparseloco_matches_its_definition():
    run_ranks(3, "tests.optim.test_sparseloco:rank_sparseloco_matches_its_definition")


def rank_sparseloco_bytes_and_resume():
    """At H = 20 on 4 ranks the exchange sends over 1000x fewer bytes than DDP's fp32 allreduce
    at every step; a state taken between outer steps resumes bit for bit."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    shapes = [(256, 512), (512,), (300, 100)]

    def start():
        rng = np.random.default_rng(0)
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    def run(params, outer, first, last, save_at=None):
        saved = None
        for step in range(first, last + 1):
            for i, p in enumerate(params):
                rng = np.random.default_rng([comm.rank, step, i])
                p -= np.float32(0.01) * (p + rng.standard_normal(p.shape).astype(np.float32))
            outer.step()
            if step == save_at:
                saved = ([p.copy() for p in params], {k: np.array(v, copy=True) for k, v in outer.state_dict().items()})
        return saved

    params = start()
    outer = gc.optim.DiLoCo(params, sync_every=20, compressor="sparseloco", comm=comm)
    copies, state = run(params, outer, 1, 100, save_at=50)
    ratio = outer.stats()["compression_ratio"]
    assert ratio > 1000, outer.stats()
    again_params = start()
    again = gc.optim.DiLoCo(again_params, sync_every=20, compressor="sparseloco", comm=comm)
    for p, q in zip(again_params, copies):
        p[...] = q
    again.load_state_dict(state)
    run(again_params, again, 51, 100)
    for p, q in zip(params, again_params):
        np.testing.assert_array_equal(p, q)
    other = gc.optim.DiLoCo(start(), sync_every=20, compressor="sparseloco:beta=0.9", comm=comm)
    with pytest.raises(ValueError, match="config"):
        other.load_state_dict(state)
    print(f"rank {comm.rank}: {ratio:.0f}x fewer bytes than DDP", flush=True)


def test_sparseloco_bytes_and_resume():
    run_ranks(4, "tests.optim.test_sparseloco:rank_sparseloco_bytes_and_resume")


# ---------------------------------------------------------------------------------------------
# compressor="auto": the exchange fitted to the link and the local steps
# ---------------------------------------------------------------------------------------------
def test_fit_picks_the_least_predicted_time_to_a_loss():
    """Priced on a link and an inner step: the candidate with the least ``STEPS * (compute +
    exchange not hidden)``, a denser one winning ties within 2%; the codes on fast links, 4-bit
    codes at 10 Mbit/s, a sparse exchange at 1 Mbit/s."""
    from gradcomp.optim.fit import CANDIDATES, STEPS, FittedExchange, fit
    from gradcomp.planning.cost import Cluster, Link

    buckets = [[(256, 96), (256,), (3 * 96, 96), (96, 384), (384, 96)]] * 4  # about 0.4M values
    chosen = {}
    for beta in (125e6, 1.25e6, 125e3):  # 1 Gbit/s, 10 and 1 Mbit/s
        for step_s in (0.01, 0.1, 2.0):
            for overlap in (0, 5):
                exchange = FittedExchange()
                k = fit(exchange, buckets, Cluster(4, 1, Link(1e-3, beta)), step_s, 20, overlap)
                why = exchange.why
                seconds = list(why["predicted_s"].values())
                for sparse in (False, True):  # densest first: the codes on DiLoCo's buckets, the
                    # sparse ones on a bucket per tensor
                    mine = [t for t, o in zip(seconds, exchange.outer) if (o is not None) == sparse]
                    assert mine == sorted(mine, reverse=True), why["predicted_s"]
                paced = [STEPS[c] * (20 * step_s + max(0.0, t - overlap * step_s)) for c, t in zip(CANDIDATES, seconds)]
                best = 0
                for j, t in enumerate(paced):
                    best = j if t < paced[best] * 0.98 else best
                assert k == best and why["chosen"] == CANDIDATES[k], why
                chosen[beta, step_s, overlap] = CANDIDATES[k]
    assert chosen[125e6, 0.1, 0] == "int8"  # a fast link: the densest
    assert chosen[1.25e6, 0.1, 0] == "int4"  # 10 Mbit/s, the LM's step
    assert chosen[125e3, 0.1, 0].startswith("sparseloco")  # 1 Mbit/s
    assert chosen[125e3, 2.0, 0] == "int4"  # a long step pays for the slow link's codes
    # the run that chose int4 at 1 Mbit/s on 2 hosts of 2 ranks when priced as 4 hosts (the probe
    # fitted 175 KB/s for an allreduce, which crosses a host's link once, not once a rank)
    shared = FittedExchange()
    fit(shared, buckets, Cluster(2, 2, Link(1.3e-3, 175e3)), 0.099, 20, 0)
    assert shared.why["chosen"] == "sparseloco", shared.why
    for (beta, step_s, overlap), spec in chosen.items():  # hiding part of the exchange never makes it sparser
        if overlap:
            assert CANDIDATES.index(spec) <= CANDIDATES.index(chosen[beta, step_s, 0]), (beta, step_s)


def test_fit_prices_a_sparse_option_on_a_bucket_per_tensor():
    """A sparse option runs on a bucket per tensor (``Fitting.apply``), a message each; it is
    priced on that layout, the codes on DiLoCo's own buckets (one here)."""
    from gradcomp.optim.fit import FittedExchange, fit, predict
    from gradcomp.planning.cost import Cluster, Link

    shapes = [(256, 96), (256,), (3 * 96, 96), (96, 384), (384, 96)] * 4
    own = [[s] for s in shapes]
    cluster = Cluster(2, 2, Link(1.3e-3, 175e3))  # what the probe fitted at 1 Mbit/s on 2 hosts
    exchange = FittedExchange()
    fit(exchange, [shapes], cluster, 0.1, 20, 0)
    for spec, c, outer in zip(exchange.allowed, exchange.options, exchange.outer):
        expected = predict(c, own if outer is not None else [shapes], cluster)
        assert exchange.why["predicted_s"][spec] == expected, spec
        if outer is not None:  # a message a tensor: the latencies count
            assert expected > predict(c, [shapes], cluster), spec


def rank_auto_exchange(pause: float):
    """``compressor="auto"`` on real ranks: the same choice everywhere at the first outer step,
    the chosen exchange's outer defaults, identical replicas, ``stats()["fit"]``, and a resume
    that keeps the choice. With ``pause`` seconds of inner step the exchange costs next to nothing
    and int8 is chosen; with none, and the codes counted at ten times a sparse exchange's steps, a
    sparse one wins (on a fast link the latencies of its message a tensor could outweigh its bytes)."""
    import time

    import gradcomp as gc
    from gradcomp.optim import fit as fitting

    if not pause:  # a sparse exchange wins where the codes need ten times its steps
        fitting.STEPS = {spec: 1.0 if spec.startswith("sparseloco") else 10.0 for spec in fitting.STEPS}

    comm = gc.MPICommunicator()
    shapes = [(128, 64), (64,)]

    def start():
        g = np.random.default_rng(0)
        return [g.standard_normal(s).astype(np.float32) for s in shapes]

    params = start()
    outer = gc.optim.DiLoCo(params, sync_every=10, compressor="auto", comm=comm)
    saved = None
    for step in range(1, 31):
        time.sleep(pause)
        for i, p in enumerate(params):
            p -= np.float32(0.01) * (p + np.random.default_rng([comm.rank, step, i]).standard_normal(p.shape).astype(np.float32))
        outer.step()
        if step == 15:
            saved = ([p.copy() for p in params], {k: np.array(v, copy=True) for k, v in outer.state_dict().items()})
    fit = outer.stats()["fit"]
    chosen = fit["chosen"]
    names = comm.allgather(np.frombuffer(chosen.ljust(40).encode(), np.uint8).copy())
    assert (names == names[0]).all(), "ranks chose differently"
    expect_sparse = chosen.startswith("sparseloco")
    assert (outer.momentum == 0.0) == expect_sparse and (outer.lr[0] == 1.0) == expect_sparse, (chosen, outer.momentum)
    assert (chosen == "int8") == (pause > 0), fit
    assert fit["probe_bytes_sent"] > 0 and "least predicted time" in fit["why"]
    digest = hashlib.sha256(b"".join(p.tobytes() for p in params)).digest()[:8]
    everyone = comm.allgather(np.frombuffer(digest, np.int64).copy())
    assert (everyone == everyone[0]).all(), "replicas differ after the last outer step"
    again_params = start()
    again = gc.optim.DiLoCo(again_params, sync_every=10, compressor="auto", comm=comm)
    for p, q in zip(again_params, saved[0]):
        p[...] = q
    again.load_state_dict(saved[1])
    assert again.stats()["fit"]["chosen"] == chosen and again.momentum == outer.momentum
    # a sparse choice chunks each tensor on its own: a bucket per tensor, as a named one
    assert [len(r.buckets) for r in (outer.reducer, again.reducer)] == [len(shapes) if expect_sparse else 1] * 2
    for step in range(16, 31):
        for i, p in enumerate(again_params):
            p -= np.float32(0.01) * (p + np.random.default_rng([comm.rank, step, i]).standard_normal(p.shape).astype(np.float32))
        again.step()
    for p, q in zip(params, again_params):
        np.testing.assert_array_equal(p, q)
    print(f"rank {comm.rank}: chose {chosen}: {fit['why']}", flush=True)


@pytest.mark.parametrize("pause", [0.0, 0.02])
def test_auto_exchange(pause):
    run_ranks(2, "tests.optim.test_sparseloco:rank_auto_exchange", pause)


def rank_jax_sparseloco():
    """``gradcomp.jax.DiLoCo(..., compressor="sparseloco")``: the method's outer defaults, the same
    bits on every rank after each outer step, and the NumPy core's bits for the same replicas."""
    import jax
    import jax.numpy as jnp

    import gradcomp as gc
    import gradcomp.jax

    comm = gc.MPICommunicator()
    params = {"w": jax.random.normal(jax.random.PRNGKey(0), (96, 64)), "b": jnp.zeros(64)}
    outer = gradcomp.jax.DiLoCo(params, sync_every=2, compressor="sparseloco", comm=comm)
    assert outer.outer.momentum == 0.0 and outer.outer.lr[0] == 1.0
    host = [np.array(np.asarray(x)).reshape(np.shape(x)) for x in jax.tree_util.tree_leaves(params)]
    twin = gc.optim.DiLoCo(host, sync_every=2, compressor="sparseloco", comm=comm)
    p = params
    for step in range(1, 7):
        p = jax.tree_util.tree_map(lambda x: x - 0.01 * (comm.rank + 1) * jnp.sign(x + step), p)
        for h, x in zip(host, jax.tree_util.tree_leaves(p)):
            h[...] = np.asarray(x)
        twin.step()
        p = outer.step(p)
        if step % 2 == 0:
            leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(p)]
            digest = hashlib.sha256(b"".join(x.tobytes() for x in leaves)).digest()[:8]
            table = comm.allgather(np.frombuffer(digest, np.int64).copy())
            assert (table == table[0]).all(), f"step {step}: replicas differ"
            for a, b in zip(leaves, host):
                np.testing.assert_array_equal(a, b)
    print(f"rank {comm.rank}: ok", flush=True)


def test_jax_sparseloco():
    pytest.importorskip("jax")
    run_ranks(2, "tests.optim.test_sparseloco:rank_jax_sparseloco", timeout=240)
