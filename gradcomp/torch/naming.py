"""Which parameter each tensor key names, in a DDP hook: ``register`` keys a compressor's
per-tensor state by parameter name and leaves a ``ModelRecord`` on the compressor, so a pickled
compressor keeps its names, and a hook attached to it without the model (``comm_hook``) finds the
model once (``names_from_model``) and keys tensors by name as ``register`` did.
"""
from __future__ import annotations

from typing import Any, Protocol

from ..compressors import Compressor


class HookParts(Protocol):
    """What this module and ``layouts`` read and write of a ``hook.HookState``: typed here, so that
    neither imports the hook that imports them."""

    compressor: Compressor
    comm: Any
    names: dict[int, str]
    shapes: dict[str, tuple]
    layouts: list[tuple[str, ...]]
    replay: list[tuple[str, ...]]
    _step_layouts: list[tuple[str, ...]]


class HookRegisteredTwice(RuntimeError, ValueError):
    """A second communication hook on one DDP or FSDP model (``register``). A ``RuntimeError``, as
    PyTorch's own refusal ("register_comm_hook ... can only be called once") that code written for
    DDP catches; also a ``ValueError``, what ``register`` raised before, so that code written
    against gradcomp still catches it. Here, beside the record ``register`` leaves, so that the
    DDP hook and the FSDP reduce-scatter both raise it without importing each other."""


#: where ``register`` leaves a ``ModelRecord`` on the compressor itself (pickled with it)
RECORD = "_gradcomp_ddp_model"


class ModelRecord:
    """What ``register`` knows of the model a compressor reduces for, kept on the compressor
    (``RECORD``) so that ``torch.save(compressor)`` carries it: the parameters' names and shapes
    (the keys of its per-tensor state, in the model's order) and the last whole step's bucket
    layouts. A hook attached to such a compressor without the model (``comm_hook``) keys tensors by
    name too, and cuts a fresh model's first bucket into these layouts. ``hierarchical``: whether
    ``register`` ran it inside ``Hierarchical``, whose groups key its state; ``comm_hook`` does
    again."""

    hierarchical = False  # (a class default: records pickled before it existed read False)

    def __init__(self, shapes: dict[str, tuple]) -> None:
        self.shapes = dict(shapes)
        self.layouts: list[tuple[str, ...]] = []
        self.loaded = False  # unpickled or copied: its compressor's state must find its tensors

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.loaded = True

    def difference(self, shapes: dict[str, tuple]) -> str | None:
        """Why a loaded compressor's state cannot follow its tensors into the model with
        ``shapes`` (a parameter it kept state for is missing or has another shape), or None. A
        parameter the model adds is a new tensor, as a new layer is."""
        for name, shape in self.shapes.items():
            if name not in shapes:
                return f"its model had {name!r} {shape}, which this model lacks"
            if tuple(shapes[name]) != tuple(shape):
                return f"its model's {name!r} had shape {shape}, this model's has {tuple(shapes[name])}"
        return None


def record_of(compressor: Compressor) -> ModelRecord | None:
    record = getattr(compressor, RECORD, None)
    return record if isinstance(record, ModelRecord) else None


def names_from_model(state: HookParts, params: list[Any]) -> None:
    """Name the parameters as ``register`` does, in a hook attached without the model
    (``comm_hook``) to a compressor that ``register`` attached before: its state is keyed by
    parameter name (``ModelRecord``).

    DDP's ``GradBucket`` hands over the parameters but neither their names nor the model, and a
    parameter does not know its module. Positions do not identify them: the first step's single
    bucket holds them in the model's order only on a fresh model under DDP's default bucketing
    (not with ``find_unused_parameters``, per-bucket caps, or a model that has already stepped),
    and shapes repeat, so a guess could hand one layer's residuals to another. So the model that
    holds these very parameters is found, once, as ``OneBitAdam`` finds it (``_owning_ddp``:
    through the garbage collector's referrers), and the state is refused where it is not."""
    from .optim import _owning_ddp

    model = _owning_ddp(params[0])
    if model is None or not {id(p) for p in params} <= {id(p) for p in model.module.parameters()}:
        raise ValueError(
            f"gradcomp.torch: {state.compressor.describe()} was attached with gradcomp.torch.register"
            "(model, ...) before, so its state (error-feedback residuals, warm-start factors, counters) "
            "is kept by parameter name; this hook was attached without the model (comm_hook()), and "
            "the DistributedDataParallel model that holds this bucket's parameters, whose names it "
            "needs, was not found. Attach it with gradcomp.torch.register(ddp_model, compressor)")
    adopt(state, list(model.module.named_parameters()))


def adopt(state: HookParts, named: list[tuple[str, Any]], *others: Any) -> None:
    """Key ``state``'s tensors by the names of ``named`` (a DDP model's
    ``module.named_parameters()``) and record them on its compressor (and ``others``, the object
    the user holds where ``register`` wrapped it): ``ModelRecord``. A loaded compressor whose
    model had other parameters is refused before its state could go to the wrong tensors."""
    shapes = {name: tuple(p.shape) if p.dim() else (1,) for name, p in named}
    record = record_of(state.compressor)
    if record is not None and record.loaded:
        differs = record.difference(shapes)
        if differs is not None:
            raise ValueError(
                f"gradcomp.torch: this {state.compressor.describe()} was saved from a model with other "
                f"parameters ({differs}): its state (error-feedback residuals, warm-start factors) is "
                "kept per parameter name and would be lost or reach the wrong tensors. Attach it to "
                "a model with the same parameters, or start from a new compressor")
    if record is None or record.shapes != shapes:
        record = ModelRecord(shapes)
    record.loaded = False
    for compressor in (state.compressor, *others):
        if isinstance(compressor, Compressor):
            setattr(compressor, RECORD, record)
    state.names = {id(p): name for name, p in named}
    state.shapes = shapes
