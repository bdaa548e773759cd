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
