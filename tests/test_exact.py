"""``gradcomp.exact``: arithmetic whose bits do not depend on the CPU (DESIGN.md, "Same bits on
any CPU"), and top-k's choice among tied magnitudes (``sparsifiers.largest``). That ranks on other
CPUs decide alike with them is ``tests/planning/test_any_cpu.py``'s."""
from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from gradcomp import exact
from gradcomp.compressors.sparsifiers import largest


def test_log_is_within_two_units_in_the_last_place_and_its_bits_are_recorded():
    rng = np.random.default_rng(0)
    xs = np.concatenate([rng.random(3000) * 4, np.exp(rng.uniform(-700, 700, 3000)),
                         [5e-324, 1e-310, 0.5, 1.0, 2.0, np.nextafter(1.0, 2.0), np.nextafter(1.0, 0.0),
                          1.7976931348623157e308]])
    for x in xs.tolist():
        want = math.log(x)
        assert abs(exact.log(x) - want) <= 2 * math.ulp(want), x
    assert exact.log(0.0) == -math.inf and exact.log(math.inf) == math.inf
    assert math.isnan(exact.log(-1.0)) and math.isnan(exact.log(math.nan))
    # its bits, the same on any machine (Python floats, one rounding per operation): a change of
    # the series shows here
    recorded = {10.0: "0x1.26bb1bbb55515p+1", 1.0000001: "0x1.ad7f2847b6492p-24", 3e-310: "-0x1.6459f44103e86p+9",
                1.5e300: "0x1.59972ac7617a8p+9"}
    assert {x: exact.log(x).hex() for x in recorded} == recorded


def test_sums_are_exactly_rounded_per_segment():
    rng = np.random.default_rng(1)
    values = rng.standard_normal(1000) * 10.0 ** rng.integers(-12, 12, 1000)
    bounds = np.array([0, 1, 1, 300, 999, 1000])
    got = exact.sums(values, bounds)
    want = [float(sum(map(Fraction, values[a:b].tolist()), Fraction(0))) for a, b in zip(bounds[:-1], bounds[1:])]
    assert got.tolist() == want and got[1] == 0.0
    assert exact.fsum([1e308, 1e308]) == math.inf and math.isnan(exact.fsum([math.inf, -math.inf]))


def _fold(values: list[float]) -> float:
    """``exact.total``'s order, spelt out: halves added element-wise, odd values left out."""
    left = []
    while len(values) > exact.TAIL:
        half = len(values) // 2
        if len(values) % 2:
            left.append(values[-1])
        values = [a + b for a, b in zip(values[:half], values[half:2 * half])]
    return math.fsum(values + left)


def test_total_adds_in_its_fixed_order():
    rng = np.random.default_rng(2)
    for n in (0, 1, exact.TAIL, exact.TAIL + 1, 2 * exact.TAIL + 1, 4099, 30001):
        values = rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)
        assert exact.total(values.copy()) == _fold(values.tolist()), n
    assert math.isnan(exact.total(np.array([1.0, np.nan] * 600)))


def test_sum_of_squares_in_float64_for_every_dtype():
    import ml_dtypes

    rng = np.random.default_rng(3)
    x = rng.standard_normal(5000)
    for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16):
        a = x.astype(dtype)
        squares = a.astype(np.float64) ** 2
        assert exact.sum_of_squares(a.reshape(50, 100)) == _fold(squares.tolist()), dtype
        assert math.isclose(exact.sum_of_squares(a), math.fsum(squares.tolist()), rel_tol=1e-14)
    assert exact.sum_of_squares(np.zeros(0, np.float32)) == 0.0


def test_sum_of_squares_of_a_large_array_folds_chunk_by_chunk():
    """Over ``2 ** FOLDS * CHUNK`` values the first folds are taken from the squares chunk by
    chunk: the same bits as ``total`` of the whole squared array (odd sizes at each fold, every
    dtype, an inf), holding a float64 array an eighth of the squares' and a few chunks."""
    import tracemalloc

    import ml_dtypes

    rng = np.random.default_rng(4)
    above = 2 ** exact.FOLDS * exact.CHUNK
    for n in (above + 1, above + 7, 3 * above + 5, 4 * above):
        x = rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n)
        for dtype in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16):
            a = x.astype(dtype)
            assert exact.sum_of_squares(a) == exact.total(np.square(a, dtype=np.float64)), (n, dtype)
    big = rng.standard_normal(8 * above).astype(np.float32)
    tracemalloc.start()
    exact.sum_of_squares(big)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 2 * big.size, f"{peak / big.size:.1f} bytes a value (the whole squared array: 8)"
    big[5] = np.inf
    assert exact.sum_of_squares(big) == math.inf


def test_top_k_keeps_the_first_of_tied_magnitudes():
    """``argpartition`` leaves the choice among ties to NumPy's SIMD form for the CPU; ``largest``
    keeps the first positions (NaN counts as the largest)."""
    m = np.array([1.0, 3.0, 2.0, 3.0, 2.0, 2.0, np.nan, 2.0], np.float32)
    assert sorted(largest(m, 1).tolist()) == [6]
    assert sorted(largest(m, 3).tolist()) == [1, 3, 6]
    assert sorted(largest(m, 5).tolist()) == [1, 2, 3, 4, 6]
    assert sorted(largest(m, 8).tolist()) == list(range(8))
    assert sorted(largest(np.full(6, np.nan, np.float32), 2).tolist()) == [0, 1]
    rng = np.random.default_rng(4)
    for _ in range(50):
        n = int(rng.integers(1, 400))
        m = rng.integers(0, 5, n).astype(np.float32)
        k = int(rng.integers(1, n + 1))
        order = np.lexsort((np.arange(n), -m))  # by magnitude, then position
        assert sorted(largest(m, k).tolist()) == sorted(order[:k].tolist())
