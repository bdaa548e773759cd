"""The workload zoo (``python -m benchmarks zoo``, issue 57): correctness only, never a wall-clock
threshold.

* The zoo's shape: at least 8 workloads from at least 3 families under at least 3 optimizers, and
  each half has an MLP, a CNN and a sequence model under at least 2 optimizers.
* Every workload builds (data, model, the user's optimizer, the schedule) and takes a few steps on
  one process, no mpiexec; its held-out metric is finite and its data deterministic.
* Method specs: applicability (DGC on momentum SGD, OneBitAdam on Adam), typos refused, the gap's
  sign convention.
* One tiny end-to-end run at 2 real ranks (2 workloads, ``none`` and ``int8``, 10 steps): one JSON per
  method, the gap of ``none`` to itself 0, the table and the heatmap written; a second run skips
  what exists; ``--report`` reads the JSONs only.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("sklearn")

from benchmarks.zoo import methods as MT  # noqa: E402
from benchmarks.zoo import workloads as W  # noqa: E402


def test_the_zoo_has_the_families_optimizers_and_halves_issue_57_asks_for():
    assert len(W.WORKLOADS) >= 8
    assert len({w.name for w in W.WORKLOADS}) == len(W.WORKLOADS)
    assert len({w.family for w in W.WORKLOADS}) >= 3
    assert {"sgd", "adamw"} <= {w.optimizer for w in W.WORKLOADS}
    assert len({w.optimizer for w in W.WORKLOADS}) >= 3
    assert {w.family for w in W.WORKLOADS} >= {"mlp", "cnn", "rnn", "transformer"}
    for half in W.HALVES:
        mine = W.select(half)
        assert len(mine) >= 4, half
        families = {w.family for w in mine}
        assert {"mlp", "cnn"} <= families and families & {"rnn", "transformer"}, (half, families)
        assert len({w.optimizer for w in mine}) >= 2, half
    assert all(w.half in W.HALVES and w.family in W.FAMILIES and w.optimizer in W.OPTIMIZERS
               and w.metric in ("accuracy", "loss") for w in W.WORKLOADS)


@pytest.mark.parametrize("name", [w.name for w in W.WORKLOADS])
def test_every_workload_builds_and_trains_a_few_steps(name):
    workload = W.BY_NAME[name]
    torch.set_num_threads(1)
    data = workload.data()
    torch.manual_seed(0)
    net = workload.model()
    opt = W.build_optimizer(workload, W.param_groups(workload, net))
    steps = 3
    sched = torch.optim.lr_scheduler.LambdaLR(opt, W.schedule(workload, steps))
    for step in range(steps):
        x, y = data.train_batch(torch.Generator().manual_seed(step), workload.batch)
        assert len(x) == len(y) == workload.batch
        opt.zero_grad()
        loss = W.loss_fn(workload, net(x), y)
        loss.backward()
        opt.step()
        sched.step()
        assert math.isfinite(loss.item())
    result = W.evaluate(workload, net, data.eval_x[:64], data.eval_y[:64])
    value = W.metric_of(workload, result)
    assert math.isfinite(value)
    if workload.classifier:
        assert 0 <= value <= 100
    # the same generator draws the same batch: every method of a job sees the same data
    a = data.train_batch(torch.Generator().manual_seed(7), 4)
    b = data.train_batch(torch.Generator().manual_seed(7), 4)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_methods_apply_to_the_optimizers_they_replace():
    sgd, adamw, adam, rmsprop = (next(w for w in W.WORKLOADS if w.optimizer == o)
                                 for o in ("sgd", "adamw", "adam", "rmsprop"))
    dgc, onebitadam = MT.parse("dgc:ratio=0.05"), MT.parse("onebitadam")
    assert dgc.kind == "dgc" and dgc.options == {"ratio": 0.05}
    assert MT.applies(dgc, sgd) and not any(MT.applies(dgc, w) for w in (adamw, adam, rmsprop))
    assert MT.applies(onebitadam, adamw) and MT.applies(onebitadam, adam)
    assert not MT.applies(onebitadam, sgd) and not MT.applies(onebitadam, rmsprop)
    for spec in ("none", "int8", "topk:ratio=0.01", "powersgd", "diloco:sync_every=10"):
        assert all(MT.applies(MT.parse(spec), w) for w in W.WORKLOADS)
    assert MT.parse("topk:ratio=0.01").kind == "hook"
    with pytest.raises(ValueError, match="int8"):
        MT.parse("int88")


def test_gap_signs():
    classifier = next(w for w in W.WORKLOADS if w.classifier)
    lm = next(w for w in W.WORKLOADS if not w.classifier)
    assert W.gap(classifier, 80.0, 82.5) == pytest.approx(-2.5)   # points, negative = worse
    assert W.gap(lm, 2.2, 2.0) == pytest.approx(10.0)             # percent, positive = worse
    assert W.badness(classifier, -2.5) == 2.5 and W.badness(lm, 10.0) == 10.0
    assert W.gap(lm, float("nan"), 2.0) is None


def test_a_tiny_zoo_end_to_end_at_two_ranks(tmp_path, capsys):
    from benchmarks.__main__ import main

    out = tmp_path / "zoo"
    args = ["zoo", "--workloads", "mlp-tabular", "mlp-friedman", "--methods", "none", "int8",
            "--steps", "10", "--ranks", "2", "--evals", "2", "--out", str(out)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    for name in ("mlp-tabular", "mlp-friedman"):
        for spec in ("none", "int8"):
            r = json.loads((out / name / "10" / f"{spec}@0.json").read_text())
            assert "error" not in r, r
            assert r["workload"] == name and r["method"] == spec and r["steps"] == 10 and r["ranks"] == 2
            assert r["weights_identical"]
            assert math.isfinite(r["value"]) and r["bytes_sent"] > 0 and r["reference_bytes"] > 0
            assert r["compression_ratio"] == pytest.approx(r["reference_bytes"] / r["bytes_sent"])
            assert [p[0] for p in r["curve"]] == [0, 5, 10]
            assert isinstance(r["stats"], dict) and r["stats"]["steps"] == 10
        ref = json.loads((out / name / "10" / "none@0.json").read_text())
        assert ref["gap"] == 0 and ref["compression_ratio"] == pytest.approx(1.0)
        # int8 sends exact fp32 in its first steps (its warm-up): the same model as the reference
        int8 = json.loads((out / name / "10" / "int8@0.json").read_text())
        assert int8["reference_value"] == ref["value"] and int8["gap"] is not None
    table = (out / "zoo-10.md").read_text()
    assert "mlp-tabular" in table and "mlp-friedman" in table and "+0.00pt, 1.0x" in table
    assert table.splitlines()[0] in printed
    for png in (out / "zoo-10.png", out / "zoo-loss-vs-bytes.png"):  # (mlp-friedman's metric is a loss)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    # nothing left to run: the second call only reports; --report reads the JSONs alone
    stamp = {p: p.stat().st_mtime_ns for p in out.glob("*/10/*.json")}
    assert main(args) == 0
    assert main(["zoo", "--report", "--out", str(out), "--no-plots"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.glob("*/10/*.json")} == stamp
    assert "mlp-friedman" in capsys.readouterr().out


def test_list_names_every_workload(capsys):
    from benchmarks.zoo.cli import main

    assert main(["--list"]) == 0
    printed = capsys.readouterr().out
    assert all(w.name in printed and w.half in printed for w in W.WORKLOADS)


def test_report_marks_what_does_not_apply(tmp_path):
    """A method that does not apply shows n/a, one without a result -, a failed one ERR."""
    from benchmarks.zoo import report

    sgd = next(w for w in W.WORKLOADS if w.optimizer == "sgd")
    folder = tmp_path / sgd.name / "400"
    folder.mkdir(parents=True)
    base = dict(workload=sgd.name, steps=400, seed=0, ranks=4, seconds=1.0)
    (folder / "none@0.json").write_text(json.dumps(dict(base, method="none", value=80.0, compression_ratio=1.0)))
    (folder / "topk@0.json").write_text(json.dumps(dict(base, method="topk", value=78.5, compression_ratio=20.0)))
    (folder / "int8@0.json").write_text(json.dumps(dict(base, method="int8", error="exit 1")))
    text, figures = report.report(Path(tmp_path), methods=["none", "int8", "topk", "onebitadam", "dgc"])
    row = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("|")}
    assert "-1.50pt, 20.0x" in row["topk"] and "ERR" in row["int8"]
    assert "n/a" in row["onebitadam"] and row["dgc"].rstrip(" |").endswith("-")
    assert figures and figures[0].exists()
