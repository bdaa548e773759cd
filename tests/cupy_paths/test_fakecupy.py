"""The CuPy stand-in (``tests/fakecupy``) behaves as CuPy where gradcomp's CuPy branches could
go wrong, and it reaches no process that did not ask for it (DESIGN invariant 6 included)."""
from __future__ import annotations

import subprocess
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from tests.cupy_paths import FAKE, env, installed


@pytest.fixture
def cp():
    with installed() as cupy:
        yield cupy


def test_device_arrays_are_not_numpy_arrays(cp):
    a = cp.arange(6, dtype=np.float32)
    assert type(a).__module__ == "cupy" and not isinstance(a, np.ndarray)
    assert cp.ndarray.__array_priority__ == 100
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    with pytest.raises(TypeError, match="Unsupported type <class 'numpy.ndarray'>"):
        a + np.ones(6, np.float32)
    with pytest.raises(TypeError, match="Unsupported type"):
        np.ones(6, np.float32) * a  # NumPy's ufunc defers to CuPy's, which refuses the host array
    with pytest.raises(TypeError, match="Unsupported type"):
        cp.add(a, np.zeros((), np.float32))  # even a 0-d host array
    with pytest.raises(TypeError):
        np.concatenate([a, np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        a[...] = np.ones(6, np.float32)
    host = np.zeros(6, np.float32)
    with pytest.raises(TypeError):
        host[...] = a
    a[np.array([0, 1])] = np.array([5, 6], np.float32)  # advanced indices copy host values over
    assert a.get().tolist() == [5, 6, 2, 3, 4, 5]


def test_numpy_calls_dispatch_and_results_stay_on_the_device(cp):
    a = cp.asarray(np.array([1.0, -2.0, np.nan], np.float32))
    for out in (np.isfinite(a), np.abs(a), np.concatenate([a, a]), a.sum(), a[1], np.sum(a)):
        assert isinstance(out, cp.ndarray)
    assert a.sum().shape == () and a[1].shape == ()  # 0-d arrays, not scalars
    assert float(a[1]) == -2.0 and bool(cp.isnan(a[2])) and int(cp.count_nonzero(a)) == 3
    with pytest.raises(TypeError):
        range(cp.asarray(3))  # no __index__
    assert cp.get_array_module(a) is cp and cp.get_array_module(np.ones(1)) is np
    assert isinstance(cp.asnumpy(a), np.ndarray) and cp.asnumpy(a).dtype == np.float32


def test_get_set_and_cupy_signatures(cp):
    a = cp.zeros(4, np.float32)
    with pytest.raises(ValueError, match="Shape mismatch"):
        a.set(np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="cannot be set"):
        a.set(np.zeros(4, np.float64))
    a.reshape(2, 2).set(np.ones((2, 2), np.float32))
    assert a.get().tolist() == [1, 1, 1, 1]
    bits = cp.packbits(cp.asarray(np.array([1, 0, 1], bool)), bitorder="little")
    assert cp.unpackbits(bits, bitorder="little").get().tolist()[:3] == [1, 0, 1]
    with pytest.raises(TypeError):
        cp.unpackbits(bits, count=3, bitorder="little")  # CuPy's unpackbits has no count
    x = cp.asarray(np.arange(100.0)[::-1].copy())
    with pytest.raises(TypeError):
        cp.argpartition(x, np.int64(90))  # kth must be a Python int (Cython's isinstance)
    top = cp.argpartition(x, 90)[90:].get()
    assert sorted(top.tolist()) == list(range(10)) and top.tolist() != np.argpartition(x.get(), 90)[90:].tolist()
    with pytest.raises(NotImplementedError):
        cp.multiply.reduceat(x, cp.asarray(np.array([0, 5])))  # add's only
    assert cp.add.reduceat(x, cp.asarray(np.array([0, 50]))).get().tolist() == [
        float(np.arange(50, 100).sum()), float(np.arange(50).sum())]


def test_dtypes(cp):
    b = cp.ones(3, ml_dtypes.bfloat16)  # CuPy >= 14 takes ml_dtypes' bfloat16
    assert (b + b).dtype == np.dtype(ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match="big-endian"):
        cp.ones(3, ">f4")
    assert np.isnan(cp.empty(4, np.float32).get()).all()  # not zeroed


def test_streams_devices_and_the_hazard_check(cp):
    a = cp.arange(8, dtype=np.float32)  # a kernel, queued
    assert a.data.ptr == a[2:].data.ptr - 8 and a.device == cp.cuda.Device(0)
    with pytest.raises(cp.HazardError):
        a.__cuda_array_interface__  # what MPI reads: the kernel has not finished
    cp.cuda.get_current_stream().synchronize()
    info = a.__cuda_array_interface__
    assert info["version"] == 3 and info["data"] == (a.data.ptr, False) and info["strides"] is None
    a[:4] += 1
    a[4:].__cuda_array_interface__  # untouched memory is fine
    with pytest.raises(cp.HazardError):
        a[:2].__cuda_array_interface__
    done = threading.Thread(target=lambda: cp.cuda.get_current_stream().synchronize())
    done.start()
    done.join()  # the legacy default stream is one stream for every host thread
    a.__cuda_array_interface__
    seen = []
    t = threading.Thread(target=lambda: (cp.cuda.Device(0).use(), seen.append(cp.cuda.runtime.getDevice())))
    t.start()
    t.join()
    assert seen == [0] and cp.cuda.runtime.getDeviceCount() == 1
    with pytest.raises(cp.cuda.CUDARuntimeError):
        cp.cuda.Device(1)


def test_mpi4py_takes_device_buffers_by_their_interface(cp):
    from mpi4py import MPI

    a = cp.asarray(np.arange(4, dtype=np.float32))
    b = cp.zeros(4, np.float32)
    cp.cuda.Device().synchronize()
    buf = MPI.buffer.frombuffer(a, readonly=True)  # no buffer protocol: mpi4py reads the interface
    assert buf.address == a.data.ptr and buf.nbytes == 16
    b[...] = a
    with pytest.raises(cp.HazardError):
        MPI.buffer.frombuffer(b)


def test_only_the_tests_that_ask_get_it():
    """Without ``GRADCOMP_FAKE_CUPY=1`` the stand-in refuses to load even on ``sys.path``; with it,
    ``import gradcomp`` and a NumPy reduction still import no ``cupy`` (invariant 6)."""
    code = ("import sys; sys.path.insert(0, %r)\n"
            "try:\n    import cupy\nexcept ImportError as e:\n    print('refused:', e)\n") % str(FAKE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={}, timeout=60)
    assert "refused: tests/fakecupy is gradcomp's test stand-in" in out.stdout, out.stdout + out.stderr
    code = ("import sys, numpy as np, gradcomp as gc\n"
            "c = gc.MPICommunicator()\n"
            "gc.Allreduce().reduce(np.ones(8, np.float32), c).result()\n"
            "gc.make('int8').reduce(np.ones(8, np.float32), c).result()\n"
            "c.close()\n"
            "assert 'cupy' not in sys.modules, 'gradcomp imported cupy'\n"
            "print('clean')\n")
    import os

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env()}, cwd=str(FAKE.parent.parent))
    assert "clean" in out.stdout, out.stdout + out.stderr
