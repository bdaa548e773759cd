"""Every kernel of gradcomp, one subject at a time: the NumPy reference beside its compiled
(numba) form, and the one dispatch that picks between them.

Each subject has a NumPy module, which callers use: it holds the NumPy reference (the bits every
path must give) and ``compiled(...)``, the subject's one dispatch (the compiled module where it
runs here and takes the arrays, else None); where the subject has a single entry point, that
function itself picks. The compiled modules import numba and are loaded only through a dispatch.

================  ==========================  ===========================================
subject           NumPy module (use this)     compiled (numba) form
================  ==========================  ===========================================
half casts        ``halfcast``                ``half`` (``encode``, ``decode``)
element-wise      ``elementwise``             ``half`` (``add_into``, ``divide_in_place``)
quantization      ``affine``                  ``quantize``, ``quantize64``, ``chunks``
signs (1-bit)     ``signcodes``               ``onebit``, ``signs``
sparse            ``selection``               ``fused_selection``
low rank          ``products``                ``lowrank``
================  ==========================  ===========================================

Shared by the compiled forms: ``primitives`` (the compile policy, ``kernel``/``inline``, and the
LLVM intrinsics: half-precision conversion, float bits, int32 min/max, bit counts, streamed
stores) and ``check`` (the self-check behind ``available()``).

numba is imported only under this package, and only once ``available()`` has been asked (it
takes a good fraction of a second to import: processes that never need a kernel do not pay it).
This module and the NumPy modules import no numba, and nothing above this package (the layer at
the bottom of DESIGN.md's drawing): ``array_module`` lives here, ``gradcomp.arrays`` re-exports it.

``GRADCOMP_JIT=0`` turns the compiled forms off: every dispatch answers NumPy.
"""
from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any

import numpy as np

#: ``x + 2**23`` rounds a float32 ``x`` in [0, 2**22) to a whole number in its low mantissa bits
ROUND_MAGIC = np.float32(2.0 ** 23)

#: an output array of at least this many bytes is written around the caches (``stream``):
#: it is larger than a core's share of the last-level cache, so it would be evicted before
#: anything reads it, and a plain store first reads every line it writes (twice the traffic)
STREAM_BYTES = 4 << 20

_ok: bool | None = None


def array_module(array: Any) -> ModuleType:
    """Return ``numpy`` or ``cupy``, whichever owns ``array`` (CuPy is never imported here: an
    array of it means the caller imported it)."""
    if type(array).__module__.split(".")[0] == "cupy":
        return sys.modules["cupy"]
    return np


def stream(out) -> bool:
    """Whether a kernel writing all of ``out`` should do it with ``primitives._stream`` (``STREAM_BYTES``)."""
    return out.nbytes >= STREAM_BYTES


def available() -> bool:
    """True when the compiled kernels can be used: not disabled (``GRADCOMP_JIT=0``), numba
    present, and ``check.passes()`` on this machine. Asked once; the first answer stays."""
    global _ok
    if _ok is None:
        _ok = os.environ.get("GRADCOMP_JIT", "1") != "0" and _passes()
    return _ok


def load(name: str, *arrays: Any) -> ModuleType | None:
    """The compiled module ``gradcomp.kernels.<name>`` where the compiled kernels run here
    (``available()``) and every one of ``arrays`` is a contiguous NumPy array, else None. What
    each subject's dispatch is built on; the arrays are looked at first, so work that could never
    take a kernel does not import numba."""
    if all(type(a) is np.ndarray and a.flags.c_contiguous for a in arrays) and available():
        return importlib.import_module(f"{__name__}.{name}")
    return None


def _passes() -> bool:
    try:  # numba is an install requirement, but gradcomp must still import and run without it
        from .check import passes
    except ImportError:  # pragma: no cover - exercised by GRADCOMP_JIT=0 instead
        return False
    return passes()
