"""The memory-traffic floors (``benchmarks.floors``): every registered method has one, and the
simple ones come to the bytes counted by hand."""
from __future__ import annotations

import numpy as np
import pytest

import gradcomp as gc
from benchmarks import floors
from gradcomp.registry import steady

N = 1 << 20  # values; a float32 bucket of 4 MiB
B = 4 * N


def stage(spec: str):
    """The compressor a registered name runs in steady state (a recipe's last stage)."""
    comp = gc.make(steady(spec))
    return comp.compressors[-1] if isinstance(comp, gc.Schedule) else comp


@pytest.mark.parametrize("spec", sorted(n for n in gc.REGISTRY if n != "auto") + ["topk:stages=2"])
@pytest.mark.parametrize("ranks", [1, 4])
def test_every_registered_method_has_a_floor(spec, ranks):
    t = floors.floor(stage(spec), N, np.float32, ranks, [(1024, 1024)])
    assert t is not None, spec
    if spec == "allreduce" and ranks == 1:
        assert t.total == 0  # a scratch bucket is its own mean
    else:  # every other method reads the whole gradient at least once and writes the mean back
        assert t.read >= B and t.write >= B / 2, (spec, ranks, t.read, t.write)


def test_floors_counted_by_hand():
    # fp16 on one rank: the bucket read and its half copy written, then read and widened back
    half = floors.floor(stage("fp16"), N, np.float32, 1)
    assert half.total == pytest.approx(2 * B + 2 * (B // 2))
    # fp32 allreduce at 4 ranks: divide (read + write the bucket), 3 ring steps of a quarter sent
    # and received, each added (two reads, one write), and the allgather (a quarter read, 3 written)
    q = B / 4
    assert floors.floor(stage("allreduce"), N, np.float32, 4).total == pytest.approx(
        2 * B + 6 * q + 9 * q + 4 * q)
    # two-stage top-k moves the same message as top-k's allgather once each way, not N times
    one = floors.floor(stage("topk"), N, np.float32, 4)
    two = floors.floor(stage("topk:stages=2,ratio=0.005"), N, np.float32, 4)
    assert dict((n, r) for n, r, _ in two.passes)["alltoall"] == pytest.approx(8 * 4 * -(-N // 4 // 200))
    assert dict((n, w) for n, _, w in one.passes)["allgather"] == pytest.approx(4 * 8 * -(-N // 100))


@pytest.mark.parametrize("spec", sorted(n for n in gc.REGISTRY if n != "auto") + ["topk:stages=2"])
def test_every_registered_method_declares_its_passes(spec):
    # the recipe declares its steady stage's passes, and the floor is what the method declares
    shapes = [(1024, 1024)]
    declared = gc.make(steady(spec)).memory_passes(shapes, 4, 4)
    assert declared is not None, spec
    assert declared == stage(spec).memory_passes(shapes, 4, 4) == floors.floor(stage(spec), N, np.float32, 4, shapes)
    assert declared.total == pytest.approx(sum(r + w for _, r, w in declared.passes))


def test_wrappers_delegate_and_undeclared_say_none():
    from gradcomp.compressors import passes
    from gradcomp.compressors.hierarchical import Hierarchical

    shapes, n = [(N,)], N
    int8 = gc.QuantizedAllreduce(bits=8)
    for owner in (True, False):  # error feedback tells its codec which residuals it keeps
        fed = gc.ErrorFeedback(int8, owner_feedback=owner).memory_passes(shapes, 4, 4)
        assert fed == int8.memory_passes(shapes, 4, 4, passes.Residuals(owner=owner))
        assert ("owner residual" in [p.name for p in fed.passes]) == owner
    inner = gc.ErrorFeedback(gc.TopK(0.01))
    half = gc.FP16(inner).memory_passes(shapes, 4, 4)  # the inner method on the half copy
    assert half == passes.half_cast(n, 4, 2, inner.memory_passes(shapes, 4, 2))
    assert gc.BF16(gc.PowerSGD(rank=2, batched=True)).memory_passes(shapes, 4, 4) is None
    assert Hierarchical(gc.Allreduce()).memory_passes(shapes, 4, 4) is None
    assert floors.floor(Hierarchical(gc.Allreduce()), N) is None
