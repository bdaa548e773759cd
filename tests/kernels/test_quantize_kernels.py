"""The quantization kernels, compiled (``gradcomp.kernels``, numba) and NumPy, bit for bit.

Both paths must give the documented reference sequence's bits (``test_kernels``'s reference), and
the same bits as each other on the inputs where the reference leaves NumPy's choices open (which
zero ``min`` returns when a chunk holds +0 and -0), for every shape of chunking: per channel with
a tail, chunks wider than the NumPy block, per tensor, lengths 0 and 1.
"""
from __future__ import annotations

import numpy as np
import pytest

from gradcomp import kernels
from gradcomp.kernels import affine, signcodes
from gradcomp.kernels.affine import chunk_count, dequantize, quantize

from tests.mpi_launch import run_ranks
from tests.kernels.test_kernels import _quantize_cases, _reference_dequantize_add, _reference_quantize

COMPILED = kernels.available()
PATHS = ["numpy", pytest.param("compiled", marks=pytest.mark.skipif(
    not COMPILED, reason="numba kernels unavailable (numba missing or GRADCOMP_JIT=0)"))]
SHAPES = [(8, 512), (4, 512), (1, 512), (8, 3), (8, 100000), (8, 300000), (8, None)]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch):
    """Run a test on one path: 'numpy' hides the compiled kernels (``affine.compiled``, the
    quantizers' one dispatch)."""
    if request.param == "numpy":
        monkeypatch.setattr(affine, "compiled", lambda *a: None)
    return request.param


class _Quantizer:
    """The kernels with one chunk width (None: the whole vector) and bit count."""

    def __init__(self, bits, width, zero=False):
        self.levels, self.width, self.zero = (1 << bits) - 1, width, zero

    def _width(self, n):
        return self.width or max(n, 1)

    def quantize(self, x):
        params = np.empty((2, chunk_count(x.size, self._width(x.size))), np.float32)
        codes = np.empty(x.size, np.uint8)
        quantize(x, params, codes, self._width(x.size), self.levels, self.zero)
        return params, codes

    def dequantize_add(self, acc, params, codes):
        dequantize(acc, params, codes, self._width(acc.size), add=True)


def _make(bits, width, zero=False):
    return _Quantizer(bits, width, zero)


def _round_trip(q, x, acc):
    params, codes = q.quantize(x)
    acc = acc.copy()
    q.dequantize_add(acc, params, codes)
    return params, codes, acc


def _signed_zero_cases():
    """Chunks whose minimum or maximum is a zero held with both signs, and their neighbours."""
    rng = np.random.default_rng(5)
    cases = {}
    x = np.abs(rng.standard_normal(4096)).astype(np.float32)  # min is a zero in every chunk
    x[rng.integers(0, x.size, 300)] = 0.0
    x[rng.integers(0, x.size, 300)] = -0.0
    cases["min-zero"] = x
    cases["max-zero"] = -x
    cases["all-zeros"] = rng.choice(np.array([0.0, -0.0], np.float32), 3000)
    cases["minus-zeros"] = np.full(1500, -0.0, np.float32)
    x = rng.standard_normal(5000).astype(np.float32)
    x[::7] = -0.0
    cases["inner-zeros"] = x
    return cases


def _non_finite_runs():
    """NaN and Inf in runs of adjacent chunks, isolated chunks and the tail (each its own run of
    chunks for the NumPy fallback of the compiled path)."""
    rng = np.random.default_rng(6)
    x = rng.standard_t(2, 512 * 40 + 100).astype(np.float32)
    x[512 * 3 + 5: 512 * 7] = np.nan  # chunks 3..6
    x[512 * 9 + 1] = np.inf
    x[512 * 10 + 2] = -np.inf
    x[512 * 20] = -np.nan
    x[-3] = np.nan  # the tail
    y = np.full(512 * 4 + 1, np.inf, np.float32)
    y[::2] = -np.inf
    return {"nan-runs": x, "infinities": y, "all-nan": np.full(1025, np.nan, np.float32)}


@pytest.mark.parametrize("zero", [False, True], ids=["range", "zero"])
@pytest.mark.parametrize("bits,width", SHAPES)
def test_each_path_matches_the_reference(path, bits, width, zero):
    if zero and bits == 1:
        pytest.skip("a grid that holds zero needs two levels or more")
    q = _make(bits, width, zero)
    cases = {**_quantize_cases(), **_non_finite_runs(), "empty": np.zeros(0, np.float32),
             "one": np.array([1.5], np.float32)}
    for name, x in cases.items():
        acc0 = np.random.default_rng(3).standard_normal(x.size).astype(np.float32)
        params, codes, acc = _round_trip(q, x, acc0)
        ref_params, ref_codes = _reference_quantize(x, bits, width, zero)
        assert np.array_equal(params.view(np.uint32), ref_params.view(np.uint32)), name
        assert np.array_equal(codes, ref_codes), name
        ref = acc0.copy()
        _reference_dequantize_add(ref, ref_params, ref_codes, width)
        assert np.array_equal(acc.view(np.uint32), ref.view(np.uint32)), name


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("zero", [False, True], ids=["range", "zero"])
@pytest.mark.parametrize("bits,width", SHAPES)
def test_compiled_and_numpy_paths_give_the_same_bits(bits, width, zero, monkeypatch):
    if zero and bits == 1:
        pytest.skip("a grid that holds zero needs two levels or more")
    q = _make(bits, width, zero)
    cases = {**_quantize_cases(), **_non_finite_runs(), **_signed_zero_cases()}
    for name, x in cases.items():
        acc0 = np.random.default_rng(4).standard_normal(x.size).astype(np.float32)
        acc0[::5] = -0.0
        with monkeypatch.context() as m:
            m.setattr(affine, "compiled", lambda *a: None)
            expected = _round_trip(q, x, acc0)
        got = _round_trip(q, x, acc0)
        for e, g, what in zip(expected, got, ("params", "codes", "acc")):
            assert e.dtype == g.dtype and e.shape == g.shape, (name, what)
            assert np.array_equal(e.view(np.uint8), g.view(np.uint8)), (name, what)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
def test_numpy_arrays_use_the_compiled_kernels(monkeypatch):
    from gradcomp.kernels import quantize as compiled

    calls = []
    for name in ("quantize_chunks", "dequantize_chunks"):
        kernel = getattr(compiled, name)
        monkeypatch.setattr(compiled, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    q = _make(8, 512)
    x = np.arange(2000, dtype=np.float32)
    q.dequantize_add(np.zeros(2000, np.float32), *q.quantize(x))
    assert calls == ["quantize_chunks", "dequantize_chunks"]


def test_dequantize_add_takes_parameters_from_an_unaligned_message(path):
    """run() reads each sender's parameters as a float32 view into a uint8 message, which need
    not be 4-byte aligned."""
    q = _make(8, 512)
    x = np.random.default_rng(7).standard_t(2, 3000).astype(np.float32)
    params, codes = q.quantize(x)
    raw = np.zeros(1 + params.nbytes + codes.size, np.uint8)
    raw[1:1 + params.nbytes] = params.reshape(-1).view(np.uint8)
    raw[1 + params.nbytes:] = codes
    view = raw[1:1 + params.nbytes].view(np.float32).reshape(2, -1)
    acc = np.ones(x.size, np.float32)
    q.dequantize_add(acc, view, raw[1 + params.nbytes:])
    expected = np.ones(x.size, np.float32)
    _reference_dequantize_add(expected, params, codes, 512)
    assert np.array_equal(acc.view(np.uint32), expected.view(np.uint32))


# -- float64, packed codes, the codecs' fused stages on every dtype -----------------------------------
def _float64_cases():
    """float64 inputs where NumPy's sequence has its own corners: offsets that round up to
    float32 (codes below zero, whose rounding depends on the chunk's NumPy block), a block holding
    such a chunk and a NaN chunk, ranges beyond float32, and the float32 cases widened."""
    rng = np.random.default_rng(8)
    cases = {name: x.astype(np.float64) for name, x in _quantize_cases().items()}
    cases.update({name: x.astype(np.float64) for name, x in _non_finite_runs().items()})
    x = rng.standard_t(3, 600 * 512 + 77) * 1e-3
    for c in (3, 520, 590):  # around 1, a range of ~1e-10: the offset rounds up, codes go below zero
        x[c * 512:(c + 1) * 512] = 1.0 + np.linspace(-1e-12, 1e-10, 512)
    x[530 * 512 + 9] = np.nan  # in the block of chunk 520 (chunks 512..599), not of chunk 3
    x[-5:] = 1.0 + np.linspace(-1e-12, 1e-10, 5)  # the tail chunk
    cases["rounding-up-offsets"] = x
    y = rng.standard_t(3, 5000) * 1e-3
    y[100], y[200] = 1e39, -1e39  # beyond float32: infinite parameters
    cases["beyond-float32"] = y
    z = 1.0 + np.linspace(-1e-12, 1e-10, 300000)  # one chunk per tensor, longer than a NumPy block
    cases["per-tensor-rounding"] = z
    return cases


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("zero", [False, True], ids=["range", "zero"])
@pytest.mark.parametrize("bits,width", SHAPES)
def test_float64_compiled_and_numpy_paths_give_the_same_bits(bits, width, zero, monkeypatch):
    if zero and bits == 1:
        pytest.skip("a grid that holds zero needs two levels or more")
    q = _make(bits, width, zero)
    for name, x in {**_float64_cases(), **{k: v.astype(np.float64) for k, v in _signed_zero_cases().items()}}.items():
        acc0 = np.random.default_rng(4).standard_normal(x.size)
        acc0[::5] = -0.0
        with monkeypatch.context() as m:
            m.setattr(affine, "compiled", lambda *a: None)
            expected = _round_trip(q, x, acc0)
        got = _round_trip(q, x, acc0)
        for e, g, what in zip(expected, got, ("params", "codes", "acc")):
            assert e.dtype == g.dtype and e.shape == g.shape, (name, what)
            assert np.array_equal(e.view(np.uint8), g.view(np.uint8)), (name, what)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_packed_codes_are_pack4_of_the_codes(dtype):
    """The kernels' 4-bit codes, packed as they are made, equal ``pack4`` of the byte codes (an
    odd last code alone in its byte), and unpack back."""
    from gradcomp.kernels import quantize as compiled
    from gradcomp.kernels.affine import pack4, quantize_compiled

    rng = np.random.default_rng(9)
    for n in (1, 31, 33, 511, 512, 513, 512 * 5 + 77, 512 * 6):
        x = rng.standard_t(3, n).astype(dtype)
        x[n // 2] = np.nan
        params = np.empty((2, chunk_count(n, 512)), np.float32)
        codes = np.empty(n + n % 2, np.uint8)
        codes[n:] = 0
        quantize(x, params, codes[:n], 512, 15)
        expected = np.empty((n + 1) // 2, np.uint8)
        pack4(codes, expected)
        packed_params = np.empty_like(params)
        packed = np.empty((n + 1) // 2, np.uint8)
        quantize_compiled(compiled, x, packed_params, packed, 512, 15, packed=True)
        assert np.array_equal(packed_params.view(np.uint32), params.view(np.uint32)), n
        assert np.array_equal(packed, expected), n
        acc = np.zeros(n, dtype)
        want = np.zeros(n, dtype)
        compiled.unpack4_dequantize_chunks(acc, params, packed, 512, True, np.empty(512, np.uint8))
        dequantize(want, params, codes[:n], 512, add=True)
        assert np.array_equal(acc.view(np.uint8), want.view(np.uint8)), n


CODECS = {"int8": lambda gc: gc.ErrorFeedback(gc.QuantizedAllreduce(8)),
          "int8-worker": lambda gc: gc.ErrorFeedback(gc.QuantizedAllreduce(8), owner_feedback=False),
          "int8-noef": lambda gc: gc.QuantizedAllreduce(8),
          "int4": lambda gc: gc.ErrorFeedback(gc.QuantizedAllreduce(4)),
          "int4-noef": lambda gc: gc.QuantizedAllreduce(4),
          "int4-128": lambda gc: gc.ErrorFeedback(gc.QuantizedAllreduce(4, chunk=128)),
          "int4-zero": lambda gc: gc.ErrorFeedback(gc.QuantizedAllreduce(4, exact_zero=True)),
          "int8-zero-noef": lambda gc: gc.QuantizedAllreduce(8, exact_zero=True),
          "onebit": lambda gc: gc.ErrorFeedback(gc.OneBit()),
          "onebit-worker": lambda gc: gc.ErrorFeedback(gc.OneBit(), owner_feedback=False),
          "onebit-noef": lambda gc: gc.OneBit(),
          "quantize-channel": lambda gc: gc.QuantizePerChannel(),
          "quantize-tensor": lambda gc: gc.QuantizePerTensor()}
DTYPES = ["float32", "float64", "float16", "bfloat16"]


def _codec_bits(name, dtype, comm, n):
    """``name`` for 5 steps on ``dtype`` buckets (NaN, infinities and signed zeros in step 2,
    offsets that round up in float64 in step 1), with every compiled kernel and with them hidden
    from the codecs: every output and state entry must carry the same bits."""
    from unittest import mock

    import ml_dtypes

    import gradcomp as gc

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    rng = np.random.default_rng(11 + comm.rank)
    steps = []
    for k in range(5):
        x = rng.standard_t(3, n) * 1e-3
        if k == 1:
            x[512:1024] = 1.0 + np.linspace(-1e-12, 1e-10, 512) * (1 + comm.rank)
        if k == 2:
            x[600:700] = np.nan
            x[1600] = np.inf
            x[2048:2560:3] = -0.0
            x[2049:2560:3] = 0.0
        steps.append(x.astype(dt))

    def run(compiled):
        comp = CODECS[name](gc)
        hidden = (lambda *a: None)
        with mock.patch.object(affine, "compiled", affine.compiled if compiled else hidden), \
                mock.patch.object(signcodes, "compiled", signcodes.compiled if compiled else hidden):
            outs = [comp.reduce(gc.Bucket(x.copy(), 0, scratch=True), comm).result().copy() for x in steps]
        return outs, comp.state_dict()

    fast, fast_state = run(True)
    slow, slow_state = run(False)
    for k, (a, b) in enumerate(zip(fast, slow)):
        assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
            f"{name} {dtype}: step {k} differs"
    assert sorted(fast_state) == sorted(slow_state)
    for key in slow_state:
        a, b = np.asarray(fast_state[key]), np.asarray(slow_state[key])
        assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (name, dtype, key)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(CODECS))
def test_codecs_compiled_and_numpy_give_the_same_bits(name, dtype):
    """Every chunk codec on one rank, every bucket dtype: the fused worker, owner and decode
    kernels (float32, float64, half-precision gradients widened inside) against NumPy's steps."""
    import gradcomp as gc

    comm = gc.MPICommunicator(pipeline_depth=0)
    try:
        _codec_bits(name, dtype, comm, 512 * 9 + 130)
    finally:
        comm.close()


def rank_codecs_compiled_and_numpy_bits():
    import gradcomp as gc

    comm = gc.MPICommunicator()
    for dtype in DTYPES:
        for name in CODECS:
            _codec_bits(name, dtype, comm, 512 * 9 + 130)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
def test_codecs_compiled_and_numpy_give_the_same_bits_on_three_ranks():
    """The same at 3 ranks: the owners average three messages (divided), slices have tails."""
    run_ranks(3, "tests.kernels.test_quantize_kernels:rank_codecs_compiled_and_numpy_bits", timeout=900)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_streamed_decode_gives_the_same_bits(dtype):
    """The kernels that write a large output around the caches (``kernels.stream``) give the bits of
    the plain ones: several rows (divided), a row with a NaN offset, one with an infinite scale,
    an odd tail, outputs aligned to 16 bytes and not (the plain stores)."""
    from gradcomp.kernels import quantize as compiled

    rng = np.random.default_rng(21)
    for n in (512 * 7, 512 * 5 + 37, 130):
        chunks = chunk_count(n, 512)
        for size in (1, 3):
            rows = rng.integers(0, 256, (size, 8 * chunks + n), dtype=np.uint8)
            params = rng.standard_normal((size, 2, chunks)).astype(np.float32)
            params[:, 1] = np.abs(params[:, 1]) * 1e-2
            if chunks > 2:
                params[size - 1, 0, 1] = np.nan
                params[0, 1, 2] = np.inf
            want = np.empty(n, dtype)
            compiled.dequantize_rows_chunks(rows, params, 8 * chunks, 512, want, want.dtype.type(size))
            for shift in (0, 1):
                space = np.empty(n + 1, dtype)
                got = space[shift:shift + n]
                compiled.dequantize_rows_chunks_streamed(rows, params, 8 * chunks, 512, got,
                                                         got.dtype.type(size), np.empty(512, dtype))
                assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (n, size, shift)


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("name", ["quantize-channel", "onebit", "onebit-noef", "int8"])
def test_codecs_streaming_every_output_give_the_same_bits(name, monkeypatch):
    """With every output streamed (``kernels.STREAM_BYTES`` 0), the codecs against NumPy's steps."""
    import gradcomp as gc

    monkeypatch.setattr(kernels, "STREAM_BYTES", 0)
    comm = gc.MPICommunicator(pipeline_depth=0)
    try:
        for dtype in ("float32", "float64"):
            _codec_bits(name, dtype, comm, 512 * 9 + 130)
    finally:
        comm.close()


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_onebit_kernels_on_odd_byte_counts(dtype):
    """1-bit encode, decode (written, added, streamed) and the owner's stage on lengths whose last
    chunk holds an odd number of bytes of signs (the kernels take two bytes at a time), against
    NumPy's encode and decode."""
    from unittest import mock

    from gradcomp.compressors.quantize import onebit
    from gradcomp.kernels import onebit as compiled
    from gradcomp.comm.pipeline import Workspace

    codec = onebit.OneBit()
    rng = np.random.default_rng(12)
    for n in (512 * 3 + 24, 8, 512 + 8 * 13):
        x = rng.standard_t(3, n).astype(dtype)
        x[1] = -0.0
        fast = np.empty(codec.message_size(n), np.uint8)
        slow = np.empty_like(fast)
        codec.encode(x, fast, Workspace())
        with mock.patch.object(signcodes, "compiled", lambda *a: None):
            codec.encode(x, slow, Workspace())
        assert np.array_equal(fast, slow), n
        for add in (False, True):
            base = rng.standard_normal(n).astype(dtype)
            got, want = base.copy(), base.copy()
            codec.decode(fast, got, Workspace(), add=add)
            with mock.patch.object(signcodes, "compiled", lambda *a: None):
                codec.decode(fast, want, Workspace(), add=add)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), (n, add)
        chunks = chunk_count(n, 512)
        streamed = np.empty(n, dtype)
        compiled.onebit_decode_chunks_streamed(fast[:4 * chunks].view(np.float32), fast[4 * chunks:], streamed, 512,
                                               np.empty(512, dtype))
        codec.decode(fast, want, Workspace())
        assert np.array_equal(streamed.view(np.uint8), want.view(np.uint8)), n


def _owner_rows(rng, size, n, case):
    """``size`` 1-bit messages of ``n`` values whose scales per chunk follow ``case`` (rows of a
    multiple of 4 bytes, as the owner's compiled stage takes them)."""
    chunks = chunk_count(n, 512)
    rows = np.empty((size, 4 * chunks + -(-n // 32) * 4), np.uint8)
    rows[:, 4 * chunks:] = rng.integers(0, 256, (size, rows.shape[1] - 4 * chunks), dtype=np.uint8)
    scales = rows[:, :4 * chunks].view(np.float32)
    scales[...] = rng.uniform(0.5, 1.5, (size, chunks))
    if case == "equal":  # patterns whose mean is exactly zero (s - s), and +0 against -0
        scales[...] = scales[0]
    elif case == "zeros":
        scales[size // 2] = 0.0
    elif case == "span":  # magnitudes too far apart for an exact count: value by value
        scales[-1, ::2] = 1e-9
    elif case == "negative":  # not from this encoder, but a message all the same
        scales[0, 1::2] *= -1
    elif case == "bad":
        scales[0, 0], scales[-1, 1] = np.nan, np.inf
        scales[:, 2] = 3e38  # their sum overflows
    elif case == "float64-inexact":  # sums that need more than float32's digits (float64 values)
        scales[:, ::2] = 1.0 + rng.integers(1, 1 << 20, (size, (chunks + 1) // 2)) * 2.0 ** -23
        scales[0, ::2] = 3.0 ** 0.5
    return rows


@pytest.mark.skipif(not COMPILED, reason="numba kernels unavailable")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["plain", "equal", "zeros", "span", "negative", "bad", "float64-inexact"])
def test_onebit_owner_by_sign_patterns_gives_the_same_bits(case, dtype):
    """The owner's stage without a residual counts sign patterns per chunk (up to
    ``PATTERN_ROWS`` rows, where the magnitudes sum exactly) instead of decoding every value: at
    1 to 5 rows, whole and short last chunks, its message against NumPy's steps (decode every row
    into zeros in rank order, divide, encode)."""
    from unittest import mock

    from gradcomp.comm.pipeline import Workspace
    from gradcomp.compressors.quantize import onebit
    from gradcomp.kernels import onebit as compiled

    codec = onebit.OneBit()
    rng = np.random.default_rng(31)
    patterned = 0
    for size in range(1, compiled.PATTERN_ROWS + 2):
        for n in (512 * 6, 512 * 5 + 24):
            rows = _owner_rows(rng, size, n, case)
            got = np.empty(codec.message_size(n), np.uint8)
            assert codec.average(rows, n, dtype, got, Workspace())
            with mock.patch.object(signcodes, "compiled", lambda *a: None):
                mine = np.zeros(n, dtype)
                for r in range(size):
                    codec.decode(rows[r], mine, Workspace(), add=True)
                if size > 1:
                    np.divide(mine, mine.dtype.type(size), out=mine)
                want = np.empty_like(got)
                codec.encode(mine, want, Workspace())
            assert np.array_equal(got, want), (case, dtype, size, n)
            if size <= compiled.PATTERN_ROWS:
                vals = np.empty(1 << size, dtype)
                patterned += sum(compiled._pattern_means.py_func(
                    rows.view(np.float32), size, c, vals.dtype.type(size), vals, np.empty(1 << size),
                    np.empty(1 << size, np.uint64)) for c in range(n // 512))
    if case in ("plain", "equal", "zeros", "negative", "span"):
        assert patterned, "no chunk took the pattern path"
