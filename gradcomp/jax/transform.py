"""gradcomp as optax transformations: the state on the host, the step outside jit or inside it.

An optax transformation is a pair of pure functions over a state pytree. gradcomp's state cannot
be that: the compressor's residuals and counters live in its own per-tensor stores, updated in
place on the host while the collectives run (DESIGN: "state follows each tensor"), and moving them
through the optax state every step would copy them twice a step. So a ``Transformation`` holds its
host side (``TreeReducer``, or a ``gradcomp.optim`` optimizer) as an object, and the optax state
holds one step counter (``count``, an int32 array), which every step checks against the host
side's own count and across ranks: restoring an optax state without the host state, or ranks at
different steps, is a ``CollectiveError`` on every rank, never a silent restart of a warm-up.

Checkpoints are therefore two pieces, both plain: the optax state (arrays, as any optax state) and
``transformation.state_dict()`` (arrays and numbers, ``numpy.savez``-able); a resume builds the
same transformation, calls ``init``, and loads both.

Where the step runs:

* **outside jit** (called on concrete arrays): ``grads = jit(grad_fn)(...)``, then ``tx.update``
  in Python, then a jitted apply. The reduction reads the gradients through host views;
* **inside jit** (called on tracers, e.g. ``tx.update`` inside a jitted train step): the host side
  runs as ``jax.experimental.io_callback(..., ordered=True)``: an effect that XLA neither drops,
  repeats nor reorders, which collectives need (DESIGN invariant 1: the same collectives in the
  same order on every rank). ``pure_callback`` would allow XLA to do all three. An error in the
  callback (a ``CollectiveError``) reaches the caller as JAX's runtime error, on every rank.

Both give the same bits (tested); the callback costs the copies XLA makes of the operands and
results (``benchmarks/scripts/jax_overhead.py`` measures both).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback

from ..comm import Communicator
from ..compressors.contract import Compressor
from ..optim import DGC_WARMUP
from .tree import OutputPool, TreeReducer, host_view


class CountState(NamedTuple):
    """The optax state of a gradcomp transformation: its step count (the rest is on the host)."""
    # int32 scalar: steps taken, checked against the host side's count. Named as optax's own
    # states name it (``optax.tree_utils.tree_get(state, "count")``), over tuple.count.
    count: jax.Array  # type: ignore[assignment]


def traced(leaves: Any) -> bool:
    """Whether any leaf is a tracer (we are inside jit, grad, vmap...)."""
    return any(isinstance(x, jax.core.Tracer) for x in leaves)


class Transformation(optax.GradientTransformationExtraArgs):
    """An optax ``GradientTransformation`` (``init``, ``update``) whose state is on the host.

    ``host`` is the object behind it (``Mean``, ``OptimizerTransform``); ``state_dict`` /
    ``load_state_dict`` checkpoint it, ``stats`` gives the compressor's traffic figures.
    """

    __slots__ = ()

    @property
    def host(self) -> Any:
        return self.update.__self__  # always a bound method of the host object

    def state_dict(self) -> dict[str, Any]:
        """The host state: plain arrays and numbers (``numpy.savez``-able, no pickling)."""
        return self.host.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output (after ``init``); checked before anything changes."""
        self.host.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        return self.host.stats()


class Mean:
    """The host side of ``mean``: a ``TreeReducer`` built by ``init``."""

    def __init__(self, compressor: Compressor | str, comm: Communicator | None, bucket_cap_mb: float):
        from ..registry import make

        self.compressor = make(compressor) if isinstance(compressor, str) else compressor
        if not isinstance(self.compressor, Compressor):
            raise TypeError(f"gradcomp.jax.mean: expected a gradcomp Compressor or a registry spec, "
                            f"got {type(compressor).__name__}")
        self.comm = comm
        self.bucket_cap_mb = bucket_cap_mb
        self.reducer: TreeReducer | None = None

    def init(self, params: Any) -> CountState:
        """Build the reducer for ``params``' structure (collective: every rank calls it)."""
        if self.reducer is not None and self.reducer.steps:
            raise ValueError(f"gradcomp.jax.mean: init called again after {self.reducer.steps} steps; the "
                             "compressor's state lives in this transformation: build a new one for a "
                             "new run, or load_state_dict() to resume")
        self.reducer = TreeReducer(params, self.compressor, self.comm, self.bucket_cap_mb)
        return CountState(jnp.zeros([], jnp.int32))

    def update(self, updates: Any, state: CountState, params: Any = None, **extra: Any) -> tuple[Any, CountState]:
        reducer = self._built()
        leaves, treedef = jax.tree_util.tree_flatten(updates)
        problem = reducer.problem(treedef, leaves)
        if not traced([*leaves, state.count]):
            return reducer.step(updates, int(state.count)), CountState(state.count + 1)

        def callback(count: np.ndarray, *hosts: np.ndarray) -> list[np.ndarray]:
            # XLA copies the returned arrays into its own buffers before the callback ends
            return reducer.reduce_host(hosts if not problem else [], problem, int(count))

        shapes = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in leaves]
        out = io_callback(callback, shapes, state.count, *leaves, ordered=True)
        return jax.tree_util.tree_unflatten(treedef, out), CountState(state.count + 1)

    def _built(self) -> TreeReducer:
        if self.reducer is None:
            raise RuntimeError("gradcomp.jax.mean: call init(params) before update (or load_state_dict)")
        return self.reducer

    def state_dict(self) -> dict[str, Any]:
        return self._built().state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._built().load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        return self.compressor.stats()


def mean(compressor: Compressor | str = "allreduce", comm: Communicator | None = None,
         bucket_cap_mb: float = 25.0) -> Transformation:
    """An optax transformation that replaces each rank's gradients by their mean over the ranks.

        tx = optax.chain(gradcomp.jax.mean("int8"), optax.adamw(1e-3))
        opt_state = tx.init(params)                       # collective: the structure is agreed
        updates, opt_state = tx.update(grads, opt_state)  # grads: this rank's; updates: the same everywhere

    ``compressor``: a ``gradcomp.Compressor`` or registry spec (``"int8"``, ``"powersgd:rank=4"``).
    Works outside jit (on concrete gradients) and inside it (an ordered host callback); the means
    have the bits of ``gradcomp.GradientReducer`` on the same gradients. Checkpoint with
    ``tx.state_dict()`` next to the optax state (the module docstring says why it is separate).
    """
    host = Mean(compressor, comm, bucket_cap_mb)
    return Transformation(host.init, host.update)


# ---------------------------------------------------------------------------------------------
# optimizers that communicate themselves (gradcomp.optim)
# ---------------------------------------------------------------------------------------------
Schedule = Callable[[Any], Any]


class OptimizerTransform:
    """The host side of ``onebit_adam`` / ``dgc``: a ``gradcomp.optim`` optimizer on host copies
    of the parameters, built by ``init``.

    ``update(grads, state, params)`` copies ``params`` into the optimizer's arrays (so the
    optimizer always steps from what the caller holds), steps it with this rank's local ``grads``,
    and returns ``new - params`` as the updates; ``optax.apply_updates`` adds them back. Every rank
    computes the same bits, so replicas stay identical; the sum can differ from the optimizer's
    own new parameters by one rounding per step.
    """

    def __init__(self, method: Any, name: str, learning_rate: float | Schedule, options: dict[str, Any],
                 comm: Communicator | None, bucket_cap_mb: float):
        self.method, self.name = method, name
        self.learning_rate = learning_rate
        self.options = options
        self.comm = comm
        self.bucket_cap_mb = bucket_cap_mb
        self.optimizer: Any = None
        self.treedef: Any = None
        self.avals: list[tuple[tuple, np.dtype]] = []

    def _rate(self, count: Any) -> Any:
        lr = self.learning_rate
        return lr(count) if callable(lr) else lr

    def init(self, params: Any) -> CountState:
        from ..comm import default_communicator
        from .tree import agree_structure, describe_leaves

        if self.optimizer is not None and self.optimizer.steps:
            raise ValueError(f"gradcomp.jax.{self.name}: init called again after {self.optimizer.steps} "
                             "steps; build a new transformation for a new run, or load_state_dict()")
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        if traced(leaves):
            raise TypeError(f"gradcomp.jax.{self.name}: call init outside jit (it copies the parameters "
                            "to the host optimizer)")
        comm = self.comm if self.comm is not None else default_communicator()
        agree_structure(comm, describe_leaves(self.treedef, leaves))
        # 0-d leaves (a scale, a temperature) travel as 1-element arrays: NumPy arithmetic on 0-d
        # arrays returns scalars, which in-place code (``out=``) cannot take
        host = [np.array(host_view(x), copy=True, order="C").reshape(np.shape(x) or (1,)) for x in leaves]
        self.avals = [(tuple(np.shape(x)), p.dtype) for x, p in zip(leaves, host)]
        _agree_values(comm, host, self.name)
        rate = self._rate(0)
        self.optimizer = self.method(host, lr=float(rate), comm=comm, bucket_cap_mb=self.bucket_cap_mb,
                                     **self.options)
        self.outputs = OutputPool(self.avals)
        return CountState(jnp.zeros([], jnp.int32))

    def update(self, updates: Any, state: CountState, params: Any = None, **extra: Any) -> tuple[Any, CountState]:
        if self.optimizer is None:
            raise RuntimeError(f"gradcomp.jax.{self.name}: call init(params) before update")
        if params is None:
            raise ValueError(f"gradcomp.jax.{self.name} needs the parameters: update(grads, state, params)")
        grads, treedef = jax.tree_util.tree_flatten(updates)
        values, params_def = jax.tree_util.tree_flatten(params)
        problem = self._problem(treedef, grads, params_def, values)
        # A constant rate stays a Python float (the NumPy optimizer's own arithmetic); a schedule
        # is evaluated on the count, in JAX, and travels as a float32 scalar.
        constant = not callable(self.learning_rate)
        rate = jnp.zeros([], jnp.float32) if constant else jnp.asarray(self._rate(state.count), jnp.float32)
        n = len(values)

        def lr_of(value: Any) -> float:
            return float(self.learning_rate) if constant else float(value)  # type: ignore[arg-type]

        if not traced([*grads, *values, state.count, rate]):
            delta = self.outputs.take()
            self._step(grads, values, problem, int(state.count), lr_of(rate), delta)
            out = jax.device_put(delta)
        else:
            scratch = [np.empty(shape, dtype) for shape, dtype in self.avals]

            def callback(count: np.ndarray, lr: np.ndarray, *arrays: np.ndarray) -> list[np.ndarray]:
                # XLA copies the returned arrays into its own buffers before the callback ends
                return self._step(list(arrays[:n]), list(arrays[n:]), problem, int(count), lr_of(lr), scratch)

            shapes = [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in self.avals]
            out = io_callback(callback, shapes, state.count, rate, *grads, *values, ordered=True)
        return jax.tree_util.tree_unflatten(self.treedef, out), CountState(state.count + 1)

    def _problem(self, treedef: Any, grads: list, params_def: Any, values: list) -> str:
        if treedef != self.treedef or params_def != self.treedef:
            return (f"the gradients' structure {treedef} / the parameters' {params_def} differ from the "
                    f"one init saw, {self.treedef}")
        for i, (g, x, (shape, dtype)) in enumerate(zip(grads, values, self.avals)):
            for what, a in (("gradient", g), ("parameter", x)):
                if tuple(np.shape(a)) != shape or np.dtype(a.dtype) != dtype:
                    return (f"{what} {i} is {np.dtype(a.dtype).name} {tuple(np.shape(a))}, init saw "
                            f"{dtype.name} {shape}")
        return ""

    def _step(self, grads: list, values: list, problem: str, count: int, rate: float,
              delta: list[np.ndarray]) -> list[np.ndarray]:
        """Step the host optimizer from ``values`` with ``grads``; ``new - values`` into ``delta``."""
        from .tree import agree_step

        opt = self.optimizer
        agree_step(opt.comm, problem, count, opt.steps)
        given = [host_view(x) for x in values]
        for p, x in zip(opt.params, given):
            np.copyto(p, x.reshape(p.shape), casting="no")
        local = [host_view(g).reshape(p.shape) for g, p in zip(grads, opt.params)]
        for g in local:
            g.flags.writeable = False  # JAX's arrays never change: the step copies them to average
        opt.step(local, lr=rate)
        for d, p, x in zip(delta, opt.params, given):
            np.subtract(p.reshape(d.shape), x, out=d)
        return delta

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state (``gradcomp.optim.Optimizer.state_dict``: step, moments, residuals)."""
        if self.optimizer is None:
            raise RuntimeError(f"gradcomp.jax.{self.name}: call init(params) first")
        return self.optimizer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"gradcomp.jax.{self.name}: call init(params) before load_state_dict")
        self.optimizer.load_state_dict(state)

    def stats(self) -> dict[str, Any]:
        return {} if self.optimizer is None else self.optimizer.stats()


def _agree_values(comm: Communicator, arrays: list[np.ndarray], name: str) -> None:
    """``CollectiveError`` on every rank unless every rank starts from the same parameter bits:
    these optimizers apply one averaged update to parameters they assume identical."""
    import hashlib

    from ..comm import CollectiveError

    h = hashlib.sha256()
    for a in arrays:
        h.update(a.reshape(-1).view(np.uint8).data)
    mine = np.frombuffer(h.digest()[:8], np.int64).copy()
    table = comm.allgather(mine)
    if (table != table[0]).any():
        groups = sorted({int(v) for v in table[:, 0]})
        who = "; ".join(f"rank {r}: digest {groups.index(int(table[r, 0]))}" for r in range(comm.size))
        raise CollectiveError(f"gradcomp.jax.{name}: the parameters differ across ranks at init ({who}); "
                              "initialise them from the same seed on every rank (or broadcast rank 0's)")


def onebit_adam(learning_rate: float | Schedule = 1e-3, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, warmup: int | str = "auto", compressor: Compressor | str | None = None,
                comm: Communicator | None = None, bucket_cap_mb: float = 25.0, **options: Any) -> Transformation:
    """``gradcomp.optim.OneBitAdam`` as an optax transformation: this rank's local gradients in,
    AdamW updates out (a warm-up until the gradients' scale settles, or for ``warmup`` steps, then
    frozen variance and compressed momentum).

        tx = gradcomp.jax.onebit_adam(3e-3, b2=0.95, weight_decay=0.1)
        updates, state = tx.update(local_grads, state, params)    # params are required

    Not chained after ``mean``: it averages what it sends itself. ``learning_rate``: a float or an
    optax schedule (a function of the step count). Other keyword arguments go to
    ``gradcomp.optim.OneBitAdam`` as they are."""
    host = OptimizerTransform(_core().OneBitAdam, "onebit_adam", learning_rate,
                              dict(betas=(b1, b2), eps=eps, weight_decay=weight_decay, warmup=warmup,
                                   compressor=compressor, **options), comm, bucket_cap_mb)
    return Transformation(host.init, host.update)


def dgc(learning_rate: float | Schedule = 0.01, momentum: float = 0.9, weight_decay: float = 0.0,
        ratio: float = 0.01, warmup: int | str = DGC_WARMUP, clip_norm: float | None = None,
        comm: Communicator | None = None, bucket_cap_mb: float = 25.0, **options: Any) -> Transformation:
    """``gradcomp.optim.DGC`` (Deep Gradient Compression) as an optax transformation: momentum SGD
    that sends the top ``ratio`` of each rank's accumulated velocity. Local gradients in, updates
    out; ``update(grads, state, params)``. Other keyword arguments go to ``gradcomp.optim.DGC``."""
    host = OptimizerTransform(_core().DGC, "dgc", learning_rate,
                              dict(momentum=momentum, weight_decay=weight_decay, ratio=ratio, warmup=warmup,
                                   clip_norm=clip_norm, **options), comm, bucket_cap_mb)
    return Transformation(host.init, host.update)


def _core() -> Any:
    from .. import optim

    return optim
