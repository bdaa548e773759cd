"""Arithmetic whose bits do not depend on the CPU (DESIGN.md, "Same bits on any CPU").

What a rank decides alone from agreed values (a warm-up's end, the governor's rungs) must come out
the same on every rank, whatever CPU each runs on. IEEE 754's basic operations (``+ - * /`` and
``sqrt``) are correctly rounded: the same bits on any machine, at any vector width. NumPy's
transcendental functions (``exp``, ``log``, ``power``, ...) are not: NumPy picks a SIMD
implementation for the CPU at run time (AVX-512, AVX2 or its baseline give other last bits), as
the C library picks its own; BLAS (``vdot``, ``dot``, ``linalg.norm``) picks kernels by CPU that
add in their own order. So the helpers here use the basic operations only, in an order fixed
here, or ``math.fsum`` (exactly rounded: no order to fix):

- ``log``: the natural logarithm of a Python float, from ``math.frexp`` and a fixed series;
- ``sums``: a sum per segment of a short array, each exactly rounded (``math.fsum``);
- ``total``: a whole array's sum at about memory speed, in a fixed tree of element-wise adds;
- ``sum_of_squares``: a gradient's squared norm in float64, through ``total``.

This module imports nothing of gradcomp above ``gradcomp.kernels`` (``gradcomp.arrays``
re-exports ``sum_of_squares``).
"""
from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np

from .kernels import array_module

#: ln 2 and sqrt(1/2), correctly rounded
LN2 = 0.6931471805599453
SQRT_HALF = 0.7071067811865476
#: the series of ``log``: 2 atanh(s) = 2 (s + s^3/3 + s^5/5 + ...), terms up to s^(2 TERMS - 1);
#: with |s| <= 0.1716 the first term left out is under 1e-17 of the sum
TERMS = 12
_ODD = tuple(1.0 / (2 * k + 1) for k in range(TERMS))
#: ``total`` folds an array until at most this many values remain, then sums them exactly
TAIL = 512


def log(x: float) -> float:
    """The natural logarithm of ``x`` within a few units in the last place, the same bits on any
    CPU: ``x = m 2^e`` (``math.frexp``, exact) with ``m`` in [sqrt(1/2), sqrt(2)), then
    ``e ln 2 + 2 atanh((m - 1) / (m + 1))`` by a fixed series in Python floats (each operation
    rounded on its own: CPython fuses none). 0 gives -inf, inf gives inf, a negative or NaN
    ``x`` NaN."""
    x = float(x)
    if not x > 0.0:
        return -math.inf if x == 0.0 else math.nan
    if x == math.inf:
        return math.inf
    m, e = math.frexp(x)  # 0.5 <= m < 1
    if m < SQRT_HALF:
        m, e = 2.0 * m, e - 1
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    acc = _ODD[-1]
    for c in _ODD[-2::-1]:
        acc = acc * s2 + c
    return e * LN2 + 2.0 * (s * acc)


def fsum(values: Sequence[float]) -> float:
    """``math.fsum`` (exactly rounded), also where the exact sum overflows: then the infinite
    sum in order (``math.fsum`` raises) and NaN for inf - inf."""
    try:
        return math.fsum(values)
    except OverflowError:
        return float(sum(values))
    except ValueError:  # inf + -inf
        return math.nan


def sums(values: Any, bounds: Any) -> np.ndarray:
    """``values[bounds[i]:bounds[i + 1]]``'s sum for each ``i``, each exactly rounded (float64;
    an empty segment: 0). For short arrays (an audit's sample): one ``math.fsum`` per segment."""
    flat = np.asarray(values, np.float64).reshape(-1).tolist()
    edges = [int(b) for b in np.asarray(bounds).reshape(-1)]
    return np.array([fsum(flat[a:b]) for a, b in zip(edges[:-1], edges[1:])], np.float64)


def total(values: Any) -> float:
    """The sum of the 1-D float64 array ``values`` (NumPy or CuPy, contiguous), in one order
    fixed here: the upper half added onto the lower half element by element (an odd count leaves
    its last value out), again and again until at most ``TAIL`` remain, which are summed with
    the values left out exactly (``fsum``). About one pass over memory; ``values`` is
    overwritten (scratch)."""
    return _fold(values, int(values.size), [])


def _fold(values: Any, n: int, left: list[float]) -> float:
    """``total``'s folds of ``values[:n]``, with the values ``left`` out so far."""
    xp = array_module(values)
    skipped = []  # the positions left out: never written again (each later fold writes below them)
    while n > TAIL:
        half = n // 2
        if n % 2:
            skipped.append(n - 1)
        xp.add(values[:half], values[half:2 * half], out=values[:half])
        n = half
    rest = values[:n].tolist() + left
    if skipped:
        rest += values[xp.asarray(skipped)].tolist()
    return fsum(rest)


#: ``sum_of_squares`` computes the first ``FOLDS`` folds of ``total`` straight from the squares, a
#: chunk of ``CHUNK`` values of the folded array at a time, for arrays of more than ``2 ** FOLDS *
#: CHUNK`` values: a float64 array an eighth of the squares' (GPT-2's embedding: 39 MB, not 309)
FOLDS, CHUNK = 3, 1 << 16


def sum_of_squares(array: Any) -> float:
    """The sum of ``array``'s squared values in float64 (a gradient's squared norm: a warm-up's
    levels, a norm to clip by), the same bits on every rank and any CPU for the same input: each
    square is correctly rounded (exact for the half formats and float32), then ``total``'s sum,
    whose first folds are taken chunk by chunk from the squares (the same additions in the same
    pairs: the same bits as ``total`` of the whole squared array, without holding it)."""
    xp = array_module(array)
    flat = array.reshape(-1)
    n = int(flat.size)
    if n <= 2 ** FOLDS * CHUNK:
        return total(xp.square(flat, dtype=np.float64))
    sizes = [n]
    for _ in range(FOLDS):
        sizes.append(sizes[-1] // 2)

    def level(k: int, start: int, stop: int) -> Any:
        """Values ``start:stop`` of the array after ``k`` folds."""
        if k == 0:
            return xp.square(flat[start:stop], dtype=np.float64)
        out = level(k - 1, start, stop)
        out += level(k - 1, start + sizes[k], stop + sizes[k])
        return out

    # left out by the first folds: the last value of each odd-sized level, in ``total``'s order
    left = [float(level(k, sizes[k] - 1, sizes[k])[0]) for k in range(FOLDS) if sizes[k] % 2]
    folded = xp.empty(sizes[FOLDS], np.float64)
    for start in range(0, sizes[FOLDS], CHUNK):
        stop = min(start + CHUNK, sizes[FOLDS])
        folded[start:stop] = level(FOLDS, start, stop)
    return _fold(folded, sizes[FOLDS], left)
