"""Pytrees of JAX arrays through a ``GradientReducer``: host views in, means out as JAX arrays.

``TreeReducer`` is ``GradientReducer`` for a pytree. On the CPU a JAX array's memory is host
memory, and ``np.asarray(leaf)`` is a read-only view of it (no copy), so a step is: one copy of
every leaf into the reducer's flat buffers (the buckets), the compressor's reduction in those
buffers (scratch, as always), and one copy of every mean out into a new JAX array. That is exactly
what ``GradientReducer.step(my_arrays)`` costs on NumPy arrays; the reduction itself is the NumPy
reducer's, so the means have the same bits, on every rank.

Two things are particular to JAX:

* **a mean leaves the buffers as a copy of its own.** JAX arrays are immutable, and on the CPU
  ``jax.device_put`` of a NumPy array keeps that array as the JAX array's memory (even with
  ``may_alias=False``, jax 0.10, measured) wherever it is 64-byte aligned, and copies it later,
  asynchronously, where it is not. Handing it views of the reducer's buffers would let the next
  step change arrays the caller holds. So every mean is copied once (NumPy's copy, synchronous)
  into a 64-byte-aligned host array of an ``OutputPool``, which JAX then takes as its memory
  without a second copy, in one batched ``device_put``. The pool reuses an array once JAX has
  let go of it (the caller dropped the step's means): the steady state allocates nothing and
  touches no fresh pages;
* **the structure is agreed on, not just the shapes.** Two ranks whose trees hold the same shapes
  under other keys would average the wrong leaves together without any bucket looking different.
  The tree's structure is compared across ranks at construction (a ``CollectiveError`` on every
  rank naming both), and every step shares one flag: a rank whose tree no longer matches, or
  whose step counter (``count``) differs, raises the same ``CollectiveError`` on every rank before
  any data moves, and the communicator stays usable.
"""
from __future__ import annotations

import sys
from typing import Any, Sequence

import jax
import numpy as np

from ..arrays import dtype_name
from ..comm import CollectiveError, Communicator, default_communicator
from ..compressors.agreement import texts_if_different
from ..compressors.contract import Compressor
from ..reducer import GradientReducer
from ..registry import make


def host_view(leaf: Any) -> np.ndarray:
    """A host NumPy view of ``leaf`` (a JAX or NumPy array): no copy for a JAX array on the CPU
    (it waits for the value to be computed); a copy for one on an accelerator."""
    return np.asarray(leaf)


def aligned_empty(shape: tuple, dtype: np.dtype, align: int = 64) -> np.ndarray:
    """An uninitialised C-contiguous array whose data starts on an ``align``-byte boundary (where
    the CPU client of JAX takes host memory without copying it)."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def _dtype(leaf: Any) -> np.dtype:
    dtype = getattr(leaf, "dtype", None)
    return np.dtype(dtype) if dtype is not None else np.asarray(leaf).dtype


def _refs(array: np.ndarray) -> tuple[int, int]:
    return sys.getrefcount(array), sys.getrefcount(array.base)


class OutputPool:
    """Aligned host arrays (one set per step) that become the memory of new JAX arrays.

    A set is reused once nothing but the pool refers to any of its arrays or their memory: JAX
    holds a reference to the NumPy memory it aliases (or is still copying) and drops it, through
    its deferred reference release, after the JAX array is gone. Up to ``keep`` sets are kept (a
    caller holding the means of several steps); beyond that, sets are made and let go.
    """

    def __init__(self, avals: Sequence[tuple[tuple, np.dtype]], keep: int = 3):
        self.avals = list(avals)
        self.keep = keep
        self._sets: list[tuple[list[np.ndarray], list[tuple[int, int]]]] = []

    def take(self) -> list[np.ndarray]:
        for arrays, free in self._sets:
            if [_refs(a) for a in arrays] == free:
                return arrays
        arrays = [aligned_empty(shape, dtype) for shape, dtype in self.avals]
        if len(self._sets) < self.keep:
            self._sets.append((arrays, [_refs(a) for a in arrays]))
        return arrays

    def to_jax(self, hosts: Sequence[np.ndarray]) -> list[jax.Array]:
        """New JAX arrays holding ``hosts``' values as they are now (``hosts`` may change right
        after): one NumPy copy each, into a pool set that JAX then keeps as its memory."""
        out = self.take()
        for o, h in zip(out, hosts):
            np.copyto(o, h, casting="no")
        return jax.device_put(out)


def describe_leaves(treedef: Any, leaves: Sequence[Any]) -> list[str]:
    """The structure, then one ``dtype (shape)`` per leaf: what every rank must agree on."""
    out = [str(treedef)]
    for leaf in leaves:
        try:
            out.append(f"{dtype_name(np.dtype(leaf.dtype))} {tuple(leaf.shape)}")
        except (AttributeError, TypeError):
            out.append(type(leaf).__name__)
    return out


class TreeReducer:
    """Average a pytree of arrays over all ranks with ``compressor``; returns a tree of JAX arrays.

        reducer = gradcomp.jax.TreeReducer(params, "int8")      # collective: every rank builds it
        for step in range(steps):
            grads = grad_fn(params, batch)                      # jitted, this rank's gradients
            grads = reducer.step(grads)                         # the means, same tree, every rank
            ...

    ``tree`` gives the structure, shapes and dtypes (the parameters or a first gradient; only their
    shapes and dtypes are read). ``compressor``: a ``gradcomp.Compressor`` or a registry spec
    (``"int8"``, ``"powersgd:rank=4"``). Leaves are grouped into buckets of about
    ``bucket_cap_mb`` MiB by a ``GradientReducer``, which keeps the compressor's state per leaf
    (by position in the flattened tree), so ``state_dict``/``load_state_dict`` resume exactly.
    Every rank must pass the same structure, shapes and dtypes; if one does not, every rank
    raises ``CollectiveError``.
    """

    def __init__(self, tree: Any, compressor: Compressor | str = "allreduce", comm: Communicator | None = None,
                 bucket_cap_mb: float = 25.0):
        self.compressor = make(compressor) if isinstance(compressor, str) else compressor
        self.comm = comm if comm is not None else default_communicator()
        leaves, self.treedef = jax.tree_util.tree_flatten(tree)
        self.layout = describe_leaves(self.treedef, leaves)
        agree_structure(self.comm, self.layout)
        # Placeholders give the reducer shapes and dtypes (their pages are never touched); its
        # own buffers then hold the gradients: ``gradients`` are views into them.
        like = [np.empty(np.shape(leaf), _dtype(leaf)) for leaf in leaves]
        self.avals = [(a.shape, a.dtype) for a in like]
        self.reducer = GradientReducer(like, self.compressor, self.comm, bucket_cap_mb)
        self._views = self.reducer.gradients
        self.outputs = OutputPool(self.avals)
        self.steps = 0

    # -- one step ----------------------------------------------------------------------------------
    def step(self, tree: Any, count: int | None = None) -> Any:
        """The means over ranks of ``tree``'s leaves, as new JAX arrays in ``tree``'s structure.
        ``count``: the caller's step counter, if it keeps one (see ``reduce_host``)."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        problem = self.problem(treedef, leaves)
        means = self.reduce_host([host_view(x) for x in leaves] if not problem else [], problem, count)
        return jax.tree_util.tree_unflatten(self.treedef, self.outputs.to_jax(means))

    def reduce_host(self, leaves: Sequence[np.ndarray], problem: str = "", count: int | None = None
                    ) -> list[np.ndarray]:
        """Average host arrays (one per leaf, in order) in the reducer's buffers and return those
        buffers' views: valid until the next step. ``problem``: why this rank cannot take part
        (every rank then raises). ``count``: the caller's step counter, agreed on as well."""
        agree_step(self.comm, problem, self.steps if count is None else count, self.steps)
        for view, leaf in zip(self._views, leaves):
            np.copyto(view, leaf, casting="no")
        self.reducer.step()
        self.steps += 1
        return self._views

    def problem(self, treedef: Any, leaves: Sequence[Any]) -> str:
        """Why ``leaves`` (flattened with ``treedef``) cannot be reduced here, or ``""``."""
        if treedef != self.treedef:
            return f"the tree's structure is {treedef}, the reducer was built for {self.treedef}"
        for i, (leaf, (shape, dtype)) in enumerate(zip(leaves, self.avals)):
            got_shape, got_dtype = tuple(getattr(leaf, "shape", ())), getattr(leaf, "dtype", None)
            if got_shape != shape or got_dtype is None or np.dtype(got_dtype) != dtype:
                return (f"leaf {i} is {describe_leaves(treedef, [leaf])[1]}, the reducer was built for "
                        f"{dtype_name(dtype)} {shape}")
        return ""

    # -- checkpoints --------------------------------------------------------------------------------
    @property
    def shapes(self) -> dict[str, tuple]:
        return self.reducer.shapes

    def state_dict(self) -> dict[str, Any]:
        """The compressor's state (per leaf, by position) and the step count: ``numpy.savez``-able."""
        return {"step": self.steps, **{f"compressor/{k}": v for k, v in self.reducer.state_dict().items()}}

    def load_state_dict(self, state: Any) -> None:
        """Restore ``state_dict()``'s output, checked (shapes, dtypes, keys) before anything changes."""
        from ..state import take_int

        state = dict(state)
        step = take_int(state, "step", "TreeReducer")
        odd = [k for k in state if not k.startswith("compressor/")]
        if odd:
            raise ValueError(f"TreeReducer state: unexpected keys {odd[:3]} (expected 'step' and "
                             "'compressor/...', the output of state_dict())")
        self.reducer.load_state_dict({k[len("compressor/"):]: v for k, v in state.items()})
        self.steps = step


def agree_structure(comm: Communicator, layout: list[str]) -> None:
    """``CollectiveError`` on every rank unless every rank brings the same ``layout``
    (``describe_leaves``), naming the first difference and each rank's value."""
    texts = texts_if_different(comm, "\n".join(layout))
    if texts is None:
        return
    everyone = [t.split("\n") for t in texts]
    if len({e[0] for e in everyone}) > 1:
        what, seen = "the pytree structure", [e[0] for e in everyone]
    else:
        i = next(i for i in range(1, max(len(e) for e in everyone))
                 if len({e[i] if i < len(e) else "(none)" for e in everyone}) > 1)
        what, seen = f"leaf {i - 1}", [e[i] if i < len(e) else "(none)" for e in everyone]
    per_rank = "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen))
    raise CollectiveError(f"gradcomp.jax: {what} differs across ranks ({per_rank}); every rank must "
                          "pass the same tree structure, shapes and dtypes")


def agree_step(comm: Communicator, problem: str, count: int, steps: int) -> None:
    """One small allgather per step: every rank can reduce its tree and all are at the same step
    (the caller's ``count``, which must also equal this reducer's ``steps``); otherwise the same
    ``CollectiveError`` on every rank, before any data moves."""
    if not problem and count != steps:
        problem = (f"the transformation's state is at step {count} but its compressor at step {steps} "
                   "(restoring a checkpoint needs both: load_state_dict() with the saved state_dict())")
    table = comm.allgather(np.array([int(bool(problem)), count], np.int64))
    bad = [r for r in range(comm.size) if table[r, 0]]
    if bad:
        here = f" (here: {problem})" if problem else ""
        raise CollectiveError(f"gradcomp.jax: rank(s) {bad} cannot take part in this step{here}")
    if (table[:, 1] != table[0, 1]).any():
        counts = "; ".join(f"rank {r}: {int(table[r, 1])}" for r in range(comm.size))
        raise CollectiveError(f"gradcomp.jax: the step count differs across ranks ({counts})")
