"""``auto`` under real mpiexec: every rank measures the same link and compute and so makes the same
per-bucket choice from its cost model; the means are the chosen method's, bit-identical on every
rank; ``stats()`` says what it chose and every candidate's prediction; the choice is checkpointed
and restored; ``allowed`` restricts the candidates; a table file replaces the timing. On one host
the topology decides and nothing is measured, unless ``predict=True``."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

SHAPES = [(256, 200), (200,), (4000,), (128, 128)]


def rank_auto(table: str | None, predict: bool = False):
    import gradcomp as gc
    from gradcomp.comm.protocol import probe_traffic
    from gradcomp.planning.auto import Auto

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    spec = "auto:allowed=allreduce,int8" + (f",table={table}" if table else "") + (",predict=True" if predict else "")
    comp = gc.make(spec)
    assert isinstance(comp, Auto) and comp.allowed == ("allreduce", "int8")
    reducer = gc.GradientReducer(grads, comp, comm, bucket_cap_mb=0.05)
    outs = None
    for _ in range(3):
        outs = reducer.step([g.copy() for g in grads])
    stats = comp.stats()
    choices = stats["choices"]
    assert choices and all(c["chosen"] in ("allreduce", "int8") and c["why"] for c in choices)
    if not (table or predict):
        # one host (both ranks here): the topology decides, the first allowed method, and
        # nothing is probed or timed (the probe had cost 26.8 MB against 30.8 MB for a whole
        # 800-step run); stats() says so
        assert stats["probe_bytes_sent"] == 0 and probe_traffic(comm) == (0.0, 0) and comm.bytes_sent > 0, stats
        assert all(c["chosen"] == "allreduce" and c["predicted_s"] == {} for c in choices), choices
        assert all("one host" in c["why"] and "nothing was probed or timed" in c["why"] for c in choices), choices
        assert "link" not in stats and "compute_s_per_byte" not in stats, stats
        assert stats["compression_ratio"] == pytest.approx(1.0), stats
    else:
        # the link probe's bytes are its own, not the method's, and the communicator marks them so
        assert stats["probe_bytes_sent"] > 0 and probe_traffic(comm)[0] == stats["probe_bytes_sent"], stats
        assert all(set(c["predicted_s"]) == {"allreduce", "int8"} for c in choices), choices
    # every rank chose the same, and holds the same bits
    mine = json.dumps(sorted((c["bucket"], c["chosen"]) for c in choices))
    assert len(set(comm.comm.allgather(mine))) == 1, mine
    digest = np.concatenate([o.reshape(-1) for o in outs]).tobytes()
    assert len(set(comm.comm.allgather(digest))) == 1
    exact = [np.mean(comm.comm.allgather(g), axis=0) for g in grads]
    for o, e in zip(outs, exact):
        assert np.allclose(o, e, atol=0.05 * np.abs(e).max()), "auto's means are not the mean"
    if table:  # the table's numbers, not a timing
        assert stats["compute_s_per_byte"] == {"allreduce": 1e-6, "int8": 0.0}
        assert stats["local_stage_share"] == {"allreduce": 0.5, "int8": 0.0}
    elif predict:  # int8 encodes in its local stage: a share of its compute, timed; and on one
        # host there is still no link to spare: the first allowed method, exact
        assert 0 < stats["local_stage_share"]["int8"] < 1, stats["local_stage_share"]
        assert all(c["chosen"] == "allreduce" and "one host" in c["why"] for c in choices), choices
        assert stats["compression_ratio"] == pytest.approx(1.0), stats  # fp32's bytes, no probe
        # on one host the exchange is priced on the probed link, not the model's default one:
        # fp32's prediction holds at least the probe's latency and bandwidth terms
        link = stats["link"]
        for c in choices:
            wire = link["alpha_s"] * (2 * (comm.size - 1) + 1) + \
                2 * (comm.size - 1) / comm.size * 4 * c["numel"] / link["beta_bytes_per_s"]
            assert c["predicted_s"]["allreduce"] >= wire * (1 - 1e-9), (c, link)
    # the choice is state: saved, restored into a fresh auto, kept
    saved = reducer.state_dict()
    fresh = gc.make(spec)
    again = gc.GradientReducer(grads, fresh, comm, bucket_cap_mb=0.05)
    again.load_state_dict(saved)
    again.step([g.copy() for g in grads])
    chosen = {k: v for k, v in again.state_dict().items() if "choice/" in k}
    assert chosen and chosen == {k: v for k, v in saved.items() if "choice/" in k}, (chosen, saved.keys())
    print(f"rank {comm.rank}: ok {mine}", flush=True)


@pytest.mark.parametrize("with_table, predict", [(False, False), (True, False), (False, True)])
def test_auto_agrees_reduces_and_checkpoints(tmp_path, with_table, predict):
    table = None
    if with_table:
        table = str(tmp_path / "table.json")
        with open(table, "w") as f:
            json.dump({"allreduce": [1e-6, 0.5], "int8": 0.0}, f)  # fp32 made costly: int8 must win
    out = run_ranks(2, "tests.planning.test_auto:rank_auto", table, predict, timeout=180)
    assert out.count(": ok") == 2, out
    if with_table:
        assert '"int8"' in out and '"allreduce"' not in out, out


def test_owner_stage_scales_with_ranks():
    """A compute table timed on one rank (``prepare_share`` known) holds a two-stage code's owner
    re-encode of the whole bucket; on P ranks each rank re-encodes 1/P: ``share (1 - 1/P)`` of it
    is not spent. An allreduce-kind method, or a fitted model (no shares), keeps its compute."""
    from gradcomp.planning import cost

    model = cost.Model({"int4": 1e-9, "fp16": 1e-9}, prepare_share={"int4": 0.6, "fp16": 0.5})
    n = 1 << 20
    for ranks, factor in [(1, 1.0), (2, 0.7), (4, 0.55)]:
        cluster = cost.Cluster(ranks, 1, cost.Link(0.0, 1e9))
        two = cost.Traffic("two-stage", 1000.0)
        local, cpu, _ = model.stages("int4", two, n, cluster, False)
        assert cpu == pytest.approx(factor * 4e-9 * n) and local == pytest.approx(0.6 * 4e-9 * n)
        assert model.rank_cpu("fp16", cost.Traffic("allreduce", 1000.0), n, cluster, False) == \
            pytest.approx(4e-9 * n)
    fitted = cost.Model({"int4": 1e-9})
    assert fitted.rank_cpu("int4", cost.Traffic("two-stage", 1.0), n, cost.Cluster(4, 1, cost.Link(0, 1)), False) == \
        pytest.approx(4e-9 * n)


def test_pipeline_model():
    """``cost.pipelined``: a bucket's local stage overlaps the previous bucket's exchange, at most
    ``depth`` buckets ahead, and the step is never below all the compute."""
    from gradcomp.planning.cost import pipelined

    assert pipelined([]) == 0
    assert pipelined([(0.0, 0.0, 1.0)] * 5) == pytest.approx(5.0)        # nothing local: the sum
    # encode 0.25 of 2 s, 1 s of compute: the first encode, then the rest of each, back to back
    assert pipelined([(0.25, 1.0, 2.0)] * 5) == pytest.approx(0.25 + 5 * 1.75)
    # compute-bound: both threads share the cores, so the compute is the floor
    assert pipelined([(0.5, 2.0, 2.5)] * 4) == pytest.approx(8.5)
    assert pipelined([(1.0, 3.0, 3.1)] * 4) == pytest.approx(12.0)
    # a long local stage waits for the bucket depth + 1 before it to finish
    assert pipelined([(1.0, 1.0, 1.0), (0.0, 0.0, 5.0), (1.0, 1.0, 1.0)], depth=0) == pytest.approx(7.0)
    assert pipelined([(1.0, 1.0, 1.0), (0.0, 0.0, 5.0), (1.0, 1.0, 1.0)], depth=1) == pytest.approx(6.0)


def test_compute_timed_on_the_bucket_layout():
    """The compute table is timed on the first bucket's layout, out of the caches: its shapes
    repeated up to ``TIMED_MIN`` values or cut at ``TIMED_MAX`` (rows off a large matrix), so
    PowerSGD is timed on matrices it compresses, past its exact warm-up steps. On a flat vector
    (what the timing used before) it sends the vector as it is: nothing to compute on one rank."""
    import math

    from gradcomp.planning.measurements import TIMED_MAX, TIMED_MIN, time_candidates, timed_shapes

    small = timed_shapes([(64, 32), (32,)])
    assert small[:4] == [(64, 32), (32,), (64, 32), (32,)]
    assert TIMED_MIN <= sum(math.prod(s) for s in small) < TIMED_MIN + 64 * 32 + 32
    assert timed_shapes([(30522, 768)]) == [(TIMED_MAX // 768, 768)]
    assert timed_shapes([(3, 4), (TIMED_MAX, 2)]) == [(3, 4), ((TIMED_MAX - 12) // 2, 2)]
    assert timed_shapes([(0, 5)]) == [(TIMED_MIN,)]
    layout = timed_shapes([(1024, 1024), (1024,)], lo=1 << 21)
    on_matrices, _ = time_candidates(["powersgd"], layout, repeats=2)
    on_a_vector, _ = time_candidates(["powersgd"], [(sum(math.prod(s) for s in layout),)], repeats=2)
    # rank-4 power iterations and orthogonalization against a copy: about ten times apart here
    assert on_matrices["powersgd"] > 3 * on_a_vector["powersgd"], (on_matrices, on_a_vector)


def rank_auto_hosts():
    import gradcomp as gc
    from gradcomp.planning import cost
    from gradcomp.planning.measurements import Measurements

    comm = gc.MPICommunicator()
    assert comm.topology.hosts == 2 and comm.topology.local_size == 2, comm.topology
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in SHAPES]
    spec = "auto:allowed=allreduce,int8"
    comp = gc.make(spec)
    reducer = gc.GradientReducer(grads, comp, comm, bucket_cap_mb=0.05)
    outs = reducer.step([g.copy() for g in grads])  # measured: both schedules of both candidates
    choices = comp.stats()["choices"]
    labels = {"allreduce", "int8", "hier-allreduce", "hier-int8"}
    assert choices and all(set(c["predicted_s"]) == labels and c["chosen"] in labels for c in choices), choices
    assert all("2 hosts (flat and hierarchical)" in c["why"] for c in choices), choices
    # a host link 1000x slower than the path inside: fp32's hierarchical schedule halves what
    # crosses it, and int8's costly compute loses (the measurement injected, so the choice is sure)
    comp.replan()
    comp._measured = Measurements(hosts=2, ranks_per_host=2, link=cost.Link(1e-4, 1e6),
                                  compute_s_per_byte={"allreduce": 0.0, "int8": 1e-5}, local_stage_share={},
                                  ranks_per_core=1.0, link_inside_host=cost.Link(1e-6, 1e9),
                                  memory_pass_s_per_byte=1e-10)
    for _ in range(2):
        outs = reducer.step([g.copy() for g in grads])
    chosen = {c["chosen"] for c in comp.stats()["choices"]}
    assert chosen == {"hier-allreduce"}, comp.stats()["choices"]
    digest = np.concatenate([o.reshape(-1) for o in outs]).tobytes()
    assert len(set(comm.comm.allgather(digest))) == 1, "ranks differ"
    exact = [np.mean(comm.comm.allgather(g), axis=0) for g in grads]
    for o, e in zip(outs, exact):
        np.testing.assert_allclose(o, e, rtol=1e-5, atol=1e-6)
    # the hierarchical choice is checkpointed as such, and a fresh auto resumes with it
    saved = reducer.state_dict()
    fresh = gc.make(spec)
    again = gc.GradientReducer(grads, fresh, comm, bucket_cap_mb=0.05)
    again.load_state_dict(saved)
    resumed = again.step([g.copy() for g in grads])
    for o, r in zip(outs, resumed):
        assert np.array_equal(o, r)
    assert {k: v for k, v in again.state_dict().items() if "choice/" in k} == \
        {k: v for k, v in saved.items() if "choice/" in k} and any(v == 2 for k, v in saved.items() if "choice/" in k)
    print(f"rank {comm.rank}: ok", flush=True)


def test_auto_plans_both_schedules_on_several_hosts():
    """On 2 simulated hosts of 2 ranks, ``auto`` predicts every candidate flat and hierarchical
    (``hier-NAME``) and may choose either: the hierarchical schedule is what a multi-host job's
    default gives the methods it pays for (on 2 emulated hosts x 2 ranks at 100 Mbit/s, flat int4
    took twice hierarchical int4's step, and a flat-only ``auto`` with it). A hierarchical choice
    reduces exactly as ``Hierarchical`` does, on every rank alike, and is checkpointed."""
    out = run_ranks(4, "tests.planning.test_auto:rank_auto_hosts", env={"GRADCOMP_RANKS_PER_HOST": "2"}, timeout=240)
    assert out.count(": ok") == 4, out


def test_overlap_needs_a_core():
    """With more ranks than cores the local stage overlaps the previous bucket's exchange only for
    the share of a core its thread finds: ``stages_s``' local part is the encode over the ranks per
    core, and the pipelined step rises with it (4 ranks on 2 cores, 1 Gbit/s: int4 measured
    240-260 ms, predicted 230-256 this way, 191-211 with the whole encode overlapped)."""
    from types import SimpleNamespace

    import gradcomp as gc
    from gradcomp.planning import cost
    from gradcomp.planning.measurements import Measurements

    shapes = [(1024, 1024)]
    paced = {}
    for contention in (1.0, 2.0):
        comp = gc.make("auto:allowed=int4")
        comp._measured = Measurements(hosts=4, ranks_per_host=1, link=cost.Link(0.0, 1.25e8),
                                      compute_s_per_byte={"int4": 1e-9}, local_stage_share={"int4": 0.6},
                                      ranks_per_core=contention, link_inside_host=None,
                                      memory_pass_s_per_byte=1e-10)
        bucket = gc.Bucket(np.zeros(1 << 20, np.float32), 0, shapes)
        comp._choose(bucket, SimpleNamespace(size=4, rank=0))
        why = comp.stats()["choices"][0]
        local, cpu, total = why["stages_s"]["int4"]
        encode = 0.6 * 1e-9 * 4 * (1 << 20) * contention  # the share of the compute, slowed by sharing
        assert local == pytest.approx(encode / contention) and total > cpu, why
        paced[contention] = why["pipelined_s"]["int4"]
    assert paced[2.0] > paced[1.0]
