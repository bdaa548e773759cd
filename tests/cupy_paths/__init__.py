"""gradcomp's CuPy branches, run on every commit through the test stand-in for CuPy
(``tests/fakecupy``: NumPy underneath, CuPy's refusals and stream order on top).

The stand-in is installed only where these tests ask for it: ``env()`` for the ranks they launch
under ``mpiexec``, ``installed()`` in this process for the short single-process checks (taken out
again afterwards). It proves the Python logic of the CuPy branches, not CUDA;
``benchmarks/scripts/gpu_check.py`` is the check on a real GPU.
"""
from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Iterator

#: the folder that holds the stand-in's ``cupy`` package
FAKE = Path(__file__).resolve().parent.parent / "fakecupy"


def env(**extra: str) -> dict[str, str]:
    """Environment for ranks that run on the stand-in."""
    path = os.pathsep.join([str(FAKE), os.environ.get("PYTHONPATH", "")])
    return {"PYTHONPATH": path, "GRADCOMP_FAKE_CUPY": "1", **extra}


@contextlib.contextmanager
def installed() -> Iterator:
    """``import cupy`` gives the stand-in inside the block, in this process only."""
    before = os.environ.get("GRADCOMP_FAKE_CUPY")
    os.environ["GRADCOMP_FAKE_CUPY"] = "1"
    sys.path.insert(0, str(FAKE))
    try:
        import cupy

        cupy._fake.reset()
        yield cupy
    finally:
        sys.path.remove(str(FAKE))
        for name in [m for m in sys.modules if m == "cupy" or m.startswith("cupy.")]:
            del sys.modules[name]
        if before is None:
            os.environ.pop("GRADCOMP_FAKE_CUPY", None)
        else:
            os.environ["GRADCOMP_FAKE_CUPY"] = before
