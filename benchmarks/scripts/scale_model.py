"""The cost model against measured steps, and what it predicts for larger clusters.

    python benchmarks/scripts/scale_model.py --fit RUN41.json --check RUN22a.json RUN22b.json RUN14.json

Each RUN is a ``benchmarks.worker`` result on the reducer path (``benchmarks/capped_steps.sh``,
with ``CAPPED_HOSTS`` for the shape). The constants (network and local links, each method's compute per
byte: ``benchmarks.fit.fit``) come from the ``--fit`` runs; the model then predicts every
row of every run, ``--check`` ones included, and the table says how far off it is. ``hier-SPEC`` and ``flat-SPEC``
rows name their schedule; plain ones ran the default's.

Where a run was on ``capped.sh``'s link, the bytes the busiest host sent on it per step
(``host_link_bytes_per_step``, the namespace's counter: TCP/IP headers and ACKs included, a few
tenths of a percent with the veth's large segments) are set beside the schedule's formula.

Then the predictions: the step of every fitted method, flat and hierarchical, at 8x8, 64x8 and
512x8 ranks on 100 and 10 Gbit/s links between hosts (latency ``REAL_ALPHA``, a host's own path
``REAL_LOCAL``), a core per rank, and the link speed below which each method beats fp32
allreduce (where compression starts to pay).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # benchmarks/ (the checkout)

from benchmarks.fit import fit  # noqa: E402
from benchmarks.shapes import model_shapes  # noqa: E402
from benchmarks.tables import aligned_table  # noqa: E402
from gradcomp.bucket import group  # noqa: E402
from gradcomp.planning import cost  # noqa: E402
from gradcomp.registry import make  # noqa: E402

SHAPES = ((8, 8), (64, 8), (512, 8))
RATES = (("100 Gbit/s", 100e9 / 8), ("10 Gbit/s", 10e9 / 8))
#: inside a real host: shared memory or NVLink-class paths, well above the network (an assumption:
#: the emulated hosts' shared memory here is slowed by the wire thread's sleeping wait)
REAL_LOCAL = cost.Link(5e-6, 20e9)
#: a real network's latency per message (an assumption: the emulated link's fitted alpha holds the
#: scheduling delays of 4 ranks and 4 emulated kernels on 2 cores, not a wire's latency)
REAL_ALPHA = 25e-6


def buckets(model: str, bucket_mb: float) -> list[list[tuple[int, ...]]]:
    shapes = model_shapes(model)
    views = [np.broadcast_to(np.float32(0), s) for s in shapes]  # shape and size, no memory
    return [[shapes[i] for i in members] for members in group(views, bucket_mb)]


def spec_of(row: dict, several: bool) -> tuple[str, bool]:
    """(the compressor spec, whether it ran hierarchically: a ``hier-`` row, or a plain one whose
    method the default made hierarchical on ``several`` hosts of several ranks)."""
    name = row["method"]
    spec = row.get("spec") or name
    if name.startswith(("hier-", "flat-")):
        return spec, name.startswith("hier-")
    return spec, several and make(spec).hierarchical_pays()


def runs_of(path: Path) -> list[dict]:
    """The model's runs (``benchmarks.fit.fit``'s form) of one worker job, one per gradcomp row."""
    job = json.loads(path.read_text())
    if job.get("path") != "reducer":
        raise SystemExit(f"{path}: the model is fitted on the reducer path (got {job.get('path')})")
    ranks, per_host = job["ranks"], job["ranks_per_host"]
    hosts = ranks // per_host
    cores = float(job.get("cpus") or ranks)
    cluster = cost.Cluster(hosts, per_host, cost.Link(0, 1), cores_per_host=cores / hosts)
    layout = buckets(job["model"], job["bucket_mb"])
    out = []
    for row in job["results"]:
        if row.get("kind") != "gradcomp" or "time_s" not in row:
            continue
        spec, hierarchical = spec_of(row, hosts > 1 and per_host > 1)
        across = hosts if hierarchical else ranks
        parts = [(cost.traffic(make(spec), shapes, across), sum(math.prod(s) for s in shapes))
                 for shapes in layout]
        out.append(dict(method=spec, row=row["method"], parts=parts, cluster=cluster,
                        hierarchical=hierarchical, seconds=row["time_s"], shape=f"{hosts}x{per_host}",
                        measured_link=row.get("host_link_bytes_per_step"), source=path.name))
    return out


def formula_bytes(r: dict) -> float:
    return sum(cost.host_link_bytes(t, r["cluster"], r["hierarchical"]) for t, _ in r["parts"])


def check(runs: list[dict], fitted: list[dict]) -> tuple[cost.Link, cost.Model, str]:
    link, model = fit(fitted)
    rows = []
    for r in runs:
        c = r["cluster"]
        shaped = cost.Cluster(c.hosts, c.per_host, link, c.local, c.cores_per_host)
        predicted = model.step_of(r["method"], r["parts"], shaped, r["hierarchical"])
        formula = formula_bytes(r)
        measured = r["measured_link"]
        rows.append([r["shape"], r["row"], "hier" if r["hierarchical"] else "flat",
                     f"{1e3 * r['seconds']:.0f}", f"{1e3 * predicted:.0f}",
                     f"{predicted / r['seconds'] - 1:+.0%}",
                     f"{formula / 2**20:.2f}" if c.hosts > 1 else "-",
                     f"{measured / 2**20:.2f}" if measured and c.hosts > 1 else "-",
                     f"{measured / formula:.3f}" if measured and c.hosts > 1 else "-"])
    head = ["shape", "method", "schedule", "measured ms", "model ms", "model error",
            "host link MiB (formula)", "host link MiB (counter)", "counter / formula"]
    text = aligned_table(head, rows)
    text += (f"\n\nlink: alpha {1e6 * link.alpha:.0f} us, beta {8 * link.beta / 1e9:.3f} Gbit/s; local: "
             + (f"alpha {1e6 * model.local.alpha:.0f} us, beta {8 * model.local.beta / 1e9:.2f} Gbit/s"
                if model.local else "not measured")
             + "\ncompute, ns per gradient byte on a core of its own: "
             + ", ".join(f"{m} {1e9 * v:.2f}" for m, v in sorted(model.compute.items())))
    return link, model, text


def _real_step(model: cost.Model, method: str, hosts: int, per_host: int, beta: float, hier: bool,
               layout: list) -> float:
    """``method``'s predicted step on a real cluster of ``hosts`` x ``per_host`` ranks whose
    network moves ``beta`` bytes a second (latency REAL_ALPHA, a host's own path REAL_LOCAL)."""
    cluster = cost.Cluster(hosts, per_host, cost.Link(REAL_ALPHA, beta), REAL_LOCAL)
    across = hosts if hier else hosts * per_host
    parts = [(_traffic(method, tuple(map(tuple, s)), across), n) for s, n in layout]
    return cost.Model(model.compute).step_of(method, parts, cluster, hier)


@functools.lru_cache(maxsize=None)
def _traffic(method: str, shapes: tuple, ranks: int) -> cost.Traffic:
    return cost.traffic(make(method), shapes, ranks)


def predict(model: cost.Model) -> str:
    """Steps at larger shapes: the model's compute on a core per rank, the link's bandwidth from
    RATES (see ``_real_step``)."""
    layout = [(shapes, sum(math.prod(s) for s in shapes)) for shapes in buckets("resnet50", 25.0)]
    methods = ["allreduce"] + sorted(model.compute)
    rows = []
    for hosts, per_host in SHAPES:
        for rate_name, beta in RATES:
            steps = {(m, hier): _real_step(model, m, hosts, per_host, beta, hier, layout)
                     for m in methods for hier in (False, True)}
            base = steps["allreduce", False]
            for m in methods:
                rows.append([f"{hosts}x{per_host}", rate_name, m, f"{1e3 * steps[m, False]:.1f}",
                             f"{1e3 * steps[m, True]:.1f}", f"{steps[m, False] / base:.2f}",
                             f"{steps[m, True] / base:.2f}"])
    head = ["shape", "network", "method", "flat ms", "hierarchical ms", "flat / fp32 flat",
            "hier / fp32 flat"]
    return aligned_table(head, rows) + "\n\n" + breakeven(model, methods[1:], layout)


def breakeven(model: cost.Model, methods: list[str], layout: list) -> str:
    """The network bandwidth below which each method's hierarchical step beats fp32's (both
    hierarchical), at each shape: compression pays below it."""
    lines = []
    for hosts, per_host in SHAPES:
        found = []
        for m in methods:
            def gain(gbit: float) -> float:
                beta = gbit * 1e9 / 8
                return (_real_step(model, "allreduce", hosts, per_host, beta, True, layout)
                        - _real_step(model, m, hosts, per_host, beta, True, layout))
            lo, hi = 0.01, 10000.0
            if gain(lo) <= 0:
                found.append(f"{m} never")
                continue
            if gain(hi) > 0:
                found.append(f"{m} > {hi:.0f}")
                continue
            for _ in range(60):
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if gain(mid) > 0 else (lo, mid)
            found.append(f"{m} {lo:.3g}")
        lines.append(f"{hosts}x{per_host}: compression pays below (Gbit/s, hierarchical against "
                     f"hierarchical fp32): " + ", ".join(found))
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--fit", type=Path, nargs="+", required=True, help="runs the compute is fitted on")
    p.add_argument("--check", type=Path, nargs="*", default=[], help="further runs, predicted")
    args = p.parse_args(argv)
    fitted = [r for path in args.fit for r in runs_of(path)]
    runs = fitted + [r for path in args.check for r in runs_of(path)]
    _, model, text = check(runs, fitted)
    print(text + "\n")
    print(predict(model))


if __name__ == "__main__":
    main()
