"""FSDP2 (``fully_shard``): every FSDP module's gradient reduce-scatter through a gradcomp compressor.

Under FSDP2 a module's gradients leave each rank through one reduce-scatter per FSDP module and
step, not an allreduce: FSDP copies every parameter's gradient into a flat buffer laid out as one
row per destination rank (row r holds shard r of each parameter, each shard padded to equal
length), and each rank keeps the reduced row of its own shards. torch 2.13 lets that collective
be replaced (``FSDPModule.set_custom_reduce_scatter``); ``register`` puts a ``_ReduceScatter`` on
every FSDP module of the tree, which hands the flat buffer to the compressor as a ``scatter``
bucket (``gradcomp.bucket``): each rank encodes its row for each destination, an alltoall moves
the messages, and the owner decodes and averages its row. No second copy of any quantizer: the
codecs' own reduce-scatter form does the work (``gradcomp.compressors.codec``).

What the bucket carries, so that state follows parameters (``HookState``'s promise under DDP):

* keys ``"<parameter name>#<r>of<N>"``, one per parameter shard in the row for rank r, so error
  feedback residuals are checkpointed per parameter shard, as plain tensors, and a resume into a
  freshly built model on the same number of ranks continues bit for bit; a checkpoint saved on
  another number of ranks names shards that never come, and the first step refuses it;
* ``is_last`` on the last FSDP module to reduce in a step (the number of modules with trainable
  parameters is counted at ``register``), so recipes' warm-up steps count training steps. A
  module whose parameters got no gradient in a step (FSDP then skips its reduce-scatter) would
  shift that count; the next forward raises an error that says so instead.

Across hosts (ZeRO++'s shape): shard inside each host (``fully_shard(..., mesh=mesh["local"])``
of a ``(hosts, local)`` device mesh), and ``register`` leaves FSDP's own reduce-scatter inside the
host, over the fast local path, and compresses only what crosses hosts: FSDP's all-reduce hook
(``set_all_reduce_hook``) receives each rank's reduced row, and ``_AcrossHosts`` averages it with
the ranks of the same local position on the other hosts (a communicator of its own), in place.
Every host then holds the same shards, bit for bit.

FSDP asks for ``op`` AVG (float32 and bfloat16 reduce dtypes), SUM (float16: FSDP divides before
and after), or PREMUL_SUM (a custom divide factor, refused here). Methods without a reduce-scatter
form (PowerSGD, random-k, ``auto``, the hierarchical wrapper) are refused at ``register``.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ..arrays import FLOAT_DTYPES, cast, is_device_array, synchronize
from ..bucket import Bucket
from ..comm import CollectiveError, Communicator
from ..compressors import Compressor
from ..compressors.agreement import texts_if_different
from ..compressors.contract import parts, sends_part
from ..metrics import Meter
from ..registry import REGISTRY, make
from .checkpoint import from_torch_state, to_torch_state
from .communicator import default_comm
from .fsdp_gather import GatherStats, QuantizedAllGather
from .naming import HookRegisteredTwice
from .tensors import as_array, wait_for_torch


class FSDPState:
    """What ``register`` returns for an FSDP2 model: the compressor (``.compressor.stats()``:
    ``bytes_sent``, and ``compression_ratio`` against FSDP's own reduce-scatter of the same
    shards), the communicator, and the checkpoint pair ``state_dict()``/``load_state_dict()``
    (tensors and plain values, ``torch.save``-able; save it beside FSDP's model and optimizer
    state dicts, between steps)."""

    def __init__(self, compressor: Compressor, comm: Communicator | None, modules: int):
        self.compressor = compressor
        self.comm = comm
        self.modules = modules          # FSDP modules with trainable parameters: reduces per step
        self.calls = 0                  # reduce-scatters so far in this step
        self.shapes: dict[str, tuple[int, ...]] = {}  # every shard key -> (length,)
        self.gathered: GatherStats | None = None  # the parameter all-gathers' bytes (all_gather=)
        self.gathers: list[tuple[Any, QuantizedAllGather]] = []  # (FSDP module, its all-gather)

    def __repr__(self) -> str:
        return f"FSDPState({self.compressor!r}, {self.comm!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["comm"] = None  # threads and MPI handles never travel
        state["gathers"] = []  # nor FSDP modules
        state.pop("_meter", None)
        return state

    def metrics(self) -> dict[str, float]:
        """``HookState.metrics``: the compressor's figures as flat scalars for a logger."""
        return self.meter.update(self.compressor.stats())

    @property
    def meter(self) -> Meter:
        """The ``gradcomp.Meter`` that ``metrics()`` reads through."""
        return self.__dict__.setdefault("_meter", Meter())

    def comm_of(self) -> Communicator:
        """The communicator (gradcomp's default one, made at first use, if none was given)."""
        if self.comm is None:
            self.comm = default_comm()
        return self.comm

    @contextlib.contextmanager
    def exact_all_gather(self) -> Iterator[None]:
        """Inside it, FSDP's own float all-gather: forward passes see the exact parameters (to
        evaluate the trained weights rather than their codes, with ``all_gather``); collective,
        as every forward is. The codes' all-gather is back on exit."""
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

        for module, _ in self.gathers:
            module.set_custom_all_gather(DefaultAllGather())
        try:
            yield
        finally:
            for module, gather in self.gathers:
                module.set_custom_all_gather(gather)

    def all_gather_stats(self) -> dict[str, Any] | None:
        """The parameter all-gathers' bytes (``bytes_sent``, ``compression_ratio`` against FSDP's
        own all-gather of the same rows), or None without ``all_gather``."""
        return None if self.gathered is None else self.gathered.stats()

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state as tensors and plain values."""
        if self.calls:
            raise RuntimeError(f"gradcomp.torch.fsdp: state_dict() in the middle of a step ({self.calls} of "
                               f"{self.modules} FSDP modules reduced); take it between steps")
        return {"compressor": self.compressor.describe(), "fsdp": True,
                "state": to_torch_state(self.compressor.state_dict())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; checked before anything changes."""
        if not isinstance(state, dict) or "state" not in state or not state.get("fsdp"):
            raise ValueError("gradcomp.torch.fsdp: expected the output of FSDPState.state_dict() "
                             "(a dict with 'compressor', 'fsdp' and 'state'); a DDP hook's state does not "
                             "load into an FSDP model")
        saved = state.get("compressor")
        if saved != self.compressor.describe():
            raise ValueError(f"gradcomp.torch.fsdp: this checkpoint was saved by {saved}, but this model "
                             f"runs {self.compressor.describe()}")
        self.compressor.load_state_dict(from_torch_state(state["state"]), self.shapes or None)
        self.calls = 0


class _Module:
    """One FSDP module's parameters and the bucket layouts gradcomp gives its gradients."""

    def __init__(self, state: FSDPState, module_name: str, shards: list[tuple[str, Any]]):
        self.state = state
        self.module_name = module_name or "<root>"
        self.shards = shards  # (parameter name, FSDPParam) in FSDP's order
        self._layouts: dict[tuple, tuple[list[str], list[tuple[int]]]] = {}

    def layout(self, ranks: int, rows: range | None = None) -> tuple[list[str], list[tuple[int]]]:
        """Keys and shapes of each trainable parameter's padded shard for ``ranks`` shards, in the
        ``rows`` given (default: all of them, row by row: a reduce-scatter's input)."""
        rows = range(ranks) if rows is None else rows
        names = tuple(name for name, p in self.shards if p.sharded_param.requires_grad)
        cached = self._layouts.get((ranks, tuple(rows), names))
        if cached is None:
            sizes = [_row_length(p, ranks) for _, p in self.shards if p.sharded_param.requires_grad]
            keys = [f"{name}#{r}of{ranks}" for r in rows for name in names]
            shapes = [(size,) for _ in rows for size in sizes]
            cached = self._layouts[(ranks, tuple(rows), names)] = (keys, shapes)
            self.state.shapes.update(zip(keys, shapes))
        return cached

    def bucket(self, tensor: torch.Tensor, keys: list[str], shapes: list[tuple[int]], scatter: bool) -> Bucket:
        """``tensor`` as this step's next bucket (counting FSDP modules to find the step's end)."""
        expected = sum(math.prod(s) for s in shapes)
        if tensor.numel() != expected:
            raise ValueError(
                f"gradcomp.torch.fsdp: FSDP module {self.module_name!r} reduces {tensor.numel()} values, "
                f"but its trainable parameters' padded shards hold {expected}: some parameter got no "
                "gradient this step (call module.set_reduce_scatter_unused_params(True) so FSDP reduces "
                "zeros for it)")
        if tensor.dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
            raise TypeError(f"gradcomp.torch.fsdp: reduce dtype {tensor.dtype} is not one of "
                            f"{', '.join(FLOAT_DTYPES)} (MixedPrecisionPolicy.reduce_dtype)")
        state = self.state
        state.calls += 1
        index, is_last = state.calls - 1, state.calls >= state.modules
        if is_last:
            state.calls = 0
        if tensor.is_cuda:
            wait_for_torch(tensor)
        return Bucket(as_array(tensor), index, shapes, is_last, scratch=True, keys=keys, scatter=scatter)

    def comm(self) -> Communicator:
        return self.state.comm_of()


def _write(out_tensor: torch.Tensor, row: Any, factor: float = 1) -> None:
    """``out_tensor[...] = row * factor`` (``row`` a NumPy or CuPy array)."""
    out = as_array(out_tensor)
    if factor != 1:
        row = row * row.dtype.type(factor)
    if row.dtype != out.dtype:
        row = cast(row, out.dtype)
    if row is not out:
        out[...] = row
    if is_device_array(out):
        synchronize(out)


class _ReduceScatter(_Module, ReduceScatter):
    """One FSDP module's reduce-scatter through ``state.compressor`` (see the module docstring)."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> None:
        comm = self.comm()
        ranks = dist.get_world_size(group)
        if ranks != comm.size:
            raise ValueError(f"gradcomp.torch.fsdp: FSDP module {self.module_name!r} reduce-scatters over "
                             f"{ranks} ranks but gradcomp's communicator has {comm.size}")
        factor = _sum_factor(op, ranks)
        keys, shapes = self.layout(ranks)
        bucket = self.bucket(input_tensor, keys, shapes, scatter=True)
        _write(output_tensor, self.state.compressor.reduce(bucket, comm).result(), factor)
        return None


class _AcrossHosts(_Module):
    """FSDP's all-reduce hook of one module sharded inside a host: this rank's reduced row (the
    mean over its host) averaged with the same row of every other host, in place."""

    def __init__(self, state: FSDPState, module_name: str, shards: list[tuple[str, Any]], local: int,
                 local_size: int):
        super().__init__(state, module_name, shards)
        self.local, self.local_size = local, local_size

    def __call__(self, reduce_output: torch.Tensor) -> None:
        keys, shapes = self.layout(self.local_size, range(self.local, self.local + 1))
        bucket = self.bucket(reduce_output, keys, shapes, scatter=False)
        _write(reduce_output, self.state.compressor.reduce(bucket, self.comm()).result())


def _row_length(param: Any, ranks: int) -> int:
    """Values of ``param``'s gradient in each destination row: FSDP pads dim 0 to a multiple of
    the ranks (``Shard(0)``) or cuts another dim evenly (``Shard(d)``)."""
    size = tuple(param._orig_size)
    if not size:
        return 1
    dim = param.fsdp_placement.dim
    if dim == 0:
        return -(-size[0] // ranks) * math.prod(size[1:])
    return math.prod(size) // ranks


def _sum_factor(op: Any, ranks: int) -> float:
    """What the mean is multiplied by for FSDP's ``op``: 1 for AVG, the ranks for SUM."""
    if op == dist.ReduceOp.AVG:
        return 1
    if op == dist.ReduceOp.SUM:
        return ranks
    raise ValueError(f"gradcomp.torch.fsdp: FSDP asked for reduce op {op!r}; gradcomp reduces with AVG or SUM "
                     "(a custom gradient divide factor, set_gradient_divide_factor, is not supported)")


def scatter_names(allow_partial: bool = False) -> list[str]:
    """The registered names that have a reduce-scatter form and that ``register`` takes for FSDP
    (with ``allow_partial=False``, its default, not the ones that send part of each gradient)."""
    names = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some factories warn when built (randomk)
        for name in REGISTRY:
            try:
                made = make(name)
                if made.scatters and (allow_partial or not sends_part(made)):
                    names.append(name)
            except Exception:  # a third-party factory that cannot be built without arguments
                continue
    return names


def register(model: Any, compressor: Compressor | str | None, comm: Communicator | None = None,
             state: FSDPState | None = None, allow_partial: bool = False,
             all_gather: str | None = None) -> FSDPState:
    """Make every FSDP module of ``model`` (the root ``fully_shard`` returned) reduce-scatter its
    gradients with ``compressor``; ``gradcomp.torch.register`` calls it for FSDP2 models.

    Call it on every rank after ``fully_shard`` and before the first ``backward()``. ``comm``:
    as for DDP (MPI under mpiexec, torch.distributed under torchrun). ``state``: an ``FSDPState``
    to reuse (its compressor is used). ``allow_partial``: run a method that sends only part of
    each gradient (onebit, topk, PowerSGD across hosts), which is refused by default: under
    FSDP2 and AdamW such methods ended well above FSDP's own loss in gradcomp's measurements,
    while int8 and int4 matched it. ``all_gather``: also send FSDP's parameter all-gathers in
    chunk codes, ``"int8"`` or ``"int4"`` (``gradcomp.torch.fsdp_gather``; 1-D FSDP over all
    ranks). Every rank agrees on the method and ``all_gather`` here, before any data moves.
    Returns the state (see ``FSDPState``).
    """
    earlier = getattr(model, "_gradcomp_state", None)
    if earlier is not None and earlier is not state:
        raise HookRegisteredTwice(
            f"gradcomp.torch.register: this FSDP model already has gradcomp's reduce-scatter "
            f"({earlier.compressor.describe()}), and a second one would leave the first one's step check "
            "behind. Keep the FSDPState the first register returned (restore a checkpoint with its "
            "load_state_dict), or pass it as state= to register again")
    if state is not None:
        compressor = state.compressor
    if isinstance(compressor, str):
        compressor = make(compressor)
    if not isinstance(compressor, Compressor):
        raise TypeError(f"gradcomp.torch.register: expected a gradcomp Compressor or a registry name, "
                        f"got {type(compressor).__name__}")
    names = {id(p): name for name, p in model.named_parameters()}
    modules = []
    for module_name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = module._get_fsdp_state()._fsdp_param_groups  # (torch 2.13's FSDP internals)
        if len(groups) > 1:
            raise ValueError(f"gradcomp.torch.register: FSDP module {module_name or '<root>'!r} has "
                             f"{len(groups)} parameter groups (shard_placement_fn with several meshes); "
                             "FSDP's custom reduce-scatter takes one")
        if not groups:
            continue
        group = groups[0]
        if getattr(group, "_is_hsdp", False):
            raise ValueError(f"gradcomp.torch.register: FSDP module {module_name or '<root>'!r} is HSDP "
                             "(a 2-D mesh); gradcomp reduces 1-D FSDP meshes")
        shards = [(names[id(p.sharded_param)], p) for p in group.fsdp_params]
        modules.append((module_name, module, shards))
    trainable = sum(any(p.sharded_param.requires_grad for _, p in shards) for _, _, shards in modules)
    meshes = {tuple(dist.get_process_group_ranks(_group(m).mesh_info.shard_process_group)) for _, m, _ in modules}
    if len(meshes) > 1:
        raise ValueError(f"gradcomp.torch.register: the FSDP modules are sharded over different groups of "
                         f"ranks ({sorted(meshes)}); gradcomp takes one mesh for the whole model")
    shard_ranks = list(meshes.pop()) if meshes else []
    across = 0 < len(shard_ranks) < dist.get_world_size()
    if not across and not compressor.scatters:
        lacking = [p.describe() for p in parts(compressor) if not p.scatters]
        raise ValueError(f"gradcomp.torch.register: {compressor.describe()} has no reduce-scatter form "
                         f"({lacking[0] if lacking else 'it'} cannot reduce FSDP's gradient shards); under "
                         f"FSDP2 use one of: {', '.join(scatter_names(allow_partial))}")
    if sends_part(compressor) and not allow_partial:
        raise ValueError(f"gradcomp.torch.register: {compressor.describe()} sends a 1-bit, sparse or low-rank "
                         "part of each gradient, and under FSDP2 with Adam(W) such methods did not reach "
                         "FSDP's own loss in gradcomp's measurements (docs/guides/fsdp.md). Use 'int4' "
                         "(about 8x fewer bytes) or 'int8' (about 4x), which did; or pass "
                         "allow_partial=True to run it anyway")
    gathered = None
    if all_gather is not None:
        gathered = GatherStats(all_gather)
        if across:
            raise ValueError("gradcomp.torch.register: all_gather compresses 1-D FSDP's parameter all-gather "
                             "over all ranks; sharded inside each host, the all-gather stays on the host's "
                             "own fast path (leave all_gather out)")
    if state is None:
        if comm is None:
            comm = _across_hosts_comm(shard_ranks) if across else default_comm()
        state = FSDPState(compressor, comm, trainable)
    else:
        state.modules, state.calls = trainable, 0
        if comm is not None or state.comm is None:
            state.comm = comm if comm is not None else (
                _across_hosts_comm(shard_ranks) if across else default_comm())
    assert state.comm is not None
    _agree_on_setup(state.comm, f"{compressor.describe()}; all_gather={all_gather}")
    state.gathered = gathered
    state.gathers = [] if gathered is None else [
        (module, QuantizedAllGather(gathered, state.comm_of, name)) for name, module, _ in modules]
    for module, gather in state.gathers:
        module.set_custom_all_gather(gather)
    for module_name, module, shards in modules:
        if across:
            local = shard_ranks.index(dist.get_rank())
            hook = _AcrossHosts(state, module_name, shards, local, len(shard_ranks))
            module.set_all_reduce_hook(hook)
            hook.layout(len(shard_ranks), range(local, local + 1))  # so that a checkpoint loads before the first step
        else:
            scatter = _ReduceScatter(state, module_name, shards)
            module.set_custom_reduce_scatter(scatter)
            scatter.layout(len(shard_ranks))  # so that a checkpoint loads before the first step
    if earlier is None:
        model.register_forward_pre_hook(_step_check(state))
    model._gradcomp_state = state  # what a second register names
    return state


def _agree_on_setup(comm: Communicator, text: str) -> None:
    """Every rank registered the same method and all-gather, or every rank raises the same
    ``CollectiveError`` naming each rank's."""
    texts = texts_if_different(comm, text)
    if texts is not None:
        raise CollectiveError("gradcomp.torch.register: the ranks registered different methods ("
                              + "; ".join(f"rank {r}: {t}" for r, t in enumerate(texts)) + ")")


def _group(module: FSDPModule) -> Any:
    """The FSDP parameter group of ``module`` (one: ``register`` checked it)."""
    return module._get_fsdp_state()._fsdp_param_groups[0]


def _across_hosts_comm(shard_ranks: list[int]) -> Communicator:
    """A communicator of the ranks at this rank's place in every FSDP shard group (one per host:
    consecutive blocks of ranks), MPI's under mpiexec, torch.distributed's otherwise."""
    from ..comm import launched_by_mpi

    world, local_size = dist.get_world_size(), len(shard_ranks)
    first = shard_ranks[0]
    if world % local_size or shard_ranks != list(range(first, first + local_size)) or first % local_size:
        raise ValueError(f"gradcomp.torch.register: FSDP shards over ranks {shard_ranks} of {world}; gradcomp "
                         "compresses across hosts for meshes of consecutive blocks of equal size "
                         "(init_device_mesh(device, (hosts, per_host))['<the second dim>'])")
    local = dist.get_rank() - first
    if launched_by_mpi():
        from ..comm import MPICommunicator, default_communicator

        world_comm: Any = default_communicator()
        return MPICommunicator(world_comm.comm.Split(local, dist.get_rank()))
    from .communicator import TorchCommunicator

    groups = [dist.new_group(list(range(l, world, local_size))) for l in range(local_size)]
    return TorchCommunicator(groups[local])


def _step_check(state: FSDPState) -> Any:
    """A forward pre-hook on the root: the previous step reduced every FSDP module or none."""
    def check(module: Any, args: Any) -> None:
        if state.calls:
            done, state.calls = state.calls, 0
            raise RuntimeError(
                f"gradcomp.torch.fsdp: the last backward reduce-scattered {done} of {state.modules} FSDP "
                "modules with trainable parameters: the others got no gradient, so gradcomp cannot tell "
                "where a training step ends (call model.set_reduce_scatter_unused_params(True), or freeze "
                "the unused parameters before register())")
    return check
