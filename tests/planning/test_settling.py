"""warmup="auto": the warm-up ends when the gradients' scale settles, on the same step on every
rank, said in stats(), and carried through a checkpoint."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from gradcomp.settling import Settling, drift
from tests.mpi_launch import run_ranks


def _levels(step: int) -> list[float]:
    """Two tensors whose scale falls tenfold over 60 steps, then holds (a little noise)."""
    fall = 10.0 ** (-min(step, 60) / 60)
    wobble = 1 + 0.01 * np.sin(step)
    return [fall * wobble, 4 * fall * wobble]


def test_ends_at_the_first_settled_window():
    s = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    ended = [step for step in range(200) if s.observe(_levels(step), [100, 10])]
    # windows ending at 10..60 fall by 10^(1/6) (drift log(10)/6 = 0.38); 70 still holds steps of
    # the fall; the window ending at 80 is the first flat one against a flat one
    assert ended == [79] and s.ended_at == 80
    assert "settled" in s.reason and s.stats()["warmup_ended_at"] == 80
    assert not s.observe(_levels(200), [100, 10])  # decided once


def test_patience_counts_calm_windows_in_a_row():
    """Levels that jump by 2x between windows, but for one pair of windows that happen to match:
    patience 1 (the default) ends there; patience 2 waits for a second calm window in a row."""
    def noisy(step: int) -> list[float]:
        window = step // 10  # 1, 2, 1, 2, 1, 2, 2, 1, 2, ...: windows 5 and 6 match
        return [2.0 if (window % 2 == 1) != (window >= 6) else 1.0]

    hasty = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    assert [t for t in range(200) if hasty.observe(noisy(t), [1])] == [69]
    patient = Settling(window=10, tolerance=0.1, earliest=20, latest=500, patience=2)
    assert [t for t in range(200) if patient.observe(noisy(t), [1])] == []


def test_latest_ends_it_anyway_and_says_so():
    s = Settling(window=10, tolerance=0.01, earliest=10, latest=50)
    ended = [step for step in range(100) if s.observe([10.0 ** (-step / 20)], [1])]
    assert ended == [49] and s.ended_at == 50 and "latest=50" in s.reason


def test_levels_follow_each_tensor_whichever_arrive():
    """Levels keyed by tensor, a changing set of them from step to step (the governor moves tensors
    between rungs on their own): a tensor's window mean is over the steps it came, the drift over
    the tensors of both windows. The same levels in full every step decide as a positional list."""
    full = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    positional = [step for step in range(200) if full.observe(_levels(step), [100, 10])]
    keyed = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    ended = []
    for step in range(200):
        levels = dict(zip(("a", "b"), _levels(step)))
        come = {k: v for k, v in levels.items() if not (k == "b" and step % 7 == 3)}  # b skips a step now and then
        if step in range(40, 45):
            come["c"] = 1.0  # a tensor that comes for a few steps only
        if keyed.observe(come, {k: {"a": 100, "b": 10}.get(k, 5) for k in come}):
            ended.append(step)
    assert ended == positional == [79]
    halfway = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    for step in range(37):
        halfway.observe({"a": _levels(step)[0], **({"b": _levels(step)[1]} if step % 2 else {})},
                        {"a": 100, **({"b": 10} if step % 2 else {})})
    again = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    again.load_state_dict(halfway.state_dict())
    assert again.state_dict().keys() == halfway.state_dict().keys()
    assert all(np.array_equal(np.asarray(again.state_dict()[k]), np.asarray(v), equal_nan=v.dtype.kind == "f")
               if isinstance(v, np.ndarray) else again.state_dict()[k] == v for k, v in halfway.state_dict().items())


def test_a_checkpoint_from_before_the_keys_still_loads():
    """A warm-up saved before levels were keyed (one value per tensor, in the order given) is
    adopted by the next step's tensors in their order when as many come; else its window starts
    again, with a warning."""
    straight = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    first = [step for step in range(200) if straight.observe(_levels(step), [100, 10])]
    old = {"steps": 37, "ended_at": -1, "calm": 0, "reason": np.array(""),
           "sum": np.array([sum(_levels(s)[i] for s in range(30, 37)) for i in range(2)]),
           "before": np.array([sum(_levels(s)[i] for s in range(20, 30)) / 10 for i in range(2)]),
           "sizes": np.array([100.0, 10.0])}
    again = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    again.load_state_dict(old)
    assert [step for step in range(37, 200) if again.observe(_levels(step), [100, 10])] == first
    other = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    other.load_state_dict(old)
    with pytest.warns(RuntimeWarning, match="starts again"):
        other.observe([1.0, 2.0, 3.0], [1, 1, 1])


def test_drift_weighs_by_size_and_skips_tensors_without_gradient():
    assert drift(np.array([2.0, 1.0]), np.array([1.0, 1.0]), np.array([1.0, 3.0])) == pytest.approx(np.log(2) / 4)
    assert drift(np.array([0.0, 1.0]), np.array([5.0, 1.0]), np.array([1.0, 1.0])) == 0.0


def test_a_checkpoint_mid_window_decides_the_same_step():
    straight = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    first = [step for step in range(200) if straight.observe(_levels(step), [100, 10])]
    resumed = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    for step in range(37):
        resumed.observe(_levels(step), [100, 10])
    again = Settling(window=10, tolerance=0.1, earliest=20, latest=500)
    again.load_state_dict(resumed.state_dict())
    assert [step for step in range(37, 200) if again.observe(_levels(step), [100, 10])] == first
    bad = resumed.state_dict()
    bad["ended_at"] = 99
    with pytest.raises(ValueError, match="ended_at"):
        Settling().load_state_dict(bad)
    with pytest.raises(ValueError, match="unexpected"):
        Settling().load_state_dict({**resumed.state_dict(), "stray": 1})


def _gradient(rank: int, step: int, n: int) -> np.ndarray:
    """Each rank's gradient: a scale that falls over 40 steps and then holds, plus rank noise."""
    rng = np.random.default_rng([rank, step])
    return (10.0 ** (-min(step, 40) / 40) * (1 + 0.1 * rng.standard_normal(n))).astype(np.float32)


def _reduce_steps(comm, spec: str, shape: tuple[int, ...], steps: int, resume_at: int | None = None):
    """``spec``'s outputs over ``steps`` steps of one bucket of ``shape``; at ``resume_at`` its
    state goes through state_dict() into a fresh instance."""
    import math

    import gradcomp as gc

    method = gc.make(spec)
    outs = []
    for step in range(steps):
        if step == resume_at:
            saved = method.state_dict()
            method = gc.make(spec)
            method.load_state_dict(saved)
        bucket = gc.Bucket(_gradient(comm.rank, step, math.prod(shape)), 0, [shape])
        outs.append(method.reduce(bucket, comm).result().copy())
    return method, outs


def rank_recipes_and_onebit_adam_settle_together():
    """A recipe, OneBitAdam and DGC with warmup='auto' end their warm-up on the same step on every rank
    (agreed before every bucket), say so in stats(), compress afterwards, and a run resumed from a
    checkpoint taken in the warm-up (in its 4-bit part, ``warmup_bits=4``) ends it on the same step,
    with the same bits."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    n = 3000

    def run(steps: int, resume_at: int | None = None):
        return _reduce_steps(comm, "onebit:warmup='auto',warmup_bits=4,budget=None", (n,), steps, resume_at)

    recipe, outs = run(120)
    stats = recipe.stats()
    ended = stats["warmup_ended_at"]
    assert ended is not None and 40 <= ended < 100, stats
    assert "settled" in stats["warmup_reason"], stats
    assert recipe.stage_at(ended - 1) == 0 and recipe.stage_at(ended) == 1
    ends = comm.allgather(np.array([ended], np.int64))[:, 0]
    assert (ends == ended).all(), f"ranks ended the warm-up at {ends}"
    digests = comm.allgather(np.array([zlib.crc32(outs[-1].tobytes())], np.int64))[:, 0]
    assert (digests == digests[0]).all(), "the result differs across ranks"
    # warmup_bits=4: 8-bit codes for the warm-up's first 30 steps (more than 16 values in a chunk), then 4-bit
    assert len(np.unique(outs[25][:512])) > 16 >= len(np.unique(outs[35][:512]))
    # onebit's sign code after the warm-up: every value of a slice is +-scale
    assert len(np.unique(np.abs(outs[-1][:512]))) <= 2 < len(np.unique(np.abs(outs[ended - 1][:512])))
    again, outs2 = run(120, resume_at=ended - 7)
    assert again.stats()["warmup_ended_at"] == ended
    assert all(np.array_equal(a, b) for a, b in zip(outs, outs2)), "a resumed warm-up changed the result"

    # OneBitAdam: the variance freezes on the step the averaged gradients settled
    params = [np.ones(n, np.float32)]
    opt = gc.optim.OneBitAdam(params, lr=1e-3, betas=(0.9, 0.95), comm=comm)
    assert opt.config()["warmup"] == "auto"
    for step in range(120):
        if step == 50:
            saved = opt.state_dict()
            copy = [p.copy() for p in params]
        opt.step([_gradient(comm.rank, step, n)])
    s = opt.stats()
    assert s["warmup_ended_at"] is not None and "settled" in s["warmup_reason"], s
    assert s["phase"] == "frozen variance", s
    resumed = gc.optim.OneBitAdam(copy, lr=1e-3, betas=(0.9, 0.95), comm=comm)
    resumed.load_state_dict(saved)
    for step in range(50, 120):
        resumed.step([_gradient(comm.rank, step, n)])
    assert resumed.stats()["warmup_ended_at"] == s["warmup_ended_at"]
    assert np.array_equal(copy[0], params[0]), "a resumed OneBitAdam froze elsewhere"

    # DGC: 8-bit codes until the averaged update settles, then the top 1% (ungoverned here: the
    # settling is what this checks)
    params = [np.ones(n, np.float32)]
    dgc = gc.optim.DGC(params, lr=1e-3, warmup="auto", comm=comm, budget=None)
    phases = []
    for step in range(140):
        if step == 45:
            saved, copy = dgc.state_dict(), [p.copy() for p in params]
        dgc.step([_gradient(comm.rank, step, n)])
        phases.append(dgc.phase())
    d = dgc.stats()
    end = d["warmup_ended_at"]
    assert end is not None and 40 <= end < 100 and "settled" in d["warmup_reason"], d
    assert set(phases[:end - 1]) == {"8-bit warm-up"}, phases[:end]
    assert set(phases[end - 1:]) == {"kept 0.01"}, phases[end - 2:]
    ends = comm.allgather(np.array([end], np.int64))[:, 0]
    assert (ends == end).all(), f"ranks ended DGC's first level at {ends}"
    resumed = gc.optim.DGC(copy, lr=1e-3, warmup="auto", comm=comm, budget=None)
    resumed.load_state_dict(saved)
    for step in range(45, 140):
        resumed.step([_gradient(comm.rank, step, n)])
    assert resumed.stats()["warmup_ended_at"] == end
    assert np.array_equal(copy[0], params[0]), "a resumed DGC ramped elsewhere"
    print(f"rank {comm.rank}: settled at {ended}, {s['warmup_ended_at']} and {end}", flush=True)


def test_recipes_and_onebit_adam_settle_together():
    run_ranks(2, "tests.planning.test_settling:rank_recipes_and_onebit_adam_settle_together")


def rank_powersgd_settles_then_compresses():
    """powersgd:start_iter='auto': 8-bit codes until the scale settles (the same step on every
    rank), then PowerSGD's rank-4 factors (after its own 2 exact steps); a resume from inside the
    warm-up gives the same bits."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    shape = (60, 50)

    def run(steps: int, resume_at: int | None = None):
        return _reduce_steps(comm, "powersgd:start_iter='auto',budget=None", shape, steps, resume_at)

    method, outs = run(110)
    stats = method.stats()
    ended = stats["warmup_ended_at"]
    assert ended is not None and 40 <= ended < 100 and "settled" in stats["warmup_reason"], stats
    ends = comm.allgather(np.array([ended], np.int64))[:, 0]
    assert (ends == ended).all(), f"ranks ended the warm-up at {ends}"
    assert np.linalg.matrix_rank(outs[ended - 1].reshape(shape)) > 4  # 8-bit codes of a full-rank mean
    assert np.linalg.matrix_rank(outs[-1].reshape(shape)) <= 4  # PowerSGD's rank-4 product
    digests = comm.allgather(np.array([zlib.crc32(outs[-1].tobytes())], np.int64))[:, 0]
    assert (digests == digests[0]).all(), "the result differs across ranks"
    again, outs2 = run(110, resume_at=ended - 5)
    assert again.stats()["warmup_ended_at"] == ended
    assert all(np.array_equal(a, b) for a, b in zip(outs, outs2)), "a resumed warm-up changed the result"
    print(f"rank {comm.rank}: settled at {ended}", flush=True)


def test_powersgd_settles_then_compresses():
    run_ranks(2, "tests.planning.test_settling:rank_powersgd_settles_then_compresses")
