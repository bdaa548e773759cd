"""The cost model's fit (``benchmarks.fit``, moved out of ``gradcomp.planning.cost``)."""
from __future__ import annotations

import numpy as np
import pytest


def test_cost_model_fit_recovers_its_constants():
    """``fit`` on steps the model itself produced (flat and hierarchical, one host and several,
    a few methods) gives back the link constants and each method's compute, and so the steps."""
    import gradcomp as gc
    from benchmarks.fit import fit
    from gradcomp.planning import cost

    network, local = cost.Link(3e-4, 1.2e8), cost.Link(4e-5, 9e8)
    truth = cost.Model({"int8": 3e-10, "onebit": 1.5e-10}, local=local)
    layout = [[(512, 1000), (1000,)], [(300, 700)], [(2048, 256), (256,)]]
    runs = []
    for hosts, per_host in ((4, 1), (2, 2), (1, 4), (2, 1)):
        cluster = cost.Cluster(hosts, per_host, network, cores_per_host=2 / hosts)
        for method in ("allreduce", "int8", "onebit"):
            for hier in {False, hosts > 1 and per_host > 1}:
                across = hosts if hier else hosts * per_host
                spec = method + (":warmup=0" if method == "onebit" else "")
                parts = [(cost.traffic(gc.make(spec), s, across), int(sum(np.prod(x) for x in s))) for s in layout]
                runs.append(dict(method=method, parts=parts, cluster=cluster, hierarchical=hier,
                                 seconds=truth.step_of(method, parts, cluster, hier)))
    link, model = fit(runs)
    assert link.alpha == pytest.approx(network.alpha, rel=1e-6)
    assert link.beta == pytest.approx(network.beta, rel=1e-6)
    assert model.local is not None and model.local.beta == pytest.approx(local.beta, rel=1e-6)
    assert model.compute == pytest.approx(truth.compute, rel=1e-6)
    for r in runs:
        c = r["cluster"]
        shaped = cost.Cluster(c.hosts, c.per_host, link, c.local, c.cores_per_host)
        assert model.step_of(r["method"], r["parts"], shaped, r["hierarchical"]) == pytest.approx(r["seconds"])
