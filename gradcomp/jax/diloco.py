"""Local steps for JAX: ``gradcomp.optim.DiLoCo`` on host copies of a parameter pytree.

    outer = gradcomp.jax.DiLoCo(params, sync_every=20, compressor="int8")   # collective
    for batch in data:
        params, opt_state = train_step(params, opt_state, batch)   # any jitted inner step (optax...)
        params = outer.step(params)         # every 20th call: the synced parameters, else params

Not an optax transformation, on purpose: between outer steps every rank holds other parameters,
and an optax transformation can only return ``updates`` that ``optax.apply_updates`` adds to each
rank's own parameters; ``(synced - mine) + mine`` is not always ``synced`` in floating point, so
the replicas would leave the outer step one rounding apart. ``step`` returns the synced
parameters themselves: the same bits on every rank.

Between outer steps ``step`` only counts (no copy, no communication, nothing traced: call it
outside jit); at an outer step the leaves are copied to the host (a view on the CPU), the outer
step runs there (``gradcomp.optim.DiLoCo``: compressed pseudo-gradients, error feedback across
outer steps, the outer optimizer) and the synced leaves come back as new JAX arrays. The pytree's
structure is agreed across ranks at construction, and every outer step checks it again.
``state_dict()``/``load_state_dict()`` checkpoint the outer state (the inner optimizer's state is
the caller's, e.g. optax's).
"""
from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from ..comm import Communicator, default_communicator
from ..compressors.contract import Compressor
from ..optim import diloco as core
from .transform import _agree_values, traced
from .tree import agree_structure, describe_leaves, host_view


class DiLoCo:
    """``gradcomp.optim.DiLoCo`` for a pytree of JAX arrays (see the module docstring).

    ``params``: the starting parameters, the same bits on every rank (checked). The other
    arguments are ``gradcomp.optim.DiLoCo``'s: ``sync_every``, ``compressor`` (a compressor or
    registry name, or ``"sparseloco"``), the outer optimizer's ``lr``/``momentum``/``nesterov`` (their
    defaults are the exchange's), ``fragments``, ``overlap``, ``keep_local``,
    ``budget`` (the exchange's governor).
    """

    def __init__(self, params: Any, sync_every: int = core.SYNC_EVERY, compressor: Compressor | str = "int8",
                 lr: float | None = None, momentum: float | None = None, nesterov: bool = True,
                 fragments: int = 1, comm: Communicator | None = None, bucket_cap_mb: float = 25.0,
                 overlap: int = 0, budget: float | None = core.GOVERNOR_BUDGET, keep_local: bool = False):
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        if traced(leaves):
            raise TypeError("gradcomp.jax.DiLoCo: build it outside jit (it copies the parameters to the host)")
        self.comm = comm if comm is not None else default_communicator()
        self.layout = describe_leaves(self.treedef, leaves)
        agree_structure(self.comm, self.layout)
        # 0-d leaves travel as 1-element arrays (in-place NumPy arithmetic needs arrays)
        self.host = [np.array(host_view(x), copy=True, order="C").reshape(np.shape(x) or (1,)) for x in leaves]
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        _agree_values(self.comm, self.host, "DiLoCo")
        self.outer = core.DiLoCo(self.host, sync_every=sync_every, compressor=compressor, lr=lr,
                                 momentum=momentum, nesterov=nesterov, fragments=fragments, overlap=overlap, comm=self.comm,
                                 bucket_cap_mb=bucket_cap_mb, budget=budget, keep_local=keep_local)

    @property
    def steps(self) -> int:
        return self.outer.steps

    @property
    def landed(self) -> list[int]:
        """The fragments whose outer step landed at the last step (their parameters are the same
        bits on every rank); empty between outer steps."""
        return self.outer.landed

    def step(self, params: Any) -> Any:
        """Count one inner step; at an outer step return the synced parameters (new JAX arrays,
        the same bits on every rank), else ``params`` itself. Collective at outer steps."""
        if not self.outer.acts():
            self.outer.step()
            return params
        return self._sync(params, self.outer.step)

    def sync_now(self, params: Any) -> Any:
        """An outer step of every fragment now, off schedule (every rank at the same point)."""
        return self._sync(params, self.outer.sync_now)

    def _sync(self, params: Any, run: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(params)
        if traced(leaves):
            raise TypeError("gradcomp.jax.DiLoCo.step: call it outside jit, on the parameters a jitted "
                            "step returned")
        layout = describe_leaves(treedef, leaves)
        agree_structure(self.comm, layout)  # the tree, every rank, before any data moves
        if layout != self.layout:
            raise ValueError("gradcomp.jax.DiLoCo.step: the parameters' structure or shapes differ from "
                             "the ones it was built with")
        for h, x in zip(self.host, leaves):
            np.copyto(h, host_view(x).reshape(h.shape), casting="no")
        run()
        out = [jax.device_put(h.reshape(s).copy()) for h, s in zip(self.host, self.shapes)]
        return jax.tree_util.tree_unflatten(self.treedef, out)

    def stats(self) -> dict[str, Any]:
        return self.outer.stats()

    def metrics(self) -> dict[str, float]:
        """``gradcomp.metrics`` of ``stats()`` with the ``recent_*`` figures since the previous call,
        for a logger (``gradcomp.Meter``; its ``events``: the back-off lines)."""
        from ..metrics import Meter

        return self.__dict__.setdefault("_meter", Meter()).update(self.stats())

    def state_dict(self) -> dict[str, Any]:
        """The outer state (``gradcomp.optim.DiLoCo.state_dict``): plain arrays and numbers."""
        return self.outer.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.outer.load_state_dict(state)
