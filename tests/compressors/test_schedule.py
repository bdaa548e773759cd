"""Schedule: compressor by step, hand-over of error feedback between stages, nesting, checkpoint.

Multi-rank checks compare the Schedule's output bit for bit with the stage compressors run on
their own over the same buckets (on the same ranks), so a wrong stage, a step counted twice or a
lost residual shows up as a difference.
"""
from __future__ import annotations

import io
import math

import numpy as np
import pytest

import gradcomp as gc
from gradcomp.bucket import StepCount
from tests.mpi_launch import run_ranks

LAYOUT_0 = [(24, 16), (16,), (12, 3, 3)]
LAYOUT_1 = [(30, 20), (20,)]


def numel(layout):
    return sum(math.prod(s) for s in layout)


def make_steps(comm, steps, seed=0):
    rng = np.random.default_rng([seed, comm.rank])
    return [[(1, LAYOUT_1, False, rng.standard_normal(numel(LAYOUT_1)).astype(np.float32)),
             (0, LAYOUT_0, True, rng.standard_normal(numel(LAYOUT_0)).astype(np.float32))]
            for _ in range(steps)]


def reduce(comp, comm, index, layout, last, g):
    return comp.reduce(gc.Bucket(g, index, layout, last), comm).result()


def bits_equal(a, b) -> bool:
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def rank_stage_selection():
    """Steps 0-1 Allreduce, 2-3 FP16(Allreduce), 4- PowerSGD; two buckets per step, the step
    advancing on the is_last one only."""
    comm = gc.MPICommunicator()
    sched = gc.Schedule([(0, gc.Allreduce()), (2, gc.FP16(gc.Allreduce())),
                         (4, gc.PowerSGD(rank=1, start_iter=2))])
    refs = [gc.Allreduce(), gc.FP16(gc.Allreduce()), gc.PowerSGD(rank=1, start_iter=2)]
    for step, buckets in enumerate(make_steps(comm, 9)):
        stage = 0 if step < 2 else 1 if step < 4 else 2
        assert sched.stage_at(sched.step) == stage and sched.step == step
        for index, layout, last, g in buckets:
            got = reduce(sched, comm, index, layout, last, g)
            want = reduce(refs[stage], comm, index, layout, last, g)
            assert bits_equal(got, want), f"step {step} bucket {index}: not stage {stage}'s result"
    assert sched.stats()["stage"] == 2 and sched.stats()["steps"] == 9
    assert refs[2].stats()["compressed_steps"] == 3  # the stage counts its own steps: 4,5 warm-up


def rank_handover():
    """The residual of the stage being left is sent with the next gradient, through wrappers."""
    comm = gc.MPICommunicator()
    cases = [
        (lambda: gc.PowerSGD(rank=1, start_iter=2), gc.Allreduce),
        (lambda: gc.FP16(gc.PowerSGD(rank=1, start_iter=2)), lambda: gc.PowerSGD(rank=2, start_iter=2)),
        (lambda: gc.Schedule([(0, gc.Allreduce()), (1, gc.PowerSGD(rank=1, start_iter=2))]),
         lambda: gc.BF16(gc.Allreduce())),  # nested schedule hands over too
    ]
    switch = 5
    for first, second in cases:
        sched = gc.Schedule([(0, first()), (switch, second())])
        ref_first, ref_second = first(), second()
        for step, buckets in enumerate(make_steps(comm, 8, seed=3)):
            for index, layout, last, g in buckets:
                got = reduce(sched, comm, index, layout, last, g)
                if step < switch:
                    want = reduce(ref_first, comm, index, layout, last, g)
                else:
                    if step == switch:  # take the reference's residuals by hand
                        bucket = gc.Bucket(g, index, layout, last)
                        handed = ref_first.take_residual(bucket.keys)
                        assert handed and max(np.abs(v).max() for v in handed.values()) > 0
                        g = g.copy()
                        for key, off, shape in bucket.placements():
                            if key in handed:
                                g[off:off + math.prod(shape)] += handed[key].reshape(-1).astype(np.float32)
                    want = reduce(ref_second, comm, index, layout, last, g)
                assert bits_equal(got, want), f"{sched!r}: step {step} bucket {index}"
        # the first stage gave its residuals away
        assert not any("residual/" in k for k in sched.compressors[0].state_dict())


def rank_nesting():
    """A Schedule inside FP16 and the PyTorch-style warm-up built from a Schedule."""
    comm = gc.MPICommunicator()
    outer = gc.FP16(gc.Schedule([(0, gc.Allreduce()), (2, gc.PowerSGD(rank=2, start_iter=2))]))
    ref_a, ref_b = gc.FP16(gc.Allreduce()), gc.FP16(gc.PowerSGD(rank=2, start_iter=2))
    for step, buckets in enumerate(make_steps(comm, 7, seed=4)):
        for index, layout, last, g in buckets:
            got = reduce(outer, comm, index, layout, last, g)
            want = reduce(ref_a if step < 2 else ref_b, comm, index, layout, last, g)
            assert bits_equal(got, want), f"step {step} bucket {index}"
    assert outer.inner.step == 7 and ref_b.inner.stats()["compressed_steps"] == 3


@pytest.mark.parametrize("check", ["rank_stage_selection", "rank_handover", "rank_nesting"])
def test_schedule_on_two_ranks(check):
    run_ranks(2, f"tests.compressors.test_schedule:{check}")


def test_schedule_checkpoint_across_a_pending_hand_over():
    """Stop at step 5 of a schedule whose hand-overs happen at steps 3 and 9; the restarted run
    matches the uninterrupted one bit for bit (the check lives with the PowerSGD checkpoint test)."""
    run_ranks(2, "tests.powersgd.test_powersgd:rank_checkpoint", ["schedule"], 5, 12)


# ---------------------------------------------------------------------------------------------
# In-process
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("stages, error, words", [
    ([], ValueError, "at least one"),
    ([(1, gc.Allreduce())], ValueError, "start at step 0"),
    ([(0, gc.Allreduce()), (5, gc.Allreduce()), (5, gc.Allreduce())], ValueError, "strictly increase"),
    ([(0, gc.Allreduce()), (3, "fp16")], TypeError, "expected a gradcomp Compressor"),
    ([(0, gc.Allreduce()), (2.5, gc.Allreduce())], TypeError, "must be an integer"),
    ([gc.Allreduce()], TypeError, "pair"),
])
def test_bad_schedules_are_named(stages, error, words):
    with pytest.raises(error, match=words):
        gc.Schedule(stages)


def test_stage_at_and_repr():
    s = gc.Schedule([(0, gc.Allreduce()), (10, gc.FP16(gc.Allreduce())), (20, gc.Allgather())])
    assert [s.stage_at(k) for k in (0, 9, 10, 19, 20, 10**9)] == [0, 0, 1, 1, 2, 2]
    assert repr(s) == "Schedule([(0, Allreduce()), (10, FP16(inner=Allreduce())), (20, Allgather())])"
    assert isinstance(s, gc.Compressor)


def test_state_dict_is_plain_and_round_trips():
    s = gc.Schedule([(0, gc.Allreduce()), (3, gc.PowerSGD(rank=2, start_iter=2))])
    s._steps, s._last_stage = StepCount(7), {"0.0": 1, "4.1": 0}
    state = s.state_dict()
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:
        loaded = {k: f[k] for k in f.files}
    t = gc.Schedule([(0, gc.Allreduce()), (3, gc.PowerSGD(rank=2, start_iter=2))])
    t.load_state_dict(loaded)
    assert t.step == 7 and t._last_stage == {"0.0": 1, "4.1": 0}
    assert any(k.startswith("stage1/") for k in loaded)
    with pytest.raises(ValueError, match="Schedule state: unexpected keys"):
        t.load_state_dict(dict(loaded, **{"stage9/x": 1}))
    with pytest.raises(ValueError, match="Schedule state: missing 'step'"):
        t.load_state_dict({})


def test_later_stages_move_together_from_where_they_were_built():
    """``start_later_stages``: the end of a warm-up decided while training moves every later
    stage, gaps kept, counted from the construction (a resume moves them to the same place)."""
    s = gc.Schedule([(0, gc.Allreduce()), (300, gc.FP16(gc.Allreduce())), (340, gc.Allreduce())])
    s.start_later_stages(80)
    assert s.starts == [0, 80, 120]
    s.start_later_stages(80)
    assert s.starts == [0, 80, 120]
    assert s.stage_at(79) == 0 and s.stage_at(80) == 1 and s.stage_at(120) == 2
    with pytest.raises(ValueError, match="step 0"):
        s.start_later_stages(0)
