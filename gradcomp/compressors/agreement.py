"""What every rank checks, collectively, before a bucket's data moves (DESIGN invariant 3).

Each rank describes its bucket and its compressor in a few fields: whether the buffer (or the local
stage) was usable at all, length, dtype, layout (tensor keys and shapes), bucket index and
``is_last``, the compressor's declared configuration (``Compressor.config``) and its state for this
bucket (``Compressor.agreement_state``: step, phase, stage, ...). One allgather of a digest per
field compares them. When a field differs, a second, rarer round gathers that field's text from
every rank, and every rank raises the same ``CollectiveError`` naming the field and each rank's
value. MPI would otherwise truncate a message, hang, or silently mix mismatched buffers.
"""
from __future__ import annotations

import numpy as np

from ..arrays import dtype_name
from ..bucket import Bucket, buffer_problem, digest
from ..comm import CollectiveError, Communicator

FIELDS = ("usable", "length", "dtype", "layout", "bucket index", "is_last", "compressor", "compressor state")


def describe(bucket: Bucket | None, compressor, prepared, problem: str | None) -> list[str]:
    """This rank's value of each field, as text."""
    config = compressor.describe()
    if problem is not None or bucket is None:
        return ["no: " + (problem or "unknown"), "", "", "", "", "", config, ""]
    state = compressor.agreement_state(bucket, prepared)
    state_text = ", ".join(f"{k}={v}" for k, v in state.items())
    return ["yes", str(bucket.numel), dtype_name(bucket.dtype), bucket.layout_text(), str(bucket.index),
            str(bucket.is_last), config, state_text]


def agree(comm: Communicator, bucket, compressor, prepared=None,
          problem: str | None = None, flag: int = 0) -> tuple[Bucket, np.ndarray]:
    """Check, collectively, that every rank brings a compatible bucket, configuration and state;
    return the bucket as a ``Bucket`` and every rank's ``flag``. ``problem``: why this rank cannot
    take part (a buffer that cannot be a bucket, a local stage that failed); every rank then raises
    ``CollectiveError``. ``flag``: a number that may differ across ranks and travels with the
    digests for free (the divergence guard's, ``guard``).
    """
    if problem is None and not isinstance(bucket, Bucket):
        problem = buffer_problem(bucket)
        if problem is None:
            bucket = Bucket(bucket)
    texts = describe(bucket if problem is None else None, compressor, prepared, problem)
    mine = np.array([digest(t) for t in texts] + [int(flag)], dtype=np.int64)
    mine[0] = 0 if problem is None else 1
    table = comm.allgather(mine)
    differs = [col for col in range(len(FIELDS)) if (table[:, col] != table[0, col]).any()]
    if not differs and problem is None:
        return bucket, table[:, len(FIELDS)]
    bad = [r for r in range(comm.size) if table[r, 0]]
    if bad:
        # ranks that cannot take part: say who and why (their texts), nothing else matters
        reasons = gather_texts(comm, texts[0])
        detail = "; ".join(f"rank {r}: {reasons[r][4:]}" for r in bad)
        raise CollectiveError(f"gradcomp: rank(s) {bad} cannot take part in this reduction ({detail})")
    col = differs[0]
    values = gather_texts(comm, texts[col])
    per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(values))
    raise CollectiveError(f"gradcomp: {FIELDS[col]} differs across ranks ({per_rank})")


def texts_if_different(comm: Communicator, text: str) -> list[str] | None:
    """None when every rank brings the same ``text`` (one allgather of a digest), else every
    rank's text (``gather_texts``): for a check whose error names each rank's value."""
    mine = np.array([digest(text)], dtype=np.int64)
    if (comm.allgather(mine) == mine).all():
        return None
    return gather_texts(comm, text)


def gather_texts(comm: Communicator, text: str) -> list[str]:
    """Every rank's ``text`` (two allgathers of bytes: lengths, then the padded texts)."""
    data = np.frombuffer(text.encode(), dtype=np.uint8)
    lengths = comm.allgather(np.array([data.shape[0]], dtype=np.int64))[:, 0]
    padded = np.zeros(int(lengths.max()), dtype=np.uint8)
    padded[:data.shape[0]] = data
    rows = comm.allgather(padded)
    return [bytes(rows[r, :int(lengths[r])]).decode(errors="replace") for r in range(comm.size)]
