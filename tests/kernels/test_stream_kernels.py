"""Top-k's and random-k's compiled output paths against NumPy, bit for bit: the streamed scatter
(``kernels.fused_selection.scatter_into_streamed``, a large output written around the caches) and the picked
candidates' hand-over (``kernels.fused_selection.topk_take``)."""
from __future__ import annotations

import numpy as np
import pytest

from gradcomp import kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba kernels unavailable")
if kernels.available():
    from gradcomp.kernels import fused_selection as jit


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_streamed_scatter_gives_the_same_bits(dtype):
    rng = np.random.default_rng(4)
    for n in (2048 * 5, 2048 * 3 + 17, 100):
        index = np.sort(rng.choice(n, size=max(1, n // 50), replace=False)).astype(np.int32)
        values = rng.standard_normal(index.shape[0]).astype(dtype)
        values[0] = -0.0
        want = np.zeros(n, dtype)
        want[index] += values
        for shift in (0, 1):
            space = np.full(n + 1, 7.0, dtype)
            out = space[shift:shift + n]
            jit.scatter_into_streamed(out, index, values, np.empty(2048, dtype))
            assert np.array_equal(out.view(np.uint8), want.view(np.uint8)), (n, shift)


@pytest.mark.parametrize("feedback", [True, False])
def test_topk_take_matches_the_numpy_steps(feedback):
    rng = np.random.default_rng(5)
    n, count, k = 10000, 400, 150
    cand = np.sort(rng.choice(n, size=count, replace=False)).astype(np.int64)
    e = rng.standard_normal(n).astype(np.float32)
    e[cand[3]] = np.nan
    e[cand[10]] = np.inf
    vals = e[cand].copy()
    picked = np.zeros(count, np.bool_)
    picked[rng.choice(count, size=k, replace=False)] = True
    index = np.empty(k, np.int32)
    values = np.empty(k, np.float32)
    got = e.copy()
    assert jit.topk_take(cand, vals, picked, index, values, got, feedback) == k
    top = cand[picked]
    want = e.copy()
    if feedback:
        want[top] = 0
        rest = want[cand]
        want[cand[~np.isfinite(rest)]] = 0
    assert np.array_equal(index, top.astype(np.int32))
    assert np.array_equal(values.view(np.uint32), e[top].view(np.uint32))
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
