"""The benchmark figures make their point, checked on what matplotlib drew (no MPI, a few seconds).

* every figure is written as a real, non-blank PNG;
* ``error_vs_ratio``: every method is named in exactly one label, no two label boxes overlap, none
  covers a point, all lie inside the axes (text extents measured by the Agg renderer);
* ``time_vs_bandwidth``: a handful of lines per panel, each one named in its panel's legend, the
  legend outside the axes; measured dots (and the claim of them) only when capped results exist;
* ``bytes_vs_ranks``: the reference curves are 2(N-1)/N and N-1, the measured fp32 allreduce and
  allgather points lie on them, and the text no longer says allreduce traffic does not grow.

The rows are synthetic (same fields as ``benchmarks.worker`` writes) and, where the checkout has
them, the capped runs in ``benchmarks/figures/results.json``.
"""
from __future__ import annotations

import importlib.util
import itertools
import json
import os

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.text import Annotation, Text  # noqa: E402

from benchmarks import plots  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "figures", "results.json")
NUMEL = 25_557_032

# name, kind, pattern ("ar": 2(N-1)/N, "ag": N-1), bytes per fp32 gradient byte, rel. error, local s
METHODS = [
    ("allreduce", "gradcomp", "ar", 1.0, 3.74e-8, 0.18),
    ("fp16", "gradcomp", "ar", 0.5, 3.25e-4, 0.19),
    ("bf16", "gradcomp", "ar", 0.5, 2.6e-3, 0.20),
    ("allgather", "gradcomp", "ag", 1.0, 3.74e-8, 1.1),
    ("quantize-tensor", "gradcomp", "ag", 0.25, 9.7e-2, 0.33),
    ("quantize-channel", "gradcomp", "ag", 0.2539, 4.3e-3, 0.31),
    ("powersgd-r1", "gradcomp", "ar", 0.00535, 0.738, 0.15),
    ("powersgd-r4", "gradcomp", "ar", 0.015, 0.399, 0.17),
    ("fp16-powersgd-r4", "gradcomp", "ar", 0.0075, 0.3992, 0.25),
    ("gloo-allreduce", "gradcomp", "ar", 1.0, 3.74e-8, 0.25),
    ("gloo-fp16", "gradcomp", "ar", 0.5, 3.25e-4, 0.26),
    ("gloo-powersgd-r4", "gradcomp", "ar", 0.015, 0.399, 0.26),
    ("torch-allreduce", "torch", "ar", 1.0, 3.74e-8, 0.23),
    ("torch-fp16", "torch", "ar", 0.5, 3.25e-4, 0.22),
    ("torch-bf16", "torch", "ar", 0.5, 2.6e-3, 0.21),
    ("torch-powersgd-r1", "torch", "ar", 0.00535, 0.700, 0.35),
    ("torch-powersgd-r4", "torch", "ar", 0.015, 0.3945, 0.55),
]


def factor(pattern, n):
    return 2 * (n - 1) / n if pattern == "ar" else n - 1


def job(ranks, model="resnet50", network="", slow=1.0, methods=METHODS):
    gradient = 4.0 * NUMEL
    ref = factor("ar", ranks) * gradient
    rows = [dict(method="memcpy", kind="baseline", time_s=0.04, bytes_per_rank=0.0, rel_error=0.0)]
    for name, kind, pattern, c, err, local in methods:
        sent = c * factor(pattern, ranks) * gradient
        rows.append(dict(method=name, kind=kind, time_s=local * slow, times_s=[local * slow],
                         bytes_per_rank=sent, rel_error=err if ranks > 1 else 0.0,
                         compression_ratio=ref / sent if sent else None))
    return dict(model=model, ranks=ranks, numel=NUMEL, buckets=5, network=network, results=rows)


def capped(network, ranks=4, model="resnet50"):
    rate = plots._rate_gbit(network)
    j = job(ranks, model=model, network=network)
    for r in j["results"]:  # the step on the link: local + bytes / rate
        r["time_s"] += r["bytes_per_rank"] * 8 / (rate * 1e9)
    return j


@pytest.fixture
def drawn(monkeypatch):
    """Every figure the plotting functions save, kept (and given a canvas again) for inspection."""
    figs = []
    real = plots._save

    def keep(fig, path, *args, **kw):
        figs.append(fig)
        return real(fig, path, *args, **kw)
    monkeypatch.setattr(plots, "_save", keep)
    return figs


def renderer_of(fig):
    canvas = FigureCanvasAgg(fig)  # pyplot's close() leaves the figure without its Agg canvas
    canvas.draw()
    return canvas.get_renderer()


def text_box(t, renderer):
    if isinstance(t, Annotation):
        t.update_positions(renderer)
    return Text.get_window_extent(t, renderer)  # the text alone, without an annotation's leader


def overlap(a, b):
    w = min(a.x1, b.x1) - max(a.x0, b.x0)
    h = min(a.y1, b.y1) - max(a.y0, b.y0)
    return w > 0.5 and h > 0.5


def all_text(fig):
    return "\n".join(t.get_text() for t in fig.findobj(Text))


def is_png(path):
    with open(path, "rb") as f:
        return f.read(8) == b"\x89PNG\r\n\x1a\n"


# -- every figure ---------------------------------------------------------------------------------------
def test_all_figures_writes_non_blank_pngs(tmp_path):
    import matplotlib.image as mpimg

    jobs = [job(n) for n in (2, 3, 4)] + [job(1, model="tiny"), job(2, model="tiny")]
    kernel_rows = [dict(kernel="memcpy", mb=100.0, time_s=0.01, vs_memcpy=1.0),
                   dict(kernel="fp16 round trip, gradcomp cast", mb=100.0, time_s=0.015, vs_memcpy=1.5)]
    paths = plots.all_figures(jobs, kernel_rows, [capped("1gbit"), capped("500mbit")], str(tmp_path))
    names = sorted(os.path.basename(p) for p in paths)
    assert names == sorted(["time_vs_bandwidth-resnet50.png", "error_vs_ratio-resnet50.png",
                            "bytes_vs_ranks-resnet50.png", "time_vs_bandwidth-tiny.png",
                            "error_vs_ratio-tiny.png", "bytes_vs_ranks-tiny.png", "kernels.png",
                            "capped.png", "error_vs_ratio-capped-1gbit.png",
                            "error_vs_ratio-capped-500mbit.png"])
    for p in paths:
        assert is_png(p) and os.path.getsize(p) > 5000, p
        img = mpimg.imread(p)
        assert img.shape[0] > 200 and img.shape[1] > 200 and img[..., :3].std() > 0.05, p


# -- error against compression ratio ----------------------------------------------------------------------
def error_cases():
    cases = [("synthetic, 4 ranks", job(4))]
    if os.path.exists(RESULTS):
        with open(RESULTS) as f:
            for c in json.load(f).get("capped", []):
                cases.append((f"benchmarks/figures capped {c.get('network')}", c))
    return cases


@pytest.mark.parametrize("case", error_cases(), ids=lambda c: c[0])
def test_error_vs_ratio_labels_name_every_point_once_and_never_overlap(case, tmp_path, drawn):
    _, data = case
    plots.error_vs_ratio(data, str(tmp_path / "e.png"))
    assert is_png(tmp_path / "e.png")
    (fig,) = drawn
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    renderer = renderer_of(fig)
    labels = [t for t in ax.texts if t.get_text().strip()]
    expected = sorted(r["method"] for r in data["results"]
                      if "time_s" in r and r["method"] != "memcpy" and r.get("compression_ratio"))
    named = sorted(part.strip(" =") for t in labels for line in t.get_text().split("\n")
                   for part in line.split(" = ") if part.strip(" ="))
    assert named == expected  # every point named, none twice

    boxes = [text_box(t, renderer) for t in labels]
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        assert not overlap(a, b), (labels[i].get_text(), labels[j].get_text())
    inside = ax.get_window_extent(renderer)
    for t, b in zip(labels, boxes):
        assert inside.x0 <= b.x0 and b.x1 <= inside.x1 and inside.y0 <= b.y0 and b.y1 <= inside.y1, t.get_text()
    points = np.concatenate([c.get_offset_transform().transform(c.get_offsets())
                             for c in ax.collections if isinstance(c, PathCollection)])
    assert len(points) == len(expected)
    for t, b in zip(labels, boxes):
        covered = [p for p in points if b.x0 < p[0] < b.x1 and b.y0 < p[1] < b.y1]
        assert not covered, (t.get_text(), covered)


def test_error_vs_ratio_methods_on_one_spot_share_one_label(tmp_path, drawn):
    plots.error_vs_ratio(job(4), str(tmp_path / "e.png"))
    texts = [t.get_text() for t in drawn[0].axes[0].texts]
    fp16 = [t for t in texts if "torch-fp16" in t]
    assert len(fp16) == 1 and "gloo-fp16" in fp16[0] and fp16[0].startswith("fp16")


# -- time against bandwidth ----------------------------------------------------------------------------
def panels(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def check_lines_and_legends(fig, renderer):
    """Each panel: a few lines, every one named once in a legend outside the axes."""
    drawn_methods = []
    for ax in panels(fig):
        lines = [ln for ln in ax.lines if len(ln.get_xdata()) > 1]
        assert 1 <= len(lines) <= 7, [ln.get_label() for ln in lines]
        legend = ax.get_legend()
        assert legend is not None
        entries = [t.get_text() for t in legend.get_texts()]
        for ln in lines:
            assert entries.count(ln.get_label()) == 1, (ln.get_label(), entries)
        assert not overlap(legend.get_window_extent(renderer), ax.get_window_extent(renderer))
        styles = [(str(ln.get_color()), ln.get_linestyle()) for ln in lines]
        assert len(set(styles)) == len(styles), styles  # no two lines look alike in a panel
        drawn_methods += [ln.get_label() for ln in lines if "reference" not in ln.get_label()]
    return drawn_methods


def test_time_vs_bandwidth_without_capped_runs_says_model_only(tmp_path, drawn):
    data = job(4)
    # capped runs of another model and another number of ranks: not this figure's
    plots.time_vs_bandwidth(data, [capped("1gbit", model="bert-base"), capped("1gbit", ranks=3)],
                            str(tmp_path / "t.png"))
    assert is_png(tmp_path / "t.png")
    (fig,) = drawn
    renderer = renderer_of(fig)
    methods = check_lines_and_legends(fig, renderer)
    assert sorted(methods) == sorted(m[0] for m in METHODS)  # each method once, in some panel
    assert len(panels(fig)) == 4
    text = all_text(fig)
    assert "model only" in text
    assert "dots" not in text.lower() and "capped link" not in text
    for ax in panels(fig):
        assert not [c for c in ax.collections if isinstance(c, PathCollection) and len(c.get_offsets())]


def test_time_vs_bandwidth_draws_the_capped_runs_it_claims(tmp_path, drawn):
    plots.time_vs_bandwidth(job(4), [capped("1gbit"), capped("500mbit")], str(tmp_path / "t.png"))
    (fig,) = drawn
    renderer = renderer_of(fig)
    check_lines_and_legends(fig, renderer)
    text = all_text(fig)
    assert "model only" not in text and "dots: measured" in text and "1gbit" in text and "500mbit" in text
    xs = sorted({float(x) for ax in panels(fig) for c in ax.collections if isinstance(c, PathCollection)
                 for x, _ in c.get_offsets()})
    assert xs == [0.5, 1.0]
    n_dots = sum(len(c.get_offsets()) for ax in panels(fig) for c in ax.collections)
    assert n_dots == 2 * len(METHODS)


# -- bytes against ranks ------------------------------------------------------------------------------
def by_gid(fig):
    return {ln.get_gid(): ln for ax in fig.axes for ln in ax.lines if ln.get_gid()}


def test_bytes_vs_ranks_draws_the_formulas_and_the_data_lies_on_them(tmp_path, drawn):
    plots.bytes_vs_ranks([job(n) for n in (2, 3, 4)], "resnet50", str(tmp_path / "b.png"))
    assert is_png(tmp_path / "b.png")
    (fig,) = drawn
    lines = by_gid(fig)
    n = np.asarray(lines["ref-allreduce"].get_xdata(), float)
    assert n.min() == 2 and n.max() >= 8
    np.testing.assert_allclose(lines["ref-allreduce"].get_ydata(), 2 * (n - 1) / n)
    np.testing.assert_allclose(lines["ref-allgather"].get_ydata(), n - 1)
    for name, formula in (("allreduce", lambda k: 2 * (k - 1) / k), ("allgather", lambda k: k - 1)):
        measured = lines[f"measured-{name}"]
        k = np.asarray(measured.get_xdata(), float)
        assert list(k) == [2, 3, 4]
        np.testing.assert_allclose(measured.get_ydata(), formula(k), rtol=1e-9)
    # the compressed methods follow c times their formula beyond the measured ranks
    fp16 = lines["formula-fp16"]
    k = np.asarray(fp16.get_xdata(), float)
    np.testing.assert_allclose(fp16.get_ydata(), 0.5 * 2 * (k - 1) / k, rtol=1e-9)
    q = lines["formula-quantize-channel"]
    np.testing.assert_allclose(np.asarray(q.get_ydata()) / (np.asarray(q.get_xdata(), float) - 1), 0.2539)
    text = all_text(fig)
    assert "do not" not in text and "bounded" in text and "linearly" in text
    assert "2(N-1)/N" in text and "N-1" in text
    # int8 allgather at c = 0.2539 sends more than fp32 allreduce once 0.2539 (N-1) > 2(N-1)/N: N = 8
    assert "from 8 ranks on" in text


def test_bytes_vs_ranks_tells_the_pattern_from_the_data_not_the_name(tmp_path, drawn):
    methods = [("allreduce", "gradcomp", "ar", 1.0, 1e-8, 0.1), ("mystery", "gradcomp", "ag", 0.3, 1e-2, 0.1),
               ("quantize-odd", "gradcomp", "ar", 0.3, 1e-2, 0.1)]
    plots.bytes_vs_ranks([job(n, methods=methods) for n in (2, 3, 5)], "resnet50", str(tmp_path / "b.png"))
    lines = by_gid(drawn[0])
    for gid, pattern in (("formula-mystery", "ag"), ("formula-quantize-odd", "ar")):
        k = np.asarray(lines[gid].get_xdata(), float)
        np.testing.assert_allclose(lines[gid].get_ydata(), 0.3 * factor(pattern, k), rtol=1e-9)


def test_bytes_vs_ranks_with_one_rank_and_zero_bytes(tmp_path, drawn):
    """The bench test's case: 1 and 2 ranks, nothing sent at 1 rank (a log axis cannot show 0)."""
    plots.bytes_vs_ranks([job(1, model="tiny"), job(2, model="tiny")], "tiny", str(tmp_path / "b.png"))
    assert is_png(tmp_path / "b.png")
    lines = by_gid(drawn[0])
    assert list(lines["measured-allreduce"].get_xdata()) == [2]
    # at 2 ranks allreduce and allgather send the same bytes, but they part beyond: two formulas
    k = np.asarray(lines["formula-allgather"].get_xdata(), float)
    np.testing.assert_allclose(lines["formula-allgather"].get_ydata(), k - 1)
    np.testing.assert_allclose(lines["formula-allreduce"].get_ydata(), 2 * (k - 1) / k)


# -- the demo's table ---------------------------------------------------------------------------------
def load_demo():
    spec = importlib.util.spec_from_file_location("demo", os.path.join(ROOT, "scripts", "demo.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_note_says_when_time_is_cpu_contention():
    demo = load_demo()
    over = demo.timing_note(4, 2)
    assert "4 ranks on 2 CPU cores" in over and "oversubscribed" in over and "contention" in over
    assert "not the network" in over
    fits = demo.timing_note(2, 8)
    assert "2 ranks on 8 CPU cores" in fits and "oversubscribed" not in fits and "nearly free" in fits
    for note in (over, fits):
        assert not any(line.startswith("| ") for line in note.splitlines())  # not a table row


# -- the convergence report's accuracy points -----------------------------------------------------------
def load_convergence():
    spec = importlib.util.spec_from_file_location("convergence", os.path.join(ROOT, "benchmarks", "scripts", "convergence.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def digits_run(accuracies: list[float]) -> dict:
    """A CNN-shaped result: one (step, test loss, accuracy %, seconds) point an epoch."""
    curve = [[11 * (i + 1), 1.0 / (i + 1), a, float(i)] for i, a in enumerate(accuracies)]
    return {"test_curve": curve, "test_accuracy": accuracies[-1], "steady_bytes_per_step": 100.0,
            "bytes_per_step": 100.0, "compression_ratio": 2.0}


def test_convergence_points_over_the_last_evaluations():
    conv = load_convergence()
    # the reference ends on an upswing; the method ends on a downswing of the same oscillation
    ref = digits_run([90.0, 95.0, 96.0, 97.0, 95.0, 97.0, 95.0, 97.0])
    method = digits_run([90.0, 95.0, 96.0, 97.0, 95.0, 97.0, 97.0, 95.0])
    assert conv.late_accuracy(ref) == pytest.approx((97 + 95 + 97 + 95 + 97) / 5)
    assert conv.late_accuracy(digits_run([99.0] * (conv.LATE_EVALS - 1))) is None  # too short a run
    assert conv.late_accuracy({"test_curve": [[1, 0.5, 0.9]] * conv.LATE_EVALS}) == pytest.approx(90.0)  # MLP: a fraction
    text = conv.table("cnn", {"none": {0: ref}, "fp16": {0: method}})
    header = [c.strip() for c in text.splitlines()[0].strip("|").split("|")]
    row = next([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines() if "fp16" in line)
    cells = dict(zip(header, row))
    assert cells["vs exact points (mean / worst)"] == "-2.00 / -2.00"  # the final evaluation alone
    assert cells[f"points, last {conv.LATE_EVALS} evals (mean / worst)"] == "+0.00 / +0.00"


def test_convergence_runs_local_steps_with_their_own_script():
    """``diloco[:key=value]`` on the LM is benchmarks/scripts/diloco_lm.py, each key one of its
    flags, the arguments after ``--`` last; elsewhere it is refused."""
    from pathlib import Path

    conv = load_convergence()
    cmd = conv.command("lm", "diloco:sync_every=10,compressor='int4'", 2, Path("out.json"), ["--steps", "50"])
    assert cmd[0].endswith(os.path.join("benchmarks", "scripts", "diloco_lm.py"))
    assert cmd[1:] == ["--seed", "2", "--json", "out.json", "--sync-every", "10", "--compressor", "int4",
                       "--steps", "50"]
    with pytest.raises(SystemExit, match="lm workload only"):
        conv.command("mlp", "diloco", 0, Path("out.json"), [])
