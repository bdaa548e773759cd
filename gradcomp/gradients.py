"""The entry point for training loops without PyTorch: average a list of gradient arrays."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from .bucket import pack, unpack
from .comm import CollectiveError, Communicator, default_communicator
from .compressors.base import Compressor


def allreduce_gradients(arrays: Sequence, compressor: Compressor, comm: Communicator | None = None,
                        bucket_cap_mb: float = 25.0) -> list:
    """Average ``arrays`` (NumPy or CuPy, any shapes) over all ranks with ``compressor``, in place.

    The arrays are packed into flat buckets of about ``bucket_cap_mb`` MiB, every bucket is queued
    on the communicator at once (they reduce in order on its worker while later ones are packed),
    and the averages are written back into the original arrays. Every rank must pass the same
    shapes and dtypes in the same order; if one does not, every rank raises ``CollectiveError``.
    Returns ``arrays``.
    """
    comm = comm if comm is not None else default_communicator()
    try:
        packed, problem = pack(arrays, bucket_cap_mb), ""
    except (TypeError, ValueError) as exc:
        packed, problem = [], str(exc)
    table = comm.allgather(np.array([int(bool(problem)), len(packed)], dtype=np.int64))
    bad = [r for r in range(comm.size) if table[r, 0]]
    if bad:
        here = f" (here: {problem})" if problem else ""
        raise CollectiveError(f"gradcomp: rank(s) {bad} passed gradients that cannot be bucketed{here}")
    if (table[:, 1] != table[0, 1]).any():
        counts = ", ".join(f"rank {r}: {int(c)}" for r, c in enumerate(table[:, 1]))
        raise CollectiveError(f"gradcomp: the gradients pack into different numbers of buckets ({counts})")
    futures = [compressor.reduce(bucket, comm) for bucket, _ in packed]
    for (bucket, members), future in zip(packed, futures):
        unpack(future.result(), bucket, arrays, members)
    return arrays
