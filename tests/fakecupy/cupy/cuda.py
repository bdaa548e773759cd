"""The stand-in's ``cupy.cuda``: devices, streams, memory pointers, the runtime calls gradcomp and
``benchmarks/scripts/gpu_check.py`` make. One device (``FAKE_CUPY_DEVICES`` changes that).

Streams keep the order that matters for correctness without a GPU: every kernel the stand-in
runs is *queued* on the calling thread's current stream (``_queue``) and only counts as finished
once that stream (or the device) is synchronized. A consumer that reads device memory behind
CUDA's back (MPI through ``__cuda_array_interface__``) while a kernel that wrote it is still
queued is a hazard: on a GPU it would read stale values. As in CUDA, the legacy default stream
(``Stream.null``) is one stream shared by every host thread of the process, and the current
device is per host thread.
"""
from __future__ import annotations

import itertools
import os
import threading
import types

_local = threading.local()
_lock = threading.Lock()
_ptrs = itertools.count(0x1000)
_streams: list["Stream"] = []

#: what the stand-in saw (read by the tests; ``cupy._fake.reset()`` clears it)
stats = {"stream_synchronize": 0, "device_synchronize": 0}


class CUDARuntimeError(RuntimeError):
    pass


def _device_count() -> int:
    return int(os.environ.get("FAKE_CUPY_DEVICES", "1"))


def _check_id(device_id: int) -> int:
    if not 0 <= int(device_id) < _device_count():
        raise CUDARuntimeError("cudaErrorInvalidDevice: invalid device ordinal")
    return int(device_id)


class Device:
    """``cupy.cuda.Device(id)``: ``use()`` makes it current on this host thread; also a context
    manager (restores the previous device on exit)."""

    def __init__(self, device=None):
        if device is None:
            device = getattr(_local, "device", 0)
        elif isinstance(device, Device):
            device = device.id
        self.id = _check_id(device)
        self._previous: list[int] = []

    def use(self) -> None:
        _local.device = self.id

    def __enter__(self):
        self._previous.append(getattr(_local, "device", 0))
        self.use()
        return self

    def __exit__(self, *exc):
        _local.device = self._previous.pop()
        return False

    def synchronize(self) -> None:
        stats["device_synchronize"] += 1
        for s in list(_streams):
            s._done = s._seq

    def __eq__(self, other):
        return isinstance(other, Device) and other.id == self.id

    def __hash__(self):
        return hash(("cupy.cuda.Device", self.id))

    def __int__(self):
        return self.id

    def __repr__(self):
        return f"<CUDA Device {self.id}>"


class Stream:
    """``cupy.cuda.Stream``. ``Stream.null`` is the legacy default stream (``ptr`` 0), shared by
    all host threads; ``with stream:`` makes a stream current on this thread."""

    null: "Stream"

    def __init__(self, null: bool = False, non_blocking: bool = False, ptds: bool = False):
        self.ptr = 0 if null else next(_ptrs)
        self.device_id = getattr(_local, "device", 0)
        self._seq = 0     # kernels queued so far
        self._done = 0    # kernels known finished (at the last synchronize)
        self._previous: list[Stream] = []
        with _lock:
            _streams.append(self)

    def synchronize(self) -> None:
        stats["stream_synchronize"] += 1
        self._done = self._seq

    def done(self) -> bool:
        return self._done == self._seq

    def use(self) -> "Stream":
        _local.stream = self
        return self

    def __enter__(self):
        self._previous.append(get_current_stream())
        return self.use()

    def __exit__(self, *exc):
        _local.stream = self._previous.pop()
        return False

    def __repr__(self):
        return f"<Stream {self.ptr:#x} (device {self.device_id})>"


Stream.null = Stream(null=True)


def get_current_stream(device_id: int | None = None) -> Stream:
    return getattr(_local, "stream", None) or Stream.null


def _queue() -> tuple[Stream, int]:
    """Queue one kernel on the current stream: (stream, its sequence number)."""
    s = get_current_stream()
    with _lock:
        s._seq += 1
        return s, s._seq


class MemoryPointer:
    """``ndarray.data``: ``ptr`` is the address of the array's first element (here, host memory)."""

    def __init__(self, ptr: int, device_id: int):
        self.ptr = int(ptr)
        self.device_id = device_id

    @property
    def device(self) -> Device:
        return Device(self.device_id)

    def __int__(self):
        return self.ptr


def _get_device() -> int:
    return getattr(_local, "device", 0)


def _set_device(device_id: int) -> None:
    _local.device = _check_id(device_id)


def _device_synchronize() -> None:
    Device().synchronize()


runtime = types.SimpleNamespace(
    getDeviceCount=_device_count, getDevice=_get_device, setDevice=_set_device,
    deviceSynchronize=_device_synchronize, runtimeGetVersion=lambda: 12080,
    driverGetVersion=lambda: 12080, is_hip=False, streamLegacy=1, streamPerThread=2,
    CUDARuntimeError=CUDARuntimeError)


def is_available() -> bool:
    return _device_count() > 0
