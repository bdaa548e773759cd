"""The Compressor contract shared by every method.

A compressor turns one bucket on every rank into the average over ranks, doing its own
compression, collectives and decompression. It runs on the communicator's ordered worker, so the
collectives of successive buckets never interleave; a method with several rounds (PowerSGD) simply
calls several blocking collectives in a row.

Before any data moves, ``agree`` exchanges a few integers per rank (size, dtype, layout, the
compressor's own configuration, and whether the rank's buffer was usable at all). When they differ,
every rank raises the same ``CollectiveError`` naming the ranks and values, and nothing hangs:
MPI would otherwise truncate, hang, or silently mix mismatched buffers.
"""
from __future__ import annotations

import zlib
from concurrent.futures import Future

import numpy as np

from ..arrays import FLOAT_DTYPES, dtype_name, is_device_array, synchronize
from ..bucket import Bucket, buffer_problem
from ..comm import Communicator, CollectiveError, default_communicator, wire_bytes

_FIELDS = ("unusable buffer", "length", "dtype", "layout", "compressor", "bucket index", "is_last")


def _digest(text: str) -> int:
    data = text.encode()
    return zlib.crc32(data) | (zlib.adler32(data) << 31)


def agree(comm: Communicator, bucket, compressor: "Compressor") -> Bucket:
    """Check, collectively, that every rank brings a compatible bucket; return it as a Bucket.

    ``bucket`` may be a ``Bucket`` or a bare array: a bare array that cannot be a bucket (2-D,
    integer, strided) is reported to every rank here instead of raising on one rank alone, which
    would leave the others blocked in the next collective.
    """
    if isinstance(bucket, Bucket):
        problem, buffer = None, bucket.buffer
    else:
        problem, buffer = buffer_problem(bucket), bucket
        if problem is None:
            bucket = Bucket(buffer)
    if problem is None:
        dtype_code = FLOAT_DTYPES.index(dtype_name(bucket.dtype))
        mine = [0, bucket.numel, dtype_code, bucket.layout_key(), _digest(repr(compressor)),
                bucket.index, int(bucket.is_last)]
    else:
        mine = [1, -1, -1, -1, _digest(repr(compressor)), -1, -1]
    everyone = comm.allgather(np.array(mine, dtype=np.int64))
    if comm.size > 1 or problem:
        _raise_on_disagreement(everyone, problem, comm.rank)
    return bucket


def _raise_on_disagreement(table: np.ndarray, my_problem: str | None, my_rank: int) -> None:
    bad_ranks = [r for r in range(table.shape[0]) if table[r, 0]]
    if bad_ranks:
        detail = f" (here: {my_problem})" if my_problem else ""
        raise CollectiveError(
            f"gradcomp: rank(s) {bad_ranks} passed a buffer that cannot be a bucket{detail}; "
            "a bucket must be a 1-D contiguous float16/bfloat16/float32/float64 array")
    for col in range(1, table.shape[1]):
        values = table[:, col]
        if (values != values[0]).any():
            if _FIELDS[col] == "dtype":
                shown = [FLOAT_DTYPES[v] for v in values]
            elif _FIELDS[col] in ("layout", "compressor"):
                shown = [f"#{v & 0xFFFF:04x}" for v in values]
            else:
                shown = [int(v) for v in values]
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            raise CollectiveError(f"gradcomp: bucket {_FIELDS[col]} differs across ranks ({per_rank})")


def _on_device(device, fn, *args):
    """Run ``fn`` with ``device`` current on this (worker) thread. Left current afterwards, so that
    done-callbacks, which run on this thread right after ``fn``, copy on the same GPU."""
    device.use()
    return fn(*args)


class Compressor:
    """Base class: subclasses implement ``run`` (and, if stateful, the state-dict pair).

    ``reduce(bucket, comm)`` is the public entry point: it returns a Future of the averaged bucket,
    a new array with the input's length and dtype; the input is never modified.
    """

    def __init__(self):
        self._stats = dict(calls=0, steps=0, input_bytes=0, bytes_sent=0.0, rounds=0,
                           reference_bytes=0.0)

    # -- public API ------------------------------------------------------------------------------
    def reduce(self, bucket, comm: Communicator | None = None) -> Future:
        """Average ``bucket`` (a ``Bucket`` or a 1-D array) over the ranks of ``comm``.

        Queued on the communicator's ordered worker; returns at once. On the GPU, the caller's
        current CUDA stream is synchronized first, so the worker sees finished values, and the
        worker runs on the buffer's device (the current device is per thread, and a new thread
        starts on device 0: a rank driving GPU 1 would otherwise compute on the wrong GPU).
        """
        comm = comm if comm is not None else default_communicator()
        buffer = getattr(bucket, "buffer", bucket)
        synchronize(buffer)
        if is_device_array(buffer):
            return comm.submit(_on_device, buffer.device, self.checked_run, bucket, comm)
        return comm.submit(self.checked_run, bucket, comm)

    def checked_run(self, bucket, comm: Communicator):
        """``agree`` on the bucket, then ``run`` it and record traffic (on the worker thread)."""
        bucket = agree(comm, bucket, self)
        before_bytes, before_calls = comm.bytes_sent, getattr(comm, "collectives", 0)
        out = self.run(bucket, comm)
        s = self._stats
        s["calls"] += 1
        s["steps"] += int(bucket.is_last)
        s["input_bytes"] += bucket.buffer.nbytes
        s["bytes_sent"] += comm.bytes_sent - before_bytes
        s["rounds"] += getattr(comm, "collectives", 0) - before_calls
        s["reference_bytes"] += wire_bytes("allreduce", bucket.buffer.nbytes, comm.size)
        return out

    def run(self, bucket: Bucket, comm: Communicator):
        """Reduce ``bucket`` over ``comm`` on the calling (worker) thread and return the mean over
        ranks: a new array of the bucket's length and dtype. Must not modify ``bucket.buffer``.

        Wrappers (FP16, Schedule) call their inner compressor's ``run`` directly, on a bucket with
        the same index and layout, so per-bucket state follows the bucket through any nesting."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Traffic so far. ``bytes_sent``: bytes this rank put on the wire (bandwidth-optimal
        algorithms); ``compression_ratio``: what a plain allreduce of the same buckets would have
        sent divided by what was sent; ``rounds_per_step``: collectives per training step."""
        s = dict(self._stats)
        steps = max(s["steps"], 1)
        s["bytes_sent_per_step"] = s["bytes_sent"] / steps
        s["rounds_per_step"] = s["rounds"] / steps
        s["compression_ratio"] = (s["reference_bytes"] / s["bytes_sent"]) if s["bytes_sent"] else 1.0
        return s

    def state_dict(self) -> dict:
        """Plain arrays and numbers only (``numpy.savez``-able); stateless methods return {}."""
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} is stateless but got state keys {sorted(state)}")

    def __repr__(self):
        return f"{type(self).__name__}()"

