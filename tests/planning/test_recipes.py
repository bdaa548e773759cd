"""Registered names as recipes (gradcomp.planning), the divergence guard, and loaded state that no
tensor claims, under real mpiexec."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import gradcomp as gc
from gradcomp.planning.recipes import sparsity_ramp
from tests.mpi_launch import run_ranks


def test_sparsity_ramp():
    assert sparsity_ramp(0.01, 0) == [(0, 0.01)]
    assert sparsity_ramp(0.01, 400) == [(0, 0.25), (133, 0.0625), (266, 0.015625), (400, 0.01)]
    stages = sparsity_ramp(0.001, 400)
    assert stages == [(0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.00390625), (400, 0.001)]
    assert sparsity_ramp(0.01, 300) == [(0, 0.25), (100, 0.0625), (200, 0.015625), (300, 0.01)]
    assert sparsity_ramp(0.5, 100) == [(0, 0.5)]  # nothing above the ratio: no ramp


def test_recipes_declare_what_they_use():
    from gradcomp.planning.governor import Governed

    governed = gc.make("topk:ratio=0.001,warmup=50,ramp=200")  # as shipped: the recipe, governed
    assert isinstance(governed, Governed) and isinstance(governed.method, gc.Recipe)
    topk = gc.make("topk:ratio=0.001,warmup=50,ramp=200,budget=None")
    assert isinstance(topk, gc.Recipe)
    assert topk.describe().startswith("topk(ratio=0.001, warmup=50, ramp=200")
    assert topk.starts == [0, 50, 100, 150, 200, 250]
    assert topk.warmup_steps == 250
    assert topk.error_feedback_on
    config = topk.config()
    assert config["recipe"] == "topk" and config["warmup"] == 50 and len(config["stages"]) == 6
    assert gc.make("onebit:warmup=0,budget=None").starts == [0]
    with pytest.raises(ValueError, match="feedback"):
        gc.make("onebit:feedback=always")
    with pytest.raises(ValueError, match="warmup"):
        gc.make("topk:warmup=-1")
    # the 8-bit codes: an exact warm-up by default, the codec alone one parameter away
    for name in ("int8", "quantize-tensor"):
        recipe = gc.make(name)
        assert isinstance(recipe, gc.Recipe) and recipe.starts == [0, 50], name
        assert recipe.describe().startswith(f"{name}(warmup=50, "), recipe.describe()
    assert type(gc.make("quantize-tensor:warmup=0")) is gc.QuantizePerTensor
    assert type(gc.make("quantize-channel")) is gc.QuantizePerChannel
    fed = gc.make("quantize-channel:warmup=5,feedback=worker,channel_size=128")
    assert fed.starts == [0, 5] and fed.error_feedback_on and fed.compressors[-1].inner.channel_size == 128
    with pytest.raises(ValueError, match="quantize-tensor feedback"):
        gc.make("quantize-tensor:feedback=both")  # an allgathered code has no owner stage


def rank_old_definitions_are_one_parameter_away():
    """``topk:warmup=0`` is the codec-only top-k of earlier releases (ErrorFeedback(TopK())),
    bit for bit; the default recipe averages exactly during its warm-up."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    pairs = [(gc.make("topk:warmup=0"), gc.ErrorFeedback(gc.TopK(0.01))),
             (gc.make("onebit:warmup=0,feedback=both"), gc.ErrorFeedback(gc.OneBit())),
             (gc.make("randomk:warmup=0"), gc.RandomK(0.01))]
    for new, old in pairs:
        for step in range(6):
            g = rng.standard_normal(5000).astype(np.float32)
            a = new.reduce(gc.Bucket(g, 0, [(50, 100)]), comm).result()
            b = old.reduce(gc.Bucket(g, 0, [(50, 100)]), comm).result()
            assert np.array_equal(a, b), f"{new.describe()} differs from {old.describe()}"
    warm, exact = gc.make("onebit:warmup=3"), gc.Allreduce()
    for step in range(5):
        g = rng.standard_normal(2000).astype(np.float32)
        a = warm.reduce(g, comm).result()
        b = exact.reduce(g, comm).result()
        assert np.array_equal(a, b) == (step < 3), f"step {step}: warm-up exact={step < 3} not kept"
    print(f"rank {comm.rank}: ok", flush=True)


def test_old_definitions_are_one_parameter_away():
    run_ranks(2, "tests.planning.test_recipes:rank_old_definitions_are_one_parameter_away")


# ---------------------------------------------------------------------------------------------
# the divergence guard
# ---------------------------------------------------------------------------------------------
def rank_guard_warns_once_everywhere(spec: str, runaway: bool):
    """A residual that grows without bound (top-k of a constant gradient: nothing but the same
    few coordinates is ever sent) is announced once on every rank; a healthy one never is; the
    averages are the same with and without the guard looking."""
    import warnings

    comm = gc.MPICommunicator()
    comp = gc.make(spec)
    rng = np.random.default_rng(comm.rank)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(300):
            g = np.ones(4000, np.float32) if runaway else rng.standard_normal(4000).astype(np.float32)
            comp.reduce(gc.Bucket(g, 0, [(40, 100)]), comm).result()
    ours = [w for w in seen if issubclass(w.category, gc.compressors.guard.RunawayResidual)]
    guard = comp.stats()["guard"]
    if runaway:
        assert len(ours) == 1, f"{len(ours)} warnings"
        text = str(ours[0].message)
        assert comp.describe() in text and "gradcomp.optim" in text and "warmup" in text, text
        assert guard["warned"] and guard["runaway"], guard
    else:
        assert not ours and not guard["warned"], guard
    assert guard["checks"] == 30, guard
    flags = comm.allgather(np.array([len(ours)]))
    assert (flags == flags[0]).all(), "ranks disagree on the warning"
    print(f"rank {comm.rank}: guard {guard}", flush=True)


@pytest.mark.parametrize("spec,runaway", [("topk:warmup=0,ratio=0.001,budget=None", True), ("int8:warmup=0", False),
                                          ("topk:warmup=0", False)])
def test_divergence_guard(spec, runaway):
    run_ranks(2, "tests.planning.test_recipes:rank_guard_warns_once_everywhere", spec, runaway)


# ---------------------------------------------------------------------------------------------
# loaded state that no tensor claims
# ---------------------------------------------------------------------------------------------
def rank_unclaimed_state_is_an_error(spec: str):
    """State whose tensors no bucket carries (saved from other arrays) is a CollectiveError on
    every rank at the first step, naming the tensor and how to attach it; the same state loaded
    where its tensors are is accepted and continues."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    arrays = [rng.standard_normal((30, 40)).astype(np.float32), rng.standard_normal(40).astype(np.float32)]
    first = gc.GradientReducer(arrays, gc.make(spec), comm)
    for _ in range(4):
        first.step([a.copy() for a in arrays])
    saved = first.state_dict()
    fine = gc.GradientReducer(arrays, gc.make(spec), comm)
    fine.load_state_dict(saved)
    fine.step([a.copy() for a in arrays])
    # the same tensors reduced under other keys: bucket-index keys ("0.0"), as comm_hook() gives
    comp = gc.make(spec)
    comp.load_state_dict(first.compressor.state_dict())  # the compressor's own form (no saving rank)
    try:
        comp.reduce(gc.Bucket(arrays[0].reshape(-1).copy(), 0, [(30, 40)]), comm).result()
    except gc.CollectiveError as exc:
        assert "no bucket of this step carries" in str(exc) and "'0.0'" in str(exc), exc
        assert "gradcomp.torch.register" in str(exc), exc
    else:
        raise AssertionError("unclaimed state was silently ignored")
    print(f"rank {comm.rank}: ok", flush=True)


@pytest.mark.parametrize("spec", ["topk:warmup=2", "powersgd:start_iter=2"])
def test_unclaimed_state_is_an_error(spec):
    run_ranks(2, "tests.planning.test_recipes:rank_unclaimed_state_is_an_error", spec)


def rank_a_damaged_owner_residual_is_refused():
    """A loaded slice owner's residual of the wrong length is a CollectiveError on every rank at
    the first step, naming the key; undamaged, the same state resumes bit for bit."""
    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(5000).astype(np.float32) for _ in range(6)]

    def bucket(step):
        return gc.Bucket(grads[step].copy(), 0, [(50, 100)])

    first = gc.make("int8:warmup=0")
    for step in range(3):
        first.reduce(bucket(step), comm).result()
    saved = first.state_dict()
    owners = [k for k in saved if k.startswith("stage0/owner/")]  # int8:warmup=0 is a one-stage recipe
    assert len(owners) == 1, sorted(saved)
    expected = [first.reduce(bucket(step), comm).result().copy() for step in (3, 4)]
    resumed = gc.make("int8:warmup=0")
    resumed.load_state_dict(saved)
    assert all(np.array_equal(resumed.reduce(bucket(step), comm).result(), e) for step, e in zip((3, 4), expected))
    damaged = gc.make("int8:warmup=0")
    damaged.load_state_dict({**saved, owners[0]: saved[owners[0]][:-1]})
    try:
        damaged.reduce(bucket(3), comm).result()
    except gc.CollectiveError as exc:
        assert owners[0][len("stage0/"):] in str(exc) and "holds 2559 values, but this rank owns 2560" in str(exc), exc
    else:
        raise AssertionError("a damaged owner residual was silently restarted")
    print(f"rank {comm.rank}: ok", flush=True)


def test_a_damaged_owner_residual_is_refused():
    run_ranks(2, "tests.planning.test_recipes:rank_a_damaged_owner_residual_is_refused")


def test_an_optimizer_drops_a_named_codes_warmup_unless_given():
    """``OneBitAdam(compressor=NAME)`` runs its own exact warm-up first, so the name's warm-up and
    ramp become 0 (the code from the freeze), unless the name sets them."""
    from gradcomp.optim import OneBitAdam
    from gradcomp.registry import steady

    assert steady("topk:stages=2,ratio=0.02", keep_given=True) == \
        "topk:warmup=0,ramp=0,budget=None,stages=2,ratio=0.02"
    assert steady("topk:warmup=5", keep_given=True) == "topk:warmup=5,ramp=0,budget=None"  # the governor off
    assert steady("topk:warmup=5") == "topk:warmup=0,ramp=0,budget=None"
    assert steady("int8") == "int8:warmup=0" and steady("quantize-channel") == "quantize-channel"
    params = [np.zeros((64, 8), np.float32)]
    comm = gc.MPICommunicator()
    try:
        freeze = OneBitAdam(params, compressor="topk:stages=2,ratio=0.02", comm=comm)
        assert freeze.momentum_compressor.warmup_steps == 0
        assert freeze.momentum_compressor.describe().startswith("topk(ratio=0.02, warmup=0")
        kept = OneBitAdam(params, compressor="topk:warmup=7", comm=comm)
        assert kept.momentum_compressor.warmup_steps == 7
    finally:
        comm.close()


@contextlib.contextmanager
def regimes_judged():
    """The regime of every residual check the divergence guard makes meanwhile, in order."""
    from gradcomp.compressors.guard import Guard

    seen: list = []
    measure = Guard.measure

    def spy(self, bucket, residuals, gradients, regime=()):
        seen.append(regime)
        return measure(self, bucket, residuals, gradients, regime)

    Guard.measure = spy
    try:
        yield seen
    finally:
        Guard.measure = measure


def test_the_guard_judges_each_stage_on_its_own():
    """A residual 20x its gradient, steady, after a stage whose residuals were 1x (an 8-bit
    warm-up, a ramp's first level) is no runaway: the smallest residuals are forgotten when the
    regime changes. Growing 10x within the later stage still is one. Schedules name their stage
    (nested ones too), and wrappers pass their inner method's regime on."""
    from gradcomp.compressors.guard import Guard

    bucket = gc.Bucket(np.zeros(100, np.float32), 0, [(100,)])

    def checks(guard: Guard, norms_and_regimes) -> bool:
        for norm, regime in norms_and_regimes:
            guard.measure(bucket, {"0.0": np.full(100, norm / 10, np.float32)}, [1.0], regime)
        return bool(guard.flag)

    warm_then_steady = [(1.0, (0,))] * 3 + [(20.0, (1,))] * 5
    assert not checks(Guard(), warm_then_steady)
    assert checks(Guard(), [(n, ()) for n, _ in warm_then_steady]), "one regime: the same residuals run away"
    assert checks(Guard(), warm_then_steady + [(250.0, (1,))]), "growth within the stage is still a runaway"
    # regimes are per tensor: auto may reduce two buckets of one step by two methods
    guard, other = Guard(), gc.Bucket(np.zeros(100, np.float32), 1, [(100,)])
    for norm in (1.0, 1.0, 250.0):
        checks(guard, [(norm, (0,))])
        guard.measure(other, {other.keys[0]: np.ones(100, np.float32)}, [1.0], (1,))
    assert guard.flag and list(guard.runaway) == ["0.0"], guard.stats()

    comm = gc.MPICommunicator()
    with regimes_judged() as seen, contextlib.closing(comm):
        ramped = gc.make("topk:warmup=0,ramp=40")              # stages from 0, 13, 26, 40
        halved = gc.make("fp16-powersgd:start_iter=3")          # FP16(PowerSGD): no stages
        dgc = gc.optim.DGC([np.zeros(4000, np.float32)], warmup=40, comm=comm)
        rng = np.random.default_rng(0)
        for step in range(50):
            g = rng.standard_normal(4000).astype(np.float32)
            ramped.reduce(gc.Bucket(g.copy(), 0, [(40, 100)]), comm).result()
            halved.reduce(gc.Bucket(g.copy(), 0, [(40, 100)]), comm).result()
            dgc.step([g.copy()])
    # checks at steps 9, 19, 29, 39, 49 of each, interleaved: the ramp's stages, none, DGC's ramp
    # the governor's rung (0: the method) first, then the recipe's stage
    assert seen[0::3] == [(0, 0), (0, 1), (0, 2), (0, 2), (0, 3)], seen
    assert seen[1::3] == [()] * 5, seen  # a fixed start_iter: PyTorch's PowerSGD, not governed
    assert seen[2::3] == [(0, 0), (0, 1), (0, 2), (0, 2), (0, 3)], seen


def test_the_guard_inside_an_optimizer_advises_the_optimizer():
    """An optimizer's exchange warns with the optimizer's advice (the exchange's compressor carries
    it to the guard), never by sending its user to the optimizer they already use."""
    import warnings

    from gradcomp.compressors.guard import Guard, RunawayResidual
    from gradcomp.optim import DGC, OneBitAdam

    params = [np.zeros((64, 8), np.float32)]
    comm = gc.MPICommunicator()
    try:
        exchanges = {"OneBitAdam": OneBitAdam(params, comm=comm).compressor,
                     "DGC": DGC(params, comm=comm).compressor, "topk": gc.make("topk")}
    finally:
        comm.close()
    texts = {}
    for name, comp in exchanges.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            Guard().announce([0, 1], comp.describe(), comp.runaway_advice)
        assert [w.category for w in seen] == [RunawayResidual], seen
        texts[name] = str(seen[0].message)
    assert "1-bit momentum" in texts["OneBitAdam"] and "gradcomp.optim" not in texts["OneBitAdam"]
    assert "larger ratio" in texts["DGC"] and "gradcomp.optim" not in texts["DGC"]
    assert "gradcomp.optim.OneBitAdam" in texts["topk"] and "rank(s) [1]" in texts["topk"]


def test_a_checkpoint_of_an_earlier_definition_says_how_to_resume():
    """``int8`` gained an exact warm-up: its state saved before (one stage) does not load into the
    new recipe (two), and the error names the parameter that builds the earlier one, which loads it."""
    comm = gc.MPICommunicator()
    try:
        old = gc.make("int8:warmup=0")
        g = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
        for _ in range(3):
            old.reduce(gc.Bucket(g.copy(), 0, [(50, 100)]), comm).result()
        state = old.state_dict()
        with pytest.raises(ValueError, match=r"int8\(warmup=50.*2 stage\(s\).*from 1.*'int8:warmup=0'"):
            gc.make("int8").load_state_dict(state)
        again = gc.make("int8:warmup=0")
        again.load_state_dict(state)
        assert again.step == 3
        with pytest.raises(ValueError, match="shape") as caught:  # a failure of another kind is not re-told
            gc.make("int8:warmup=0").load_state_dict({**state, "stage0/shape/0.0": np.array([7])})
        assert "another definition" not in str(caught.value)
    finally:
        comm.close()


def test_an_auto_warmup_from_the_other_codes_says_how_to_resume():
    """A state saved by an auto warm-up on other codes (``warmup_bits``: 8-bit throughout, or 8
    then 4) is refused, naming the build that loads it, and that build loads it."""
    comm = gc.MPICommunicator()
    try:
        g = np.random.default_rng(0).standard_normal(5000).astype(np.float32)
        for saved_by, loaded_by in (("onebit:warmup_bits=4", "onebit"), ("powersgd", "powersgd:warmup_bits=4")):
            old = gc.make(saved_by)
            for _ in range(3):
                old.reduce(gc.Bucket(g.copy(), 0, [(50, 100)]), comm).result()
            state = old.state_dict()
            bits = saved_by.partition("warmup_bits=")[2] or "8"
            name = saved_by.partition(":")[0]
            with pytest.raises(ValueError, match=f"saved by a warm-up on .*Build '{name}:warmup_bits={bits}'"):
                gc.make(loaded_by).load_state_dict(state)
            again = gc.make(f"{name}:warmup_bits={bits}")
            again.load_state_dict(state)
            assert again.step == 3
        for spec in ("onebit:warmup=100,warmup_bits=4", "powersgd:start_iter=100,warmup_bits=4"):
            with pytest.raises(ValueError, match="warmup_bits=4 is the bits of the auto warm-up's codes; "
                                                 "a warm-up of 100 steps is exact"):
                gc.make(spec)
    finally:
        comm.close()


def test_the_guard_does_not_judge_a_tensor_without_gradient():
    """A tensor whose gradient is exactly zero (FSDP's padding, an embedding shard whose rows no
    batch uses) keeps a residual from its chunk-mates: no ratio to judge, so no runaway."""
    from gradcomp.compressors.guard import Guard

    guard = Guard(every=1)
    bucket = gc.Bucket(np.zeros(8, np.float32), 0, [(4,), (4,)], keys=["used", "unused"])
    bucket.buffer[:4] = 1.0
    for scale in (1e-3, 1.0, 100.0):
        residuals = {"used": np.full(4, 1e-3, np.float32), "unused": np.full(4, scale, np.float32)}
        guard.measure(bucket, residuals, guard.gradient_norms(bucket))
    assert guard.flag == 0 and not guard.runaway, guard.runaway
    residuals = {"used": np.full(4, 100.0, np.float32), "unused": np.zeros(4, np.float32)}
    guard.measure(bucket, residuals, guard.gradient_norms(bucket))  # a used tensor still runs away
    assert guard.flag == 1 and "used" in guard.runaway
