"""Sparse gradients (``nn.Embedding(sparse=True)``): DDP hands each one over as a bucket of its
own, a sparse COO tensor. ``Allreduce`` and ``Allgather`` average it as PyTorch's allreduce does
(each rank's values divided by the world size, every rank's entries gathered, duplicates summed),
through the communicator's pipeline so it stays in order with the dense buckets. Lossy compressors
are defined on dense buckets only: for them every rank raises the same error."""
from __future__ import annotations

from concurrent.futures import Future

import numpy as np
import torch

from ..bucket import digest
from ..comm import CollectiveError, Communicator
from ..compressors import Allgather, Allreduce, Compressor


def reduce_sparse(compressor: Compressor, comm: Communicator, tensor: torch.Tensor) -> Future[torch.Tensor]:
    """A Future of the mean over ranks of the sparse ``tensor`` (a new sparse tensor)."""
    exact = type(compressor) in (Allreduce, Allgather)
    t = tensor.detach().coalesce().cpu()
    size = comm.size
    indices = t.indices().numpy()
    values = (t.values() / size).numpy()
    dense_shape = tuple(t.shape)
    describe = f"{dense_shape} {t.dtype} sparse_dim={t.sparse_dim()}"

    def run(_prepared, _error):
        mine = np.array([int(exact), digest(describe), indices.shape[1]], dtype=np.int64)
        table = comm.allgather(mine)
        if not table[:, 0].all():
            raise CollectiveError(
                f"gradcomp: {compressor.describe()} reduces dense buckets only, and this model has "
                "sparse gradients (e.g. nn.Embedding(sparse=True)): use gradcomp.Allreduce() or "
                "Allgather() for it, or sparse=False")
        if (table[:, 1] != table[0, 1]).any():
            raise CollectiveError(f"gradcomp: sparse gradient shapes differ across ranks (here {describe})")
        counts = [int(c) for c in table[:, 2]]
        width = max(counts)
        idx = np.zeros((indices.shape[0], width), np.int64)
        idx[:, :indices.shape[1]] = indices
        val = np.zeros((width,) + values.shape[1:], values.dtype)
        val[:values.shape[0]] = values
        all_idx = comm.allgather(idx.reshape(-1)).reshape(size, indices.shape[0], width)
        all_val = comm.allgather(val.reshape(-1)).reshape((size, width) + values.shape[1:])
        cat_idx = np.concatenate([all_idx[r, :, :counts[r]] for r in range(size)], axis=1)
        cat_val = np.concatenate([all_val[r, :counts[r]] for r in range(size)], axis=0)
        mean = torch.sparse_coo_tensor(torch.from_numpy(cat_idx), torch.from_numpy(cat_val),
                                       dense_shape, check_invariants=False).coalesce()
        return mean.to(tensor.device)

    return comm.submit(run)
