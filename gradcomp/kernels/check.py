"""The self-check behind ``gradcomp.kernels.available()``: the target numba compiles for has the
half-precision conversions in hardware, and the half-precision kernels agree with NumPy /
ml_dtypes on this machine (compiling them on the way)."""
from __future__ import annotations

import numpy as np
from llvmlite import binding
from numba.core import config


def target_has_f16c() -> bool:
    """Whether the CPU numba compiles for (``NUMBA_CPU_NAME`` / ``NUMBA_CPU_FEATURES``, else this
    host) converts halves in hardware. Without F16C, LLVM lowers ``primitives._f16_encode`` to a
    runtime helper that numba does not link, and the first call jumps to nowhere (a crash, not an
    exception the check below could catch): so the answer must come before anything compiles.
    ``NUMBA_CPU_NAME=generic`` (plain x86-64) is such a target."""
    features = getattr(config, "CPU_FEATURES", None)  # set by numba from the environment
    if features is None:
        features = binding.get_host_cpu_features().flatten()
    return "+f16c" in features.split(",")


def passes() -> bool:
    """Compile the kernels and compare them with NumPy / ml_dtypes on every float16 and bfloat16
    value and on awkward float32 inputs; a target without F16C or any failure (a numba bug)
    means the NumPy kernels are used instead."""
    if not target_has_f16c():
        return False
    from .half import decode, encode

    try:
        import ml_dtypes

        every = np.arange(1 << 16, dtype=np.uint16)
        probe = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 1e9, -1e9, 5.96e-8, 2.98e-8, 1e-40,
                          np.inf, -np.inf, 1.00048828125, 3.0e-5, 0.1], np.float32)
        for name, dtype in (("float16", np.float16), ("bfloat16", ml_dtypes.bfloat16)):
            bf16 = name == "bfloat16"
            halves = every.view(dtype)
            finite = np.isfinite(halves.astype(np.float32))
            wide = np.empty(every.shape, np.float32)
            decode(every, wide, bf16)
            if not np.array_equal(wide[finite].view(np.uint32),
                                  halves[finite].astype(np.float32).view(np.uint32)):
                return False
            narrow = np.empty(probe.shape, np.uint16)
            encode(probe, narrow, bf16)
            with np.errstate(all="ignore"):
                if not np.array_equal(narrow, probe.astype(dtype).view(np.uint16)):
                    return False
        return True
    except Exception:  # noqa: BLE001 - any failure to compile or run means "not available"
        return False
