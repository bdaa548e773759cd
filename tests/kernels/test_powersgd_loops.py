"""The compiled PowerSGD products (``gradcomp.kernels.lowrank``) against NumPy matmul, one process.

Every row-blocking case is covered: ranks 1 to 8 (groups of four columns plus a remainder), row
counts that are not multiples of four, narrow matrices (one row at a time) and wide ones (four
rows at a time), float32 and float64, with and without the folded-in add and subtract. The
elements between matrices (uncompressed tensors) must be left alone, the results must not
depend on where the arrays sit in memory (ranks hold the same values at other addresses), and
NaN / Inf must come through as they would from matmul.
"""
from __future__ import annotations

import numpy as np
import pytest

from gradcomp import kernels

if kernels.available():
    from gradcomp.kernels import lowrank

pytestmark = pytest.mark.skipif(not kernels.available(),
                                reason="numba kernels unavailable (numba missing or GRADCOMP_JIT=0)")

# (n, m, r): narrow and wide (m * r * itemsize above lowrank._WIDE_BYTES), n % 4 != 0 included
SHAPES = [(5, 7, 1), (9, 3000, 4), (13, 600, 3), (4, 4096, 5), (17, 2048, 8), (3, 10, 2),
          (8, 5000, 1), (6, 9000, 2), (1, 1, 1), (64, 64, 4)]
GAP = 3  # elements between matrices, standing for uncompressed tensors


def layout(dtype):
    rows, off, po, qo = [], 0, 0, 0
    for n, m, r in SHAPES:
        rows.append((off, n, m, r, po, qo))
        off, po, qo = off + n * m + GAP, po + n * r, qo + m * r
    return np.array(rows, np.int64), off, po, qo


def blocks(table, flat, which):
    """The per-matrix views of a flat region: 'm' (n x m), 'p' (n x r) or 'q' (m x r)."""
    for off, n, m, r, po, qo in table:
        if which == "m":
            yield flat[off:off + n * m].reshape(n, m)
        elif which == "p":
            yield flat[po:po + n * r].reshape(n, r)
        else:
            yield flat[qo:qo + m * r].reshape(m, r)


def gaps(table, flat):
    return np.concatenate([flat[off + n * m:off + n * m + GAP] for off, n, m, *_ in table])


def assert_close(got, want):
    """Within a few units of rounding of the block's largest value: sums of thousands of terms
    cancel, so single entries may be far smaller than the rounding of the terms."""
    eps = np.finfo(want.dtype).eps
    err = np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < 64 * eps, f"{want.shape}: relative error {err:.3g}"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_products_match_matmul(dtype):
    rng = np.random.default_rng(1)
    table, size, p_size, q_size = layout(dtype)
    x = rng.standard_normal(size).astype(dtype)
    g = rng.standard_normal(size).astype(dtype)
    q = rng.standard_normal(q_size).astype(dtype)
    p_in = rng.standard_normal(p_size).astype(dtype)
    s = x + g

    # P = (X + G) Q, with X += G folded in on the matrices' rows only
    x1, p = x.copy(), np.empty(p_size, dtype)
    lowrank.project(x1, q, p, table, add=g)
    for mm, pp, qq, got in zip(blocks(table, s, "m"), blocks(table, p, "p"), blocks(table, q, "q"),
                               blocks(table, x1, "m")):
        assert_close(pp, mm @ qq)
        assert np.array_equal(got, mm)
    assert np.array_equal(gaps(table, x1), gaps(table, x))  # uncompressed parts untouched

    # Q = X^T P, with and without the add
    for add in (None, g):
        xx, qt = (s.copy(), np.empty(q_size, dtype)) if add is None else (x.copy(), np.empty(q_size, dtype))
        lowrank.project_t(xx, p_in, qt, table, add=add)
        for mm, pp, qq in zip(blocks(table, s, "m"), blocks(table, p_in, "p"), blocks(table, qt, "q")):
            assert_close(qq, mm.T @ pp)

    # OUT = P Q^T, and the residual X - OUT folded in
    for residual in (None, s.copy()):
        out = np.full(size, 7, dtype)
        lowrank.reconstruct(out, p_in, q, table, residual=residual)
        for oo, pp, qq, mm in zip(blocks(table, out, "m"), blocks(table, p_in, "p"),
                                  blocks(table, q, "q"), blocks(table, s, "m")):
            assert_close(oo, pp @ qq.T)
        assert (gaps(table, out) == 7).all()
        if residual is not None:
            for rr, oo, mm in zip(blocks(table, residual, "m"), blocks(table, out, "m"), blocks(table, s, "m")):
                assert np.array_equal(rr, mm - oo)  # exactly the subtraction of what was output
            assert np.array_equal(gaps(table, residual), gaps(table, s))


def test_rank_one_output_is_the_exact_outer_product():
    """At rank 1 each output element is one multiplication, as NumPy's broadcasting gives."""
    rng = np.random.default_rng(2)
    table = np.array([(0, 37, 5000, 1, 0, 0)], np.int64)
    p, q = rng.standard_normal(37).astype(np.float32), rng.standard_normal(5000).astype(np.float32)
    out = np.empty(37 * 5000, np.float32)
    lowrank.reconstruct(out, p, q, table)
    assert np.array_equal(out.reshape(37, 5000), p[:, None] * q[None, :])


def test_results_do_not_depend_on_addresses():
    """Ranks hold equal P and Q at other addresses and must produce equal bits: run the same
    inputs from buffers shifted by one to fifteen elements (other alignments) and compare."""
    rng = np.random.default_rng(3)
    table, size, p_size, q_size = layout(np.float32)
    x = rng.standard_normal(size).astype(np.float32)
    q = rng.standard_normal(q_size).astype(np.float32)
    p_in = rng.standard_normal(p_size).astype(np.float32)

    def run(shift):
        def place(a):
            buf = np.empty(a.size + 16, a.dtype)[shift:shift + a.size]
            buf[:] = a
            return buf
        p, qt, out, res = (place(np.zeros(p_size, np.float32)), place(np.zeros(q_size, np.float32)),
                           place(np.zeros(size, np.float32)), place(x))
        lowrank.project(place(x), place(q), p, table)
        lowrank.project_t(place(x), place(p_in), qt, table)
        lowrank.reconstruct(out, place(p_in), place(q), table, residual=res)
        return [a.copy() for a in (p, qt, out, res)]

    want = run(0)
    assert all(np.abs(a).max() > 0 for a in want)  # an implementation that writes nothing fails
    for shift in (1, 3, 8, 15):
        for a, b in zip(want, run(shift)):
            assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"shift {shift}"


def test_non_finite_values_come_through():
    """No fast-math assumptions: a NaN or Inf in M reaches the products of its row / column."""
    table = np.array([(0, 8, 3000, 4, 0, 0)], np.int64)
    x = np.ones(8 * 3000, np.float32)
    x[3 * 3000 + 17] = np.nan
    x[5 * 3000 + 2] = np.inf
    q = np.full(3000 * 4, 0.5, np.float32)
    p = np.empty(32, np.float32)
    lowrank.project(x, q, p, table)
    p = p.reshape(8, 4)
    assert np.isnan(p[3]).all() and np.isposinf(p[5]).all() and np.isfinite(np.delete(p, [3, 5], 0)).all()
    qt = np.empty(3000 * 4, np.float32)
    lowrank.project_t(x, np.ones(32, np.float32), qt, table)
    qt = qt.reshape(3000, 4)
    assert np.isnan(qt[17]).all() and np.isposinf(qt[2]).all()
