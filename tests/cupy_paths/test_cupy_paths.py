"""gradcomp's CuPy branches on every commit, through the CuPy stand-in (``tests/fakecupy``).

Under real ``mpiexec`` (``tests.cupy_paths.jobs``): every registered compressor through the
conformance kit on device buckets, and against the NumPy path bit for bit, host-staged
(``GRADCOMP_CUDA_AWARE=0``) and CUDA-aware (``=1``, device pointers to MPI, which the stand-in
makes host pointers); ``MPICommunicator``'s collectives on device arrays on three ranks (the
ring's steps), with the stand-in's check that no device memory reaches MPI while a kernel on it
is queued; ``GradientReducer`` and the optimizers on CuPy arrays; the DDP hook's CuPy path and
``TorchCommunicator``'s staging. In this process: the kernels whose CuPy branches had bugs.
"""
from __future__ import annotations

import importlib.util

import ml_dtypes
import numpy as np
import pytest

import gradcomp as gc
from tests.cupy_paths import env, installed
from tests.mpi_launch import run_ranks

NAMES = sorted(gc.REGISTRY)
#: and the variants whose parameter switches to another codec or branch (as the kit's own test)
VARIANTS = ["topk:stages=2", "int4:chunk=64", "int4:exact_zero=False", "powersgd:factor_bits=8",
            "powersgd:rank=1"]
#: the kit's checks on device buckets (``accuracy`` and ``schedule`` read values: the CuPy path's
#: are the NumPy path's, ``test_cupy_path_gives_the_numpy_paths_bits``)
KIT_CHECKS = ["shapes", "dtypes", "non-finite", "checkpoint", "mismatches", "scatter"]


@pytest.fixture
def cp():
    with installed() as cupy:
        yield cupy


# ---------------------------------------------------------------------------------------------
# kernels (one process)
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_quantize_on_device_gives_the_numpy_kernels_bits(cp, dtype, zero):
    """float64 chunks included: their offsets, scales and ``x - offset`` in float32, as every
    other path computes them (the CuPy branch once kept float64 there, so its codes were taken
    against parameters other than the ones it sent)."""
    from gradcomp.kernels import affine

    rng = np.random.default_rng(3)
    x = (rng.standard_normal(2 * 512 + 77) * 1e-3 + 0.3).astype(dtype)
    x[600] = np.nan
    chunks = affine.chunk_count(x.shape[0], 512)
    p, c = np.empty((2, chunks), np.float32), np.empty(x.shape[0], np.uint8)
    affine.quantize(x, p, c, 512, 255, zero=zero)
    dp, dc = cp.empty((2, chunks), np.float32), cp.empty(x.shape[0], np.uint8)
    affine.quantize(cp.asarray(x), dp, dc, 512, 255, zero=zero)
    assert np.array_equal(dp.get().view(np.uint32), p.view(np.uint32)) and np.array_equal(dc.get(), c)
    out, dout = np.zeros(x.shape[0], dtype), cp.zeros(x.shape[0], dtype)
    affine.dequantize(out, p, c, 512)
    affine.dequantize(dout, dp, dc, 512)
    assert np.array_equal(dout.get().view(np.uint8), out.view(np.uint8))


def test_one_bit_codes_on_device(cp):
    """CuPy's ``unpackbits`` has no ``count``: the 1-bit decode slices instead."""
    from gradcomp.kernels import signcodes

    rng = np.random.default_rng(4)
    n = 1496  # (the NumPy/CuPy encode takes a multiple of 8 values: see jobs.KNOWN)
    x = rng.standard_normal(n).astype(np.float32)
    chunks = -(-n // 512)
    scales, bits = np.empty(chunks, np.float32), np.empty(-(-n // 8), np.uint8)
    signcodes.encode(x, scales, bits, 512, np.empty(n, np.float64), np.empty(n, bool))
    dscales, dbits = cp.empty(chunks, np.float32), cp.empty(-(-n // 8), np.uint8)
    signcodes.encode(cp.asarray(x), dscales, dbits, 512, cp.empty(n, np.float64), cp.empty(n, bool))
    assert np.array_equal(dscales.get(), scales) and np.array_equal(dbits.get(), bits)
    out, dout = np.empty(n, np.float32), cp.empty(n, np.float32)
    signcodes.decode(scales, bits, out, 512, np.empty(n, np.float32))
    signcodes.decode(dscales, dbits, dout, 512, cp.empty(n, np.float32))
    assert np.array_equal(dout.get(), out)


def test_array_helpers_and_buckets_on_device(cp):
    from gradcomp import arrays
    from gradcomp.bucket import buffer_problem

    x = np.linspace(-3, 3, 1001).astype(np.float32)
    d = cp.asarray(x)
    for half in (np.float16, ml_dtypes.bfloat16):
        assert np.array_equal(arrays.cast(d, half).get().view(np.uint16), arrays.cast(x, half).view(np.uint16))
        h, dh = arrays.cast(x, half), arrays.cast(d, half)
        arrays.add_into(h, h)
        arrays.add_into(dh, dh)
        arrays.subtract_into(h, arrays.cast(x, half))
        arrays.subtract_into(dh, arrays.cast(d, half))
        assert np.array_equal(dh.get().view(np.uint16), h.view(np.uint16))
        assert np.array_equal(arrays.divide(dh, 3.0).get().view(np.uint16), arrays.divide(h, 3.0).view(np.uint16))
    assert arrays.sum_of_squares(d) == arrays.sum_of_squares(x)
    assert arrays.is_device_array(d) and not arrays.is_device_array(x)
    assert isinstance(arrays.to_host(d), np.ndarray)
    arrays.synchronize(d * 2)
    assert not cp._fake.hazards
    assert buffer_problem(d) is None
    assert "1-D" in buffer_problem(d.reshape(7, 143))
    assert "contiguous" in buffer_problem(cp.ones(20, np.float32)[::2])
    assert "float" in buffer_problem(cp.ones(20, np.int32))


# ---------------------------------------------------------------------------------------------
# under mpiexec
# ---------------------------------------------------------------------------------------------
def test_conformance_kit_on_device_buckets():
    """Every registered name, host-staged (the default where MPI is not CUDA-aware)."""
    run_ranks(2, "tests.cupy_paths.jobs:conformance", NAMES, KIT_CHECKS, 2, 40, timeout=300,
              env=env(GRADCOMP_CUDA_AWARE="0"))


@pytest.mark.parametrize("aware", ["0", "1"])
def test_cupy_path_gives_the_numpy_paths_bits(aware):
    run_ranks(2, "tests.cupy_paths.jobs:compare", NAMES + VARIANTS, 2, timeout=300,
              env=env(GRADCOMP_CUDA_AWARE=aware))


def test_mpi_collectives_on_device_arrays():
    run_ranks(3, "tests.cupy_paths.jobs:collectives", timeout=300, env=env())


def test_gradient_reducer_and_optimizers_on_device_arrays():
    run_ranks(2, "tests.cupy_paths.jobs:reducer_and_optimizers", timeout=300, env=env(GRADCOMP_CUDA_AWARE="1"))


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_ddp_hook_and_torch_communicator_on_device_buckets():
    run_ranks(2, "tests.cupy_paths.jobs:torch_paths", ["allreduce", "topk"], timeout=300,
              env=env(GRADCOMP_CUDA_AWARE="0"))
