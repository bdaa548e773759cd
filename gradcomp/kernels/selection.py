"""Sparse: the sparsifiers' selection kernels (top-k's candidates, random-k's draws and gather,
the scatter of sent values). The NumPy references, and the one dispatch (``compiled``) to their
compiled form (``gradcomp.kernels.fused_selection``); the codecs themselves are
``gradcomp.compressors.sparsifiers``.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import array_module, load, stream

BLOCK = 2048  # values per block of the compiled one-pass kernels (in the L1 cache)


def compiled(*arrays: Any) -> Any:
    """``gradcomp.kernels.fused_selection`` where its kernels take ``arrays`` (contiguous NumPy arrays; the
    float ones, if any, float32 or float64 of one dtype; index arrays beside them) and run here,
    else None: the one place the sparsifiers choose compiled or NumPy."""
    floats = [a for a in arrays if a.dtype.kind == "f"]
    if floats and (floats[0].dtype not in (np.float32, np.float64) or any(a.dtype != floats[0].dtype for a in floats)):
        return None
    return load("fused_selection", *arrays)


def sum_is_finite(top_bits: int, n: int, dtype: np.dtype) -> bool | None:
    """Whether a vector of ``n`` values whose largest magnitude has the bits ``top_bits`` (from
    ``randomk_gather``) sums to a finite value in NumPy's ``sum``: False when a value is NaN or
    Inf, True when ``n`` times the largest magnitude is below a quarter of the dtype's largest
    value (no partial sum can overflow: NumPy's pairwise sum grows rounding errors by far less
    than 4x), None when only the sum itself can tell."""
    info = np.finfo(dtype)
    inf_bits = int(np.array(np.inf, dtype).view(np.int32 if dtype == np.float32 else np.int64))
    if top_bits >= inf_bits:
        return False
    largest = float(np.array(top_bits, np.int32 if dtype == np.float32 else np.int64).view(dtype))
    return True if largest * n < float(info.max) / 4 else None


class Draws:
    """Random-k's positions: ``choose`` draws what NumPy's ``Generator.choice`` draws, with the
    scratch of the compiled draws kept from one call to the next."""

    def __init__(self) -> None:
        self._bitmap: np.ndarray | None = None  # Floyd's drawn positions (``choose``)
        self._spare: np.ndarray | None = None

    def choose(self, rng: np.random.Generator, n: int, k: int, index: Any) -> None:
        """``k`` of ``n`` positions, ascending, into ``index``: ``np.sort(rng.choice(n, k,
        replace=False, shuffle=False))``. Where NumPy's choice uses Floyd's algorithm (not more
        than 2% of a large ``n``) and the kernels are here, the same draws from the same bit
        generator by a compiled loop (``jit.floyd_bits``, checked against NumPy on first use),
        which marks them in a bitmap whose set bits are the sorted positions (no sort)."""
        jit = compiled(index)
        floyd = k and not (n > 10000 and k > n // 50) and n < 1 << 31
        if jit is None or not floyd or not _floyd_matches_numpy(jit):
            chosen = np.sort(rng.choice(n, size=k, replace=False, shuffle=False)) if k else np.zeros(0, np.int64)
            index[...] = array_module(index).asarray(chosen)
            return
        words = -(-n // 64)
        if self._bitmap is None or self._bitmap.shape[0] < words:
            self._bitmap = np.zeros(words, np.uint64)  # all zero between uses (cleared as read)
        _floyd_positions(jit, rng, n, k, self._bitmap[:words], index, self._positions(k))

    def _positions(self, k: int) -> np.ndarray:
        """Room for ``k`` positions and the two ``jit.bitmap_positions`` may write past them."""
        if self._spare is None or self._spare.shape[0] < k + 2:
            self._spare = np.empty(k + 2, np.int64)
        return self._spare[:k + 2]


def scatter(out: Any, index: Any, values: Any, add: bool) -> bool:
    """``out (+)= scatter(index, values)`` in one write of ``out`` (``jit.scatter_into``: zeros and
    the values' ``0 + v`` a block at a time) where the kernels take the arrays and ``index`` is
    ascending without repeats (every message the sparsifiers encode); else False, nothing changed."""
    jit = compiled(out, values, index)
    if jit is None:
        return False
    n = out.shape[0]
    if index.shape[0] and not (int(index[0]) >= 0 and int(index[-1]) < n and bool((index[1:] > index[:-1]).all())):
        return False
    if not add and stream(out):
        jit.scatter_into_streamed(out, index, values, np.empty(BLOCK, out.dtype))
    else:
        jit.scatter_into(out, index, values, BLOCK, add)
    return True


def _floyd_positions(jit: Any, rng: np.random.Generator, n: int, k: int, bitmap: np.ndarray, index: Any,
                     spare: np.ndarray) -> None:
    """Floyd's ``k`` of ``n`` from ``rng``'s 32-bit outputs (low half of each 64-bit one first, as
    NumPy's PCG64 hands them out), ascending into ``index`` (through ``spare``, ``k + 2`` long);
    ``bitmap`` zero before and after."""
    raw = rng.bit_generator.random_raw(k // 2 + k // 64 + 64).view(np.uint32)
    j, used = n - k, 0
    while True:
        j, used = jit.floyd_bits(raw, n, k, j, used, bitmap)
        if j >= n:
            break
        raw = np.concatenate([raw[used:], rng.bit_generator.random_raw(k // 64 + 64).view(np.uint32)])
        used = 0
    jit.bitmap_positions(bitmap, spare)
    index[...] = spare[:k]


_FLOYD_OK: bool | None = None


def _floyd_matches_numpy(jit: Any) -> bool:
    """Whether ``jit.floyd_bits`` draws what this NumPy's ``Generator.choice`` draws (checked once,
    on a few sizes): a NumPy that samples another way gets its own ``choice``."""
    global _FLOYD_OK
    if _FLOYD_OK is None:
        ok = True
        for n, k, seed in ((10, 3, 1), (1000, 10, 2), (10001, 200, 3), (1 << 20, 10485, 4), (70001, 1, 5)):
            expected = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False, shuffle=False))
            got = np.empty(k, np.int64)
            _floyd_positions(jit, np.random.default_rng(seed), n, k, np.zeros(-(-n // 64), np.uint64), got,
                             np.empty(k + 2, np.int64))
            ok = ok and bool(np.array_equal(expected, got))
        _FLOYD_OK = ok
    return _FLOYD_OK
