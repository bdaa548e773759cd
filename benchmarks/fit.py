"""Fitting the cost model (``gradcomp.planning.cost``) to measured steps: ``fit`` finds the link
constants and each method's compute per byte from worker runs (``benchmarks/scripts/scale_model.py``'s
``--fit``). Benchmark code, not the library's: the library only evaluates the model.
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gradcomp.planning.cost import (
    IN_HOST_COST,
    Link,
    Model,
    local_bytes,
    messages,
    wire_bytes,
)


def terms(r: Mapping[str, Any], methods: Sequence[str]) -> list[float]:
    """One run's coefficients of (network alpha, 1/beta, local alpha, 1/beta, each method's
    compute per byte): its seconds are their dot product with the constants (``Model.step``)."""
    c = r["cluster"]
    hier = r["hierarchical"] and c.per_host > 1 and c.hosts > 1
    net = [0.0, 0.0]
    loc = [0.0, 0.0]
    work = [0.0] * len(methods)
    L = c.per_host
    for t, n in r["parts"]:
        pair = loc if c.hosts == 1 else net
        pair[0] += messages(t, c, hier)
        pair[1] += wire_bytes(t, c, hier)
        if hier:
            loc[0] += 2 * (L - 1)
            loc[1] += IN_HOST_COST * local_bytes(n, L)
        if r["method"] in methods:
            work[methods.index(r["method"])] += n * 4 * (1.0 / L if hier else 1.0) * c.contention()
    return net + loc + work


def fit(runs: Sequence[Mapping[str, Any]]) -> tuple[Link, Model]:
    """Constants from measured steps. Each run: ``method``, ``parts`` (one ``(Traffic, numel)``
    per bucket), ``cluster`` (its links ignored; its cores counted), ``hierarchical``,
    ``seconds``.

    One least-squares fit of every run's ``seconds`` to the model's terms, each run weighted by
    1 / its seconds (the error that matters is relative), every constant kept >= 0: the network
    link (alpha, beta), the link inside a host (from runs on one host and the local stages of
    hierarchical ones; the cluster's default where no run has them) and each method's compute
    per byte (fp32 ``allreduce``'s is 0: its additions are part of the link's time)."""
    methods = sorted({r["method"] for r in runs} - {"allreduce"})
    a = np.array([terms(r, methods) for r in runs], dtype=np.float64)
    y = np.array([r["seconds"] for r in runs], dtype=np.float64)
    if not a[:, 1].any():
        raise ValueError("fit needs runs on several hosts (the network's constants)")
    a, y = a / y[:, None], np.ones_like(y)
    free = [j for j in range(a.shape[1]) if a[:, j].any()]
    x = np.zeros(a.shape[1])
    while free:  # least squares; constants that come out negative are held at 0, the rest refit
        sol = np.linalg.lstsq(a[:, free], y, rcond=None)[0]
        if (sol >= 0).all():
            x[free] = sol
            break
        free = [j for j, v in zip(free, sol) if v >= 0]
    link = as_link(x[0], x[1])
    local = as_link(x[2], x[3]) if a[:, 3].any() else None
    return link, Model({m: float(v) for m, v in zip(methods, x[4:])}, local=local)


def as_link(alpha: float, inv_beta: float) -> Link:
    return Link(max(float(alpha), 0.0), 1.0 / float(inv_beta) if inv_beta > 0 else math.inf)
