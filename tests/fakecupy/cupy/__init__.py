"""A stand-in for CuPy, backed by NumPy, for gradcomp's tests only: no GPU has been lent to the
project, and this is how every CuPy branch of gradcomp runs on every commit.

It proves the Python logic of those branches, not CUDA: kernels are NumPy calls on host memory
that only this package touches. What it keeps of CuPy (``_core``'s docstring lists it): device
arrays of their own type (``cupy.ndarray``, not a NumPy subclass, ``type(a).__module__ ==
'cupy'``) that refuse implicit conversion to NumPy and refuse NumPy operands, 0-d results,
``get``/``set``/``asarray``/``asnumpy``, CuPy's signatures where they differ from NumPy's
(``unpackbits`` has no ``count``, ``argpartition`` wants a Python int and promises no order,
``reduceat`` is ``add``'s only), streams and devices (``cupy.cuda``) with a check that no device
memory reaches MPI while a kernel on it is still queued, and ``__cuda_array_interface__`` with
host pointers, which mpi4py hands to MPI as a CUDA-aware library would take device pointers.
The check on a real GPU remains ``benchmarks/scripts/gpu_check.py``.

Importable only where the tests put ``tests/fakecupy`` on ``sys.path`` *and* set
``GRADCOMP_FAKE_CUPY=1``: a stray path entry can never make a normal ``import cupy`` succeed.
The stand-in's own knobs and counters are ``cupy._fake`` (not CuPy's API).
"""
from __future__ import annotations

import os

if os.environ.get("GRADCOMP_FAKE_CUPY") != "1":
    raise ImportError("tests/fakecupy is gradcomp's test stand-in for CuPy, importable only in the tests "
                      "that ask for it (GRADCOMP_FAKE_CUPY=1); install CuPy for a GPU")

import builtins as _builtins

import numpy as _np
from numpy import (  # noqa: F401 - CuPy re-exports these from NumPy
    bool_, byte, cdouble, complex64, complex128, complexfloating, csingle, double, dtype, e,
    euler_gamma, finfo, float16, float32, float64, floating, generic, half, iinfo, inexact, inf,
    int8, int16, int32, int64, int_, intc, integer, intp, isdtype, issubdtype, longlong, nan, newaxis,
    number, pi, promote_types, short, signedinteger, single, ubyte, uint, uint8, uint16, uint32,
    uint64, uintc, uintp, ulonglong, unsignedinteger, ushort)

from . import cuda, linalg  # noqa: F401
from ._core import (  # noqa: F401
    UFUNCS,
    HazardError,
    _adopt,
    _call,
    _fake,
    _garbage,
    _kernel,
    check_dtype,
    ndarray,
    ufunc,
)

__version__ = "14.0.0+gradcomp.tests.fakecupy"

bool = _np.bool_  # noqa: A001 - CuPy's ``cupy.bool``
globals().update(UFUNCS)


def is_available() -> bool:
    return cuda.is_available()


# -- moving data ---------------------------------------------------------------------------------
def _from_host(obj, dtype=None, order="K") -> ndarray:
    host = _np.array(obj, dtype=dtype, order="F" if order == "F" else "C", copy=True)
    check_dtype(host.dtype)
    _fake.h2d_bytes += host.nbytes
    return _adopt(host)


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0, *, blocking=False):
    if isinstance(obj, ndarray):
        same = dtype is None or _np.dtype(dtype) == obj.dtype
        if not copy and same and (order in ("K", "A") or obj.flags.c_contiguous):
            return obj
        return obj.astype(obj.dtype if dtype is None else dtype, order="C" if order == "K" else order)
    return _from_host(obj, dtype, order)


def asarray(a, dtype=None, order=None, *, blocking=False):
    return array(a, dtype, copy=False, order=order or "K", blocking=blocking)


asanyarray = asarray


def ascontiguousarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, "
                        f"got {type(a).__name__})")
    if a.flags.c_contiguous and (dtype is None or _np.dtype(dtype) == a.dtype):
        return a
    return a.astype(a.dtype if dtype is None else dtype, order="C")


def asfortranarray(a, dtype=None):
    if not isinstance(a, ndarray):
        raise TypeError(f"Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, "
                        f"got {type(a).__name__})")
    return a.astype(a.dtype if dtype is None else dtype, order="F")


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True):
    if isinstance(a, ndarray):
        return a.get(stream=stream, order=order, out=out, blocking=blocking)
    if out is None:
        return _np.asarray(a, order=order)
    out[...] = a
    return out


def get_array_module(*args):
    return __import__("cupy") if _builtins.any(isinstance(a, ndarray) for a in args) else _np


def from_dlpack(array, *, device=None, copy=None):
    raise NotImplementedError("the test stand-in for CuPy has no CUDA tensors to import (tests stand "
                              "a CPU tensor in through cupy._fake.view_host_memory)")


fromDlpack = from_dlpack


# -- new arrays ---------------------------------------------------------------------------------
def empty(shape, dtype=float, order="C"):
    return ndarray(shape, dtype, order=order)


def _filled(shape, dtype, value, order="C"):
    a = ndarray(shape, dtype, order=order)
    a.fill(value)
    return a


def zeros(shape, dtype=float, order="C"):
    return _filled(shape, dtype, 0, order)


def ones(shape, dtype=float, order="C"):
    return _filled(shape, dtype, 1, order)


def full(shape, fill_value, dtype=None, order="C"):
    return _filled(shape, dtype if dtype is not None else _np.asarray(fill_value).dtype, fill_value, order)


def _like(prototype, dtype, shape):
    return (prototype.shape if shape is None else shape), (prototype.dtype if dtype is None else dtype)


def empty_like(prototype, dtype=None, order="K", subok=None, shape=None):
    return empty(*_like(prototype, dtype, shape))


def zeros_like(a, dtype=None, order="K", subok=None, shape=None):
    return zeros(*_like(a, dtype, shape))


def ones_like(a, dtype=None, order="K", subok=None, shape=None):
    return ones(*_like(a, dtype, shape))


def full_like(a, fill_value, dtype=None, order="K", subok=None, shape=None):
    shape, dtype = _like(a, dtype, shape)
    return full(shape, fill_value, dtype)


# -- CuPy's own signatures where they differ from NumPy's --------------------------------------------
def packbits(a, axis=None, bitorder="big"):
    if a.dtype.kind not in "biu":
        raise TypeError("Expected an input array of integer or boolean data type")
    if axis is not None:
        raise NotImplementedError("axis option is not supported yet")
    if bitorder not in ("big", "little"):
        raise ValueError("bitorder must be either 'big' or 'little'")
    if a.size == 0:
        return a.copy()
    return _call(lambda x: _np.packbits(x.ravel() != 0, bitorder=bitorder), (a,), {})


def unpackbits(a, axis=None, bitorder="big"):
    if a.dtype != _np.uint8:
        raise TypeError("Expected an input array of unsigned byte data type")
    if axis is not None:
        raise NotImplementedError("axis option is not supported yet")
    if bitorder not in ("big", "little"):
        raise ValueError("bitorder must be either 'big' or 'little'")
    return _call(lambda x: _np.unpackbits(x.ravel(), bitorder=bitorder), (a,), {})


def argpartition(a, kth, axis=-1):
    return a.argpartition(kth, axis=axis)


def partition(a, kth, axis=-1):
    if a.ndim == 0:
        raise _np.exceptions.AxisError("Sorting arrays with the rank of zero is not supported")
    out = a.copy()
    out.partition(kth, axis=axis)
    return out


def sort(a, axis=-1, kind=None):
    out = a.flatten() if axis is None else a.copy()
    out.sort(axis=-1 if axis is None else axis)
    return out


def take(a, indices, axis=None, out=None):
    """``indices`` may be on the host: CuPy copies them over."""
    return _call(_np.take, (a, indices), {"axis": axis, "out": out}, strict=False)


# -- the rest: NumPy's function on device arrays, as one kernel ------------------------------------
_GENERIC = (
    "all allclose amax amin angle any append arange argmax argmin argsort argwhere around "
    "array_equal array_equiv array_split atleast_1d atleast_2d atleast_3d average bincount "
    "broadcast_arrays broadcast_to choose clip column_stack compress concatenate convolve copy "
    "copyto corrcoef correlate count_nonzero cov cross cumprod cumsum diag diagflat diagonal diff "
    "digitize dot dsplit dstack einsum expand_dims extract eye flatnonzero flip fliplr flipud "
    "gradient hsplit hstack identity imag indices inner interp isclose iscomplex isin isneginf "
    "isposinf isreal kron lexsort linspace logspace max mean median min moveaxis nan_to_num nanargmax "
    "nanargmin nancumprod nancumsum nanmax nanmean nanmedian nanmin nanprod nanstd nansum nanvar "
    "nonzero outer pad percentile place prod ptp put putmask quantile ravel real repeat reshape "
    "resize roll rollaxis rot90 round searchsorted select split squeeze stack std sum swapaxes "
    "take_along_axis tensordot tile trace transpose tri tril triu unique var vdot vsplit vstack "
    "where"
).split()


def _generic(name):
    fn = getattr(_np, name)

    def f(*args, **kwargs):
        return _call(fn, args, kwargs)
    f.__name__ = f.__qualname__ = name
    f.__module__ = "cupy"
    return f


for _name in _GENERIC:
    if _name not in globals():
        globals()[_name] = _generic(_name)
del _name


def _metadata(name):
    """Functions that only look at dtypes and shapes (``cupy.result_type(a)`` takes device
    arrays)."""
    fn = getattr(_np, name)

    def f(*args, **kwargs):
        return fn(*[a._a if isinstance(a, ndarray) else a for a in args], **kwargs)
    f.__name__ = name
    return f


for _name in ("can_cast", "common_type", "min_scalar_type", "result_type", "isscalar", "ndim",
              "shape", "size", "may_share_memory", "shares_memory"):
    globals()[_name] = _metadata(_name)
del _name
