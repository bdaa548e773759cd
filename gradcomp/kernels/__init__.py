"""Every compiled (numba) kernel of gradcomp, and the one check that says whether they run here.

numba is imported only under this package, and only once ``available()`` has been asked (it
takes a good fraction of a second to import: processes that never need a kernel do not pay it).
This module itself imports no numba: it holds what the NumPy paths share with the kernels.

- ``base``: the compile policy (``kernel``, ``inline``) and the LLVM intrinsics every subject
  uses (half-precision conversion, float bits, int32 min/max, bit counts, streamed stores);
- ``half``: float32 <-> float16/bfloat16 casts and element-wise half arithmetic;
- ``check``: the self-check behind ``available()``;
- ``sparse``: top-k's and random-k's one-pass kernels;
- ``chunks``: the chunk codes' shared steps (ranges, codes, 4-bit packing, rows);
- ``quantize`` / ``quantize64``: the affine 8- and 4-bit codes of float32 / float64;
- ``signs`` / ``onebit``: the 1-bit code's vector intrinsics / its kernels;
- ``lowrank``: PowerSGD's products.

``GRADCOMP_JIT=0`` turns them off: callers use their NumPy kernels instead.
"""
from __future__ import annotations

import os

import numpy as np

#: ``x + 2**23`` rounds a float32 ``x`` in [0, 2**22) to a whole number in its low mantissa bits
ROUND_MAGIC = np.float32(2.0 ** 23)

#: an output array of at least this many bytes is written around the caches (``stream``):
#: it is larger than a core's share of the last-level cache, so it would be evicted before
#: anything reads it, and a plain store first reads every line it writes (twice the traffic)
STREAM_BYTES = 4 << 20

_ok: bool | None = None


def stream(out) -> bool:
    """Whether a kernel writing all of ``out`` should do it with ``base._stream`` (``STREAM_BYTES``)."""
    return out.nbytes >= STREAM_BYTES


def available() -> bool:
    """True when the compiled kernels can be used: not disabled (``GRADCOMP_JIT=0``), numba
    present, and ``check.passes()`` on this machine. Asked once; the first answer stays."""
    global _ok
    if _ok is None:
        _ok = os.environ.get("GRADCOMP_JIT", "1") != "0" and _passes()
    return _ok


def _passes() -> bool:
    try:  # numba is an install requirement, but gradcomp must still import and run without it
        from .check import passes
    except ImportError:  # pragma: no cover - exercised by GRADCOMP_JIT=0 instead
        return False
    return passes()
