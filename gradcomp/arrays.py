"""Array-module helpers: NumPy on the host, CuPy on the GPU, chosen from the array itself.

Nothing here imports CuPy unless the caller already handed us a CuPy array (DESIGN invariant 6).

Type annotations: ``Array`` is a NumPy or CuPy array, ``ArrayModule`` the module that owns one
(``numpy`` or ``cupy``), ``DTypeLike`` anything ``numpy.dtype()`` takes (ml_dtypes' bfloat16
included). CuPy is optional and untyped, so to the type checker an array is ``Any``: the names
say what is meant where NumPy's own types would wrongly exclude device arrays.
"""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, Callable

import numpy as np

from . import halfcast as _halfcast
from . import kernels as _kernels

#: A NumPy or CuPy array (see the module docstring).
Array = Any
#: ``numpy`` or ``cupy``.
ArrayModule = ModuleType
#: A dtype or anything ``numpy.dtype()`` accepts (``"float16"``, ``np.float32``, ``ml_dtypes.bfloat16``).
DTypeLike = Any

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def array_module(array: Array) -> ArrayModule:
    """Return ``numpy`` or ``cupy``, whichever owns ``array``."""
    if type(array).__module__.split(".")[0] == "cupy":
        return sys.modules["cupy"]
    return np


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


def _numpy_vector(array: Array) -> bool:
    return type(array) is np.ndarray and array.flags.c_contiguous


def _half_name(dtype: DTypeLike) -> str | None:
    name = np.dtype(dtype).name
    return name if name in ("float16", "bfloat16") else None


#: Below this many values a compiled kernel call costs more than NumPy's own loop.
_JIT_MIN = 256


_jit: Any = None  # gradcomp.kernels.half once imported and working, False when not usable here


def compiled_kernels() -> Any:
    """``gradcomp.kernels.half`` when the compiled kernels work here (``kernels.available()``),
    else None. Imported on first need only: numba takes a good fraction of a second to import,
    which processes that never touch a half-precision array should not pay."""
    global _jit
    if _jit is None:
        if _kernels.available():
            from .kernels import half

            _jit = half
        else:
            _jit = False
    return _jit or None


def _use_jit(array: Array) -> bool:
    return _numpy_vector(array) and array.size >= _JIT_MIN and compiled_kernels() is not None


def _cast_kernel(array: Array, source: Any, target: np.dtype) -> Callable[[Array, Array], Any] | None:
    """The fast kernel ``(flat source, flat out)`` for converting ``array`` from ``source`` to
    ``target``, or None where ``astype`` is the way: compiled kernels for float32 <->
    float16/bfloat16, else the NumPy float16 kernels of ``gradcomp.halfcast``. Conversions that
    involve no half type never reach ``_use_jit``, which would import numba."""
    if source == target or not (_half_name(source) or _half_name(target)):
        return None
    if _use_jit(array):
        if source == np.float32 and _half_name(target):
            return lambda x, out: _jit.encode(x, out.view(np.uint16), target.name == "bfloat16")
        if _half_name(source) and target == np.float32:
            return lambda x, out: _jit.decode(x.view(np.uint16), out, source.name == "bfloat16")
    elif _numpy_vector(array) and array.size >= _halfcast.MIN_SIZE:
        if source == np.float32 and target == np.float16:
            return _halfcast.float32_to_float16
        if source == np.float16 and target == np.float32:
            return _halfcast.float16_to_float32
    return None


def cast(array: Array, dtype: DTypeLike, out: Array | None = None) -> Array:
    """``array`` converted to ``dtype``, in a new array or in ``out`` (same shape, ``dtype``). The
    one place every dtype conversion of gradcomp goes through, so the fastest available kernel is
    chosen once for all methods.

    Contiguous NumPy float32 <-> float16/bfloat16 use the compiled kernels of ``gradcomp.kernels.half``
    (hardware conversion, about a memory pass); without numba, float32 <-> float16 uses
    ``gradcomp.halfcast`` (SIMD bit manipulation, several times faster than ``astype``). Both give
    ``astype``'s bits; everything else is ``astype``.
    """
    target = np.dtype(dtype)
    source = getattr(array, "dtype", None)
    kernel = _cast_kernel(array, source, target)
    if kernel is None or (out is not None and not _numpy_vector(out)):
        if out is None:
            return array.astype(dtype)
        out[...] = array  # converts element by element, no temporary of the whole array
        return out
    if out is None:
        out = np.empty(array.shape, target)
    kernel(array.reshape(-1), out.reshape(-1))
    return out


def _half_operands(acc: Array, other: Array) -> str | None:
    """The half kind ('float16'/'bfloat16') when ``acc`` and ``other`` are same-shape contiguous
    NumPy arrays of it, big enough for a kernel; else None."""
    kind = _half_name(acc.dtype) if type(acc) is np.ndarray else None
    if (kind and type(other) is np.ndarray and other.dtype == acc.dtype
            and other.shape == acc.shape and other.flags.c_contiguous
            and _numpy_vector(acc) and acc.size >= _JIT_MIN):
        return kind
    return None


def divide(array: Array, divisor: float, out: Array | None = None) -> Array:
    """``array / divisor`` in the array's own dtype, into ``out`` (``array`` itself is allowed)
    or a new array. NumPy half arrays go through a kernel (same bits as NumPy's emulated float16
    / ml_dtypes' bfloat16 division)."""
    kind = _half_name(array.dtype) if type(array) is np.ndarray else None
    if kind and _use_jit(array) and (out is None or _numpy_vector(out)):
        if out is None:
            out = array.copy()
        elif out is not array:
            np.copyto(out, array)
        _jit.divide_in_place(out.reshape(-1).view(np.uint16), np.float32(array.dtype.type(divisor)),
                             kind == "bfloat16")
        return out
    if kind == "float16" and _numpy_vector(array) and array.ndim == 1 and array.size >= _halfcast.MIN_SIZE:
        return _halfcast.divide(array, divisor, out)
    if out is None:
        return array / array.dtype.type(divisor)
    return array_module(array).divide(array, array.dtype.type(divisor), out=out)


def add_into(acc: Array, other: Array) -> Array:
    """``acc += other`` in ``acc``'s dtype; NumPy float16/bfloat16 through a kernel (same bits as
    NumPy's emulated float16 add / ml_dtypes' bfloat16 add)."""
    kind = _half_operands(acc, other)
    if kind and compiled_kernels():
        _jit.add_into(acc.reshape(-1).view(np.uint16), other.reshape(-1).view(np.uint16),
                      kind == "bfloat16", np.float32(1.0))
        return acc
    if kind == "float16" and acc.ndim == 1 and acc.size >= _halfcast.MIN_SIZE:
        return _halfcast.add_into(acc, other)
    acc += other
    return acc


def subtract_into(acc: Array, other: Array) -> Array:
    """``acc -= other`` in ``acc``'s dtype, with the kernel of ``add_into`` (``a - b`` is exactly
    ``a + (-b)`` in IEEE arithmetic)."""
    kind = _half_operands(acc, other)
    if kind and compiled_kernels():
        _jit.add_into(acc.reshape(-1).view(np.uint16), other.reshape(-1).view(np.uint16),
                      kind == "bfloat16", np.float32(-1.0))
        return acc
    acc -= other
    return acc


def zero_non_finite(flat: Array) -> None:
    """Zero the NaN and Inf entries of ``flat`` (an error-feedback residual after a bad step, so
    one bad step does not poison the following ones); one cheap sum decides whether to look."""
    xp = array_module(flat)
    with np.errstate(all="ignore"):
        total = flat.sum()  # NaN or Inf anywhere makes it non-finite (an overflow only costs a look)
    if not bool(xp.isfinite(total)):
        flat[~xp.isfinite(flat)] = 0


def sum_of_squares(array: Array) -> float:
    """The sum of ``array``'s squared values, accumulated in float64 (a gradient's squared norm:
    the same bits on every rank for the same input)."""
    xp = array_module(array)
    flat = array.reshape(-1)
    if dtype_name(flat.dtype) == "float64":
        return float(xp.vdot(flat, flat).real)
    return float(xp.square(flat, dtype=np.float64).sum())


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
