"""One base for compressors that reduce through another: what the contract declares comes from it.

A wrapper changes how a bucket reaches its ``inner`` method (``Cast`` on a half copy,
``ErrorFeedback`` with a residual, ``Hierarchical`` across hosts, the optimizers' agreed exchange,
a ``Schedule``'s or the governor's steady method); what the method declares is the inner method's
unless the wrapper says otherwise. ``Wrapper`` forwards every public member of the ``Compressor``
contract to ``inner`` except the machinery each compressor runs for itself (``OWN``), so a member
added to the contract reaches every wrapper at once. A wrapper that changes a member defines it
itself; ``tests/compressors/test_wrapper.py`` walks the contract and every wrapper.
"""
from __future__ import annotations

from typing import Any

from ..bucket import Bucket
from .contract import Compressor

#: the members of ``Compressor`` that every compressor answers for itself: the stages and the
#: machinery that runs them, its own configuration and traffic counters, whether the guard
#: watches it, and ``hierarchical_pays``, which the base reads from the forwarded ``traffic``
OWN = frozenset({"reduce", "checked_run", "staged", "prepare", "run", "finish", "config", "describe",
                 "stats", "watched", "hierarchical_pays"})


class _Forwarded:
    """A contract member read from the wrapper's ``inner``: an attribute, a property or a bound
    method alike (a method's arguments then go to the inner method's)."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, wrapper: Any, owner: type | None = None) -> Any:
        return self if wrapper is None else getattr(wrapper.inner, self.name)


class Wrapper(Compressor):
    """A compressor that reduces through ``inner`` and declares what ``inner`` declares (see the
    module docstring). Subclasses implement their stages (``run``, or ``prepare`` + ``finish``) and
    define the contract members they change; ``inner_stage`` says where the inner method's local
    stage is in the wrapper's."""

    inner: Compressor

    def __init__(self, inner: Compressor):
        super().__init__()
        if not isinstance(inner, Compressor):
            name = type(self).__name__
            raise TypeError(f"{name} wraps a gradcomp Compressor, e.g. {name}(gradcomp.Allreduce()); "
                            f"got {type(inner).__name__}")
        self.inner = inner

    def inner_stage(self, prepared: Any) -> Any:
        """The inner method's local-stage result within this wrapper's ``prepared`` (None: none)."""
        return prepared

    def agreement_state(self, bucket: Bucket, prepared: Any) -> dict[str, Any]:
        return self.inner.agreement_state(bucket, self.inner_stage(prepared))

    def regime(self, prepared: Any) -> tuple:
        return self.inner.regime(self.inner_stage(prepared))

    def after_runaway(self, prepared: Any) -> Any:
        return self.inner.after_runaway(self.inner_stage(prepared))


#: the contract members a wrapper takes from ``inner``: every public one of ``Compressor`` but ``OWN``
FORWARDED = tuple(name for name in vars(Compressor) if not name.startswith("_") and name not in OWN)
for _name in FORWARDED:
    if _name not in vars(Wrapper):
        setattr(Wrapper, _name, _Forwarded(_name))
del _name
