"""The scale suite's arithmetic: the memory slope between two model sizes, over the reference."""
from __future__ import annotations

from benchmarks import scale


def _row(method, size, params, peak, model="gpt2", kept=0.0):
    return dict(model=model, size=size, method=method, params=params, ranks=2, steps=8, step_s=1.0,
                peak_rss_mb=[peak, peak - 1], network="", kept_mb=kept)


def test_slope_is_over_the_reference_between_two_sizes():
    mb = 2**20
    ddp = {6: 2000, 12: 2000 + 40e6 * 12 / mb}  # DDP's own: 12 bytes a parameter
    rows = [_row("ddp", 6, 80e6, ddp[6]), _row("ddp", 12, 120e6, ddp[12]),
            _row("int8", 6, 80e6, ddp[6] + 300 + 80e6 * 6 / mb, kept=100 + 80e6 * 5 / mb),
            _row("int8", 12, 120e6, ddp[12] + 300 + 120e6 * 6 / mb, kept=100 + 120e6 * 5 / mb),
            _row("fsdp", 6, 80e6, 1000), _row("fsdp", 12, 120e6, 1100), _row("fsdp:int8", 6, 80e6, 1010),
            _row("fsdp:int8", 12, 120e6, 1110 + 40e6 * 2 / mb)]
    slopes = scale._slopes(rows)
    per, fixed = slopes[("gpt2", "int8")]
    assert abs(per - 6.0) < 1e-6 and abs(fixed - 300) < 1e-6  # 6 bytes a parameter and 300 MB over DDP's own
    assert abs(slopes[("gpt2", "fsdp:int8")][0] - 2.0) < 1e-6  # FSDP's methods against FSDP's own
    assert ("gpt2", "ddp") not in slopes
    text = scale.summary(rows)
    assert "| gpt2 | int8 | 6.0 | 5.0 | 7 | 300 |" in text  # peak RSS, then what gradcomp keeps
    capped = [dict(r, network="1gbit", method=m, step_s=s, cpu_s=c)
              for r, m, s, c in ((rows[1], "ddp", 2.0, 1.1), (rows[1], "compute", 1.0, 1.0))]
    capped.append(dict(rows[3], network="1gbit", bytes_per_step=250e6, step_s=3.0, cpu_s=1.6))  # 2 s of link: the floor
    assert "| 3.00 | 1.50 | 1.50 | 250.0 MB | nan% | 0.60 |" in scale.summary(capped)  # 0.6 s of CPU over compute
    assert scale.target("opt:onebitadam", 2) == scale.OPT_TARGET and scale.target("topk", 4) == 6
    # a method over its target: by how much, and where gradcomp keeps its memory
    heavy = [dict(_row("topk", size, n, ddp[size] + n * 9 / mb), kept_by={"gradcomp.residuals": n * 6 / mb,
                                                                          "gradcomp.pool": 200.0})
             for size, n in ((6, 80e6), (12, 120e6))]
    assert "- gpt2 `topk`: 2.0 bytes a parameter over its target, fixed part 0 MB; what gradcomp keeps, bytes " \
           "a parameter: residuals 6.0" in scale.summary(rows + heavy)


def test_kept_counts_memory_once_and_leaves_out_the_models():
    """``held.kept``: each array's memory once (views and slices of it too), under the first path
    that reaches it; ``own`` memory, modules and a torch optimizer's state are left out."""
    import numpy as np
    import torch

    from benchmarks.held import kept

    class Holder:
        __slots__ = ("ring", "views", "model", "inner", "extra")

    big, own = np.zeros(1000, np.float32), np.zeros(500, np.float32)
    net = torch.nn.Linear(10, 10)
    holder = Holder()
    holder.ring, holder.views = big, [big[:10], big[100:].reshape(30, 30), own, own[3:]]
    holder.model, holder.inner = net, torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    holder.extra = {"codes": torch.zeros(64, dtype=torch.uint8)}
    got = kept({"h": holder}, [own])
    assert got == {"h.ring": 4000, "h.extra[]": 64}, got
