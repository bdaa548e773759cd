"""DiLoCo on torchft (``gradcomp.torch.DiLoCo(..., manager=)``), for real: a lighthouse in this
process and two replica groups of one process each (``ft_jobs/diloco_replica.py``), on free ports,
on the CPU over ``ProcessGroupGloo``: a small MLP, SGD with momentum inside, an outer step every 4
inner steps with int8 codes (error feedback) on the pseudo-gradients and Nesterov outer momentum.

* **SIGKILL between outer steps** (plain, and streaming: 2 fragments, the exchange landing one
  inner step later): b is paused after a committed outer step and killed there. a's next quorum
  waits for the lighthouse's heartbeat timeout, then a goes on alone, committing every outer step;
  the restarted b heals from a in a's outer step (outer state, counters, the outer step in
  progress), taking part with no pseudo-gradient of its own.
* **A crash inside an outer exchange**: b exits once its exchange has started. a's outer step is
  discarded (not a crash) and leaves no trace: its compressor counters and outer step counter are
  put back; a sends the pseudo-gradient again at its next outer step; then as above.

Checked besides: after every outer step both groups committed, their synced parameters have the
same digest; the counters advanced once per committed outer step; both end with the same bits
and the expected number of committed steps. Stall and heal times are printed (``pytest -s``),
never asserted against the clock.
"""
from __future__ import annotations

import importlib.util
import json
import signal
import time
import types

import pytest

from tests.mpi_launch import ROOT
from tests.torch_adapter.test_torch_ft import Group, lighthouse, records, report, until, wait_for  # noqa: F401

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("torchft") is None,
                                 reason="torchft not installed (the ft extra)"),
              pytest.mark.timeout(150)]

JOB = ROOT / "tests" / "torch_adapter" / "ft_jobs" / "diloco_replica.py"
H = 4  # inner steps per outer step


def outer_records(log: list[dict], after: float = 0.0) -> list[dict]:
    return [r for r in log if r["event"] == "outer" and r["time"] > after]


def wait_for_outer_step(out, name: str, step: int, groups: list[Group], timeout: float = 90) -> None:
    """Until ``name``'s log holds its outer step at inner ``step`` (complete lines only)."""
    def logged() -> bool:
        path = out / f"{name}.log"
        lines = path.read_text().split("\n")[:-1] if path.exists() else []
        return any(r["event"] == "outer" and r["step"] == step for r in map(json.loads, lines))

    until(logged, groups, timeout)


def first_outer_step(log: list[dict], after: float) -> tuple[dict, dict]:
    """A restarted group's first record (its join: healed, in its source's outer step) and the
    first that landed (the same one, or ``overlap`` inner steps later): committed."""
    mine = outer_records(log, after)
    landed = next(r for r in mine if "committed" in r)
    assert mine[0]["healed"] and landed["committed"], mine[:2]
    return mine[0], landed


def check_end(out, groups: list[Group], rounds: int, names: str = "ab") -> list[list[dict]]:
    """Every group ended cleanly with ``rounds`` committed outer steps (and the join) and the
    same bits, agreed after every outer step they committed, and advanced their counters once
    per committed outer step; the logs of ``names``."""
    for g in groups:
        assert g.wait() == 0, g.tail()
    logs = [records(out, name) for name in names]
    synced = {}
    for log in logs:
        done = log[-1]
        assert done["event"] == "done" and done["manager_step"] == rounds + 1, log[-3:]
        assert done["exchange_compression_ratio"] > 1.2, done  # int8 codes (and their scales)
        for r in outer_records(log):
            if r.get("committed") and r["step"] > 0:
                # one outer step per commit (the join is the manager's step 0), and each
                # fragment's compressor stepped once per exchange: a discarded one left no trace
                assert r["outer_steps"] == r["manager_step"] - 1, r
                assert synced.setdefault(r["manager_step"], r["synced"]) == r["synced"], r
        assert done["digest"] == log[-2]["synced"], log[-2:]  # the replica holds the synced bits
    params = {(out / f"{name}.params").read_bytes() for name in names}
    assert len(params) == 1, "the groups' bits differ"
    return logs


@pytest.mark.parametrize("fragments, overlap", [(1, 0), (2, 1)])
def test_sigkill_between_outer_steps(lighthouse, tmp_path, fragments, overlap):
    """b is paused after committing its 2nd (streaming: 4th) outer step, at inner step 8 (9), and
    killed there; a goes on alone, waits before inner step 16 for the restarted b, which heals
    from a at a's next outer step; both to inner step 32."""
    steps, pause = 32, 2 * fragments
    rounds = steps // H * fragments + (1 if fragments > 1 or overlap else 0)  # (+ the final sync_now)
    common = ("--steps", str(steps), "--sync-every", str(H), "--fragments", str(fragments),
              "--overlap", str(overlap))
    groups = [Group(lighthouse, "a", tmp_path, *common, "--wait-for-joiner", "16", job=JOB),
              Group(lighthouse, "b", tmp_path, *common, "--pause-at", str(pause), job=JOB)]
    try:
        wait_for(tmp_path / "b.paused", groups, timeout=90)
        groups[1].proc.send_signal(signal.SIGKILL)
        killed = time.time()
        assert groups[1].wait() == -signal.SIGKILL
        restarted = time.time()
        groups.append(Group(lighthouse, "b", tmp_path, *common, job=JOB))
        a, b = check_end(tmp_path, [groups[0], groups[2]], rounds)
    finally:
        for g in groups:
            g.stop()
    after_kill = [r for r in outer_records(a, killed) if "committed" in r]
    assert all(r["committed"] for r in after_kill), after_kill  # nothing discarded: only a stall
    alone = [r for r in after_kill if r["participants"] == 1]
    assert alone and alone[0]["step"] > 8, after_kill  # a went on alone
    joined, landed = first_outer_step(b, restarted)
    assert joined["step"] >= 16, joined
    assert a[-1]["discarded"] == 0 and b[-1]["heals"] == 1, (a[-1], b[-1])
    together = [r for r in after_kill if r["participants"] == 2]
    assert together[0]["contributors"] == 1 and together[-1]["contributors"] == 2, together  # b not counted
    report(f"SIGKILL between outer steps (fragments={fragments}, overlap={overlap})",
           stall_s=alone[0]["quorum_s"], heal_outer_step_s=joined["seconds"],
           restart_to_first_commit_s=landed["time"] - restarted)


@pytest.mark.parametrize("compressor", ["int8", "int4", "sparseloco"])
def test_crash_inside_an_outer_exchange(lighthouse, tmp_path, compressor):
    """b exits in its 3rd outer step (inner step 12) once the exchange has started; a's outer step
    is discarded and undone; a goes on alone, waits before inner step 20 for the restarted b,
    which heals at a's next outer step; both to inner step 32. ``int4``'s exchange is governed:
    its rungs and audit windows are undone and healed as well. ``sparseloco`` counts no steps: for it
    the discard, the heal and the same bits at the end are what is checked."""
    steps = 32
    common = ("--steps", str(steps), "--compressor", compressor)
    groups = [Group(lighthouse, "a", tmp_path, *common, "--wait-for-joiner", "20", job=JOB),
              Group(lighthouse, "b", tmp_path, *common, "--crash-at", "3", job=JOB)]
    try:
        assert groups[1].wait(timeout=90) == 3, groups[1].tail()
        crashed = time.time()
        # b restarts once a has taken its next outer step alone: a restart that reached the
        # lighthouse first joined that quorum (CI saw it, with sparseloco; here once, with int8)
        wait_for_outer_step(tmp_path, "a", 16, groups[:1])
        groups.append(Group(lighthouse, "b", tmp_path, *common, job=JOB))
        a, b = check_end(tmp_path, [groups[0], groups[2]], steps // H - 1)  # one outer step discarded
    finally:
        for g in groups:
            g.stop()
    mine = outer_records(a)
    third = [r for r in mine if r["step"] == 12]
    assert len(third) == 1 and not third[0]["committed"] and third[0]["participants"] == 2, third
    counted = [None] if compressor == "sparseloco" else [2]  # (its accumulator counts no steps)
    assert third[0]["outer_steps"] == 2 and third[0]["compressor_steps"] == counted, third  # undone
    after = [r for r in mine if r["step"] > 12]
    assert all(r["committed"] for r in after) and after[0]["participants"] == 1, after  # then alone
    assert a[-1]["discarded"] == 1 and a[-1]["rolled_back"] == 1 and a[-1]["failures"] >= 1, a[-1]
    joined, _ = first_outer_step(b, crashed)
    assert joined["step"] >= 20, joined
    report(f"crash inside an outer exchange ({compressor})", discarded_outer_step_s=third[0]["seconds"],
           stall_after_discard_s=after[0]["quorum_s"], heal_outer_step_s=joined["seconds"])


def test_a_straggler_heals_in_its_own_outer_step(lighthouse, tmp_path):
    """Three groups; c sleeps before inner step 8, past the lighthouse's join timeout, so a and b
    take the outer step at 8 without it. c, one outer step behind, heals from them in its own
    outer step (at its inner step 8) and takes part in theirs (at 12) instead, with no
    pseudo-gradient of its own; nothing is discarded."""
    steps = 32
    common = ("--steps", str(steps), "--groups", "3", "--step-sleep", "0.15")
    groups = [Group(lighthouse, name, tmp_path, *common, *extra, job=JOB)
              for name, extra in (("a", ()), ("b", ()), ("c", ("--stall-before", "8", "--stall-s", "2.5")))]
    try:
        a, b, c = check_end(tmp_path, groups, steps // H, names="abc")
    finally:
        for g in groups:
            g.stop()
    eighth = [r for r in outer_records(a) if r["step"] == 8]
    assert eighth[0]["committed"] and eighth[0]["participants"] == 2, eighth  # without c
    caught_up = [r for r in outer_records(c) if r.get("healed")]
    assert len(caught_up) == 1 and caught_up[0]["committed"] and caught_up[0]["step"] > 8, caught_up
    theirs = [r for r in outer_records(a) if r["step"] == caught_up[0]["step"]]
    assert theirs[0]["participants"] == 3 and theirs[0]["contributors"] == 2, theirs  # c not counted
    assert all(log[-1]["discarded"] == 0 for log in (a, b, c)), [log[-1] for log in (a, b, c)]


def test_refuses_what_it_cannot_keep_consistent():
    """An overlap longer than the gap between two fragments' outer steps (torchft runs one step at
    a time), a communicator besides the manager, and the asynchronous quorum are refused."""
    import torch
    from torchft.process_group import ProcessGroupGloo

    import gradcomp.torch as gt

    def manager(use_async_quorum: bool = False):  # the attributes gradcomp reads before it joins
        return types.SimpleNamespace(_pg=ProcessGroupGloo(), _use_async_quorum=use_async_quorum)

    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    inner = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="overlap=3 must be at most 2"):
        gt.DiLoCo(net, inner, sync_every=4, fragments=2, overlap=3, manager=manager())
    with pytest.raises(TypeError, match="not both"):
        gt.DiLoCo(net, inner, comm=object(), manager=manager())
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        gt.DiLoCo(net, inner, manager=manager(use_async_quorum=True))
