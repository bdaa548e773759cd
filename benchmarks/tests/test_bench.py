"""The benchmarks: correctness only, never a wall-clock threshold. (The kernels they measure are
tested in tests/kernels/test_kernels.py.)

* The benchmark's methods follow ``gradcomp.REGISTRY`` (a registered name joins ``--methods all``
  with no edit to the bench); specs with commas parse; PyTorch's hooks point at their gradcomp twins.
* The worker on a tiny model, 2 real ranks, on both paths (``reducer``: ``GradientReducer``;
  ``ddp``: real DistributedDataParallel with comm hooks): finite times, page-fault counts, bytes,
  exact fp32 results, gradcomp's allreduce equal to DDP's own (fp32 rounding).
* ``python -m benchmarks bench`` on a tiny model, 1 and 2 real ranks, writes JSON, CSV and PNGs whose
  numbers make sense (bytes per rank, errors); ``report`` never writes empty results over results.
* ``benchmarks/capped.sh`` really puts ranks in their own namespaces and cleans up, also on failure
  (skipped without root or without iproute2).
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CAPPED = os.path.join(ROOT, "benchmarks", "capped.sh")


# -- the method list: one registry ----------------------------------------------------------------------
def test_method_list_follows_the_registry():
    """``all`` is every registered name (PowerSGD-like factories, which take ``start_iter``, as
    ``NAME:start_iter=2``) plus the extra target specs; a newly registered name joins it with no
    edit to the bench, and leaves it again when unregistered."""
    import gradcomp
    from benchmarks import methods
    from gradcomp.registry import steady

    names = [m.name for m in methods.select("all", with_torch=False)]
    for name in gradcomp.REGISTRY:
        takes_start_iter = name.startswith(("powersgd", "fp16-powersgd", "batched-powersgd"))
        from gradcomp.planning.governor import Governed

        recipe = isinstance(gradcomp.make(name), (gradcomp.Recipe, Governed))
        expect = f"{name}:start_iter=2" if takes_start_iter else methods.canonical(steady(name)) if recipe else name
        assert expect in names, name
    assert "powersgd:rank=4,start_iter=2" in names and "powersgd:rank=1,start_iter=2" in names
    assert all(m.kind == "gradcomp" and m.transport == "mpi"
               for m in methods.select("all", with_torch=False))
    plain, tunable = "zz-bench-plain", "zz-bench-tunable"
    gradcomp.register(plain, gradcomp.Allreduce)
    gradcomp.register(tunable, lambda **kw: gradcomp.PowerSGD(**{"rank": 1, "start_iter": 10, **kw}))
    try:
        chosen = {m.name: m for m in methods.select("all", with_torch=False)}
        assert plain in chosen and f"{tunable}:start_iter=2" in chosen
        assert chosen[f"{tunable}:start_iter=2"].build().start_iter == 2
        assert f"{tunable}:start_iter=2" in [m.name for m in methods.select("gradcomp", with_torch=False)]
        assert methods.resolve(f"{tunable}:start_iter=3,rank=2").build().rank == 2
    finally:
        dict.__delitem__(gradcomp.REGISTRY, plain)
        dict.__delitem__(gradcomp.REGISTRY, tunable)
    names = [m.name for m in methods.select("all", with_torch=False)]
    assert plain not in names and f"{tunable}:start_iter=2" not in names


def test_method_specs_with_commas_and_their_pytorch_twins():
    from benchmarks.methods import select

    chosen = select("allreduce,powersgd:start_iter=2,rank=4,torch-fp16,powersgd-r1,gloo-fp16,"
                    "mpi-allreduce", with_torch=True)
    assert [m.name for m in chosen] == ["allreduce", "powersgd:rank=4,start_iter=2", "torch-fp16",
                                        "powersgd:rank=1,start_iter=2", "gloo-fp16", "mpi-allreduce"]
    by = {m.name: m for m in chosen}
    assert by["allreduce"].same_as == "torch-allreduce" and by["torch-fp16"].same_as == "fp16"
    assert by["powersgd:rank=4,start_iter=2"].same_as == "torch-powersgd-r4"
    assert by["gloo-fp16"].transport == "gloo" and by["gloo-fp16"].same_as == "torch-fp16"
    assert by["powersgd:rank=4,start_iter=2"].build().rank == 4
    hier = select("int8,hier-onebit:warmup=0,flat-int8", with_torch=False)
    assert [(m.name, m.spec, m.hierarchical) for m in hier] == [
        ("int8", "int8", None), ("hier-onebit:warmup=0", "onebit:warmup=0", True), ("flat-int8", "int8", False)]
    quoted = select("int8,auto:allowed='int8,powersgd:start_iter=2'", with_torch=False)
    assert [m.name for m in quoted] == ["int8", "auto:allowed='int8,powersgd:start_iter=2'"]
    assert quoted[1].build().allowed == ("int8", "powersgd:start_iter=2")
    everything = [m.name for m in select("everything", with_torch=True)]
    assert "torch-quantize-tensor" in everything
    assert "torch-quantize-tensor" not in [m.name for m in select("all", with_torch=True)]
    with pytest.raises(ValueError, match="needs torch"):
        select("torch-fp16", with_torch=False)
    with pytest.raises(ValueError, match="unknown method"):
        select("no-such-method", with_torch=False)


REGISTERED_WORKER = r"""
import sys
import gradcomp
gradcomp.register("zz-bench-new", gradcomp.Allreduce)
from benchmarks.worker import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_registered_name_is_benchmarked_with_no_edit(tmp_path):
    """A compressor registered before the worker starts is run by ``--methods all``."""
    from gradcomp.launcher import run

    out = tmp_path / "all.json"
    done = run(2, ["-c", REGISTERED_WORKER, "--model", "tiny", "--methods", "all", "--torch", "off",
                   "--repeats", "1", "--warmup", "3", "--out", str(out)], timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.output[-3000:]
    by = {r["method"]: r for r in json.loads(out.read_text())["results"]}
    assert by["zz-bench-new"]["time_s"] > 0 and by["zz-bench-new"]["rel_error"] < 1e-6
    assert "powersgd:start_iter=2" in by and by["powersgd:start_iter=2"]["compression_ratio"] > 1


# -- the worker, on real ranks, on both paths -------------------------------------------------------------
WORKER_METHODS = "allreduce,fp16,powersgd:rank=4,start_iter=2,torch-allreduce,torch-fp16"


def _worker(tmp_path, ranks, *options, name="job"):
    from gradcomp.launcher import run

    out = tmp_path / f"{name}.json"
    done = run(ranks, ["-m", "benchmarks.worker", "--model", "tiny", *options, "--out", str(out)],
               timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.output[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("path", ["reducer", "ddp"])
def test_worker_measures_each_path(tmp_path, path):
    """Both paths run every method with finite times, page-fault counts and bytes; fp32 methods
    are exact, and on the ddp path gradcomp's allreduce gives DDP's own result (fp32 rounding)."""
    pytest.importorskip("torch")
    from benchmarks.methods import split_methods
    from benchmarks.worker import _runqueue_wait

    data = _worker(tmp_path, 2, "--path", path, "--methods", WORKER_METHODS, "--repeats", "2",
                   "--warmup", "3")
    assert data["path"] == path and data["ranks"] == 2
    by = {r["method"]: r for r in data["results"]}
    baselines = ["memcpy"] if path == "reducer" else ["backward", "ddp-buckets", "ddp"]
    assert list(by) == baselines + split_methods(WORKER_METHODS)
    n = data["numel"]
    for name, r in by.items():
        assert "error" not in r, (name, r.get("error"))
        assert len(r["times_s"]) == 2 and all(np.isfinite(t) and t > 0 for t in r["times_s"]), name
        assert r["time_s"] > 0 and np.isfinite(r["time_s"]), name
        assert len(r["faults"]) == 2 and r["faults_per_step"] >= 0, name
        # CPU of both ranks per step, and its floor: that CPU spread over the cores, per fp32 step
        assert r["cpu_s"] > 0 and 0 <= r["cpu_system_share"] <= 1, name
        assert r["cpu_floor_vs_allreduce"] == pytest.approx(
            r["cpu_s"] / len(os.sched_getaffinity(0)) / by["allreduce"]["time_s"]), name
        # the whole machine's busy CPU over the step (rank 0, /proc/stat; in ticks of 10 ms, so a
        # tiny step may read 0: test_the_machine_busy_clock_counts_this_process_cpu checks the
        # clock), spread over every core
        assert 0 <= r["machine_cpu_s"] < 60, name
        assert r["machine_floor_vs_allreduce"] == pytest.approx(
            r["machine_cpu_s"] / os.cpu_count() / by["allreduce"]["time_s"]), name
        # both ranks' run-queue wait (Linux schedstat, in ns: a real, finite count, never more
        # than the threads of two ranks could wait within one step), where the worker's clock reads
        if _runqueue_wait() is not None:
            assert 0 <= r["runq_wait_s"] < 64 * max(r["times_s"]), name
    fp32 = 2 * (2 - 1) / 2 * 4 * n
    for name in ("allreduce", "torch-allreduce") + (("ddp",) if path == "ddp" else ()):
        assert by[name]["bytes_per_rank"] == pytest.approx(fp32), name
        assert by[name]["rel_error"] < 1e-6, name
    for name in ("fp16", "torch-fp16"):
        assert by[name]["bytes_per_rank"] == pytest.approx(fp32 / 2), name
        assert 1e-5 < by[name]["rel_error"] < 1e-2, name
    psgd = by["powersgd:rank=4,start_iter=2"]
    assert 0 < psgd["bytes_per_rank"] < fp32 / 2 and psgd["compression_ratio"] > 2
    assert psgd["label"] == "PowerSGD rank 4" and psgd["same_as"] == "torch-powersgd-r4"
    assert by["fp16"]["time_vs_same_method"] > 0 and by["allreduce"]["time_vs_allreduce"] == 1.0
    if path == "ddp":
        assert data["compute_s"] > 0 and by["backward"]["kind"] == "baseline"
        assert data["bucket_view"] == "on"  # gradient_as_bucket_view=True, as the README writes it
        # DDP's built-in allreduce (gloo) and gradcomp's (MPI) sum in different orders: equal to
        # fp32 rounding; PyTorch's allreduce_hook runs the very same gloo allreduce
        assert by["allreduce"]["rel_diff_vs_ddp"] < 1e-6
        assert by["torch-allreduce"]["rel_diff_vs_ddp"] < 1e-6
        assert by["fp16"]["rel_diff_vs_ddp"] == pytest.approx(by["fp16"]["rel_error"], rel=0.05)
        assert by["ddp"]["time_vs_ddp"] == 1.0
        # DDP around a hook that communicates nothing: a baseline, whose time every method's
        # step is also given less
        assert by["ddp-buckets"]["kind"] == "baseline"
        assert by["fp16"]["time_less_ddp_buckets_s"] == pytest.approx(
            by["fp16"]["time_s"] - by["ddp-buckets"]["time_s"])


def test_bench_cli_writes_json_csv_and_figures(tmp_path):
    out = tmp_path / "results"
    methods = "allreduce,fp16,allgather,quantize-channel,powersgd:rank=1,start_iter=2"
    names = ["allreduce", "fp16", "allgather", "quantize-channel", "powersgd:rank=1,start_iter=2"]
    cmd = [sys.executable, "-m", "benchmarks", "bench", "--models", "tiny", "--ranks", "1,2",
           "--methods", methods, "--torch", "off", "--repeats", "2", "--warmup", "3",
           "--kernel-mb", "1", "--kernel-methods", "allreduce,fp16,powersgd:rank=1,start_iter=2",
           "--quiet", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert (out / "tiny-2ranks-reducer.json").exists()  # --torch off: the reducer path only
    data = json.loads((out / "results.json").read_text())
    assert sorted(j["ranks"] for j in data["jobs"]) == [1, 2]
    assert {j["path"] for j in data["jobs"]} == {"reducer"}
    two = next(j for j in data["jobs"] if j["ranks"] == 2)
    by = {r["method"]: r for r in two["results"]}
    assert set(by) == {"memcpy"} | set(names)
    n = two["numel"]
    assert by["allreduce"]["bytes_per_rank"] == pytest.approx(2 * (2 - 1) / 2 * 4 * n)
    assert by["fp16"]["bytes_per_rank"] == pytest.approx(by["allreduce"]["bytes_per_rank"] / 2)
    assert by["allgather"]["bytes_per_rank"] == pytest.approx(4 * n)
    assert by["allreduce"]["rel_error"] < 1e-6
    assert 1e-5 < by["fp16"]["rel_error"] < 1e-2
    assert by["powersgd:rank=1,start_iter=2"]["compression_ratio"] > 2
    for r in two["results"]:
        assert r["time_s"] > 0 and len(r["times_s"]) == 2 and "faults_per_step" in r
    one = next(j for j in data["jobs"] if j["ranks"] == 1)
    assert all(r["bytes_per_rank"] == 0 for r in one["results"])
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert len(rows) == 2 * (1 + len(names))
    assert {r["path"] for r in rows} == {"reducer"} and all(r["faults_per_step"] != "" for r in rows)
    kernels = list(csv.DictReader((out / "kernels.csv").open()))
    assert kernels[0]["kernel"] == "memcpy" and float(kernels[0]["vs_memcpy"]) == 1.0
    for png in ("time_vs_bandwidth-tiny-reducer.png", "error_vs_ratio-tiny-reducer.png",
                "bytes_vs_ranks-tiny-reducer.png", "kernels.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png
    summary = (out / "summary.md").read_text()
    assert "| allreduce |" in summary and "faults/step" in summary and "CPU floor / fp32" in summary


def test_worker_blocks_order_times_every_method(tmp_path):
    """``--order blocks`` (what a training run looks like: one method's steps in a row) gives each
    method its own repeats and the same bytes (and, for stateless methods, errors) as the
    round-robin order."""
    results = {}
    for order in ("blocks", "round-robin"):
        data = _worker(tmp_path, 2, "--methods", "allreduce,fp16,powersgd:rank=1,start_iter=2",
                       "--torch", "off", "--repeats", "3", "--warmup", "3", "--order", order, name=order)
        assert data["order"] == order
        results[order] = {r["method"]: r for r in data["results"]}
    for name, r in results["blocks"].items():
        assert len(r["times_s"]) == 3 and r["time_s"] > 0, name
        other = results["round-robin"][name]
        assert r["bytes_per_rank"] == other["bytes_per_rank"], name
        if name in ("allreduce", "fp16"):  # stateless: the same first timed step in both orders
            assert r["rel_error"] == pytest.approx(other["rel_error"], rel=1e-6, abs=1e-12), name
    assert results["blocks"]["fp16"]["rel_error"] > 1e-5


# -- python -m benchmarks report ----------------------------------------------------------------------------
def _report(folder):
    return subprocess.run([sys.executable, "-m", "benchmarks", "report", str(folder), "--no-plots"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_report_on_an_empty_folder_writes_nothing(tmp_path):
    done = _report(tmp_path)
    assert done.returncode != 0 and "nothing written" in done.stderr
    assert list(tmp_path.iterdir()) == []


def _gathered_results():
    """A results.json as a committed results folder keeps it (no per-run JSON files beside it)."""
    path = os.path.join(ROOT, "benchmarks", "figures", "results.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        if data.get("jobs") or data.get("capped"):
            return data
    rows = [dict(method="memcpy", kind="baseline", time_s=0.01, times_s=[0.01], bytes_per_rank=0.0,
                 rel_error=0.0),
            dict(method="allreduce", kind="gradcomp", time_s=2.0, times_s=[2.0], bytes_per_rank=1.5e8,
                 rel_error=3e-8, time_vs_allreduce=1.0, compression_ratio=1.0)]
    return dict(meta={}, jobs=[], kernels=[], capped=[dict(model="resnet50", ranks=4, numel=25557032,
                                                            buckets=5, network="1gbit", results=rows)])


def test_report_on_a_gathered_folder_keeps_its_results(tmp_path):
    """``report`` on a folder that holds only results.json (benchmarks/figures) rebuilds from it instead
    of writing empty results over it."""
    from benchmarks import driver

    data = _gathered_results()
    (tmp_path / "results.json").write_text(json.dumps(data))
    (tmp_path / "summary.md").write_text("earlier summary\n")
    done = _report(tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    after = json.loads((tmp_path / "results.json").read_text())
    assert len(after["capped"]) == len(data["capped"]) and len(after["jobs"]) == len(data["jobs"])
    assert after["capped"] and after["capped"][0]["results"] == data["capped"][0]["results"]
    assert "| allreduce |" in (tmp_path / "summary.md").read_text()
    assert len(list(csv.DictReader((tmp_path / "results.csv").open()))) > 0
    # and called directly with nothing, report refuses and leaves the files alone
    before = (tmp_path / "results.json").read_bytes()
    with pytest.raises(SystemExit):
        driver.report(str(tmp_path), [], [], {}, plots=False, capped=[])
    assert (tmp_path / "results.json").read_bytes() == before


# -- benchmarks/capped.sh ------------------------------------------------------------------------------------
def _capped_available():
    if os.geteuid() != 0:
        return "benchmarks/capped.sh needs root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "benchmarks/capped.sh needs iproute2 (ip, tc)"
    probe = subprocess.run(["ip", "netns", "add", "gcbprobe"], capture_output=True)
    subprocess.run(["ip", "netns", "del", "gcbprobe"], capture_output=True)
    if probe.returncode != 0:
        return "network namespaces are not permitted here"
    return None


def _our_namespaces():
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith("gcb")]


RANK_PROGRAM = r"""
import os, sys
import numpy as np
from mpi4py import MPI
w = MPI.COMM_WORLD
addr = open('/proc/net/fib_trie').read()
assert '10.77.0.%d' % (w.rank + 1) in addr, 'rank %d is not in its own namespace' % w.rank
assert os.environ['GRADCOMP_NETWORK'] == '200mbit'
chosen = [k for k in os.environ if k.startswith('MALLOC_') or ('ALGORITHM' in k and k.startswith('MPIR_CVAR_'))]
assert not chosen, 'capped.sh set %s' % chosen
x = np.full(1000, w.rank + 1.0)
w.Allreduce(MPI.IN_PLACE, x)
assert (x == w.size * (w.size + 1) / 2).all()
sys.stdout.write('rank %d ok\n' % w.rank); sys.stdout.flush()
sys.exit(int(os.environ.get('FAIL_WITH', '0')))
"""


@pytest.mark.parametrize("fail_with", [0, 3])
def test_capped_runs_ranks_in_their_own_namespaces_and_cleans_up(fail_with):
    """Each rank runs inside its namespace over TCP, with no MPICH algorithm or allocator variable
    set by the script; namespaces go away on success and on failure."""
    why = _capped_available()
    if why:
        pytest.skip(why)
    before = _our_namespaces()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MALLOC_", "MPIR_CVAR_"))}  # what the script itself sets shows
    done = subprocess.run([CAPPED, "200mbit", "2", sys.executable, "-c", RANK_PROGRAM],
                          capture_output=True, text=True, timeout=180,
                          env=dict(env, FAIL_WITH=str(fail_with)))
    if fail_with:
        assert done.returncode != 0
    else:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        assert "rank 0 ok" in done.stdout and "rank 1 ok" in done.stdout
        assert "host 1 sent" in done.stderr
    assert _our_namespaces() == before


PROBE_PROGRAM = r"""
import json, time
import gradcomp
from gradcomp.planning.measurements import probe_link
comm = gradcomp.MPICommunicator()
before = comm.bytes_sent
start = time.perf_counter()
link = probe_link(comm, 6_500_000)  # a 25 MB first bucket, as GPT-2's
mine = {"rank": comm.rank, "beta": link.beta, "alpha": link.alpha,
        "probe_bytes": comm.bytes_sent - before, "seconds": time.perf_counter() - start}
every = comm.comm.gather(mine, root=0)  # one line from rank 0: two ranks' prints can interleave
if comm.rank == 0:
    print(json.dumps(every), flush=True)
"""


def test_link_probe_is_sized_to_the_link():
    """On a 1 Mbit/s link (2 emulated hosts) ``auto``'s link probe stops at small sizes: it sends
    under what two seconds of the link carry in all (probing up to the first bucket's 25 MB
    sent megabytes, minutes of that link), and the bandwidth it fits is the cap's order."""
    why = _capped_available()
    if why:
        pytest.skip(why)
    done = subprocess.run([CAPPED, "1mbit", "2", sys.executable, "-c", PROBE_PROGRAM],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    ranks = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(ranks) == 1 and len(ranks[0]) == 2, done.stdout
    ranks = ranks[0]
    for r in ranks:
        assert r["probe_bytes"] < 250_000, r  # under two seconds of the link's bytes
        assert 125_000 / 3 < r["beta"] < 125_000 * 3, r  # 1 Mbit/s is 125 KB/s
    print(ranks)


def test_worker_records_what_is_not_a_default_configuration(monkeypatch):
    """MPICH and allocator variables and the comparison knobs (jumbo frames, whole two-stage
    slices, ...) go into the job's ``settings``, which the report prints; capped.sh's own
    plumbing does not."""
    from benchmarks.worker import _settings

    for k in list(os.environ):
        if k.startswith(("MPIR_CVAR_", "MALLOC_", "CAPPED_", "GRADCOMP_")):
            monkeypatch.delenv(k)
    assert _settings() == {}
    monkeypatch.setenv("CAPPED_MTU", "9000")
    monkeypatch.setenv("GRADCOMP_TWO_STAGE_PIECES", "1")
    monkeypatch.setenv("MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM", "ring")
    monkeypatch.setenv("GRADCOMP_NETWORK", "1gbit")
    monkeypatch.setenv("MPIR_CVAR_NOLOCAL", "1")  # capped.sh's plumbing: between hosts anyway
    monkeypatch.setenv("MPIR_CVAR_CH4_NETMOD", "ofi")
    assert _settings() == {"CAPPED_MTU": "9000", "GRADCOMP_TWO_STAGE_PIECES": "1",
                           "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring"}


def test_capped_steps_runs_both_paths_and_the_mpich_ring_row(tmp_path):
    """``benchmarks/capped_steps.sh`` writes one JSON per path (``capped-RATE-PATH.json``), with
    ``MPICH_RING=1`` a tagged run with MPICH's ring selected, and rebuilds the report."""
    why = _capped_available()
    if why:
        pytest.skip(why)
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "MPIR_CVAR_"))}
    env.update(MODEL="tiny", METHODS="allreduce,torch-allreduce", REPEATS="1", MPICH_RING="1",
               PYTHON=sys.executable)
    before = _our_namespaces()
    done = subprocess.run([os.path.join(ROOT, "benchmarks", "capped_steps.sh"), str(tmp_path), "1gbit", "2"],
                          capture_output=True, text=True, timeout=240, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert _our_namespaces() == before
    for path in ("reducer", "ddp"):
        data = json.loads((tmp_path / f"capped-1gbit-{path}.json").read_text())
        assert data["path"] == path and data["network"] == "1gbit" and data["ranks"] == 2
        assert "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM" not in data["settings"]
        assert {"allreduce", "torch-allreduce"} <= {r["method"] for r in data["results"]}
    ring = json.loads((tmp_path / "capped-1gbit-reducer-mpich-ring.json").read_text())
    assert ring["settings"]["MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"] == "ring"
    by = {r["method"]: r for r in ring["results"]}
    assert {"allreduce (MPICH ring, tuned)", "mpi-allreduce (MPICH ring, tuned)"} <= set(by)
    assert by["mpi-allreduce (MPICH ring, tuned)"]["rel_error"] < 1e-6
    summary = (tmp_path / "summary.md").read_text()
    assert "| mpi-allreduce (MPICH ring, tuned) |" in summary and "1gbit x2 ddp" in summary


def test_capped_rejects_bad_arguments():
    done = subprocess.run([CAPPED, "1gbit", "zero", "true"], capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "NRANKS must be a number" in done.stderr


def test_capped_skips_clearly_without_root():
    setpriv = shutil.which("setpriv")
    if os.geteuid() == 0 and not setpriv:
        pytest.skip("running as root and no setpriv to drop privileges")
    prefix = [] if os.geteuid() != 0 else [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    # a copy the unprivileged user can read, whatever the permissions of the checkout's folders
    import tempfile

    folder = tempfile.mkdtemp(prefix="gcb-")
    try:
        os.chmod(folder, 0o755)
        script = os.path.join(folder, "capped.sh")
        shutil.copy(CAPPED, script)
        os.chmod(script, 0o755)
        done = subprocess.run(prefix + [script, "1gbit", "2", "true"], capture_output=True, text=True,
                              timeout=30, cwd=folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 77
    assert "skipped: needs root" in done.stderr


def test_the_link_check_refuses_a_slow_link():
    """benchmarks/link.py: tc's rate units, and a capped fp32 run below 85% of its cap is refused
    (a bandwidth-bound one: a latency-bound tiny model is not checked)."""
    from benchmarks import link

    assert link.rate_bits("1gbit") == 1e9 and link.rate_bits("500mbit") == 5e8 and link.rate_bits("125mbps") == 1e9
    with pytest.raises(ValueError, match="rate"):
        link.rate_bits("fast")
    big = 146 * 2**20  # ResNet-50's fp32 bytes per rank at 4 ranks

    def job(seconds, nbytes=big):
        return {"network": "1gbit", "results": [{"method": "allreduce", "time_s": seconds, "bytes_per_rank": nbytes}]}

    assert link.goodput(job(1.30)) == pytest.approx(big * 8 / 1.30 / 1e9)
    assert link.problem(job(1.30)) is None            # 94% of the cap
    assert "below its rate" in link.problem(job(2.4))  # the old 64 KB bucket's half rate
    assert link.problem(job(2.4, nbytes=1e5)) is None  # latency-bound: not checked
    assert link.problem({"network": "", "results": []}) is None
    counted = job(1.30)  # the host's own counter, where the worker read it, wins over the formula
    counted["results"][0]["host_link_bytes_per_step"] = big / 2
    assert link.goodput(counted) == pytest.approx(big / 2 * 8 / 1.30 / 1e9)
    counted["results"].append({"method": "flat-allreduce", "time_s": 2.4, "bytes_per_rank": big})
    assert "below its rate" in link.problem(counted)  # the flat schedule is the link's test


def test_the_worker_names_methods_timed_in_their_warm_up():
    """``int8`` averages its first 50 steps exactly: a bench of it with 3 untimed steps would time
    fp32 allreduces, and the worker says so, naming the steady spec; the steady spec, PowerSGD's
    (``start_iter=2``, within 3 steps) and ``auto`` are not named."""
    from benchmarks.methods import select
    from benchmarks.worker import warmup_warnings

    said = warmup_warnings(select("int8,int8:warmup=0,powersgd:start_iter=2,auto,allreduce", with_torch=False), 3)
    assert len(said) == 1 and "int8 averages its first 50 steps" in said[0] and "'int8:warmup=0'" in said[0], said
    assert warmup_warnings(select("int8", with_torch=False), 50) == []


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_the_machine_busy_clock_counts_this_process_cpu():
    """``_machine_busy`` (the worker's machine-wide CPU floor) advances at least by the CPU time
    this process burns (every other process only adds), and by no more than every core's share
    of the wall time."""
    import time

    from benchmarks.worker import _machine_busy

    b0, c0, t0 = _machine_busy(), time.process_time(), time.perf_counter()
    while time.process_time() - c0 < 0.5:
        pass
    b1, c1, t1 = _machine_busy(), time.process_time(), time.perf_counter()
    assert b0 is not None and b1 is not None
    assert b1 - b0 >= (c1 - c0) - 0.05  # USER_HZ ticks: 10 ms each, at both ends
    assert b1 - b0 <= (t1 - t0) * os.cpu_count() + 0.05


def test_the_run_queue_clock_counts_a_wait_for_a_shared_core():
    """``_runqueue_wait`` (the worker's ``runq_wait_s``) grows while this thread shares its one
    core with a spinning process, and by no more than the time that passed."""
    import time

    from benchmarks.worker import _runqueue_wait

    if _runqueue_wait() is None:
        pytest.skip("this kernel has no per-thread schedstat")
    mine = os.sched_getaffinity(0)
    core = min(mine)
    rival = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{core}}})\n"
                              "print('spinning', flush=True)\nwhile True: pass"],
                             stdout=subprocess.PIPE, text=True)
    try:
        os.sched_setaffinity(0, {core})  # this thread only
        assert rival.stdout is not None and rival.stdout.readline().strip() == "spinning"
        w0, t0 = _runqueue_wait(), time.perf_counter()
        while time.perf_counter() - t0 < 0.5:
            pass
        w1, t1 = _runqueue_wait(), time.perf_counter()
    finally:
        os.sched_setaffinity(0, mine)
        rival.kill()
        rival.communicate()
    assert w0 is not None and w1 is not None
    assert 0 < w1 - w0 <= t1 - t0
