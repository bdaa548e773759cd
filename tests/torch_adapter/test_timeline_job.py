"""The timeline and the report from real 2-rank jobs: a governed 1-bit method on DDP with several
buckets (its pace quickened as in ``test_layouts``, so that the warm-up ends, audits run and rungs
change within a short run), and a NumPy reducer job whose rank 1 dies mid-run."""
from __future__ import annotations

import importlib.util
import json
import os

import pytest

from tests.mpi_launch import leave_before_torch_teardown, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

STEPS = 60
CRASH_AT = 6


def rank_governed_ddp(folder: str, steps: int = STEPS) -> None:
    """Train the byte model of ``test_layouts`` with ``onebit`` on DDP, the timeline on; rank 0
    records the stats every other step."""
    import torch

    torch.set_num_threads(1)
    import gradcomp
    import gradcomp.torch as gt
    from gradcomp import report, timeline
    from tests.torch_adapter.test_layouts import _Net, quicken

    launch = gt.init_process_group()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(_Net(list(range(6)), unused=False), bucket_cap_mb=0.008)
    state = gt.register(model, gradcomp.make("onebit"))
    governors, warmups = quicken(state.compressor, budget=0.05)
    assert governors and warmups
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(launch.rank)
    timeline.start(folder)
    for step in range(steps):
        x = torch.randint(0, 64, (8, 12), generator=data)
        loss = torch.nn.functional.cross_entropy(model(x).reshape(-1, 64), ((x * 7 + 3) % 64).reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        if launch.rank == 0 and step % 2 == 1:
            report.record(state.compressor.stats(), os.path.join(folder, "stats.jsonl"), step)
    timeline.stop()
    leave_before_torch_teardown(state.comm)  # (skips atexit: the timeline was stopped above)


def rank_dies_mid_run(crash_at: int) -> None:
    """A NumPy reducer job (the timeline from ``GRADCOMP_TIMELINE``); rank 1 ends itself at step
    ``crash_at``, a moment after the step, as a crash would, and never closes its file."""
    import time

    import numpy as np

    import gradcomp

    assert gradcomp.timeline.enabled
    grads = [np.linspace(-1, 1, 20000, dtype=np.float32) * (i + 1) for i in range(4)]
    reducer = gradcomp.GradientReducer(grads, gradcomp.make("onebit:warmup=2"), bucket_cap_mb=0.1)
    for step in range(10 * crash_at):
        reducer.step()
        if step == crash_at and reducer.comm.rank == 1:
            time.sleep(1.5)  # (the writer wakes at least twice a second)
            os._exit(9)


def _nested_and_ordered(events: list[dict]) -> None:
    """On every thread, spans nest (none ends inside another it started in), and the reduce
    tasks on the wire thread, and compress spans on the compute thread, follow the step order."""
    threads: dict[int, list[dict]] = {}
    for e in events:
        if e["ph"] == "X":
            threads.setdefault(e["tid"], []).append(e)
    for tid, spans in threads.items():
        spans.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[float] = []
        for e in spans:
            while stack and stack[-1] <= e["ts"] + 1e-3:
                stack.pop()
            end = e["ts"] + e["dur"]
            assert not stack or end <= stack[-1] + 1e-3, f"thread {tid}: {e} ends outside its enclosing span"
            stack.append(end)
        for name in ("reduce", "compress"):
            order = [(e["args"]["step"]) for e in spans if e["name"] == name]
            assert order == sorted(order), f"thread {tid}: {name} spans out of step order"


def test_governed_ddp_timeline_and_report(tmp_path):
    folder = str(tmp_path / "run")
    run_ranks(2, "tests.torch_adapter.test_timeline_job:rank_governed_ddp", folder, timeout=300)
    names = {}
    for rank in range(2):
        with open(os.path.join(folder, f"timeline.{rank}.json")) as f:
            events = json.load(f)  # stopped: a complete JSON array
        assert {e["pid"] for e in events} == {rank}
        assert {e["ph"] for e in events} <= {"X", "i", "M"}
        threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
        assert any(t.startswith("training") for t in threads) and any(t.endswith("-wire") for t in threads)
        _nested_and_ordered(events)
        hooks = {(e["args"]["step"], e["args"]["bucket"]) for e in events if e["name"] == "hook"}
        for step in range(STEPS):
            buckets = {b for s, b in hooks if s == step}
            assert buckets, f"rank {rank}: no hook call at step {step}"
            if step >= 2:  # (DDP's first step is one bucket, reduced in pieces of their own)
                assert len(buckets) > 1
            for b in buckets:
                here = [e for e in events if e.get("args", {}).get("step") == step and e["args"].get("bucket") == b]
                kinds = {e["name"] for e in here} | {e["cat"] for e in here if "cat" in e}
                assert {"compress", "reduce", "agree", "wire", "decode"} <= kinds, (rank, step, b, kinds)
        waits = [e for e in events if e["name"] == "wait"]
        assert sorted(e["args"]["step"] for e in waits) == list(range(STEPS))
        instants = [e for e in events if e["ph"] == "i"]
        names[rank] = [e["name"] for e in instants]
        assert {"warm-up end", "audit", "rung change"} <= set(names[rank]), names[rank]
        audit = next(e for e in instants if e["name"] == "audit")["args"]
        assert audit["budget"] == 0.05 and audit["cost"] >= 0 and audit["rung"] in ("method", "int4", "int8")
    assert names[0] == names[1]  # the same decisions on every rank

    from gradcomp.report import render

    out = render([folder], str(tmp_path / "report.html"), str(tmp_path / "report.png"))
    html = open(out).read()
    for title in ("Bytes sent and compression ratio", "Each tensor&#x27;s rung", "Audit costs against the budget",
                  "The step&#x27;s time split", "rung change"):
        assert title in html, title
    assert html.count("<svg") == 4 and "<script" not in html and "src=" not in html  # stands alone
    assert os.path.getsize(tmp_path / "report.png") > 10_000


def test_a_rank_that_dies_keeps_its_trace(tmp_path):
    folder = tmp_path / "crash"
    run_ranks(2, "tests.torch_adapter.test_timeline_job:rank_dies_mid_run", CRASH_AT, timeout=120,
              env={"GRADCOMP_TIMELINE": str(folder)}, expect_failure=True)
    from gradcomp import timeline
    from gradcomp.report.inputs import load, time_split

    text = (folder / "timeline.1.json").read_text()
    assert not text.rstrip().endswith("]")  # never closed
    events = timeline.read(str(folder / "timeline.1.json"))
    steps = {e["args"]["step"] for e in events if e["name"] == "reduce"}
    assert steps == set(range(CRASH_AT + 1)), sorted(steps)
    assert set(time_split(load([str(folder / "timeline.1.json")]).traces[1])) == steps
