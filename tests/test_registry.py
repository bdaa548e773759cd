"""One registry: names, specs with keyword overrides, third-party registration and entry points."""
from __future__ import annotations

import importlib.metadata

import pytest

import gradcomp as gc
from gradcomp.registry import ENTRY_POINT_GROUP, REGISTRY, Registry, compressor_spec, parse_spec


def make_ep_compressor():
    return gc.FP16(gc.Allgather())


def test_specs_and_overrides():
    assert parse_spec("powersgd:rank=4,start_iter=2") == ("powersgd", {"rank": 4, "start_iter": 2})
    comp = gc.make("powersgd:rank=4,budget=None", start_iter=7)
    assert (comp.rank, comp.start_iter) == (4, 7)
    assert gc.make("int8:feedback=none").describe() == "int8(warmup=50, feedback='none')"
    assert gc.make("int8:feedback=none,warmup=0").compressors[0].describe() == "QuantizedAllreduce(bits=8)"
    assert compressor_spec("topk:ratio=0.05") == "topk:ratio=0.05"
    with pytest.raises(Exception, match="unknown compressor 'nope'"):
        compressor_spec("nope")


def test_unknown_names_get_a_did_you_mean():
    import argparse

    with pytest.raises(ValueError, match=r"unknown compressor 'int9' \(did you mean 'int8' or 'int4'\?\); known: "):
        gc.make("int9")
    with pytest.raises(ValueError, match=r"'INT8' \(did you mean 'int8'\?\)"):
        gc.make("INT8:warmup=0")
    with pytest.raises(argparse.ArgumentTypeError, match=r"did you mean 'quantize-channel'\?"):
        compressor_spec("quantize_channel")
    with pytest.raises(ValueError, match="'onebitadam' is an optimizer|onebitadam is an optimizer"):
        gc.make("onebitadam")
    with pytest.raises(ValueError, match=r"unknown compressor 'zzz'; known: allreduce"):  # nothing close
        gc.make("zzz")


def test_register_and_refuse_duplicates():
    gc.register("test-halve", make_ep_compressor)
    try:
        assert "test-halve" in REGISTRY and gc.make("test-halve").describe().startswith("FP16(inner=Allgather")
        with pytest.raises(ValueError, match="already registered"):
            gc.register("test-halve", make_ep_compressor)
        with pytest.raises(TypeError, match="not a gradcomp Compressor"):
            gc.register("test-bad", lambda: 3, replace=True)
            gc.make("test-bad")
    finally:
        for name in ("test-halve", "test-bad"):
            if dict.__contains__(REGISTRY, name):
                dict.__delitem__(REGISTRY, name)


def test_entry_points_join_the_registry(monkeypatch):
    ep = importlib.metadata.EntryPoint(name="test-ep", value="tests.test_registry:make_ep_compressor",
                                       group=ENTRY_POINT_GROUP)
    monkeypatch.setattr(importlib.metadata, "entry_points",
                        lambda group=None: [ep] if group == ENTRY_POINT_GROUP else [])
    monkeypatch.setattr(Registry, "_loaded", False)
    try:
        assert "test-ep" in REGISTRY
        assert gc.make("test-ep").describe() == "FP16(inner=Allgather())"
    finally:
        dict.__delitem__(REGISTRY, "test-ep")


def test_an_unknown_key_is_refused_with_the_keys_there_are():
    with pytest.raises(ValueError) as caught:
        gc.make("topk:ration=0.1")
    said = str(caught.value)
    assert "'ration' (did you mean 'ratio'?)" in said, said
    assert "it takes ratio, warmup, ramp, feedback, stages" in said, said
    # factories that pass their keywords on list where they go: the wrapped method's, auto's
    with pytest.raises(ValueError, match="did you mean 'rank'.*it takes rank, start_iter"):
        gc.make("fp16-powersgd:rnk=2")
    with pytest.raises(ValueError, match="it takes allowed, table"):
        gc.make("auto", alowed="fp16")
    with pytest.raises(ValueError, match="'chunk'; it takes warmup, feedback, bits"):
        gc.make("quantize-tensor:chunk=64")
    with pytest.raises(ValueError, match="'x'; it takes no parameters"):
        gc.make("fp16:x=1")
    assert gc.make("quantize-tensor:bits=4,warmup=0").describe() == gc.QuantizePerTensor(bits=4).describe()
