"""One benchmark job, run on every rank: ``mpiexec -n N python -m benchmarks.worker ...``.

It measures what users get, on one of two paths (``--path``):

``reducer``: the README's NumPy path. Every rank keeps gradient arrays of the model's shapes
(heavy-tailed, its own), refilled in place before each step, outside the clock (``np.copyto``
from a saved copy: that stands in for the backward pass). A gradcomp method's step is
``GradientReducer(arrays, gradcomp.make(spec), comm).step()``, one reducer per method, built once.
PyTorch's hooks are called on the same bucket layout through ``HookBucket`` (a GradBucket
stand-in; their bucket tensors are restored before each step, outside the clock): the
single-collective hooks get every bucket at once (as DDP gives them), PowerSGD and quantization
one bucket at a time (their callback-launched rounds would otherwise interleave differently on
different ranks). Baseline row ``memcpy``: the refill itself.

``ddp``: the DDP hook path. Every method gets its own ``torch.nn.parallel.DistributedDataParallel``
(gloo, CPU, ``bucket_cap_mb``, ``gradient_as_bucket_view=True`` as the README writes it
(``--bucket-view off``: DDP's default), DDP's other defaults) over a module holding ``nn.Parameter``s of the
model's shapes (the parameter storage is shared by all models; DDP's buckets are each model's own).
Its backward is synthetic and cheap, the same work for every method: a custom autograd function
hands back, as each parameter's gradient, a tensor over the rank's fixed heavy-tailed gradient
array, which autograd takes as ``.grad`` without a copy, as it takes the fresh gradients of a real
backward. The arrays are refilled before each step, outside the clock, as on the reducer path
(DDP writes the means into ``.grad``, here those arrays). So the step's allocations are DDP's and
the hook's, not a model's (``--backward fresh`` clones the gradients every step instead, as a real
backward allocates them). A step is ``zero_grad(set_to_none=True)`` + forward + backward, timed
whole: DDP runs the hooks during the backward and waits for them before it returns. Rows:
``backward`` (the same module without DDP: the compute and autograd's bookkeeping alone, no
communication), ``ddp-buckets`` (DDP with a hook that hands each bucket straight back: the
backward plus DDP's own work around any hook, chiefly copying every gradient into its bucket,
one pass over the model's gradients that the reducer path's step does not contain, its
gradients living in its buckets already; ``time_less_ddp_buckets_s``, a method's step less this
row, is what compares with the method's reducer step), ``ddp`` (DDP without a hook: its
built-in allreduce, the reference), every
gradcomp spec through ``gradcomp.torch.register(model, gradcomp.make(spec))`` (MPI under mpiexec;
``gloo-`` methods over ``TorchCommunicator``), and PyTorch's hooks through
``model.register_comm_hook``. Models are built once and warmed up (DDP rebuilds its buckets after
the first step).

On both paths: a step's time is the slowest rank's, after a barrier; the reported time is the
median over ``--repeats`` steps that follow ``--warmup`` untimed ones (PowerSGD specs run with
``start_iter=2``, so 3 warm-up steps make every timed step a compressed one). Minor page faults
(``getrusage(RUSAGE_SELF).ru_minflt``, all threads of the rank) are counted around every timed
step: ``faults_per_step`` is the median over steps of the largest count of any rank (gradcomp's
steady state should allocate nothing; with glibc's defaults every fresh allocation of tens of MB
costs first-touch faults). CPU time is counted the same way (user + system, all threads):
``cpu_s`` is the median over steps of the sum over ranks, and ``cpu_floor_vs_allreduce`` that
sum spread over the cores the ranks share (``len(os.sched_getaffinity(0))``) as a fraction of the
fp32 allreduce step: a step cannot take less than its floor, whatever the network, so a method
whose floor is near its step time is bound by the CPU, not the wire. Rank 0 also reads the whole
machine's busy CPU seconds over each step (``machine_cpu_s``, from a barrier before the step to
one after it whose ranks sleep while they wait; ``machine_floor_vs_allreduce`` spreads them over
all cores): on ``benchmarks/capped.sh``'s link that adds what the emulated hosts' network stacks do
outside the ranks' own accounts. ``runq_wait_s`` is the median over steps of the time every
rank's threads spent runnable but not running (summed over ranks; Linux's per-thread schedstat):
what ranks that share cores lose queueing for them. By default the timed steps
go round-robin over the methods, so that a burst of load from other processes slows every method alike; ``--order blocks`` builds, warms up
and times one method at a time (as a training run repeats one method; also only one method's
memory is alive at a time, which BERT-sized runs with many methods need). The relative error is
measured against the exact mean (a float64 MPI allreduce of everyone's gradients) on the first
timed step, outside the clock; on the ``ddp`` path also against DDP's own result
(``rel_diff_vs_ddp``). Bytes on the wire: gradcomp's compressors count them
(``Compressor.stats()``); for PyTorch's hooks, the torch.distributed collectives they call are
counted with the same bandwidth-optimal formulas (``gradcomp.comm.wire_bytes``); DDP's own
allreduce by that formula. On ``benchmarks/capped.sh``'s link every rank also reads its emulated host's
own counter of bytes sent (``host_link_bytes_per_step``: the busiest host, after a barrier that
closes the step, outside the clock), which the link check and the hierarchical tables use. torch
runs one thread per rank, like gradcomp's BLAS (ranks share the cores).

Rank 0 prints ``@progress DONE TOTAL NAME`` lines (for the driver's progress bar) and writes the
results as JSON to ``--out``. The paths and the cases they step are in ``benchmarks.paths``;
this module is the job: the command line, the timed loop, the errors and the summary rows.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from typing import Any

import numpy as np

from gradcomp.bucket import group
from gradcomp.comm import wire_bytes
from gradcomp.planning.cost import pipelined

from .methods import Method, select
from .paths import PATHS, Case, DDPPath, ReducerPath
from .shapes import heavy_tailed, model_shapes, numel


def _link_tx() -> int | None:
    """Bytes this emulated host has sent on its capped link so far (``eth0``'s counter in the
    network namespace ``benchmarks/capped.sh`` put this rank in, shared by the host's ranks, frames with
    their TCP/IP headers and the ACKs of what it received); None outside ``capped.sh``."""
    if "GRADCOMP_NETNS_PREFIX" not in os.environ:
        return None
    try:
        with open("/sys/class/net/eth0/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return None


def _machine_busy() -> float | None:
    """CPU seconds the whole machine has been busy so far, all cores and every process and kernel
    thread (``/proc/stat``: user, nice, system, irq, softirq, steal), or None where it cannot be
    read. On ``benchmarks/capped.sh``'s link the emulated hosts' network stacks (veth, bridge, tbf)
    run on the same cores as the ranks, partly in softirq context that no rank's ``getrusage``
    counts: this is the CPU a step needs on this machine, ranks and network together. (Measured
    at 1 Gbit/s x 4 ranks: within 0.95-1.15x the ranks' own CPU, most of the network's work is
    charged to the ranks' system time.)"""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    ticks = [int(v) for v in fields[1:9]]
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + (ticks[7] if len(ticks) > 7 else 0)
    return busy / os.sysconf("SC_CLK_TCK")


def _runqueue_wait() -> float | None:
    """Seconds this rank's threads have so far spent runnable but not running (the second field
    of Linux's per-thread ``/proc/self/task/*/schedstat``), or None where it cannot be read. Ranks
    that share cores queue for them here; when the thread that waits is one whose next message
    every rank needs (the pipeline's wire thread), that wait is step time that neither the link
    nor the CPU floor accounts for."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    total, read = 0, False
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            read = True
        except (OSError, IndexError, ValueError):
            continue  # a thread that ended meanwhile, or no such field here
    return total / 1e9 if read else None


def _quiet_barrier(world: Any) -> None:
    """A barrier whose waiting ranks sleep between tests instead of spinning (MPI's ``Barrier``
    spins): a rank that finished its step early must not take a core from one still working (4
    ranks share 2 cores here), nor count as the machine's busy time (``_machine_busy``)."""
    request = world.Ibarrier()
    pause = 2e-6
    while not request.Test():
        time.sleep(pause)
        pause = min(pause * 2, 2e-4)


def _progress(rank: int, done: int, total: int, name: str) -> None:
    if rank == 0:
        print(f"@progress {done} {total} {name}", flush=True)


def _usage() -> tuple[int, float, float]:
    """(minor page faults, user CPU s, system CPU s) of this rank so far, all its threads."""
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_minflt, u.ru_utime, u.ru_stime


_CHUNK = 1 << 20


def _rel_diff(outs: list, refs: list) -> float:
    """``||outs - refs|| / ||refs||`` over all arrays, in float64, a chunk at a time (no
    model-sized temporaries)."""
    num = den = 0.0
    for o, e in zip(outs, refs):
        o, e = np.asarray(o).reshape(-1), np.asarray(e).reshape(-1)
        for s in range(0, e.size, _CHUNK):
            ref = e[s:s + _CHUNK].astype(np.float64, copy=False)
            d = o[s:s + _CHUNK].astype(np.float64) - ref
            num += float(d @ d)
            den += float(ref @ ref)
    return float(np.sqrt(num / den)) if den > 0 else 0.0


# -- the job --------------------------------------------------------------------------------------------
def _exact_mean(world: Any, grads: list[np.ndarray]) -> list[np.ndarray]:
    from mpi4py import MPI

    exact = []
    for g in grads:
        e = g.astype(np.float64)
        world.Allreduce(MPI.IN_PLACE, e, op=MPI.SUM)
        e /= world.Get_size()
        exact.append(e)
    return exact


#: gradcomp's and benchmarks/capped.sh's comparison knobs: a run with one set is not a default one
_KNOBS = ("CAPPED_MTU", "GRADCOMP_TWO_STAGE_PIECES", "GRADCOMP_PIPELINE_DEPTH", "GRADCOMP_MPI_WAIT")
#: what benchmarks/capped.sh sets so that MPI's traffic crosses the capped interface, as it does between
#: hosts (no shared memory): the emulated network, not a tuning
_NETWORK_PLUMBING = ("MPIR_CVAR_NOLOCAL", "MPIR_CVAR_CH4_NETMOD")


def not_default(name: str) -> bool:
    """Whether environment variable ``name`` makes a run differ from a user's default
    configuration: an MPICH (other than the emulated network's plumbing) or glibc allocator
    variable, or a comparison knob."""
    mpich_or_malloc = name.startswith(("MPIR_CVAR_", "MALLOC_")) and name not in _NETWORK_PLUMBING
    return mpich_or_malloc or name in _KNOBS


def _settings() -> dict[str, str]:
    """The variables of this run's environment that ``not_default`` names (the report prints them
    per job)."""
    return {k: v for k, v in sorted(os.environ.items()) if not_default(k)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    methods = select(args.methods, with_torch=None if args.torch == "auto" else args.torch == "on",
                     path=args.path)
    if args.path == "ddp" and args.torch == "off":
        raise SystemExit("benchmarks.worker: --path ddp needs torch (got --torch off)")
    if rank == 0:
        for line in warmup_warnings(methods, args.warmup):
            print(line, file=sys.stderr, flush=True)
    shapes = model_shapes(args.model)
    grads = heavy_tailed(shapes, seed=args.seed + rank)
    exact = _exact_mean(world, grads)
    path: ReducerPath | DDPPath
    path = ReducerPath(args, grads, size) if args.path == "reducer" else DDPPath(args, grads, size)
    reference_name = path.reference()
    reference: list[np.ndarray] | None = None  # the reference method's first timed result (ddp path)
    total = len(methods) + 2
    _progress(rank, 0, total, "baselines")
    results: list[dict[str, Any]] = []
    times: dict[str, list[float]] = {}
    faults: dict[str, list[int]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}  # (user, system) seconds of each timed step
    link: dict[str, list[int]] = {}  # bytes this rank's host sent on its capped link, per timed step
    machine: dict[str, list[float]] = {}  # rank 0: the machine's busy CPU seconds, per timed step
    waits: dict[str, list[float]] = {}  # this rank's run-queue wait seconds (NaN: unknown), per step
    errors: dict[str, float] = {}
    diffs: dict[str, float] = {}

    def open_case(i: int, m: Method) -> Case | None:
        """The method built and warmed up, or None (its failure recorded)."""
        try:
            case = path.case(m)
            for _ in range(args.warmup):
                case.prepare()
                case.step()
                case.release()
            return case
        except Exception as exc:  # a PyTorch hook whose own arithmetic fails (the same on every rank)
            if m.kind == "gradcomp":
                raise
            world.Barrier()
            results.append(dict(method=m.name, kind=m.kind, label=m.label, same_as=m.same_as,
                                error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"))
            return None
        finally:
            _progress(rank, i + 1, total, m.name)

    def timed_step(case: Case, rep: int) -> None:
        nonlocal reference
        case.prepare()  # restoring overwritten gradients is not part of the step
        world.Barrier()
        tx0 = _link_tx()
        m0 = _machine_busy() if rank == 0 else None
        with case.timed():
            f0, u0, s0 = _usage()
            w0 = _runqueue_wait()
            t0 = time.perf_counter()
            case.step()
            t = time.perf_counter() - t0
            w1 = _runqueue_wait()
            f1, u1, s1 = _usage()
        _quiet_barrier(world)  # every rank has finished the step (and sent its bytes)
        if m0 is not None:
            m1 = _machine_busy()
            machine.setdefault(case.name, []).append((m1 or m0) - m0)
        if tx0 is not None:
            link.setdefault(case.name, []).append((_link_tx() or 0) - tx0)
        times[case.name].append(t)
        faults[case.name].append(f1 - f0)
        cpu[case.name].append((u1 - u0, s1 - s0))
        waits.setdefault(case.name, []).append(float("nan") if w0 is None or w1 is None else w1 - w0)
        if rep == 0:  # after the clock, kept as numbers (a copy per method would not fit in memory)
            if case.kind == "baseline":
                errors[case.name] = 0.0
            else:
                outs = case.outputs()
                errors[case.name] = _rel_diff(outs, exact)
                if case.name == reference_name:
                    reference = [np.array(o, copy=True) for o in outs]
                elif reference is not None and case.kind != "baseline":
                    diffs[case.name] = _rel_diff(outs, reference)
                del outs
        # Let go of this step's results before the next one, as training reuses its gradient memory
        case.release()

    baselines = path.baselines()
    for case in baselines:
        for _ in range(args.warmup):
            case.prepare()
            case.step()
            case.release()
    cases = list(baselines)
    for case in cases:
        times[case.name], faults[case.name], cpu[case.name] = [], [], []
    if args.order == "blocks":
        closed = []
        for case in cases:
            case.begin()
            for rep in range(args.repeats):
                timed_step(case, rep)
        for i, m in enumerate(methods):
            opened = open_case(i, m)
            if opened is None:
                continue
            case = opened
            times[case.name], faults[case.name], cpu[case.name] = [], [], []
            case.prepare()
            case.step()  # one more untimed step: the previous method's memory churn settles
            case.release()
            case.begin()
            for rep in range(args.repeats):
                timed_step(case, rep)
            closed.append(_summary(case, args.repeats))
            case.close()
        finished = [_summary(c, args.repeats) for c in cases] + closed
    else:
        for i, m in enumerate(methods):
            opened = open_case(i, m)
            if opened is not None:
                cases.append(opened)
                times[opened.name], faults[opened.name], cpu[opened.name] = [], [], []
        for case in cases:
            case.begin()
        for rep in range(args.repeats):
            for case in cases:
                timed_step(case, rep)
        finished = [_summary(c, args.repeats) for c in cases]
    _progress(rank, total - 1, total, "timed steps")
    for row in finished:
        name = row["method"]
        slowest = np.array(times[name])
        world.Allreduce(MPI.IN_PLACE, slowest, op=MPI.MAX)
        most = np.array(faults[name], dtype=np.int64)
        world.Allreduce(MPI.IN_PLACE, most, op=MPI.MAX)
        used = np.array(cpu[name], dtype=np.float64)  # (steps, 2): this rank's user, system
        world.Allreduce(MPI.IN_PLACE, used, op=MPI.SUM)
        total_cpu = used.sum(axis=1)
        if name in link:  # the busiest host's link
            sent = np.array(link[name], dtype=np.int64)
            world.Allreduce(MPI.IN_PLACE, sent, op=MPI.MAX)
            row["host_link_bytes_per_step"] = float(np.median(sent))
        row.update(times_s=slowest.tolist(), time_s=float(np.median(slowest)),
                   faults=most.tolist(), faults_per_step=float(np.median(most)),
                   cpu_s=float(np.median(total_cpu)),
                   cpu_system_share=float(used[:, 1].sum() / max(used.sum(), 1e-12)),
                   rel_error=errors[name])
        if name in machine:
            row["machine_cpu_s"] = float(np.median(machine[name]))
        waited = np.array(waits[name], dtype=np.float64)  # (a rank that cannot read it: NaN)
        world.Allreduce(MPI.IN_PLACE, waited, op=MPI.SUM)
        if np.isfinite(waited).all():
            row["runq_wait_s"] = float(np.median(waited))
        if name in diffs:
            row[f"rel_diff_vs_{reference_name}"] = diffs[name]  # (a reference ran: a name)
        results.append(row)
    order = [c.name for c in baselines] + [m.name for m in methods]
    results.sort(key=lambda r: order.index(r["method"]))
    for case in cases:
        case.close()
    path.close()
    _progress(rank, total, total, "done")
    n = numel(shapes)
    by = {r["method"]: r for r in results}
    job = dict(model=args.model, ranks=size, path=args.path, numel=n,
               buckets=len(group(grads, args.bucket_mb)), bucket_mb=args.bucket_mb,
               repeats=args.repeats, warmup=args.warmup, order=args.order, host=platform.node(),
               cpus=os.cpu_count(), network=os.environ.get("GRADCOMP_NETWORK", ""),
               ranks_per_host=int(os.environ.get("GRADCOMP_RANKS_PER_HOST", "1") or 1),
               settings=_settings(), tag=args.tag or "", reducer_arrays=args.reducer_arrays,
               backward=args.backward if args.path == "ddp" else None,
               bucket_view=args.bucket_view if args.path == "ddp" else None,
               results=_with_ratios(results, n, size, len(os.sched_getaffinity(0))))
    if "backward" in by and "time_s" in by["backward"]:
        job["compute_s"] = by["backward"]["time_s"]
    if "torch" in sys.modules:  # (importing it only to say which would cost seconds)
        job["torch"] = sys.modules["torch"].__version__
    if args.tag:
        _apply_tag(job["results"], args.tag)
    return job


def warmup_warnings(methods: list[Method], untimed: int) -> list[str]:
    """A line per gradcomp method whose exact warm-up outlasts the ``untimed`` steps: some of its
    timed steps would be fp32 allreduces (``int8`` averages its first 50 exactly). Names the spec
    of the method itself (``steady``); a spec with nothing to shorten (``auto``) is not named."""
    from gradcomp.registry import steady

    out = []
    for m in methods:
        itself = steady(m.spec) if m.kind == "gradcomp" and m.spec is not None else None
        if itself is not None and itself != m.spec:
            left = m.build().warmup_steps
            if left > untimed:
                out.append(f"warning: {m.name} averages its first {left} steps exactly (its warm-up), "
                           f"more than the {untimed} untimed ones: time {itself!r} for the method itself")
    return out


def _summary(case: Case, steps: int) -> dict[str, Any]:
    nbytes, rounds = case.traffic(steps)
    row: dict[str, Any] = dict(method=case.name, kind=case.kind, label=case.label, same_as=case.same_as,
                               bytes_per_rank=nbytes, rounds_per_step=rounds)
    if case.spec is not None:
        row["spec"] = case.spec
    if case.compressor is not None:
        row["compressor"] = repr(case.compressor)
        row["label"] = case.label or row["compressor"]
        stats = case.compressor.stats()
        choices = stats.get("choices")
        if choices:  # auto: what it chose per bucket, the step its cost model predicted, and from what
            row["choices"] = {str(c["bucket"]): c["chosen"] for c in choices}
            if all(c["chosen"] in c["stages_s"] for c in choices):  # (one host: the topology chose,
                # nothing predicted, unless auto:predict=True)
                row["predicted_s"] = pipelined([c["stages_s"][c["chosen"]] for c in choices])
            row["measured"] = {k: stats[k] for k in ("link", "compute_s_per_byte", "local_stage_share") if k in stats}
    return row


def _apply_tag(rows: list[dict[str, Any]], tag: str) -> None:
    """Method names become ``NAME (TAG)`` (baselines keep theirs): rows of a run under a special
    setting (``--tag "MPICH ring, tuned"``) never pass for the default ones in a report."""
    for r in rows:
        if r.get("kind") == "baseline":
            continue
        r["method"] = f"{r['method']} ({tag})"
        if r.get("same_as"):
            r["same_as"] = f"{r['same_as']} ({tag})"


def _with_ratios(results: list[dict[str, Any]], n: int, size: int, cores: int) -> list[dict[str, Any]]:
    by = {r["method"]: r for r in results if "time_s" in r}
    fp32 = by.get("allreduce", {}).get("time_s")
    fp32_bytes = wire_bytes("allreduce", 4 * n, size)
    for r in results:
        if "time_s" not in r:
            continue
        for base in ("memcpy", "backward", "ddp", "allreduce", "fp16"):
            if base in by and by[base]["time_s"] > 0:
                r[f"time_vs_{base}"] = r["time_s"] / by[base]["time_s"]
        if fp32 and "cpu_s" in r:
            r["cpu_floor_vs_allreduce"] = r["cpu_s"] / cores / fp32
        if fp32 and "machine_cpu_s" in r:
            r["machine_floor_vs_allreduce"] = r["machine_cpu_s"] / (os.cpu_count() or 1) / fp32  # /proc/stat counts every core
        if r["kind"] != "baseline":
            r["compression_ratio"] = fp32_bytes / r["bytes_per_rank"] if r["bytes_per_rank"] else None
        if "ddp-buckets" in by and r["kind"] != "baseline":
            r["time_less_ddp_buckets_s"] = r["time_s"] - by["ddp-buckets"]["time_s"]
        twin = by.get(r.get("same_as") or "")
        if twin is not None:
            r["time_vs_same_method"] = r["time_s"] / twin["time_s"]
    return results


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.worker",
                                description="one benchmark job on every rank of an mpiexec launch")
    p.add_argument("--reducer-arrays", choices=("views", "own"), default="views",
                   help="reducer path: gradients in GradientReducer.gradients (views into its "
                        "buffers, the README's form) or in arrays of their own (copied in and out)")
    p.add_argument("--path", choices=PATHS, default="reducer",
                   help="reducer: GradientReducer on NumPy arrays (the README path); ddp: "
                        "DistributedDataParallel with each method as its comm hook")
    p.add_argument("--model", default="resnet50", help="resnet50, bert-base or tiny")
    p.add_argument("--methods", default="all",
                   help="comma-separated: all, gradcomp, torch, everything, compressor specs "
                        "(NAME[:key=value,...] from gradcomp.REGISTRY; gloo-SPEC over gloo), "
                        "torch-* hooks, mpi-allreduce (see benchmarks.methods)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 3 for PowerSGD)")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--order", choices=("round-robin", "blocks"), default="round-robin",
                   help="timed steps round-robin over the methods (spreads load from other "
                        "processes over all methods alike) or each method built, warmed up and "
                        "timed in one block (steady state, as in training; one method's memory "
                        "alive at a time)")
    p.add_argument("--torch", choices=("auto", "on", "off"), default="auto")
    p.add_argument("--backward", choices=("handover", "fresh"), default="handover",
                   help="ddp path: the synthetic backward hands autograd tensors over the fixed "
                        "gradients, taken as .grad without a copy (default: the step's "
                        "allocations are DDP's and the hook's), or clones them every step "
                        "(fresh: a new 4-bytes-per-parameter gradient each step, as a real "
                        "backward allocates, with its page faults and memory traffic)")
    p.add_argument("--bucket-view", choices=("on", "off"), default="on",
                   help="ddp path: DistributedDataParallel(gradient_as_bucket_view=...), on as the "
                        "README writes it (gradients are views into DDP's buckets: one copy of "
                        "every gradient a step fewer); off is DDP's default")
    p.add_argument("--tag", default="", help="append ' (TAG)' to every method name in the results "
                   "(a run under a non-default setting, e.g. 'MPICH ring, tuned')")
    p.add_argument("--out", required=True, help="JSON file rank 0 writes")
    return p


def _two_stage_pieces() -> None:
    """The pieces ablation: ``GRADCOMP_TWO_STAGE_PIECES=N`` cuts a two-stage slice into at most N
    pieces in this job (``gradcomp.compressors.set_two_stage_pieces``; 1: whole slices, same bits)."""
    text = os.environ.get("GRADCOMP_TWO_STAGE_PIECES")
    if text is None:
        return
    value = int(text) if text.strip().isdigit() else 0
    if value < 1:
        raise ValueError(f"GRADCOMP_TWO_STAGE_PIECES must be a whole number >= 1, got {text!r}")
    from gradcomp.compressors import set_two_stage_pieces

    set_two_stage_pieces(value)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    _two_stage_pieces()
    if args.warmup < 3:
        print("warning: fewer than 3 warm-up steps: PowerSGD (start_iter=2) is timed before it "
              "compresses", file=sys.stderr)
    result = run(args)
    from mpi4py import MPI

    from .link import goodput, problem

    result["link_goodput"] = goodput(result)
    why = problem(result)
    if why:
        result["link_problem"] = why
    if MPI.COMM_WORLD.Get_rank() == 0:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        if why:
            print(f"capped link: {why}", file=sys.stderr, flush=True)
        elif result["link_goodput"] is not None:
            print(f"capped link: fp32 allreduce at {result['link_goodput']:.0%} of the {result['network']} cap",
                  file=sys.stderr, flush=True)
    return 3 if why else 0


if __name__ == "__main__":
    sys.exit(main())
