"""The same bits before and after a refactor: every registered compressor, in its steady state, on
float32, float64, float16 and bfloat16 buckets, at 1 and 3 ranks, gives the outputs and the state
recorded in ``tests/data/same_bits.json``.

The digests were recorded from the implementation of 2026-12-05 (before the compiled kernels move
to one home, issue 49), so that a rewrite of the kernels or the runner that changes a single bit
of any method's output or state fails here, naming the method, dtype and rank count. They were
recorded anew, from the same implementation, when the inputs stopped depending on the CPU (issue
65: they took ``np.exp``, whose last bits NumPy picks by CPU). A change that is meant to change
bits records them anew, saying why in its commit:

    GRADCOMP_RECORD_DIGESTS=1 python -m pytest tests/compressors/test_same_bits.py

What "the same bits" promises across CPUs (DESIGN.md, "Same bits on any CPU"): every method's
outputs and state are the same bits on any x86-64 CPU, whatever vector width numba compiles for
(``NUMBA_CPU_NAME=generic``, ``haswell``, ``skylake-avx512``: CI runs this test under each, and
under NumPy's dispatch narrowed to AVX2 and to its baseline, ``NPY_DISABLE_CPU_FEATURES``),
except PowerSGD's, whose products reassociate their sums (``kernels/lowrank.py``) in an order
that depends on the vector width, or are BLAS's where the kernels do not run. For those names
(``CPU_DEPENDENT``) the table holds a fingerprint instead (sums and sampled values of each output
and state array), compared within a tolerance per dtype; a changed algorithm still fails it.
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
#: names whose bits depend on the CPU's vector width (PowerSGD's reassociated products)
CPU_DEPENDENT = ("powersgd", "fp16-powersgd")
#: a fingerprint's tolerance, relative to the array's largest magnitude (its sum: to its sum of
#: magnitudes): float32 sums in another order differ by a few units in the last place, and the
#: half formats round that difference to their own last place now and then (as do the arrays
#: computed from values that travel in half precision: ``_least``)
TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}
#: values sampled from each array for its fingerprint
SAMPLES = 24


def _digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def _fingerprint(arrays) -> list:
    """Per array: its dtype, length, largest magnitude, sum of magnitudes, sum and ``SAMPLES``
    values at evenly spaced places (float64); integer arrays and text: their digest."""
    found = []
    for a in arrays:
        a = np.asarray(a).ravel()
        if a.dtype.kind not in "fc" and str(a.dtype) != "bfloat16":
            found.append([str(a.dtype), _digest([a])])
            continue
        w = a.astype(np.float64)
        at = np.linspace(0, max(w.size - 1, 0), min(SAMPLES, w.size)).astype(np.int64)
        found.append([str(a.dtype), int(w.size), float(np.abs(w).max(initial=0)), float(np.abs(w).sum()),
                      float(w.sum()), w[at].tolist()])
    return found


def _differences(got: list, want: list, least: float = 0.0) -> list[str]:
    """Where two fingerprints differ beyond ``TOLERANCE`` of each array's dtype, or ``least`` where
    that is larger (``_least``); an empty list: they agree."""
    if len(got) != len(want):
        return [f"{len(got)} arrays, recorded {len(want)}"]
    found = []
    for i, (g, w) in enumerate(zip(got, want)):
        if len(w) == 2 or g[:2] != w[:2]:  # integers and text, or another dtype or length: exactly
            if g != w:
                found.append(f"array {i}")
            continue
        tol = max(TOLERANCE[w[0]], least)
        if abs(g[4] - w[4]) > tol * w[3] or \
                not np.allclose(g[5], w[5], rtol=0, atol=tol * w[2]) or abs(g[2] - w[2]) > tol * w[2]:
            found.append(f"array {i} ({w[0]}: largest {g[2]:.6g} vs {w[2]:.6g}, sum {g[4]:.6g} vs {w[4]:.6g})")
    return found


def _inputs(rank: int, step: int, dtype):
    """Heavy-tailed values of many magnitudes, a few large, built from the generator's bits with
    correctly rounded arithmetic only, so the inputs are the same bits on any CPU: NumPy's
    ``exp``, ``log``, ``power``... pick a SIMD form by CPU at run time (another last bit under
    AVX2 than AVX-512), and ``standard_normal`` calls the C library's ``log``/``exp`` in its tail.
    Each value is a bump (the sum of four uniforms, less 2) scaled by ``2^k``, ``k`` a binomial
    count of 12 coin flips less 6 (a log-normal scale of about e^N(0, 1.2), from -6 to 6
    binary orders)."""
    import ml_dtypes

    n = sum(int(np.prod(s)) for s in LAYOUT)
    rng = np.random.default_rng([7, rank, step])
    u = rng.random((4, n))
    flips = rng.integers(0, 2, (12, n), dtype=np.int64).sum(axis=0)
    x = (u[0] + u[1] + u[2] + u[3] - 2.0) * np.ldexp(1.0, flips - 6)
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
                keys = hashlib.sha256(",".join(sorted(state)).encode()).hexdigest()[:8]
                if name in CPU_DEPENDENT:
                    found[f"{name}/{dtype}"] = {"keys": keys, "outputs": _fingerprint(outputs),
                                                "state": _fingerprint(state_arrays)}
                else:
                    found[f"{name}/{dtype}"] = _digest(outputs) + ":" + _digest(state_arrays) + ":" + keys
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
            changed = sorted(k for k in want if not _same(got.get(k), want[k], k))
            missing = sorted(k for k in got if k not in want)
            assert not changed, f"outputs or state changed at {key}: {changed[:12]} ({len(changed)} in all)"
            assert not missing, f"no recorded digest for {missing[:12]} (record them: {RECORD}=1)"
    comm.close()


def _least(key: str) -> float:
    """The least tolerance of an entry's arrays (``rank/name/dtype``): that of the precision its
    values travel in, a half bucket's or ``fp16-``'s half factors. A float32 factor computed from
    them moves by their rounding, not float32's: one value rounded the other way in half precision
    moves it by about 1e-4 of its largest."""
    _, name, dtype = key.split("/")
    return TOLERANCE["float16" if name.startswith("fp16-") else dtype]


def _same(got, want, key: str) -> bool:
    """A digest is the same text; a fingerprint is the same keys and arrays within tolerance."""
    if isinstance(want, str) or not isinstance(got, dict):
        return got == want
    least = _least(key)
    return got["keys"] == want["keys"] and not _differences(got["outputs"], want["outputs"], least) and \
        not _differences(got["state"], want["state"], least)


@pytest.mark.parametrize("ranks", [1, 3])
def test_every_registered_compressor_gives_the_recorded_bits(ranks):
    record = os.environ.get(RECORD) == "1"
    if not record and not DATA.exists():
        pytest.fail(f"{DATA} is missing: record it with {RECORD}=1")
    run_ranks(ranks, "tests.compressors.test_same_bits:rank_digests", str(DATA), record, timeout=600)


def replicas_on_mixed_cpus(targets: list[str]) -> None:
    """Each rank compiles for its own CPU (``targets[rank]``) and every registered compressor,
    powersgd at rank 4 too (its QR path), gives bit-identical means on every rank."""
    import sys

    assert "numba" not in sys.modules, "numba was imported before the rank chose its target"
    from mpi4py import MPI

    os.environ["NUMBA_CPU_NAME"] = targets[MPI.COMM_WORLD.Get_rank()]
    import gradcomp as gc
    from gradcomp.registry import steady

    comm = gc.MPICommunicator()
    found = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # randomk warns when built
        names = [steady(n) for n in gc.REGISTRY if n != "auto"] + ["powersgd:rank=4,start_iter=2"]
        for name in names:
            for dtype in DTYPES:
                comp = gc.make(name)
                outputs = []
                for step in range(STEPS):
                    bucket = gc.Bucket(_inputs(comm.rank, step, dtype), 0, LAYOUT, True,
                                       keys=[f"t{i}" for i in range(len(LAYOUT))])
                    outputs.append(comp.reduce(bucket, comm).result())
                found[f"{name}/{dtype}"] = _digest(outputs)
    every = comm.comm.allgather(found)  # test-side bookkeeping only
    differ = sorted(k for k in found if len({d[k] for d in every}) > 1)
    assert not differ, f"replicas differ across CPUs {targets}: {differ}"
    comm.close()


@pytest.mark.parametrize("targets", [["haswell", "skylake-avx512"], ["generic", "skylake-avx512"]],
                         ids=["avx2-avx512", "generic-avx512"])
def test_ranks_on_different_cpus_hold_identical_replicas(targets):
    """DESIGN's promise across ranks: a rank compiled for another vector width, or one whose CPU
    has no F16C and so runs the NumPy kernels (``generic``), still ends every step with the same
    means as its peers."""
    run_ranks(2, "tests.compressors.test_same_bits:replicas_on_mixed_cpus", targets, timeout=600)
