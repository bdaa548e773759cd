"""Signs: the 1-bit code (the sign of every value, 8 per byte, and the mean magnitude of each
chunk as its scale). The NumPy kernels, and the one dispatch (``compiled``) to their compiled form
(``gradcomp.kernels.onebit``, built on ``signs``' vector intrinsics).

The scale is summed in float64 in index order on every path (the compiled loops' eight lanes,
here NumPy's ``cumsum`` in the same order), so every rank computes the same bits whichever
kernels it has. A chunk whose scale is NaN decodes to NaN on every path.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import array_module, load

#: chunks whose sums the compiled kernels run side by side (``signs.TOTALS_AT_ONCE``; that module
#: imports numba, so the number is repeated here): the scratch block they take is this many chunks
BLOCK_CHUNKS = 4


def compiled(*arrays: Any) -> Any:
    """``gradcomp.kernels.onebit`` where the compiled kernels take ``arrays`` (contiguous NumPy
    arrays, the first one float32 or float64) and run here, else None: the one place the 1-bit
    code chooses compiled or NumPy."""
    if arrays[0].dtype not in (np.float32, np.float64):
        return None
    return load("onebit", *arrays)


def encode(x: Any, scales: Any, bits: Any, chunk: int, wide: Any, positive: Any) -> None:
    """NumPy's (or CuPy's) 1-bit encode of ``x``: each chunk's mean magnitude into ``scales``
    (float32), the signs (1 = not negative) into ``bits``, little bit order; ``wide`` (float64)
    and ``positive`` (bool) are scratch of ``x``'s length."""
    xp = array_module(x)
    n = x.shape[0]
    full = n // chunk
    xp.abs(x, out=wide)
    with np.errstate(all="ignore"):
        if full:
            scales[:full] = _lane_sums(xp, wide[:full * chunk].reshape(full, chunk)) / chunk
        if n > full * chunk:
            scales[full] = _lane_sums(xp, wide[full * chunk:].reshape(1, -1))[0] / (n - full * chunk)
    xp.greater_equal(x, 0, out=positive)
    bits[...] = xp.packbits(positive, bitorder="little")


def decode(scales: Any, bits: Any, out: Any, chunk: int, signs: Any, add: bool = False) -> None:
    """NumPy's (or CuPy's) 1-bit decode: ``out (+)= sign * scale`` per chunk, NaN where a chunk's
    scale is NaN; ``signs`` is scratch of ``out``'s length and dtype."""
    xp = array_module(out)
    n = out.shape[0]
    signs[...] = xp.unpackbits(bits, bitorder="little")[:n]  # CuPy's unpackbits has no count
    signs *= 2
    signs -= 1
    full = n // chunk
    with np.errstate(all="ignore"):
        if full:
            signs[:full * chunk].reshape(full, chunk)[...] *= scales[:full, None]
        if n > full * chunk:
            signs[full * chunk:] *= scales[full]
        lost = xp.isnan(scales)  # one NaN for every path (a NaN product's sign is not portable)
        if bool(lost.any()):
            for c in xp.flatnonzero(lost).tolist():
                signs[c * chunk:(c + 1) * chunk] = np.nan
    if add:
        out += signs
    else:
        out[...] = signs


def _lane_sums(xp: Any, rows: Any) -> Any:
    """Per row, the float64 sum of the compiled loop's order: eight lanes (lane k adds values
    8j + k in order), then the lanes in order. Rows have a multiple of 8 values."""
    lanes = xp.cumsum(rows.reshape(rows.shape[0], -1, 8), axis=1)[:, -1, :]
    return xp.cumsum(lanes, axis=1)[:, -1]
