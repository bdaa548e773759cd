"""Element-wise arithmetic on half-precision buckets (``+=``, ``-=``, ``/``) and the zeroing of
non-finite values: the NumPy kernels and the one dispatch (``add_into``, ``divide``) that picks
them or the compiled ones (``gradcomp.kernels.half``, through ``halfcast.compiled``).

NumPy's float16 ``+`` and ``/`` convert one value at a time in C (numpy#28753); bfloat16
(ml_dtypes) works the same way. The compiled kernels decode, operate in float32 and encode in one
vectorized loop; without them, float16 goes through the NumPy kernels here (the casts of
``halfcast``, a chunk at a time). Both give NumPy's (float16) and ml_dtypes' (bfloat16) bits.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from . import array_module, halfcast
from .halfcast import CHUNK, JIT_MIN, MIN_SIZE, float16_to_float32, float32_to_float16, half_name, numpy_vector


def _half_operands(acc: Any, other: Any) -> str | None:
    """The half kind ('float16'/'bfloat16') when ``acc`` and ``other`` are same-shape contiguous
    NumPy arrays of it, big enough for a kernel; else None."""
    kind = half_name(acc.dtype) if type(acc) is np.ndarray else None
    if (kind and type(other) is np.ndarray and other.dtype == acc.dtype
            and other.shape == acc.shape and other.flags.c_contiguous
            and numpy_vector(acc) and acc.size >= JIT_MIN):
        return kind
    return None


def add_into(acc: Any, other: Any, sign: float = 1.0) -> bool:
    """``acc += sign * other`` (``sign`` +-1: ``a - b`` is exactly ``a + (-b)``) for half-precision
    NumPy arrays, by the compiled kernel, else (float16, ``+=``, 1-D) by NumPy's kernels here;
    False, nothing done, where neither applies (the caller's ``+=`` is then the way)."""
    kind = _half_operands(acc, other)
    if not kind:
        return False
    jit = halfcast.compiled(acc)
    if jit is not None:
        jit.add_into(acc.reshape(-1).view(np.uint16), other.reshape(-1).view(np.uint16),
                     kind == "bfloat16", np.float32(sign))
        return True
    if kind == "float16" and sign == 1.0 and acc.ndim == 1 and acc.size >= MIN_SIZE:
        float16_add_into(acc, other)
        return True
    return False


def divide(array: Any, divisor: float, out: Any = None) -> Any:
    """``array / divisor`` for a half-precision NumPy array into ``out`` (``array`` itself is
    allowed) or a new array, by the compiled kernel or NumPy's kernels here; None, nothing done,
    where neither applies."""
    kind = half_name(array.dtype) if type(array) is np.ndarray else None
    if not kind or not numpy_vector(array):
        return None
    jit = halfcast.compiled(array)
    if jit is not None and (out is None or numpy_vector(out)):
        if out is None:
            out = array.copy()
        elif out is not array:
            np.copyto(out, array)
        jit.divide_in_place(out.reshape(-1).view(np.uint16), np.float32(array.dtype.type(divisor)),
                            kind == "bfloat16")
        return out
    if kind == "float16" and array.ndim == 1 and array.size >= MIN_SIZE:
        return float16_divide(array, divisor, out)
    return None


def zero_non_finite(flat: Any) -> None:
    """Zero the NaN and Inf entries of ``flat`` (an error-feedback residual after a bad step, so
    one bad step does not poison the following ones); one cheap sum decides whether to look."""
    xp = array_module(flat)
    with np.errstate(all="ignore"):
        total = flat.sum()  # NaN or Inf anywhere makes it non-finite (an overflow only costs a look)
    if not bool(xp.isfinite(total)):
        flat[~xp.isfinite(flat)] = 0


def _binary(op, a: np.ndarray, b, out: np.ndarray) -> np.ndarray:
    """``out = op(a, b)`` for contiguous 1-D float16 ``a`` (and ``b``: same-length float16 array or
    a Python/NumPy scalar), computed in float32 and rounded once to float16, chunk by chunk.

    This is what NumPy's own float16 loops compute (convert, operate in float32, round), so the
    bits are the same; and since float32 carries more than twice float16's 11 significant bits
    plus two, the result is also the correctly rounded float16 result of +, -, *, / (no double
    rounding error), as native float16 hardware would give.
    """
    n = a.shape[0]
    size = min(CHUNK, n)
    fa = np.empty(size, np.float32)
    fb = np.empty(size, np.float32) if isinstance(b, np.ndarray) else None
    scalar = None if fb is not None else np.float32(np.float16(b))
    with np.errstate(all="ignore"):
        for start in range(0, n, CHUNK):
            stop = min(start + CHUNK, n)
            k = stop - start
            float16_to_float32(a[start:stop], fa[:k])
            if fb is not None:
                float16_to_float32(b[start:stop], fb[:k])
                op(fa[:k], fb[:k], out=fa[:k])
            else:
                op(fa[:k], scalar, out=fa[:k])
            float32_to_float16(fa[:k], out[start:stop])
    return out


def float16_add_into(acc: np.ndarray, other: np.ndarray) -> np.ndarray:
    """``acc += other`` for contiguous 1-D float16 arrays, bit-identical to NumPy's float16 add."""
    return _binary(np.add, acc, other, acc)


def float16_divide(a: np.ndarray, divisor, out: np.ndarray | None = None) -> np.ndarray:
    """``a / divisor`` into ``out`` (may be ``a``) or a new float16 array, bit-identical to NumPy's
    float16 division."""
    return _binary(np.true_divide, a, divisor, np.empty(a.shape[0], np.float16) if out is None else out)
