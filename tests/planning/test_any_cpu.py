"""Decisions a rank takes alone from agreed values come out the same on ranks with different CPUs
(DESIGN.md, "Same bits on any CPU"): 2 ranks under real mpiexec, one as this machine runs it,
the other as an older CPU would (NumPy's dispatch cut to its baseline, numba's ``generic``
target, so the NumPy kernels, and OpenBLAS's Nehalem kernels), through a governed method's
audits and rungs, a recipe's auto warm-up (``Settling``) and DiLoCo's governor, on NumPy arrays
through ``GradientReducer``. Every decision, every agreed value behind it (the audits' costs,
the warm-up's drift, the state the ranks checkpoint) and every mean must be the same bits."""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from gradcomp.launcher import run
from tests.mpi_launch import ROOT

#: float32 and float64 tensors (a float64 gradient's squared norm was BLAS's ``vdot``), and small
#: ones (each audited, and a level of the warm-up's own)
SHAPES = [((40, 30), "float32"), ((30,), "float32"), ((24, 16), "float64"), ((200,), "float64")] + \
    [((3 + i % 5,), "float32") for i in range(40)]
STEPS = 70
#: starts each rank with its own environment before anything imports NumPy (it reads
#: NPY_DISABLE_CPU_FEATURES once, at import), then runs the target as ``tests.mpi_launch`` does
SHIM = """
import json, os, runpy, sys
rank = next(os.environ[k] for k in ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK") if k in os.environ)
os.environ.update(json.loads(os.environ["GRADCOMP_TEST_RANK_ENV"])[int(rank)])
runpy.run_module("tests.mpi_launch", run_name="__main__", alter_sys=True)
"""


def _dispatched() -> list[str]:
    """NumPy's dispatched SIMD targets this CPU has (all that NPY_DISABLE_CPU_FEATURES may turn off)."""
    import numpy

    umath = (getattr(numpy, "_core", None) or numpy.core)._multiarray_umath
    return [f for f in umath.__cpu_dispatch__ if umath.__cpu_features__.get(f)]


def _grads(rank: int, step: int) -> list[np.ndarray]:
    """A shared signal whose scale falls by half over 30 steps and then holds (a warm-up that
    settles), plus each rank's own noise (what the governor weighs compression against)."""
    scale = 1.0 + 1.0 / (1.0 + min(step, 30) / 10.0)
    common = np.random.default_rng(0)
    own = np.random.default_rng([rank, step])
    return [(scale * common.standard_normal(s) + 0.5 * own.standard_normal(s)).astype(d) for s, d in SHAPES]


def _bits(value) -> str:
    """A digest of a state entry or a decision list (arrays by their bytes, floats by their bits)."""
    if isinstance(value, (list, tuple)):
        return hashlib.sha256("|".join(_bits(v) for v in value).encode()).hexdigest()[:16]
    if isinstance(value, dict):
        return _bits(sorted((k, _bits(v)) for k, v in value.items()))
    if isinstance(value, float):
        return value.hex()
    a = np.asarray(value)
    return hashlib.sha256(str(a.dtype).encode() + a.tobytes()).hexdigest()[:16]


def _agreed(state: dict) -> dict:
    """The entries of a state that every rank must hold alike: all but the residuals (each rank's
    own, DESIGN's "residuals belong to the rank that made them": the workers' and the slice
    owners') and the saving rank."""
    return {k: _bits(v) for k, v in state.items()
            if "residual" not in k and "/owner/" not in k and not k.endswith("saved_by/rank")}


def rank_decides_alike(narrowed: list[str]) -> None:
    import gradcomp as gc
    from gradcomp import kernels
    from gradcomp.arrays import sum_of_squares
    from gradcomp.optim import DiLoCo
    from gradcomp.planning.audit import tensor_costs
    from gradcomp.planning.governor import Governed
    from gradcomp.settling import drift

    comm = gc.MPICommunicator()
    if comm.rank == 1:
        assert not any(f in narrowed for f in _dispatched()), "NumPy's dispatch was not narrowed on rank 1"
        assert not kernels.available(), "rank 1 runs the compiled kernels"
    found: dict = {}
    # a governed top-k after its auto warm-up: audits every 8 steps (windows of 4), 8 steps held
    # a rung down before the method is tried again; and 1-bit codes after theirs, ungoverned
    for name, comp in (("topk", Governed(gc.make("topk:budget=None"), budget=0.2, every=8, window=4, hold=8)),
                       ("onebit", gc.make("onebit:budget=None"))):
        grads = [np.zeros(s, d) for s, d in SHAPES]
        reducer = gc.GradientReducer(grads, comp, comm)
        means = hashlib.sha256()
        for step in range(STEPS):
            for g, new in zip(reducer.gradients, _grads(comm.rank, step)):
                g[...] = new
            for out in reducer.step():
                means.update(out.tobytes())
        stats = comp.stats()
        gov = stats.get("governor", {})
        found[name] = {"means": means.hexdigest(), "state": _agreed(reducer.state_dict()),
                       "warmup": (stats["warmup_ended_at"], stats["warmup_reason"]),
                       "decisions": _bits(gov.get("decisions", [])), "audits": _bits(gov.get("audits", [])),
                       "costs": _bits(gov.get("last_cost", {}))}
        assert stats["warmup_ended_at"] is not None and "settled" in stats["warmup_reason"], stats["warmup_reason"]
        if name == "topk":
            decided = len(gov["decisions"])
            assert decided >= 2 and len(gov["audits"]) >= 4, gov
    # DiLoCo's exchange, governed (its own rungs, counted in outer steps), one outer step per step
    params = [np.zeros(s, d) for s, d in SHAPES]
    outer = DiLoCo(params, sync_every=1, compressor="topk", comm=comm)
    for step in range(24):
        for p, g in zip(params, _grads(comm.rank, step)):
            p -= 0.1 * g
        outer.step()
    gov = outer.stats()["governor"]
    assert gov["decisions"], gov
    found["diloco"] = {"params": _bits([p.copy() for p in params]), "state": _agreed(outer.state_dict()),
                       "decisions": _bits(gov["decisions"]), "audits": _bits(gov["audits"])}
    # the helpers on fixed inputs, where the CPU's own forms differ most often: a drift of one
    # tensor is one log (NumPy's SIMD log differs from its baseline one on about 1 ratio in 20
    # near 1), squared norms of float64 arrays (BLAS's vdot), an audit's costs; inputs from the
    # generator's bits and exact scalings only, the same on both ranks
    rng = np.random.default_rng(11)
    ratios = 1.0 + rng.uniform(-0.05, 0.05, 400)
    one = np.ones(1)
    found["helpers"] = {
        "drift": _bits([drift(np.array([r]), one, one) for r in ratios]),
        "sum_of_squares": _bits([sum_of_squares((rng.random(n) - 0.5) * np.ldexp(1.0, rng.integers(-10, 11, n)))
                                 for n in (3, 100, 1000, 5000, 70000)]),
        "tensor_costs": _bits(tensor_costs(rng.random(5000) - 0.5, rng.uniform(1, 2, 50), np.arange(0, 5001, 100)))}
    every = comm.comm.allgather(found)  # test-side bookkeeping only
    differ = sorted(f"{m}/{k}" + (f" {sorted(e for e in every[0][m][k] if every[0][m][k][e] != every[1][m][k].get(e))}"
                                  if k == "state" else "")
                    for m in found for k in found[m] if every[0][m][k] != every[1][m][k])
    assert not differ, f"the ranks' CPUs changed what they decided or hold: {differ}"
    print(f"rank {comm.rank}: warm-ups ended at {found['topk']['warmup'][0]} and {found['onebit']['warmup'][0]}; "
          f"{decided} top-k and {len(gov['decisions'])} DiLoCo rung decisions", flush=True)
    comm.close()


def test_ranks_on_different_cpus_decide_alike():
    """Rank 1 runs as an older CPU would: NumPy without its dispatched SIMD loops (AVX2, FMA3,
    AVX-512: its ``log`` gives other last bits), numba's ``generic`` target (the NumPy kernels),
    OpenBLAS's Nehalem kernels (its ``vdot`` adds in another order)."""
    narrowed = _dispatched()
    older = {"NUMBA_CPU_NAME": "generic", "OPENBLAS_CORETYPE": "Nehalem",
             **({"NPY_DISABLE_CPU_FEATURES": " ".join(narrowed)} if narrowed else {})}
    env = {"GRADCOMP_TEST_NRANKS": "2", "GRADCOMP_TEST_RANK_ENV": json.dumps([{}, older]),
           "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    target = "tests.planning.test_any_cpu:rank_decides_alike"
    result = run(2, ["-c", SHIM, target, json.dumps([narrowed])], timeout=300, env=env, cwd=ROOT)
    assert not result.hung, f"{target} did not finish (hang):\n{result.output}"
    assert result.returncode == 0, f"{target} failed (exit {result.returncode}):\n{result.output}"
    print(result.output)
