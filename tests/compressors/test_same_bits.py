"""The same bits before and after a refactor: every registered compressor, in its steady state, on
float32, float64, float16 and bfloat16 buckets, at 1 and 3 ranks, gives the outputs and the state
recorded in ``tests/data/same_bits.json``.

The digests were recorded from the implementation of 2026-12-05 (before the compiled kernels move
to one home, issue 49), so that a rewrite of the kernels or the runner that changes a single bit
of any method's output or state fails here, naming the method, dtype and rank count. A change
that is meant to change bits records them anew, saying why in its commit:

    GRADCOMP_RECORD_DIGESTS=1 python -m pytest tests/compressors/test_same_bits.py
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

DATA = Path(__file__).resolve().parents[1] / "data" / "same_bits.json"
RECORD = "GRADCOMP_RECORD_DIGESTS"
#: matrices, a vector of one chunk, a small odd matrix and a long vector past a chunk's end
LAYOUT = [(300, 40), (512,), (7, 9), (4097,)]
DTYPES = ("float32", "float64", "float16", "bfloat16")
STEPS = 3


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _inputs(rank: int, step: int, dtype):
    import ml_dtypes

    n = sum(int(np.prod(s)) for s in LAYOUT)
    rng = np.random.default_rng([7, rank, step])
    x = rng.standard_normal(n) * np.exp(rng.standard_normal(n))
    target = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    return x.astype(target)


def rank_digests(path: str, record: bool) -> None:
    import gradcomp as gc
    from gradcomp.registry import steady

    comm = gc.MPICommunicator()
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # randomk warns when built
        names = [n for n in gc.REGISTRY if n != "auto"]
        for name in names:
            for dtype in DTYPES:
                comp = gc.make(steady(name))
                outputs = []
                for step in range(STEPS):
                    bucket = gc.Bucket(_inputs(comm.rank, step, dtype), 0, LAYOUT, True,
                                       keys=[f"t{i}" for i in range(len(LAYOUT))])
                    outputs.append(comp.reduce(bucket, comm).result())
                state = comp.state_dict()
                state_arrays = [np.asarray(state[k]) for k in sorted(state)]
                found[f"{name}/{dtype}"] = _digest(outputs) + ":" + _digest(state_arrays) + ":" + \
                    hashlib.sha256(",".join(sorted(state)).encode()).hexdigest()[:8]
    every = comm.comm.allgather(found)  # test-side bookkeeping only
    key = f"{comm.size} ranks"
    if comm.rank == 0:
        table = json.loads(Path(path).read_text()) if Path(path).exists() else {}
        if record:
            table[key] = {f"rank{r}/{k}": v for r, d in enumerate(every) for k, v in d.items()}
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
        else:
            want = table[key]
            got = {f"rank{r}/{k}": v for r, d in enumerate(every) for k, v in d.items()}
            changed = sorted(k for k in want if got.get(k) != want[k])
            missing = sorted(k for k in got if k not in want)
            assert not changed, f"outputs or state changed at {key}: {changed[:12]} ({len(changed)} in all)"
            assert not missing, f"no recorded digest for {missing[:12]} (record them: {RECORD}=1)"
    comm.close()


@pytest.mark.parametrize("ranks", [1, 3])
def test_every_registered_compressor_gives_the_recorded_bits(ranks):
    record = os.environ.get(RECORD) == "1"
    if not record and not DATA.exists():
        pytest.fail(f"{DATA} is missing: record it with {RECORD}=1")
    run_ranks(ranks, "tests.compressors.test_same_bits:rank_digests", str(DATA), record, timeout=600)
