"""Array-module helpers: NumPy on the host, CuPy on the GPU, chosen from the array itself.

Nothing here imports CuPy unless the caller already handed us a CuPy array (DESIGN invariant 6).
"""
from __future__ import annotations

import sys

import numpy as np

from . import halfcast as _halfcast

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def array_module(array):
    """Return ``numpy`` or ``cupy``, whichever owns ``array``."""
    if type(array).__module__.split(".")[0] == "cupy":
        return sys.modules["cupy"]
    return np


def is_device_array(array) -> bool:
    return array_module(array) is not np


def dtype_name(dtype) -> str:
    """``'float32'``, ``'bfloat16'`` ... for NumPy, CuPy and ml_dtypes dtypes alike."""
    return np.dtype(dtype).name


def half_dtype(name: str, xp=np):
    """The dtype object for ``'float16'`` or ``'bfloat16'`` in the array module ``xp``.

    NumPy has no bfloat16 of its own; ml_dtypes (maintained by the JAX team) registers one with
    working ufuncs and casts. CuPy accepts the same dtype object where it supports bfloat16.
    """
    if name == "float16":
        return xp.float16
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    raise ValueError(f"unknown half dtype {name!r}; expected 'float16' or 'bfloat16'")


def cast(array, dtype):
    """``array`` converted to ``dtype`` (a new array). The one place every dtype conversion of
    gradcomp goes through, so the fastest available kernel is chosen once for all methods.

    NumPy float32 <-> float16 of contiguous arrays goes through ``gradcomp.halfcast`` (SIMD
    bit-manipulation kernels, bit-identical to ``astype`` and several times faster, see there);
    everything else is ``astype``.
    """
    if (type(array) is np.ndarray and array.size >= _halfcast.MIN_SIZE
            and array.flags.c_contiguous):
        target = np.dtype(dtype)
        if array.dtype == np.float32 and target == np.float16:
            return _halfcast.float32_to_float16(array.reshape(-1)).reshape(array.shape)
        if array.dtype == np.float16 and target == np.float32:
            return _halfcast.float16_to_float32(array.reshape(-1)).reshape(array.shape)
    return array.astype(dtype)


def _numpy_half_vector(array) -> bool:
    return (type(array) is np.ndarray and array.dtype == np.float16 and array.ndim == 1
            and array.flags.c_contiguous and array.size >= _halfcast.MIN_SIZE)


def divide(array, divisor):
    """``array / divisor`` in the array's own dtype (a new array). NumPy float16 goes through
    ``gradcomp.halfcast`` (same bits as NumPy's float16 division, which is emulated and slow)."""
    if _numpy_half_vector(array):
        return _halfcast.divide(array, divisor)
    return array / array.dtype.type(divisor)


def add_into(acc, other):
    """``acc += other`` in ``acc``'s dtype; NumPy float16 goes through ``gradcomp.halfcast``
    (same bits as NumPy's emulated float16 add, computed with SIMD float32 kernels)."""
    if (_numpy_half_vector(acc) and type(other) is np.ndarray and other.dtype == np.float16
            and other.shape == acc.shape and other.flags.c_contiguous):
        return _halfcast.add_into(acc, other)
    acc += other
    return acc


def to_host(array) -> np.ndarray:
    """A NumPy view/copy of ``array`` (synchronous for CuPy)."""
    if is_device_array(array):
        return array.get()
    return array


def synchronize(array) -> None:
    """Wait for the current CUDA stream when ``array`` lives on the GPU; no-op on the host.

    MPI reads device memory behind CUDA's back, so every kernel that wrote ``array`` must have
    finished before the buffer is handed to MPI (or copied to the host by another thread).
    """
    if is_device_array(array):
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
