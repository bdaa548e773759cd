"""What the optimizer-level methods share: checked parameters, one exchange, checkpoints.

An ``Optimizer`` here owns the parameters' update *and* their communication: every rank passes its
own local gradients to ``step``, the optimizer folds them into its state, averages what its method
sends over the ranks through a ``GradientReducer`` (buckets, the ordered pipeline, bit-identical
means), and updates the parameters in place, the same bits on every rank.

What ranks must agree on goes through the same agreement as every compressor (DESIGN invariant
3): the exchange's compressor is wrapped in ``_Agreed``, whose declared configuration holds the
optimizer's description and whose per-bucket state holds its step, phase and this step's learning
rates, so a rank with another ``betas`` or a step behind is a ``CollectiveError`` on every rank
before any data moves, never silently diverging replicas.
"""
from __future__ import annotations

import math
from concurrent.futures import Future
from typing import Any, Mapping, Sequence

import numpy as np

from ..arrays import FLOAT_DTYPES, Array, array_module, dtype_name, sum_of_squares
from ..bucket import Bucket, buffer_problem, digest
from ..comm import Communicator, Workspace, default_communicator
from ..compressors.contract import Compressor, run_stage
from ..compressors.wrapper import Wrapper
from ..params import check_float
from ..reducer import GradientReducer
from ..settling import Settling, take_settling, with_settling
from ..state import (check_array, check_saved_here, reject_leftovers, saved_by, take_config, take_int,
                     take_saved_by)

Hyper = float | Sequence[float]


def governor_stats(exchange: Compressor) -> dict[str, Any] | None:
    """The governor's part of an optimizer's ``stats()``: each tensor's rung, the steps per rung,
    the decisions, and the audits' share of the bytes the agreed ``exchange`` counted around it;
    None where the exchange is not governed."""
    from ..planning.governor import Governed

    inner = getattr(exchange, "inner", None)
    if not isinstance(inner, Governed):
        return None
    governor, sent = inner.stats()["governor"], exchange.stats()["bytes_sent"]
    return {**governor, "audit_share": governor["audit_bytes"] / sent if sent else 0.0}


def governors(reducers: Sequence[Any]) -> dict[str, Any]:
    """The exchanges' governors in ``stats()`` (``governor_stats``; a list, one per reducer: DiLoCo's
    streaming fragments); nothing where none is governed."""
    found = [g for g in (governor_stats(r.compressor) for r in reducers) if g is not None]
    return {"governor": found[0] if len(found) == 1 else found} if found else {}


class _Agreed(Wrapper):
    """``inner``, with its owner optimizer's configuration and step state agreed on as well."""

    def __init__(self, inner: Compressor, owner: Optimizer):
        super().__init__(inner)
        self._owner = owner
        # the owner's state when each bucket was submitted: the agreement runs on the pipeline,
        # by when an overlapped exchange's owner (DiLoCo(overlap=...)) has stepped on
        self._submitted: dict[int, dict[str, Any]] = {}

    def reduce(self, bucket: Bucket | Array, comm: Communicator | None = None) -> Future[Array]:
        self._submitted[id(bucket)] = self._owner.agreement_state()
        return super().reduce(bucket, comm)

    @property
    def runaway_advice(self) -> str:  # type: ignore[override]
        return self._owner.runaway_advice  # the user is on the optimizer path already

    def config(self) -> dict[str, Any]:
        return {"optimizer": self._owner.describe(), "inner": self.inner}

    def describe(self) -> str:
        return f"{self._owner.describe()} exchanging with {self.inner.describe()}"

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Any:
        return self.inner.prepare(bucket, comm, workspace)

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Any) -> Array:
        return run_stage(self.inner, bucket, comm, prepared)

    def agreement_state(self, bucket: Bucket, prepared: Any) -> dict[str, Any]:
        owner = self._submitted.pop(id(bucket), None) or self._owner.agreement_state()
        return {**owner, **self.inner.agreement_state(bucket, prepared)}


def check_params(params: Sequence[Array], owner: str) -> list[Array]:
    """``params`` as a list of updatable arrays (NumPy or CuPy, float, contiguous, one module)."""
    out = list(params)
    if not out:
        raise ValueError(f"{owner}: got an empty parameter list")
    modules = set()
    for i, p in enumerate(out):
        if type(p).__module__.split(".")[0] == "torch":
            raise TypeError(f"{owner}: parameter {i} is a torch tensor; use gradcomp.torch.{owner}, "
                            "or pass NumPy views (tensor.detach().numpy())")
        if not hasattr(p, "dtype") or not hasattr(p, "shape"):
            raise TypeError(f"{owner}: parameter {i} must be a NumPy or CuPy array, got {type(p).__name__}")
        if dtype_name(p.dtype) not in FLOAT_DTYPES:
            raise TypeError(f"{owner}: parameter {i} must be floating point, got {dtype_name(p.dtype)}")
        flat = p.reshape(-1) if p.ndim else p.reshape(1)
        problem = buffer_problem(flat)
        if problem or not p.flags.c_contiguous:
            raise ValueError(f"{owner}: parameter {i} cannot be updated in place "
                             f"({problem or 'not contiguous'})")
        modules.add(array_module(p).__name__)
    if len(modules) > 1:
        raise TypeError(f"{owner}: parameters mix array modules ({', '.join(sorted(modules))})")
    return out


def per_param(name: str, value: Hyper, count: int, minimum: float = 0.0) -> list[float]:
    """A hyperparameter given once or once per parameter, as one checked float per parameter."""
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, bool):
        return [check_float(name, value, minimum=minimum)] * count
    values = list(value)  # type: ignore[arg-type]
    if len(values) != count:
        raise ValueError(f"{name}: expected one value or {count} (one per parameter), got {len(values)}")
    return [check_float(f"{name}[{i}]", v, minimum=minimum) for i, v in enumerate(values)]


class Optimizer:
    """Base class: parameters, hyperparameters per parameter, the exchange, checkpoints.

    Subclasses set ``_arrays`` (name -> list of state arrays shaped like the parameters), build
    their exchange with ``_exchange(compressor)`` and implement ``step`` and ``config``. One whose
    warm-up ends when the scale settles (``warmup="auto"``) sets ``settling``, feeds it with
    ``_observe`` and moves what depends on the end in ``_settled``; its stats and checkpoints
    carry the decision.
    """

    #: the divergence guard's advice when the exchange's residual runs away
    runaway_advice = "lengthen the exact warm-up (warmup=...) or lower the learning rate"

    def __init__(self, params: Sequence[Array], lr: Hyper, weight_decay: Hyper,
                 comm: Communicator | None, bucket_cap_mb: float):
        name = type(self).__name__
        self.params = check_params(params, name)
        self.lr = per_param("lr", lr, len(self.params))
        self.weight_decay = per_param("weight_decay", weight_decay, len(self.params))
        self.comm = comm if comm is not None else default_communicator()
        self.bucket_cap_mb = check_float("bucket_cap_mb", bucket_cap_mb, above=0)
        self.steps = 0
        self._step_lr = self.lr
        self._arrays: dict[str, list[Array]] = {}
        self._spares: dict[int, Array] = {}  # ``in_place``'s buffers for gradients it cannot use
        self.settling: Settling | None = None
        self.reducer: GradientReducer  # set by ``_exchange``, which every subclass calls
        self.compressor: Compressor

    # -- what subclasses implement -----------------------------------------------------------------------
    def step(self, grads: Sequence[Array], lr: Hyper | None = None, weight_decay: Hyper | None = None) -> None:
        """One update from this rank's local ``grads``; ``lr``/``weight_decay`` for this step.
        ``grads`` may be overwritten: they are the exchange's buffer (``in_place``)."""
        raise NotImplementedError

    def config(self) -> dict[str, Any]:
        raise NotImplementedError

    def phase(self) -> str:
        """What this step does (``"warm-up"``, ``"compressed"``, ...), agreed on by every rank."""
        return ""

    def describe(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{type(self).__name__}({fields})"

    def _settled(self, end: int) -> None:
        """The warm-up ended: step ``end`` is the first after it (decided now, or loaded)."""

    def _observe(self, averaged: Sequence[Array]) -> None:
        """Feed ``settling`` each tensor's mean square of ``averaged`` (the exchange's output,
        the same bits on every rank, so every rank ends on the same step)."""
        assert self.settling is not None
        if self.settling.observe([sum_of_squares(a) / max(a.size, 1) for a in averaged],
                                 [a.size for a in averaged]):
            self._settled(self.steps + 1)

    def __repr__(self) -> str:
        return self.describe()

    def agreement_state(self) -> dict[str, Any]:
        lr = self._step_lr
        rates = f"{lr[0]!r}" if len(set(lr)) == 1 else f"{digest(repr(lr)):x}"
        return {"optimizer step": self.steps, "phase": self.phase(), "lr": rates}

    # -- the exchange ---------------------------------------------------------------------------------------
    def _exchange(self, compressor: Compressor, budget: float | None = None) -> GradientReducer:
        """A reducer over arrays shaped like the parameters, averaging with ``compressor`` on one
        flat schedule (DGC's masking reads each rank's own residual, which a hierarchical one
        keeps on one rank of the host; and the 25x+ codes these optimizers send were measured
        slower hierarchical, ``Compressor.hierarchical_pays``). ``budget``: the exchange is
        governed (``gradcomp.planning.governor``: it backs off to 8-bit codes where compression
        costs more than that); None: not."""
        from ..planning.governor import Governed

        self.budget = budget
        if budget is not None:
            compressor = Governed(compressor, budget=budget)
        # two buckets' buffers, not the model's: each step averages the arrays it passes where they
        # lie (``in_place``); the parameters give only the shapes and dtypes
        self.reducer = GradientReducer(self.params, _Agreed(compressor, self), self.comm, self.bucket_cap_mb,
                                       hierarchical=False, window=2)
        self.compressor = self.reducer.compressor
        return self.reducer

    def in_place(self, grads: Sequence[Array]) -> list[Array]:
        """Arrays holding ``grads``' values that this step may overwrite and exchange: each gradient
        itself where it can be (the parameter's dtype and array module, contiguous, writable), so
        that no parameter-sized buffer is kept here (the gradients then hold what was averaged, as
        under DDP); else a copy in a buffer kept from step to step (JAX's read-only arrays)."""
        out = []
        for i, (g, p) in enumerate(zip(grads, self.params)):
            if (type(g) is type(p) and g.dtype == p.dtype and g.flags.c_contiguous
                    and getattr(g.flags, "writeable", True)):
                out.append(g)
                continue
            spare = self._spares.get(i)
            if spare is None:
                spare = self._spares[i] = array_module(p).empty(p.shape, p.dtype)
            spare[...] = g
            out.append(spare)
        return out

    def _hyper(self, lr: Hyper | None, weight_decay: Hyper | None) -> tuple[list[float], list[float]]:
        n = len(self.params)
        rates = self.lr if lr is None else per_param("lr", lr, n)
        decay = self.weight_decay if weight_decay is None else per_param("weight_decay", weight_decay, n)
        self._step_lr = rates
        return rates, decay

    def _check_grads(self, grads: Sequence[Array]) -> list[Array]:
        grads = list(grads)
        if len(grads) != len(self.params):
            raise ValueError(f"{type(self).__name__}.step: expected {len(self.params)} gradients "
                             f"(one per parameter), got {len(grads)}")
        for i, (g, p) in enumerate(zip(grads, self.params)):
            if getattr(g, "shape", None) != p.shape:
                raise ValueError(f"{type(self).__name__}.step: gradient {i} has shape "
                                 f"{getattr(g, 'shape', None)}, its parameter {p.shape}")
        return grads

    def stats(self) -> dict[str, Any]:
        """The exchange's traffic (``Compressor.stats``) plus the optimizer's step and phase, the
        governor's levels and decisions where it is governed, and with ``settling``, when and why
        the warm-up ended."""
        out = {**self.compressor.stats(), "optimizer_step": self.steps, "phase": self.phase()}
        governor = governor_stats(self.compressor)
        if governor is not None:
            out["governor"] = governor
        return out if self.settling is None else {**out, **self.settling.stats()}

    # -- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain arrays and numbers: the step, every state array by parameter position, and the
        exchange's compressor state under ``exchange/``."""
        out: dict[str, Any] = {"config": self.describe(), "step": self.steps}
        for name, arrays in self._arrays.items():
            for i, a in enumerate(arrays):
                out[f"{name}/{i}"] = np.array(_host(a), copy=True)
        out.update({f"exchange/{k}": v for k, v in self.compressor.state_dict().items()})
        out.update(saved_by(self.comm))
        return with_settling(out, self.settling)

    def _check_saved_here(self, state: dict[str, Any], exchange: Mapping[str, Any], owner: str) -> None:
        """Pop the saving rank from ``state``; refuse the ``exchange`` residuals of another rank."""
        rank, size = take_saved_by(state)
        check_saved_here(exchange, rank, size, self.comm.rank, self.comm.size, owner,
                         "Save the optimizer's state_dict() on every rank, to a file of its own: "
                         "docs/guides/checkpoints.md")

    def _take_arrays(self, state: dict[str, Any], owner: str) -> dict[str, list[np.ndarray]]:
        """Pop every per-parameter array (``NAME/i``) from ``state``, checked against this
        optimizer's shapes and dtypes (a ValueError naming the key)."""
        loaded: dict[str, list[np.ndarray]] = {}
        for name, arrays in self._arrays.items():
            loaded[name] = []
            for i, a in enumerate(arrays):
                key = f"{name}/{i}"
                if key not in state:
                    raise ValueError(f"{owner} state: missing {key!r}")
                loaded[name].append(check_array(state.pop(key), key, owner, a.shape, (dtype_name(a.dtype),)))
        return loaded

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output; everything is checked before anything changes."""
        state = dict(state)
        owner = type(self).__name__
        take_config(state, owner, self.describe(), "optimizer")
        step = take_int(state, "step", owner)
        loaded = self._take_arrays(state, owner)
        exchange = {k[len("exchange/"):]: state.pop(k) for k in [k for k in state if k.startswith("exchange/")]}
        self._check_saved_here(state, exchange, owner)
        settling = take_settling(state, self.settling)
        reject_leftovers(state, owner)
        self.compressor.load_state_dict(exchange, self.reducer.shapes)
        for name, arrays in self._arrays.items():
            for a, value in zip(arrays, loaded[name]):
                a[...] = array_module(a).asarray(value)
        self.steps = step
        if settling is not None:
            self.settling = settling
            self._settled(settling.end)


def _host(a: Array) -> np.ndarray:
    from ..arrays import to_host

    return np.asarray(to_host(a))


def global_norm(arrays: Sequence[Array]) -> float:
    """The 2-norm of all ``arrays`` together, summed in float64."""
    return math.sqrt(sum(sum_of_squares(a) for a in arrays))
