"""The governor (``gradcomp.planning.governor``) under real mpiexec: it backs off where compression
costs more than its budget and stays where it does not, every rank takes the same decisions at
the same step, its audits are counted in the bytes sent, its state resumes bit for bit, a rank
with another budget is refused on every rank, and the divergence guard acts through it."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

SHAPES = [(200, 100), (100,), (50, 40)]


def _grads(rank: int, step: int, noise: float) -> list[np.ndarray]:
    """A slowly turning signal shared by every rank plus this rank's own noise."""
    common = np.random.default_rng(0)
    own = np.random.default_rng([step, rank])
    return [(common.standard_normal(s) * np.cos(step / 30) + noise * own.standard_normal(s)).astype(np.float32)
            for s in SHAPES]


def _run(reducer, grads, rank: int, steps: range, noise: float, outputs: list) -> None:
    for step in steps:
        for g, new in zip(grads, _grads(rank, step, noise)):
            g[...] = new
        reducer.step(grads)
        outputs.append(hashlib.sha256(b"".join(g.tobytes() for g in grads)).hexdigest())


def rank_governor_decides_alike_and_resumes(spec: str, backs_off: bool):
    """``spec`` over 160 steps of noisy gradients: the decisions (backing off, or none) are the
    same on every rank at the same step, the means stay bit-identical, the audit's bytes are in
    ``bytes_sent`` and a small share of it, and a checkpoint taken inside an audit window
    resumes to the same bits and the same decisions."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    make = lambda: gc.make(spec)  # noqa: E731
    comp = make()
    grads = [np.zeros(s, np.float32) for s in SHAPES]
    reducer = gc.GradientReducer(grads, comp, comm)
    outputs: list[str] = []
    _run(reducer, reducer.gradients, comm.rank, range(45), 1.0, outputs)
    saved = reducer.state_dict()  # inside the second audit window (steps 40-49)
    _run(reducer, reducer.gradients, comm.rank, range(45, 160), 1.0, outputs)
    stats = comp.stats()
    gov = stats["governor"]
    decisions = [(d["step"], d["to"], d["cost"]) for d in gov["decisions"]]
    assert bool(decisions) == backs_off, gov
    if backs_off:
        assert decisions[0][0] == 49 and gov["tensor_steps"]["int4"] > 0, gov
        assert "noise" in gov["decisions"][0]["why"], gov
    else:
        assert gov["tensor_steps"]["int4"] == gov["tensor_steps"]["int8"] == 0, gov
    assert 0 < gov["audit_bytes"] < stats["bytes_sent"] and gov["audit_share"] < 0.05, gov
    every = comm.comm.allgather((outputs, decisions))  # test-side bookkeeping only
    assert all(e == every[0] for e in every), "ranks differ in their means or their decisions"

    again = make()
    resumed = gc.GradientReducer([np.zeros(s, np.float32) for s in SHAPES], again, comm)
    from_rank_0 = comm.comm.bcast(saved, root=0)  # rank 0's file loaded everywhere: refused elsewhere
    if comm.rank != 0:
        with pytest.raises(ValueError, match=f"saved by rank 0 of 3, and this is rank {comm.rank} of 3"):
            resumed.load_state_dict(from_rank_0)
    resumed.load_state_dict(saved)
    tail: list[str] = []
    _run(resumed, resumed.gradients, comm.rank, range(45, 160), 1.0, tail)
    assert tail == outputs[45:], "the resumed run differs"
    assert [(d["step"], d["to"], d["cost"]) for d in again.stats()["governor"]["decisions"]] == decisions
    print(f"rank {comm.rank}: ok {decisions} audit share {gov['audit_share']:.4f}", flush=True)
    comm.close()


@pytest.mark.parametrize("spec,backs_off", [("topk:warmup=0,budget=0.05", True), ("topk:warmup=0,budget=1e6", False),
                                            ("powersgd:start_iter=2,budget=0.05", True)])
def test_governor_decides_alike_and_resumes(spec, backs_off):
    run_ranks(3, "tests.planning.test_governor:rank_governor_decides_alike_and_resumes", spec, backs_off)


def rank_another_budget_is_refused():
    """A rank whose governor has another budget is a CollectiveError on every rank, naming it."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    comp = gc.make(f"topk:warmup=0,budget={1.0 if comm.rank else 2.0}")
    try:
        comp.reduce(gc.Bucket(np.ones(4000, np.float32), 0, [(40, 100)]), comm).result()
    except gc.CollectiveError as exc:
        assert "budget" in str(exc), exc
    else:
        raise AssertionError("another budget was not refused")
    print(f"rank {comm.rank}: ok", flush=True)
    comm.close()


def test_another_budget_is_refused():
    run_ranks(2, "tests.planning.test_governor:rank_another_budget_is_refused")


def rank_the_guard_acts():
    """A residual that runs away (top-k of a constant gradient, another constant on each rank:
    the same few coordinates are always sent) is announced, and the governor moves every bucket
    a rung down, saying why; with a budget the audits never exceed, only the guard moved it."""
    import warnings

    import gradcomp as gc

    comm = gc.MPICommunicator()
    comp = gc.make("topk:warmup=0,ratio=0.001,budget=1e12")
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(300):
            g = np.full(4000, 1.0 + comm.rank, np.float32)
            comp.reduce(gc.Bucket(g, 0, [(40, 100)], keys=["w"]), comm).result()
    gov = comp.stats()["governor"]
    assert comp.stats()["guard"]["warned"], comp.stats()["guard"]
    assert gov["decisions"][0]["why"] == "the divergence guard saw a residual run away", gov
    assert all("within budget" in d["why"] for d in gov["decisions"][1:]), gov  # back up after its hold
    assert gov["tensor_steps"]["int4"] > 0, gov
    print(f"rank {comm.rank}: ok {gov['decisions']}", flush=True)
    comm.close()


def test_the_guard_acts():
    run_ranks(2, "tests.planning.test_governor:rank_the_guard_acts")


def rank_the_guard_acts_through_an_optimizer():
    """The same runaway in an optimizer's exchange (DiLoCo's: the guard watches the agreement
    wrapper around the governor) moves the governor too: every rank steps down at the same outer
    step, and the replicas stay the same bits."""
    import warnings

    import gradcomp as gc
    from gradcomp.planning.governor import Governed

    comm = gc.MPICommunicator()
    params = [np.zeros((40, 100), np.float32)]
    exchange = Governed(gc.make("topk:warmup=0,ratio=0.001,budget=None"), budget=1e12)
    outer = gc.optim.DiLoCo(params, sync_every=1, compressor=exchange, lr=1.0, momentum=0.0, comm=comm)
    assert outer.outer_compressor is exchange
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(300):
            params[0] -= np.float32(1.0 + comm.rank)  # the same pseudo-gradient every outer step
            outer.step()
    gov = outer.stats()["governor"]
    assert gov["decisions"][0]["why"] == "the divergence guard saw a residual run away", gov
    assert gov["tensor_steps"]["int4"] > 0, gov
    table = comm.allgather(np.array([gov["decisions"][0]["step"], gov["tensor_steps"]["int4"]], np.int64))
    assert (table == table[0]).all(), table
    print(f"rank {comm.rank}: ok {gov['decisions'][:2]}", flush=True)


def test_the_guard_acts_through_an_optimizer():
    run_ranks(2, "tests.planning.test_governor:rank_the_guard_acts_through_an_optimizer")


def test_budget_and_window_are_checked():
    from gradcomp.planning.governor import Governed

    import gradcomp as gc

    with pytest.raises(ValueError, match="budget"):
        gc.make("topk:budget=0")
    with pytest.raises(ValueError, match="window"):
        Governed(gc.make("topk:budget=None"), window=60, every=50)


def rank_adaptive_starts_a_rung_down():
    """Under an adaptive optimizer (``adapt``, which gradcomp.torch calls at an Adam-like first
    step) the method moves a rung down two steps later, and a tensor first seen after starts
    there; a checkpoint keeps both."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    comp = gc.make("topk:warmup=0")
    rng = np.random.default_rng(0)
    for step in range(3):
        comp.reduce(gc.Bucket(rng.standard_normal(4000).astype(np.float32), 0, [(40, 100)], keys=["w"]), comm).result()
    comp.adapt()
    for step in range(6):
        comp.reduce(gc.Bucket(rng.standard_normal(4000).astype(np.float32), 0, [(40, 100)], keys=["w"]), comm).result()
    comp.reduce(gc.Bucket(rng.standard_normal(300).astype(np.float32), 0, [(300,)], keys=["late"]), comm).result()
    gov = comp.stats()["governor"]
    assert gov["levels"] == {"w": "int4", "late": "int4"} and gov["tensor_steps"]["int4"] == 4 + 1, gov
    assert "adaptive" in gov["decisions"][0]["why"] and gov["limit"] == 0.25 * gov["budget"], gov
    again = gc.make("topk:warmup=0")
    again.load_state_dict(comp.state_dict())
    assert again.adaptive and again.stats()["governor"]["levels"] == gov["levels"]
    print("ok", flush=True)
    comm.close()


def test_adaptive_starts_a_rung_down():
    run_ranks(1, "tests.planning.test_governor:rank_adaptive_starts_a_rung_down")


def rank_a_warmup_end_opens_a_window():
    """When what reduces a bucket changes (here the end of a 20-step warm-up) an audit window
    opens at the next step, not at the end of the period: a method over budget is caught ten
    steps after it starts."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    comp = gc.make("topk:warmup=20,budget=0.05")
    grads = [np.zeros(s, np.float32) for s in SHAPES]
    reducer = gc.GradientReducer(grads, comp, comm)
    _run(reducer, reducer.gradients, comm.rank, range(40), 1.0, [])
    first = comp.stats()["governor"]["decisions"][0]
    assert first["step"] == 30 and first["to"] == "int4", first
    print(f"rank {comm.rank}: ok {first}", flush=True)
    comm.close()


def test_a_warmup_end_opens_a_window():
    run_ranks(2, "tests.planning.test_governor:rank_a_warmup_end_opens_a_window")


def test_the_worst_tensor_sets_the_cost():
    """Each audited tensor's cost is judged on its own: a small tensor that compression gets
    wrong is not averaged away by a large one it gets right."""
    from gradcomp.planning.audit import tensor_costs, window_cost

    starts = np.array([0, 100, 108])
    d = np.concatenate([np.full(100, 0.01), np.full(8, 1.0)])
    e = np.array([1.0, 1.0])
    assert window_cost(tensor_costs(d, e, starts)) == (pytest.approx(8.0), 1)  # the small tensor: 8 x 1.0^2 / 1.0
    assert window_cost(tensor_costs(np.zeros(108), e, starts))[0] == 0.0


def _moved_about(spec: str, steps: int, saved_at: int | None = None, state=None):
    """``spec`` governed over 7 arrays in 4 buckets at 1 rank, its tensors moved between rungs on
    their own (one every 13 steps, the last bucket's among them): the method behind the rungs
    sees another set of tensors from step to step, and often not a step's last bucket. Returns
    (the governor, every step's means, its state at ``saved_at``); ``state``: loaded first."""
    import gradcomp as gc
    from gradcomp.planning.governor import Governed

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(0)
    shapes = [(64, 32), (32,), (48, 16), (16,), (40, 40), (40,), (30, 20)]
    gov = Governed(gc.make(spec), every=1000, window=10, hold=7)
    grads = [np.zeros(s, np.float32) for s in shapes]
    reducer = gc.GradientReducer(grads, gov, comm, bucket_cap_mb=0.006)
    assert len(reducer.buckets) == 4
    means, saved, start = [], None, 0
    if state is not None:
        reducer.load_state_dict(state)
        start = gov.step
    for step in range(steps):
        draws = [rng.standard_normal(s).astype(np.float32) / (1 + step) ** 0.5 * (i + 1) for i, s in enumerate(shapes)]
        if step < start:
            continue
        for g, d in zip(reducer.gradients, draws):
            g[...] = d
        if step % 13 == 5:
            gov._tensor(str((step // 13) % len(shapes))).move(1, gov.step, 7)
        if step == saved_at:
            saved = reducer.state_dict()
        reducer.step()
        means.append(np.concatenate([g.ravel() for g in reducer.gradients]))
    return gov, means, saved


@pytest.mark.parametrize("spec", ["onebit:budget=None", "topk:budget=None", "powersgd:budget=None"])
def test_a_method_behind_the_rungs_sees_changing_tensors(spec):
    """Issue 65: behind the governor's rungs a recipe's warm-up got another number of tensors from
    step to step ("Settling: got 7 levels, 11 before"), and its steps advanced only when it
    reduced a step's last bucket. Now its warm-up follows each tensor, it counts every step it
    took part in, and a resume from a step whose last bucket went elsewhere continues bit for bit."""
    gov, means, saved = _moved_about(spec, 160, saved_at=88)
    recipe = gov.method
    assert recipe.step == 160, recipe.step  # every step reached it: some bucket stayed on the method
    assert recipe.settling.ended_at is not None and recipe.stage_at(recipe.step) == len(recipe.starts) - 1
    assert sum(t.steps[1] for t in gov._tensors.values()) > 0  # tensors did move
    assert any(k.startswith("level0/pending/") for k in saved), "the checkpoint fell inside an open step"
    _, resumed, _ = _moved_about(spec, 160, state=saved)
    assert all(np.array_equal(a, b) for a, b in zip(means[88:], resumed)), f"{spec}: the resume differs"
