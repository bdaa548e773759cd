"""The Communicator protocol over torch.distributed (gloo, nccl, or any backend torch has).

``torchrun`` users get every gradcomp compressor without MPI, and parity tests can run gradcomp and
PyTorch's own hooks on the same transport, where the same collective on the same backend adds in
the same order and so gives the same bits.

All four collectives exist natively on gloo and nccl (including ``all_to_all_single``, and
float16/bfloat16 sums), so no emulation is needed. Data is moved as bytes (uint8) for allgather,
alltoall and broadcast, which carries any dtype; allreduce sums in the array's own dtype.
"""
from __future__ import annotations

import datetime
import os
import sys
import warnings
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ..arrays import Array, ArrayModule, DTypeLike, add_into, array_module, synchronize
from ..comm import Communicator, OrderedCommunicator, launched_by_mpi
from ..comm.protocol import default_depth
from ..comm.exits import end_job
from .launch import keep_at_exit
from .tensors import as_array, as_tensor


# torch 2.13 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class TorchCommunicator(OrderedCommunicator):
    """gradcomp's transport over a torch.distributed process group.

    ``process_group=None`` creates a dedicated group over every rank of the default group (a
    collective call: every rank must construct it, in the same order as other ``new_group`` calls),
    so that gradcomp's collectives, issued from its worker thread, never interleave with those DDP
    or the application issue on the default group from the main thread. An explicit
    ``process_group`` is used as given: dedicate it to gradcomp for the same reason.

    Arrays are NumPy or CuPy. On an nccl group, host arrays are staged to the current CUDA device
    and back; on other backends, CuPy arrays are staged to host memory (gloo copies device data to
    the host anyway). Results come back in the input's array module, as new arrays.

    ``abort_grace_s``: after a rank fails halfway through a reduction, how long before this process
    ends the job (``GRADCOMP_ABORT_GRACE_S``, 10 s by default): ``MPI_Abort`` when the job was
    started by mpiexec, otherwise ``os._exit(1)``, which closes this rank's connections so that its
    peers' collectives fail instead of waiting for the process group's timeout, and lets the
    launcher (torchrun) tear the job down.
    """

    def __init__(self, process_group: dist.ProcessGroup | None = None, *, abort_grace_s: float | None = None,
                 timeout: datetime.timedelta | None = None, pipeline_depth: int | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "gradcomp.torch.TorchCommunicator needs torch.distributed to be initialized: call "
                "gradcomp.torch.init_process_group() (under mpiexec) or "
                "torch.distributed.init_process_group() (under torchrun) first")
        if process_group is None:
            kwargs: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
            process_group = dist.new_group(ranks=list(range(dist.get_world_size())), **kwargs)
        self.group = process_group
        keep_at_exit(process_group)
        self.rank = dist.get_rank(process_group)
        self.size = dist.get_world_size(process_group)
        self.backend = str(dist.get_backend(process_group))
        self._global_ranks = dist.get_process_group_ranks(process_group)
        self._topology: Any = None
        # the worker thread does not inherit the caller's current CUDA device: remember it here
        self._cuda_index = torch.cuda.current_device() if self.backend == "nccl" else None
        self._start("gradcomp-torch", abort_grace_s, default_depth(pipeline_depth))
        if self._cuda_index is not None:  # put the wire thread on that device before anything else
            index = self._cuda_index
            self.submit(lambda _p, _e: torch.cuda.set_device(index))

    def __repr__(self) -> str:
        return f"TorchCommunicator(rank={self.rank}, size={self.size}, backend={self.backend!r})"

    @property
    def topology(self) -> Any:
        """Which ranks share a host (``gradcomp.comm.topology``: the environment's word, else the
        host names), agreed by every rank on first use (collective). ``auto`` reads it: on one
        host it keeps its first method and measures nothing, as under mpiexec."""
        if self._topology is None:
            from ..comm.topology import agreed

            self._topology = self._call(agreed, self.rank, self.size, self._gathered)
        return self._topology

    def abort(self, code: int = 1) -> None:
        mpi = sys.modules.get("mpi4py.MPI")
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            end_job(mpi.COMM_WORLD, code)
        sys.stderr.flush()
        os._exit(code)

    # -- buffers -----------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self._cuda_index is not None:
            return torch.device("cuda", self._cuda_index)
        return torch.device("cpu")

    def _to_tensor(self, array: Array, as_bytes: bool = False,
                   reuse: bool = False) -> tuple[torch.Tensor, ArrayModule]:
        """A fresh tensor (ours to overwrite) with ``array``'s values on the collective's device,
        and the array module to return results in. ``reuse``: ``array`` is the caller's scratch,
        so a contiguous one already on the right device is wrapped, not copied."""
        xp = array_module(array)
        if xp is not np:
            synchronize(array)  # the CuPy kernels that produced ``array`` must have finished
        device = self._device()
        moves = (device.type == "cpu") != (xp is np)
        if moves and xp is not np:
            source = xp.asnumpy(array)  # device -> host: already a copy
        elif moves:
            source = np.ascontiguousarray(array)  # host -> device: .to() below copies
        elif reuse and array.flags.c_contiguous:
            source = array
        else:
            source = xp.array(array, copy=True, order="C")
        if as_bytes:
            source = source.reshape(-1).view(array_module(source).uint8)
        tensor = as_tensor(source)
        if tensor.device != device:
            tensor = tensor.to(device)
        return tensor, xp

    def _to_array(self, tensor: torch.Tensor, xp: ArrayModule, like_dtype: DTypeLike = None) -> Array:
        if tensor.is_cuda:
            torch.cuda.current_stream(tensor.device).synchronize()
        if xp is np:
            out = as_array(tensor.cpu()) if tensor.is_cuda else as_array(tensor)
        elif tensor.is_cuda:
            out = as_array(tensor)
        else:
            out = xp.asarray(as_array(tensor))
        return out if like_dtype is None else out.view(like_dtype)

    # -- the collective calls themselves (what a subclass over another kind of group overrides) -----
    def _all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the group, in place. One method per collective call, so that a
        transport over a group torch.distributed cannot address (``ft.QuorumCommunicator``)
        replaces only the call and keeps the staging and counting around it."""
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)

    def _all_gather_into(self, gathered: torch.Tensor, tensor: torch.Tensor) -> None:
        """Every rank's ``tensor``, in rank order, into ``gathered`` (``size`` times as long)."""
        _all_gather_single(gathered, tensor, group=self.group)

    def _all_to_all(self, received: torch.Tensor, tensor: torch.Tensor) -> None:
        """Block ``r`` of ``tensor`` (``size`` equal blocks) to rank ``r``; block ``r`` of
        ``received`` from rank ``r``."""
        dist.all_to_all_single(received, tensor, group=self.group)

    def _broadcast_from(self, tensor: torch.Tensor, root: int) -> None:
        """Group rank ``root``'s ``tensor`` into every rank's, in place."""
        dist.broadcast(tensor, src=self._global_ranks[root], group=self.group)

    # -- the collectives, on the wire thread ---------------------------------------------------------
    def _allreduce(self, array, overwrite=False):
        tensor, xp = self._to_tensor(array, reuse=overwrite)
        self._count("allreduce", array.nbytes)
        self._all_reduce_sum(tensor)
        out = self._to_array(tensor, xp)
        if overwrite:
            if xp is np and not tensor.is_cuda and tensor.data_ptr() == array.ctypes.data:
                return array  # reduced in place
            array[...] = out
            return array
        return out

    def _reduce_scatter(self, array, out=None, counts=None, overwrite=False):
        """The owner of each block adds the ``size`` contributions in rank order (alltoall of the
        padded blocks, then a local sum): identical on every rank, any backend."""
        counts, offsets = self.partition(array.shape[0], counts)
        width = max(counts) if counts else 0
        xp = array_module(array)
        padded = xp.zeros(width * self.size, array.dtype)
        for r in range(self.size):
            padded[r * width:r * width + counts[r]] = array[offsets[r]:offsets[r] + counts[r]]
        rows = self._alltoall(padded)
        mine = counts[self.rank]
        total = rows[0, :mine].copy()
        for r in range(1, self.size):
            add_into(total, rows[r, :mine])
        if out is None:
            return total
        out[...] = total
        return out

    def _allgather_blocks(self, block, out, counts=None):
        counts, offsets = self.partition(out.shape[0], counts)
        width = max(counts) if counts else 0
        xp = array_module(block)
        padded = xp.zeros(width, out.dtype)
        padded[:block.shape[0]] = block
        rows = self._allgather(padded)
        for r in range(self.size):
            out[offsets[r]:offsets[r] + counts[r]] = rows[r, :counts[r]]
        return out

    def _allgather(self, array, out=None):
        self._count("allgather", array.nbytes)
        result = self._gathered(array)
        if out is not None:
            out.reshape(result.shape)[...] = result
            return out.reshape(result.shape)
        return result

    def _gathered(self, array):
        """Every rank's ``array``, stacked, uncounted (``_allgather`` counts; the topology's own
        exchange is not a method's traffic)."""
        tensor, xp = self._to_tensor(array, as_bytes=True)
        gathered = torch.empty(self.size * tensor.numel(), dtype=torch.uint8, device=tensor.device)
        self._all_gather_into(gathered, tensor)
        return self._to_array(gathered, xp, array.dtype).reshape((self.size,) + tuple(array.shape))

    def _alltoall(self, array, out=None):
        tensor, xp = self._to_tensor(array, as_bytes=True)
        received = torch.empty_like(tensor)
        self._count("alltoall", array.nbytes)
        self._all_to_all(received, tensor)
        result = self._to_array(received, xp, array.dtype).reshape(self.size, -1)
        if out is not None:
            out.reshape(result.shape)[...] = result
            return out.reshape(result.shape)
        return result

    def _broadcast(self, array, root):
        tensor, xp = self._to_tensor(array, as_bytes=True)
        self._count("broadcast", array.nbytes)
        self._broadcast_from(tensor, root)
        return self._to_array(tensor, xp, array.dtype).reshape(array.shape)


def default_comm() -> Communicator:
    """MPI when mpiexec started one MPI rank per torch rank; torch.distributed otherwise. A job
    whose MPI world and torch world disagree is an error, never N separate jobs."""
    if launched_by_mpi():
        from ..comm import default_communicator

        comm = default_communicator()
        if dist.is_initialized() and comm.size != dist.get_world_size():
            raise RuntimeError(
                f"gradcomp.torch: MPI has {comm.size} rank(s) but torch.distributed has "
                f"{dist.get_world_size()}: start torch.distributed with "
                "gradcomp.torch.init_process_group() under mpiexec, or use torchrun without mpiexec")
        return comm
    if not dist.is_initialized():
        warnings.warn("gradcomp.torch: torch.distributed is not initialized; call "
                      "gradcomp.torch.init_process_group() first", stacklevel=3)
    return TorchCommunicator()
