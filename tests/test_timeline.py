"""The timeline (``gradcomp.timeline``) in one process: off, it records and writes nothing; on, its
file is a Chrome trace that stays readable when cut anywhere; and the report's stats records."""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

import gradcomp
from gradcomp import timeline


@pytest.fixture(autouse=True)
def _off_after():
    yield
    timeline.stop()


def _reduce_a_few(steps: int = 3) -> None:
    grads = [np.linspace(-1, 1, 3000, dtype=np.float32).reshape(30, 100) * (i + 1) for i in range(3)]
    reducer = gradcomp.GradientReducer(grads, gradcomp.make("int8:warmup=1"), bucket_cap_mb=0.02)
    for _ in range(steps):
        reducer.step()


def test_off_records_and_writes_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not timeline.enabled and timeline.current_file() is None
    assert timeline.span("x") is timeline.task("y") is timeline._OFF
    with timeline.span("x", bucket=1):
        pass
    timeline.instant("rung change", "decision", step=1)
    timeline.complete("wait", "wait", 0.0, 1.0)
    timeline.step_done()
    timeline.flush()
    _reduce_a_few()
    assert timeline.stop() is None
    assert os.listdir(tmp_path) == []
    assert not any(t.name == "gradcomp-timeline" for t in threading.enumerate())


def test_file_per_rank():
    assert timeline.file_for("run/trace.json", 3) == "run/trace.3.json"
    assert timeline.file_for("run/t-{rank}.trace", 1) == "run/t-1.trace"
    assert timeline.file_for("run", 0) == os.path.join("run", "timeline.0.json")


def test_one_process_trace(tmp_path):
    with timeline.recording(str(tmp_path / "tl"), rank=0):
        _reduce_a_few()
        timeline.instant("odd", "decision", cost=float("nan"), n=np.int64(3))
    path = tmp_path / "tl" / "timeline.0.json"
    events = json.loads(path.read_text())  # closed: strict JSON
    names = {e["name"] for e in events}
    assert {"compress", "reduce", "agree", "decode", "wait", "thread_name", "odd"} <= names
    odd = next(e for e in events if e["name"] == "odd")
    assert odd["ph"] == "i" and odd["args"] == {"cost": "nan", "n": 3}
    reduces = [e for e in events if e["name"] == "reduce"]
    assert sorted({(e["args"]["step"], e["args"]["bucket"]) for e in reduces}) == \
        [(s, b) for s in range(3) for b in range(len(reduces) // 3)]
    assert timeline.read(str(path)) == events


def test_a_file_cut_anywhere_reads_up_to_the_cut(tmp_path):
    timeline.start(str(tmp_path / "t.json"), rank=0)
    _reduce_a_few()
    timeline.flush()  # as the writer leaves it: whole events, no closing bracket
    path = tmp_path / "t.0.json"
    unclosed = path.read_text()
    assert not unclosed.rstrip().endswith("]")
    whole = timeline.read(str(path))
    assert whole and json.loads(unclosed + "]") == whole  # what the trace viewers do with it
    for cut in range(len(unclosed) // 3, len(unclosed), max(len(unclosed) // 17, 1)):
        (tmp_path / "cut.json").write_text(unclosed[:cut])
        got = timeline.read(str(tmp_path / "cut.json"))
        assert got == whole[:len(got)] and len(got) >= len(whole) * cut // len(unclosed) - 2


def test_threads_record_at_once(tmp_path):
    together = threading.Barrier(4)

    def work(i):
        together.wait()  # (alive at once: a finished thread's id may be reused)
        for j in range(500):
            with timeline.span("s", "t", i=i, j=j):
                timeline.instant("i", "t", i=i, j=j)

    with timeline.recording(str(tmp_path), rank=5):
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    events = json.loads((tmp_path / "timeline.5.json").read_text())
    spans = [e for e in events if e["name"] == "s"]
    assert len(spans) == 2000 and all(e["pid"] == 5 for e in spans)
    assert len({e["tid"] for e in spans}) == 4


def test_record_stats(tmp_path):
    from gradcomp import report

    path = tmp_path / "run" / "stats.jsonl"
    report.record({"bytes_sent": 10.0, "ratio": float("inf"), "a": np.float32(0.5), "t": (1, 2)}, str(path), 4, rank=1)
    report.record({"bytes_sent": 20.0}, str(path), 5)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0]["step"] == 4 and rows[0]["rank"] == 1
    assert rows[0]["stats"] == {"bytes_sent": 10.0, "ratio": None, "a": 0.5, "t": [1, 2]}
    assert rows[1]["rank"] == 0


def test_report_needs_something(tmp_path):
    from gradcomp.report.__main__ import main

    assert main([str(tmp_path), "-o", str(tmp_path / "r.html")]) == 2
