"""The stand-in's ``cupy.ndarray``, ``cupy.ufunc`` and the wrapping of NumPy's functions.

"Device memory" is a NumPy array that only this module touches. What CuPy refuses, this refuses
too, with CuPy's errors (checked against CuPy 14's source, ``cupy/_core/core.pyx``,
``_kernel.pyx``, ``_routines_indexing.pyx``, ``_scalar.pyx``):

* no implicit conversion to NumPy: ``__array__`` raises TypeError, there is no
  ``__array_interface__`` and no buffer protocol; a NumPy array (even 0-d) among the operands of
  a CuPy ufunc is ``TypeError: Unsupported type <class 'numpy.ndarray'>``, and NumPy's ufuncs and
  functions on a CuPy array dispatch to CuPy (``__array_ufunc__``, ``__array_function__``), so
  mixing the two fails the same way either way round;
* ``x[basic index] = numpy_array`` is refused (``fill`` takes only scalars); advanced indices and
  index arrays from the host are accepted, as CuPy copies them to the device;
* reductions and integer indexing return 0-d arrays, not scalars; ``float()``/``int()``/
  ``bool()`` work (they copy to the host), ``__index__`` does not exist (a 0-d array is no slice
  bound, no ``range`` argument);
* ``set`` wants a NumPy array of the same dtype and shape; ``get`` returns a NumPy copy;
* ``__cuda_array_interface__`` (version 3) is what mpi4py reads: the pointer is the host address
  of the stand-in's memory, so a "CUDA-aware" MPI on a CPU moves the right bytes (this stand-in
  has no ``__dlpack__``: mpi4py would take that first);
* ``empty`` memory is not zeroed (filled with NaN bit patterns: CuPy's pool hands out used
  blocks), big-endian and object dtypes are refused, ml_dtypes' bfloat16 is accepted (CuPy >= 14);
* no floating-point warnings (a GPU raises none).

Every operation counts as one kernel queued on the current stream (``cuda._queue``); the memory
it read or wrote stays "in flight" until that stream is synchronized. Handing in-flight memory to
a consumer behind CUDA's back (``__cuda_array_interface__``) is a hazard: ``HazardError`` (or, with
``_fake.strict = False``, an entry in ``_fake.hazards``).
"""
from __future__ import annotations

import warnings
from typing import Any

import numpy as np
from numpy.lib.array_utils import byte_bounds

from . import cuda


class HazardError(RuntimeError):
    """Device memory handed to a consumer outside CUDA (MPI) while a kernel on it is queued."""


class _Fake:
    """The stand-in's own knobs and counters (not CuPy's API)."""

    def __init__(self):
        self.strict = True
        self.reset()

    def reset(self) -> None:
        self.hazards: list[str] = []
        self.h2d_bytes = 0
        self.d2h_bytes = 0
        self.cai_exports = 0
        for k in cuda.stats:
            cuda.stats[k] = 0

    @property
    def synchronizations(self) -> int:
        return cuda.stats["stream_synchronize"] + cuda.stats["device_synchronize"]

    def view_host_memory(self, host: np.ndarray) -> "ndarray":
        """A device array whose memory *is* ``host`` (writes go through): what a CUDA tensor's
        ``cupy.from_dlpack`` view is to the tensor, for tests that stand a CPU tensor in for a
        CUDA one."""
        return _adopt(host, _Memory(cuda._get_device()), touched=False)


_fake = _Fake()


class _Memory:
    """One device allocation, shared by its views: the kernels queued on it, not yet known to
    have finished: ``(stream, sequence number, low address, high address)``."""

    __slots__ = ("device_id", "queued")

    def __init__(self, device_id: int):
        self.device_id = device_id
        self.queued: list[tuple] = []

    def touch(self, stream, seq: int, lo: int, hi: int) -> None:
        live = [q for q in self.queued if q[1] > q[0]._done]
        if len(live) > 64:  # merge per stream: coarser, never misses one
            merged: dict = {}
            for s, n, a, b in live:
                m = merged.get(s)
                merged[s] = (s, max(n, m[1]), min(a, m[2]), max(b, m[3])) if m else (s, n, a, b)
            live = list(merged.values())
        live.append((stream, seq, lo, hi))
        self.queued = live

    def in_flight(self, lo: int, hi: int, besides=None) -> list[tuple]:
        return [q for q in self.queued
                if q[1] > q[0]._done and q[0] is not besides and q[2] < hi and lo < q[3]]


def _root(a: np.ndarray) -> np.ndarray:
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _bounds(a: np.ndarray) -> tuple[int, int]:
    return byte_bounds(a) if a.size else (0, 0)


def _kernel(*arrays: Any) -> None:
    """One kernel, queued on the current stream, touching ``arrays`` (device arrays; others are
    ignored)."""
    stream, seq = cuda._queue()
    for x in arrays:
        if isinstance(x, ndarray) and x._a.size:
            x._mem.touch(stream, seq, *_bounds(x._a))


def _adopt(a: np.ndarray, mem: _Memory | None = None, touched: bool = True) -> "ndarray":
    x = ndarray.__new__(ndarray)
    x._a = a
    x._mem = mem if mem is not None else _Memory(cuda._get_device())
    if touched:
        _kernel(x)
    return x


_SCALARS = (bool, int, float, complex, np.generic)


def check_dtype(dtype: Any) -> np.dtype:
    dt = np.dtype(dtype)
    if dt.byteorder == ">" or (dt.byteorder == "=" and not dt.isnative):
        raise ValueError(f"Unsupported dtype {dt} with big-endian byte-order")
    if dt.hasobject or dt.kind in "OUSMm" or (dt.kind == "V" and dt.itemsize == 0):
        raise ValueError(f"Unsupported dtype {dt}")
    return dt


def _garbage(a: np.ndarray) -> np.ndarray:
    """Fresh device memory is not zeroed: NaN patterns for floats, 0x5A bytes otherwise."""
    if a.size:
        if a.dtype.kind == "b":
            a.fill(True)
        else:
            a.reshape(-1).view(np.uint8).fill(0xFF if a.dtype.kind in "fcV" else 0x5A)
    return a


def _operand(x: Any) -> Any:
    """A ufunc operand: a device array or a scalar; anything else is CuPy's TypeError."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, _SCALARS) and not isinstance(x, np.ndarray):
        return x
    raise TypeError(f"Unsupported type {type(x)}")


def _deep(x: Any) -> Any:
    """Arguments of a CuPy function: device arrays unwrapped, lists/tuples searched, host arrays
    refused."""
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        raise TypeError(f"Unsupported type {type(x)}")
    if isinstance(x, (list, tuple)):
        return type(x)(_deep(v) for v in x)
    return x


def _devices_in(x: Any, found: list) -> list:
    if isinstance(x, ndarray):
        found.append(x)
    elif isinstance(x, (list, tuple)):
        for v in x:
            _devices_in(v, found)
    elif isinstance(x, dict):
        for v in x.values():
            _devices_in(v, found)
    return found


def _outs(out: Any) -> tuple[Any, list]:
    if out is None:
        return None, []
    outs = list(out) if isinstance(out, tuple) else [out]
    for o in outs:
        if not isinstance(o, ndarray):
            raise TypeError("Output arguments must be cupy.ndarray")
    host = tuple(o._a for o in outs) if isinstance(out, tuple) else outs[0]._a
    return host, outs


def _result(r: Any, inputs: list, out: Any = None, outs: list | None = None) -> Any:
    """Wrap what NumPy returned: the given ``out``; a view of an input (same memory); else new
    device memory (0-d arrays for scalars, as CuPy's reductions)."""
    if outs:
        return out
    if isinstance(r, tuple):
        return tuple(_result(v, inputs) for v in r)
    if isinstance(r, list):
        return [_result(v, inputs) for v in r]
    if isinstance(r, (np.generic, bool, int, float, complex)):
        r = np.asarray(r)
    if not isinstance(r, np.ndarray):
        return r
    root = _root(r)
    for x in inputs:
        if _root(x._a) is root:
            return _adopt(r, x._mem, touched=False)
    check_dtype(r.dtype)
    return _adopt(r, touched=False)


def _call(fn, args: tuple, kwargs: dict, strict: bool = True) -> Any:
    """Run NumPy's ``fn`` as one kernel on device arrays (``strict``: host arrays refused)."""
    given = kwargs.pop("out", None)
    out, outs = _outs(given)
    conv = _deep if strict else _lenient
    a = [conv(v) for v in args]
    k = {key: conv(v) for key, v in kwargs.items()}
    if out is not None:
        k["out"] = out
    inputs = _devices_in(list(args), []) + _devices_in(kwargs, [])
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        r = fn(*a, **k)
    wrapped = _result(r, inputs, given, outs)
    made = _devices_in(wrapped if isinstance(wrapped, (list, tuple)) else [wrapped], [])
    fresh = [x for x in made if all(x._mem is not i._mem for i in inputs)]
    if fresh or outs:  # a view (reshape, ravel, transpose ...) runs no kernel
        _kernel(*inputs, *fresh, *outs)
    return wrapped


def _lenient(x: Any) -> Any:
    if isinstance(x, ndarray):
        return x._a
    if isinstance(x, np.ndarray):
        _fake.h2d_bytes += x.nbytes
        return x
    if isinstance(x, (list, tuple)):
        return type(x)(_lenient(v) for v in x)
    return x


class ufunc:
    """``cupy.ufunc``: operands are device arrays or scalars; ``out`` must be device arrays."""

    def __init__(self, u: np.ufunc, name: str | None = None):
        self._u = u
        self.__name__ = name or u.__name__
        self.nin, self.nout, self.nargs = u.nin, u.nout, u.nargs

    def __repr__(self):
        return f"<ufunc '{self.__name__}'>"

    def __call__(self, *args, out=None, **kwargs):
        if len(args) > self.nin:
            if out is not None:
                raise TypeError("cannot specify 'out' as both a positional and keyword argument")
            extra = args[self.nin:]
            out = extra[0] if len(extra) == 1 else tuple(extra)
            args = args[:self.nin]
        if len(args) != self.nin:
            raise TypeError(f"Wrong number of arguments for {self.__name__}")
        host_out, outs = _outs(out)
        ops = [_operand(a) for a in args]
        if host_out is not None:
            kwargs["out"] = host_out
        with np.errstate(all="ignore"):
            r = self._u(*ops, **kwargs)
        inputs = [a for a in args if isinstance(a, ndarray)]
        if outs:
            _kernel(*inputs, *outs)
            return out
        res = _result(r, [])
        _kernel(*inputs, *(res if isinstance(res, tuple) else (res,)))
        return res

    def _method(self, name, array, *args, out=None, **kwargs):
        if not isinstance(array, ndarray):
            raise TypeError(f"Unsupported type {type(array)}")
        kwargs["out"] = out
        return _call(getattr(self._u, name), (array, *args), kwargs)

    def reduce(self, array, axis=0, dtype=None, out=None, keepdims=False):
        return self._method("reduce", array, axis=axis, dtype=dtype, out=out, keepdims=keepdims)

    def accumulate(self, array, axis=0, dtype=None, out=None):
        return self._method("accumulate", array, axis=axis, dtype=dtype, out=out)

    def reduceat(self, array, indices, axis=0, dtype=None, out=None):
        if self.__name__ != "add":
            raise NotImplementedError(f"reduceat for {self.__name__} is not supported yet")
        return self._method("reduceat", array, indices, axis=axis, dtype=dtype, out=out)

    def outer(self, A, B, **kwargs):
        return _call(self._u.outer, (A, B), kwargs)

    def at(self, a, indices, b=None):
        args = (a, indices) if b is None else (a, indices, b)
        _call(self._u.at, args, {})


def _unwrap_index(key: Any) -> tuple[Any, bool]:
    """An index for NumPy, and whether it is an advanced one (arrays, lists, booleans)."""
    parts = key if isinstance(key, tuple) else (key,)
    out, advanced = [], False
    for s in parts:
        if isinstance(s, ndarray):
            out.append(s._a)
            advanced = True
        elif isinstance(s, np.ndarray) or isinstance(s, list):
            host = np.asarray(s)
            _fake.h2d_bytes += host.nbytes
            out.append(host)
            advanced = True
        else:
            if isinstance(s, (bool, np.bool_)):
                advanced = True
            out.append(s)
    return (tuple(out) if isinstance(key, tuple) else out[0]), advanced


class _Flags:
    def __init__(self, a: np.ndarray):
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = a.base is None

    def __getitem__(self, name):
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous,
                "OWNDATA": self.owndata}[name]

    def __repr__(self):
        return (f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n"
                f"  OWNDATA : {self.owndata}")


_MISSING = object()


def _defers(other: Any) -> bool:
    """CuPy's ``_should_use_rop``: let ``other`` handle the operator."""
    u = getattr(other, "__array_ufunc__", _MISSING)
    if u is not _MISSING:
        return u is None
    return getattr(other, "__array_priority__", 0) > ndarray.__array_priority__


def _binary(name: str, reflected: bool = False):
    def op(self, other):
        if not isinstance(other, ndarray) and _defers(other):
            return NotImplemented
        u = UFUNCS[name]
        return u(other, self) if reflected else u(self, other)
    op.__name__ = name
    return op


def _inplace(name: str):
    def op(self, other):
        UFUNCS[name](self, other, out=self)
        return self
    return op


class ndarray:
    """``cupy.ndarray`` (see the module docstring). ``ndarray(shape, dtype)`` allocates."""

    __slots__ = ("_a", "_mem", "__weakref__")
    __array_priority__ = 100
    __hash__ = None  # type: ignore[assignment]

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("the stand-in allocates its own memory")
        self._a = _garbage(np.empty(shape, check_dtype(dtype), order=order))
        self._mem = _Memory(cuda._get_device())

    # -- attributes ---------------------------------------------------------------------------
    shape = property(lambda self: self._a.shape)
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: self._a.size)
    nbytes = property(lambda self: self._a.nbytes)
    itemsize = property(lambda self: self._a.itemsize)
    strides = property(lambda self: self._a.strides)
    flags = property(lambda self: _Flags(self._a))
    T = property(lambda self: _result(self._a.T, [self]))
    mT = property(lambda self: _result(np.swapaxes(self._a, -1, -2), [self]))

    @property
    def base(self):
        return None if self._a.base is None else _adopt(_root(self._a), self._mem, touched=False)

    @property
    def data(self) -> cuda.MemoryPointer:
        return cuda.MemoryPointer(self._a.__array_interface__["data"][0], self._mem.device_id)

    @property
    def device(self) -> cuda.Device:
        return cuda.Device(self._mem.device_id)

    @property
    def __cuda_array_interface__(self) -> dict:
        _fake.cai_exports += 1
        busy = self._mem.in_flight(*_bounds(self._a))
        if busy:
            what = (f"a device array ({self.dtype}, shape {self.shape}) was handed over through "
                    f"__cuda_array_interface__ (to MPI) while {len(busy)} kernel(s) on its memory "
                    "were still queued: synchronize the stream first")
            _fake.hazards.append(what)
            if _fake.strict:
                raise HazardError(what)
        stream = cuda.get_current_stream().ptr or 1
        return {"shape": self.shape, "typestr": self.dtype.str, "descr": [("", self.dtype.str)],
                "stream": stream, "version": 3,
                "strides": None if self._a.flags.c_contiguous else self.strides,
                "data": (self.data.ptr if self.size else 0, False)}

    # -- host <-> device -------------------------------------------------------------------------
    def get(self, stream=None, order="C", out=None, blocking=True):
        stream = stream if stream is not None else cuda.get_current_stream()
        if self._mem.in_flight(*_bounds(self._a), besides=stream):
            _fake.hazards.append("get() on a stream other than the one still writing the array")
            if _fake.strict:
                raise HazardError(_fake.hazards[-1])
        if blocking:
            stream.synchronize()
        _fake.d2h_bytes += self.nbytes
        if out is not None:
            if not isinstance(out, np.ndarray):
                raise TypeError("Only numpy.ndarray can be obtained fromcupy.ndarray")
            if out.dtype != self.dtype:
                raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
            if out.shape != self.shape:
                raise ValueError(f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}")
            out[...] = self._a
            return out
        return np.array(self._a, order="F" if order == "A" and self._a.flags.f_contiguous else order
                        if order in ("C", "F") else "C", copy=True)

    def set(self, arr, stream=None):
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if self.dtype != arr.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if self.shape != arr.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        if not (self._a.flags.c_contiguous or self._a.flags.f_contiguous):
            raise RuntimeError("Cannot set to non-contiguous array")
        _fake.h2d_bytes += arr.nbytes
        self._a[...] = arr
        _kernel(self)

    def __array__(self, dtype=None, copy=None):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                        "Please use `.get()` to construct a NumPy array explicitly.")

    def __array_ufunc__(self, u, method, *inputs, **kwargs):
        mine = UFUNCS.get(u.__name__)
        if mine is None:
            return NotImplemented
        if "out" in kwargs:
            out = kwargs["out"]
            if len(out) != 1:
                raise ValueError("The 'out' parameter must have exactly one array value")
            kwargs["out"] = out[0]
        for x in inputs + tuple([kwargs["out"]] if "out" in kwargs else []):
            if not isinstance(x, (ndarray, np.ndarray) + _SCALARS):
                return NotImplemented
        if method == "__call__":
            return mine(*inputs, **kwargs)
        if method in ("reduce", "accumulate", "reduceat", "outer", "at"):
            return getattr(mine, method)(*inputs, **kwargs)
        return NotImplemented

    def __array_function__(self, func, types, args, kwargs):
        import cupy

        module: Any = cupy
        for part in func.__module__.split(".")[1:]:
            module = getattr(module, part, None)
        mine = getattr(module, func.__name__, None) if module is not None else None
        if mine is None or mine is func:
            return NotImplemented
        if not all(issubclass(t, (ndarray, np.ndarray)) for t in types):
            return NotImplemented
        return mine(*args, **kwargs)

    # -- conversions --------------------------------------------------------------------------------
    def __bool__(self):
        if self.size == 0:
            warnings.warn("The truth value of an empty array is ambiguous. Returning False, but in "
                          "future this will result in an error.", DeprecationWarning, stacklevel=2)
            return False
        if self.size == 1:
            return bool(self.get())
        raise ValueError("The truth value of an array with more than one element is ambiguous. "
                         "Use a.any() or a.all()")

    def __int__(self):
        return int(self.get())

    def __float__(self):
        return float(self.get())

    def __complex__(self):
        return complex(self.get())

    def __repr__(self):
        return repr(self.get())

    def __str__(self):
        return str(self.get())

    def __format__(self, spec):
        return format(self.get(), spec)

    def item(self):
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().item()

    def tolist(self):
        return self.get().tolist()

    def tobytes(self, order="C"):
        return self.get().tobytes(order)

    def __reduce__(self):
        import cupy

        return cupy.array, (self.get(),)

    def __copy__(self):
        return self.copy()

    def __deepcopy__(self, memo):
        return self.copy()

    # -- container ------------------------------------------------------------------------------------
    def __len__(self):
        if self.ndim == 0:
            raise TypeError("len() of unsized object")
        return self.shape[0]

    def __iter__(self):
        if self.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(self.shape[0]))

    def __getitem__(self, key):
        k, advanced = _unwrap_index(key)
        r = self._a[k]
        if not isinstance(r, np.ndarray):  # CuPy: a 0-d view, never a scalar
            r = self._a[(k if isinstance(k, tuple) else (k,)) + (Ellipsis,)]
        if not advanced and _root(r) is _root(self._a):
            return _adopt(r, self._mem, touched=False)
        res = _adopt(np.array(r, copy=True), touched=False)
        _kernel(self, res, *[s for s in (key if isinstance(key, tuple) else (key,)) if isinstance(s, ndarray)])
        return res

    def __setitem__(self, key, value):
        k, advanced = _unwrap_index(key)
        if isinstance(value, ndarray):
            v = value._a
        elif isinstance(value, (np.ndarray, list, tuple)):
            host = np.asarray(value)
            if advanced:
                _fake.h2d_bytes += host.nbytes
                v = host
            else:  # CuPy fills: a scalar only ("Refuse assignment from CPU arrays", gh-2079)
                host = np.asarray(value, dtype=self.dtype)
                if host.shape != ():
                    raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
                v = host[()]
        else:
            v = value
        with np.errstate(all="ignore"), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            self._a[k] = v
        target = self if advanced else _adopt(self._a[k] if isinstance(self._a[k], np.ndarray)
                                              else self._a[(k if isinstance(k, tuple) else (k,)) + (Ellipsis,)],
                                              self._mem, touched=False)
        _kernel(target, value)

    # -- methods --------------------------------------------------------------------------------
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True):
        dt = check_dtype(dtype)
        if not copy and dt == self.dtype:
            return self
        return _call(lambda a: a.astype(dt, order=order, casting=casting or "unsafe"), (self,), {})

    def copy(self, order="C"):
        return _call(lambda a: np.array(a, order=order, copy=True), (self,), {})

    def view(self, dtype=None, type=None):
        if type is not None:
            raise NotImplementedError("view(type=...) is not supported by the stand-in")
        if dtype is None:
            return _adopt(self._a.view(), self._mem, touched=False)
        return _adopt(self._a.view(check_dtype(dtype)), self._mem, touched=False)

    def fill(self, value):
        if isinstance(value, ndarray):
            if value.shape != ():
                raise ValueError("non-scalar cupy.ndarray cannot be used for fill")
            value = value.get()[()]
        else:
            host = np.asarray(value, dtype=self.dtype)
            if host.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = host[()]
        self._a.fill(value)
        _kernel(self)

    def reshape(self, *shape, order="C"):
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return _call(lambda a: a.reshape(shape, order=order), (self,), {})

    def __matmul__(self, other):
        return UFUNCS["matmul"](self, other)

    def __rmatmul__(self, other):
        return UFUNCS["matmul"](other, self)

    def __neg__(self):
        return UFUNCS["negative"](self)

    def __pos__(self):
        return UFUNCS["positive"](self)

    def __abs__(self):
        return UFUNCS["absolute"](self)

    def __invert__(self):
        return UFUNCS["invert"](self)

    def __eq__(self, other):  # type: ignore[override]
        if other is None:
            import cupy
            return cupy.zeros(self.shape, bool)
        return _binary("equal")(self, other)

    def __ne__(self, other):  # type: ignore[override]
        if other is None:
            import cupy
            return cupy.ones(self.shape, bool)
        return _binary("not_equal")(self, other)


for _name, _u in (("add", "add"), ("sub", "subtract"), ("mul", "multiply"), ("truediv", "true_divide"),
                  ("floordiv", "floor_divide"), ("mod", "remainder"), ("pow", "power"),
                  ("lshift", "left_shift"), ("rshift", "right_shift"), ("and", "bitwise_and"),
                  ("or", "bitwise_or"), ("xor", "bitwise_xor")):
    setattr(ndarray, f"__{_name}__", _binary(_u))
    setattr(ndarray, f"__r{_name}__", _binary(_u, reflected=True))
    setattr(ndarray, f"__i{_name}__", _inplace(_u))
for _name, _u in (("lt", "less"), ("le", "less_equal"), ("gt", "greater"), ("ge", "greater_equal")):
    setattr(ndarray, f"__{_name}__", _binary(_u))

#: methods that are NumPy's, run as a kernel on the device array (views stay views)
METHODS = ("sum", "mean", "max", "min", "argmax", "argmin", "any", "all", "cumsum", "cumprod", "prod",
           "var", "std", "clip", "round", "take", "repeat", "nonzero", "ravel", "flatten", "squeeze",
           "swapaxes", "transpose", "diagonal", "trace", "dot", "conj", "conjugate", "compress", "ptp",
           "argsort")


def _make_method(name):
    def method(self, *args, **kwargs):
        return _call(lambda a, *r, **k: getattr(a, name)(*r, **k), (self, *args), kwargs)
    method.__name__ = name
    return method


for _name in METHODS:
    setattr(ndarray, _name, _make_method(_name))


def _sort(self, axis=-1, kind=None):
    if self.ndim == 0:
        raise np.exceptions.AxisError("Sorting arrays with the rank of zero is not supported")
    if not self._a.flags.c_contiguous:
        raise NotImplementedError("Sorting non-contiguous array is not supported.")
    self._a.sort(axis=axis, kind="stable")
    _kernel(self)


def _kth(kth, length: int) -> tuple[int, ...]:
    """CuPy's check of ``kth``: a Python int (a NumPy integer is not one: Cython's
    ``isinstance(kth, int)``) or a sequence of them, within the axis."""
    ks = (kth,) if isinstance(kth, int) and not isinstance(kth, bool) else tuple(kth)
    out = []
    for k in ks:
        k = k + length if k < 0 else k
        if not 0 <= k < length:
            raise ValueError(f"kth(={k}) out of bounds {length}")
        out.append(int(k))
    return tuple(out)


def _partition(self, kth, axis=-1):
    if self.ndim == 0:
        raise np.exceptions.AxisError("Sorting arrays with the rank of zero is not supported")
    if not self._a.flags.c_contiguous:
        raise NotImplementedError("Sorting non-contiguous array is not supported.")
    ks = _kth(kth, self.shape[axis])
    self._a[...] = np.partition(self._a, ks, axis=axis)
    _kernel(self)


def _argpartition(self, kth, axis=-1):
    """Indices that partition the array, in an order of the stand-in's own (a full sort for short
    arrays, as CuPy; otherwise each side reversed): callers may rely on the partition only."""
    data = self._a.ravel() if axis is None else self._a
    axis = -1 if axis is None else axis
    length = data.shape[axis]
    if length == 0:
        return _adopt(np.empty((0,), np.int64))
    ks = _kth(kth, length)
    if length < 32 or max(ks) >= 1024:
        idx = np.argsort(data, axis=axis, kind="stable")
    else:
        idx = np.argpartition(data, ks, axis=axis)
        edges = (0, *sorted(ks), length)
        parts = [np.flip(np.take(idx, np.arange(a, b), axis=axis), axis=axis)
                 for a, b in zip(edges[:-1], edges[1:]) if b > a]
        idx = np.concatenate(parts, axis=axis)
    res = _adopt(idx.astype(np.int64), touched=False)
    _kernel(self, res)
    return res


ndarray.sort = _sort
ndarray.partition = _partition
ndarray.argpartition = _argpartition

ndarray.__module__ = "cupy"
ufunc.__module__ = "cupy"

#: the ufuncs CuPy has, by name (``cupy.abs`` is ``absolute``, ``conj`` is ``conjugate``)
UFUNC_NAMES = (
    "absolute add arccos arccosh arcsin arcsinh arctan arctan2 arctanh bitwise_and bitwise_count "
    "bitwise_not bitwise_or bitwise_xor cbrt ceil conjugate copysign cos cosh deg2rad degrees divide "
    "divmod equal exp exp2 expm1 fabs float_power floor floor_divide fmax fmin fmod frexp gcd greater "
    "greater_equal heaviside hypot invert isfinite isinf isnan lcm ldexp left_shift less less_equal "
    "log log10 log1p log2 logaddexp logaddexp2 logical_and logical_not logical_or logical_xor matmul "
    "maximum minimum multiply negative nextafter not_equal positive power rad2deg radians reciprocal "
    "remainder right_shift rint sign signbit sin sinh sqrt square subtract tan tanh true_divide trunc"
).split()
UFUNCS: dict[str, ufunc] = {n: ufunc(getattr(np, n)) for n in UFUNC_NAMES}
UFUNCS["abs"] = UFUNCS["absolute"]
UFUNCS["conj"] = UFUNCS["conjugate"]
UFUNCS["mod"] = UFUNCS["remainder"]
