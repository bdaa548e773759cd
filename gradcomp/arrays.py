"""Array-module helpers: NumPy on the host, CuPy on the GPU, chosen from the array itself.

The kernels behind ``cast``, ``divide``, ``add_into`` and ``subtract_into`` (half precision on
NumPy) live in ``gradcomp.kernels`` (``halfcast``, ``elementwise``), which picks compiled or NumPy;
``array_module`` and ``zero_non_finite`` are defined there too and re-exported here, as is
``sum_of_squares`` from ``gradcomp.exact`` (arithmetic whose bits do not depend on the CPU).

Nothing here imports CuPy unless the caller already handed us a CuPy array (DESIGN invariant 6).

Type annotations: ``Array`` is a NumPy or CuPy array, ``ArrayModule`` the module that owns one
(``numpy`` or ``cupy``), ``DTypeLike`` anything ``numpy.dtype()`` takes (ml_dtypes' bfloat16
included). CuPy is optional and untyped, so to the type checker an array is ``Any``: the names
say what is meant where NumPy's own types would wrongly exclude device arrays.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import numpy as np

from .exact import sum_of_squares  # noqa: F401 - defined there (the same bits on any CPU), re-exported here
from .kernels import array_module
from .kernels.elementwise import add_into as _half_add_into
from .kernels.elementwise import divide as _half_divide
from .kernels.elementwise import zero_non_finite  # noqa: F401 - defined there, re-exported here
from .kernels.halfcast import cast_kernel, numpy_vector

#: A NumPy or CuPy array (see the module docstring).
Array = Any
#: ``numpy`` or ``cupy``.
ArrayModule = ModuleType
#: A dtype or anything ``numpy.dtype()`` accepts (``"float16"``, ``np.float32``, ``ml_dtypes.bfloat16``).
DTypeLike = Any

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def is_device_array(array: Array) -> bool:
    return array_module(array) is not np


def dtype_name(dtype: DTypeLike) -> str:
    """``'float32'``, ``'bfloat16'`` ... for NumPy, CuPy and ml_dtypes dtypes alike."""
    return np.dtype(dtype).name


def half_dtype(name: str, xp: ArrayModule = np) -> Any:
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


def cast(array: Array, dtype: DTypeLike, out: Array | None = None) -> Array:
    """``array`` converted to ``dtype``, in a new array or in ``out`` (same shape, ``dtype``). The
    one place every dtype conversion of gradcomp goes through, so the fastest available kernel is
    chosen once for all methods.

    ``gradcomp.kernels.halfcast`` picks the kernel: for contiguous NumPy float32 <->
    float16/bfloat16 the compiled ones (hardware conversion, about a memory pass), without numba
    its NumPy float16 kernels (SIMD bit manipulation, several times faster than ``astype``). Both
    give ``astype``'s bits; everything else is ``astype``.
    """
    target = np.dtype(dtype)
    source = getattr(array, "dtype", None)
    kernel = cast_kernel(array, source, target)
    if kernel is None or (out is not None and not numpy_vector(out)):
        if out is None:
            return array.astype(dtype)
        out[...] = array  # converts element by element, no temporary of the whole array
        return out
    if out is None:
        out = np.empty(array.shape, target)
    kernel(array.reshape(-1), out.reshape(-1))
    return out


def divide(array: Array, divisor: float, out: Array | None = None) -> Array:
    """``array / divisor`` in the array's own dtype, into ``out`` (``array`` itself is allowed)
    or a new array. NumPy half arrays go through a kernel (``kernels.elementwise``: same bits as
    NumPy's emulated float16 / ml_dtypes' bfloat16 division)."""
    done = _half_divide(array, divisor, out)
    if done is not None:
        return done
    if out is None:
        return array / array.dtype.type(divisor)
    return array_module(array).divide(array, array.dtype.type(divisor), out=out)


def add_into(acc: Array, other: Array) -> Array:
    """``acc += other`` in ``acc``'s dtype; NumPy float16/bfloat16 through a kernel
    (``kernels.elementwise``: same bits as NumPy's emulated float16 add / ml_dtypes' bfloat16 add)."""
    if not _half_add_into(acc, other):
        acc += other
    return acc


def subtract_into(acc: Array, other: Array) -> Array:
    """``acc -= other`` in ``acc``'s dtype, with the kernel of ``add_into`` (``a - b`` is exactly
    ``a + (-b)`` in IEEE arithmetic)."""
    if not _half_add_into(acc, other, -1.0):
        acc -= other
    return acc


def to_host(array: Array) -> np.ndarray:
    """A NumPy view/copy of ``array`` (synchronous for CuPy)."""
    if is_device_array(array):
        return array.get()
    return array


def synchronize(array: Array) -> None:
    """Wait for the current CUDA stream when ``array`` lives on the GPU; no-op on the host.

    MPI reads device memory behind CUDA's back, so every kernel that wrote ``array`` must have
    finished before the buffer is handed to MPI (or copied to the host by another thread).
    """
    if is_device_array(array):
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
