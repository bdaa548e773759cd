"""The forwarding base (``gradcomp.compressors.wrapper``): every member of the Compressor contract
reaches every wrapper from its inner method, unless the wrapper changes it on purpose."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

import gradcomp as gc
from gradcomp.compressors.contract import Compressor
from gradcomp.compressors.wrapper import FORWARDED, OWN, Wrapper

#: the modules that hold wrappers (gradcomp.jax.kit only where JAX is installed)
MODULES = ["gradcomp.compressors.half_precision", "gradcomp.compressors.feedback", "gradcomp.compressors.hierarchical",
           "gradcomp.schedule", "gradcomp.planning.recipes", "gradcomp.planning.governor", "gradcomp.optim.optimizer", "gradcomp.optim.fit"]

#: what each wrapper changes on purpose; every other contract member is its inner method's
OVERRIDES = {
    "Cast": {"traffic", "memory_passes", "error_bound"},           # on the half copy, plus the casts
    "FP16": {"traffic", "memory_passes", "error_bound"},
    "BF16": {"traffic", "memory_passes", "error_bound"},
    "ErrorFeedback": {"error_feedback_on", "error_bound", "memory_passes", "take_residual", "residuals",
                      "state_dict", "load_state_dict"},           # its residuals
    "Hierarchical": {"nan_effect", "scatters", "memory_passes", "take_residual", "regime"},
    "ThroughJax": {"scatters"},
    "_Agreed": {"runaway_advice", "agreement_state"},              # the optimizer's, as well
    "FittedExchange": {"agreement_state", "state_dict", "load_state_dict"},  # the choice, as well
    # several stages: what holds for all of them, and their state; the rest is the steady method's
    "Stages": {"nan_effect", "relative_error_limit", "scatters", "error_bound", "regime", "take_residual",
               "residuals"},
}
_STAGES = OVERRIDES["Stages"] | {"agreement_state", "state_dict", "load_state_dict"}
OVERRIDES.update({
    "Schedule": _STAGES | {"error_feedback_on", "warmup_steps"},
    "Recipe": _STAGES | {"error_feedback_on", "warmup_steps"},
    "Governed": _STAGES | {"after_runaway"},                          # every bucket a rung down
})

SHAPES = [(64, 32), (100,), (7, 3)]
KEYS = ["a", "b", "c"]
#: the arguments each contract method is called with here
ARGS = {
    "traffic": (SHAPES, 2, 4),
    "memory_passes": (SHAPES, 2, 4),
    "error_bound": (np.random.default_rng(0).standard_normal((2, 50)), np.float32),
    "agreement_state": (gc.Bucket(np.ones(2169, np.float32), 0, SHAPES, keys=KEYS), None),
    "regime": (None,),
    "after_runaway": (None,),
    "state_dict": (),
    "load_state_dict": ({},),  # (on a real compressor: its own state_dict())
    "residuals": (KEYS,),
    "take_residual": (KEYS,),
}


def _import_kit():
    """``gradcomp.jax.kit``, or None without JAX; its import turns on float64 in JAX, put back here
    for the tests that run after this one."""
    try:
        import jax
    except ImportError:
        return None
    before = jax.config.jax_enable_x64
    try:
        return importlib.import_module("gradcomp.jax.kit")
    finally:
        jax.config.update("jax_enable_x64", before)


def wrapper_classes() -> dict[str, type]:
    for name in MODULES:
        importlib.import_module(name)
    _import_kit()
    found, pending = {}, list(Wrapper.__subclasses__())
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.__module__.startswith("gradcomp."):
            found[cls.__name__] = cls
    return found


def own_members(cls: type) -> set[str]:
    """The contract members ``cls`` defines itself, or a class between it and ``Wrapper`` does."""
    mro = cls.__mro__
    return {name for name in FORWARDED for c in mro[:mro.index(Wrapper)] if name in vars(c)}


def test_every_contract_member_is_forwarded_or_each_compressors_own():
    public = {name for name in vars(Compressor) if not name.startswith("_")}
    assert public == set(FORWARDED) | OWN and not set(FORWARDED) & OWN
    assert OWN <= public, f"OWN names members the contract no longer has: {sorted(OWN - public)}"
    callables = {name for name in FORWARDED if callable(vars(Compressor)[name])}
    assert callables == set(ARGS), "say here what a new contract method is called with"


def test_the_base_forwards_every_member():
    """A stand-in inner method whose every contract member answers with its own name: the wrapper
    answers the same, arguments passed on."""
    members = {}
    for name in FORWARDED:
        if callable(vars(Compressor)[name]):
            members[name] = lambda self, *args, name=name: (name, args)
        else:
            members[name] = f"inner's {name}"
    inner = type("Inner", (Compressor,), members)()
    wrapper = Wrapper(inner)
    for name in FORWARDED:
        if name in members and callable(members[name]):
            assert getattr(wrapper, name)(*ARGS[name]) == (name, ARGS[name]), name
        else:
            assert getattr(wrapper, name) == f"inner's {name}", name


def test_each_wrapper_changes_only_what_it_says():
    classes = wrapper_classes()
    assert {"Cast", "ErrorFeedback", "Hierarchical", "_Agreed", "Schedule", "Governed"} <= set(classes)
    for name, cls in classes.items():
        assert name in OVERRIDES, f"{name} wraps a compressor: say in OVERRIDES what it changes"
        assert own_members(cls) == OVERRIDES[name], (name, sorted(own_members(cls) ^ OVERRIDES[name]))


class _Owner:
    runaway_advice = "the optimizer's advice"

    def describe(self):
        return "Owner()"

    def agreement_state(self):
        return {"optimizer step": 0}


def _instances():
    from gradcomp.compressors.hierarchical import Hierarchical
    from gradcomp.optim.optimizer import _Agreed
    from gradcomp.planning.governor import Governed

    out = [gc.FP16(gc.make("int8")), gc.BF16(gc.PowerSGD(rank=2)), gc.ErrorFeedback(gc.QuantizedAllreduce(bits=8)),
           Hierarchical(gc.make("topk")), _Agreed(gc.make("int8"), _Owner()),
           gc.Schedule([(0, gc.Allreduce()), (5, gc.FP16(gc.make("onebit")))]), gc.make("int4"),
           Governed(gc.make("topk"))]
    kit = _import_kit()
    if kit is not None:
        out.append(kit.ThroughJax(gc.make("int8")))
    return out


def _same(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("wrapper", _instances(), ids=lambda w: type(w).__name__)
def test_what_a_wrapper_does_not_change_is_its_inner_methods(wrapper):
    changed = OVERRIDES[type(wrapper).__name__]
    for name in FORWARDED:
        if name in changed:
            continue
        mine, inner = getattr(wrapper, name), getattr(wrapper.inner, name)
        if name in ARGS:
            args = (wrapper.inner.state_dict(),) if name == "load_state_dict" else ARGS[name]
            mine, inner = mine(*args), inner(*args)
        assert _same(mine, inner), (type(wrapper).__name__, name, mine, inner)
