"""The steady state allocates nothing: minor page faults per step after warm-up (getrusage),
counted, not timed. A fresh 16 MiB array costs about 4,000 faults on first touch; a step of the
reducer path with Allreduce, FP16, PowerSGD or int8 must stay far below that."""
from __future__ import annotations

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

SPECS = ["allreduce", "fp16", "powersgd:rank=4,start_iter=2", "int8:warmup=0"]


def rank_faults(spec, views):
    import resource

    import gradcomp as gc

    comm = gc.MPICommunicator()
    rng = np.random.default_rng(comm.rank)
    shapes = [(1024, 1024), (1024,), (512, 2048), (2048,), (256, 3, 3, 512)] * 2
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    saved = [g.copy() for g in grads]
    reducer = gc.GradientReducer(grads, gc.make(spec), comm, bucket_cap_mb=8)
    arrays = reducer.gradients if views else grads
    faults = []
    for step in range(8):
        for a, s in zip(arrays, saved):
            np.copyto(a, s)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        reducer.step(arrays)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    total_mb = sum(g.nbytes for g in grads) / 2**20
    steady = max(faults[3:])
    if comm.rank == 0:
        print(f"{spec} views={views}: {total_mb:.0f} MiB, faults per step {faults}", flush=True)
    # a fresh copy of the gradients would be ~256 faults per MiB
    assert steady <= 0.02 * 256 * total_mb, f"{spec}: {faults} page faults per step"


@pytest.mark.parametrize("views", [True, False])
@pytest.mark.parametrize("spec", SPECS)
def test_steady_state_allocates_nothing(spec, views):
    out = run_ranks(2, "tests.comm.test_memory:rank_faults", spec, views, timeout=180)
    assert "faults per step" in out
