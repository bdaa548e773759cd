"""Error feedback: what a compressor failed to send is kept and added to the next gradient.

``ErrorFeedback(codec)`` keeps, per tensor (``TensorStore``, keyed by ``Bucket.keys``), the
difference between the vector a rank encoded and the message's own reconstruction, and adds it
to the next step's gradient before encoding. Compression error is then delayed, not lost: the sum
of the outputs over many steps tracks the sum of the true means, with a lag bounded by one
residual (Seide et al. 2014; Karimireddy et al. 2019). Two-stage codecs get a second residual at
the slice owner, for the re-encoded mean (the "server" error of 1-bit Adam's compressed
allreduce); it is kept per bucket layout and slice, and ``owner_feedback=False`` turns it off.
With sign codes, keeping both residuals made momentum SGD diverge on the digits examples at
learning rates where either one alone trains well (BENCHMARKS.md, "Convergence"): measure.

The residuals are checkpointed (``state_dict``), survive DDP's bucket rebuild, and are handed to
the next stage by ``Schedule`` (``take_residual``). A slice owner's residual belongs to a bucket
layout, not to tensors: when the layout's tensors are reduced in another layout (DDP's rebuild
after its first step, which holds every parameter in one bucket) or by another method (a hand-over:
the governor's rungs, a ``Schedule``), it is dropped, one step's re-encoding error of the mean
(under a code step per value), so that memory stays at 4/n bytes per parameter and no stale
layout's residual lives on. A residual that turned NaN or Inf (a bad step) is reset to zero, so
one bad step does not poison the following ones.

``decay`` (below 1) scales the workers' residual before it is added: SparseLoCo's accumulator
(``e = decay * e + delta``, then ``e -= sent``), which local steps' sparse exchange uses as its outer
momentum (``gradcomp.optim.sparseloco``). Error that is never sent then fades instead of waiting.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from ..arrays import Array, DTypeLike, add_into, subtract_into, zero_non_finite
from ..bucket import Bucket, digest
from ..comm import Communicator, Workspace
from ..params import check_bool, check_float
from ..state import (ClaimCheck, TensorStore, pop_shapes, reject_leftovers, shape_entries, take_config,
                     tensor_arrays)
from .codec import Codec, Prepared
from .passes import Passes, Residuals
from .wrapper import Wrapper


class ErrorFeedback(Wrapper):
    """Wrap a codec with error feedback (see the module docstring)."""

    inner: Codec

    def __init__(self, inner: Codec, owner_feedback: bool = True, decay: float = 1.0):
        if not isinstance(inner, Codec):
            raise TypeError(f"ErrorFeedback wraps a gradcomp Codec (a single-collective method), got "
                            f"{type(inner).__name__}; PowerSGD has error feedback built in")
        super().__init__(inner)
        self.owner_feedback = check_bool("owner_feedback", owner_feedback)
        self.decay = check_float("decay", decay, above=0, maximum=1)
        self.store = TensorStore()
        self.owner_residuals = TensorStore()
        self._owner_tensors: dict[str, frozenset[str]] = {}  # owner key -> its layout's tensors
        self._claims = ClaimCheck()

    def config(self) -> dict[str, Any]:
        # decay only where set: the states saved before it existed still load
        return {"inner": self.inner, "owner_feedback": self.owner_feedback,
                **({"decay": self.decay} if self.decay != 1.0 else {})}

    @property
    def error_feedback_on(self) -> bool:
        return True  # the accumulated error is what is bounded (see the conformance kit)

    def error_bound(self, inputs: np.ndarray, dtype: DTypeLike) -> np.ndarray | None:
        """None: a step sends its residual too, so its error is not the codec's on ``inputs``."""
        return None

    def memory_passes(self, shapes: Sequence[Sequence[int]], ranks: int = 1, itemsize: int = 4) -> Passes | None:
        """The codec's passes with the residuals kept here: the worker's, and the owner's where
        ``owner_feedback``."""
        return self.inner.memory_passes(shapes, ranks, itemsize, Residuals(owner=self.owner_feedback))

    def prepare(self, bucket: Bucket, comm: Communicator, workspace: Workspace) -> Prepared:
        if self._owner_tensors and (key := self._owner_key(bucket, comm)) not in self._owner_tensors:
            self._drop_owners(bucket.keys, but=key)  # a new layout: its tensors' old ones are stale
        if self.decay != 1.0:
            self._decay(bucket.keys)
        prepared = self.inner.prepare(bucket, comm, workspace, feedback=self)
        if self._claims.pending and self.owner_feedback and prepared.layout is not None:
            self._check_loaded_owner(bucket, comm, prepared.layout.slice_len)
        self._claims.saw(bucket, [self.store], type(self).__name__)
        return prepared

    def _decay(self, keys: Iterable[str]) -> None:
        """The workers' residuals of ``keys`` scaled by ``decay``, before this step adds them."""
        for key in keys:
            if (residual := self.store.view(key)) is not None:
                residual *= residual.dtype.type(self.decay)

    def _check_loaded_owner(self, bucket: Bucket, comm: Communicator, slice_len: int) -> None:
        """A loaded owner residual for this bucket must be as long as this rank's slice of it: in
        the local stage, so a damaged one is a ``CollectiveError`` on every rank, not a residual
        silently restarted from zero."""
        key = self._owner_key(bucket, comm)
        loaded = self.owner_residuals.view(key)
        if loaded is not None and loaded.shape != (slice_len,):
            raise ValueError(f"{type(self).__name__} state: 'owner/{key}' holds {loaded.size} values, but "
                             f"this rank owns {slice_len} of this bucket (saved with another chunk, or "
                             "damaged)")

    def finish(self, bucket: Bucket, comm: Communicator, prepared: Prepared) -> Array:
        return self.inner.finish(bucket, comm, prepared, feedback=self)

    # -- the runner's Feedback interface (codec.Feedback) --------------------------------------------
    def residual(self, bucket: Bucket, dtype: DTypeLike, like: Array) -> Array:
        """The bucket's residual (one flat region of the per-tensor store, updated in place)."""
        return self.store.region(bucket.placements(), bucket.numel, dtype, like=like)[0]

    def add_residual(self, bucket: Bucket, x: Array) -> None:
        add_into(x, self.residual(bucket, x.dtype, x))

    def keep_residual(self, bucket: Bucket, x: Array, own: Array) -> None:
        self.keep(self.residual(bucket, x.dtype, x), x, own)

    @staticmethod
    def keep(flat: Array, x: Array, own: Array) -> None:
        """``flat = x - own``, what the message missed (a worker's or a slice owner's), settled."""
        flat[...] = x
        with np.errstate(invalid="ignore", over="ignore"):  # NaN or Inf: settled just below
            subtract_into(flat, own)
        zero_non_finite(flat)

    def _owner_key(self, bucket: Bucket, comm: Communicator) -> str:
        return f"owner:{digest(bucket.layout_text()):x}:{comm.rank}/{comm.size}"

    def owner_residual(self, bucket: Bucket, comm: Communicator, slice_len: int, dtype: DTypeLike,
                       like: Array) -> Array:
        """This rank's residual as the owner of its slice of ``bucket`` (updated in place)."""
        key = self._owner_key(bucket, comm)
        self._owner_tensors.setdefault(key, frozenset(bucket.keys))
        return self.owner_residuals.region([(key, 0, (slice_len,))], slice_len, dtype, like=like)[0]

    def drop_owner_residuals(self) -> None:
        """Forget the slice owners' residuals (a warm-up that has ended for good: its re-encoding
        error is the warm-up's, and no later step of this stage would send it)."""
        self.owner_residuals = TensorStore()
        self._owner_tensors.clear()

    def _drop_owners(self, keys: Iterable[str], but: str = "") -> None:
        """Forget the owner residuals of the layouts holding any of ``keys`` (but ``but``): those
        tensors are reduced in another layout or by another method now (see the module)."""
        mine = set(keys)
        stale = [k for k, tensors in self._owner_tensors.items() if k != but and not mine.isdisjoint(tensors)]
        if stale:
            self.owner_residuals.drop(stale)
            for k in stale:
                del self._owner_tensors[k]

    # -- Schedule hand-over and checkpoints ----------------------------------------------------------------
    def take_residual(self, keys: Iterable[str]) -> dict[str, Array]:
        keys = list(keys)
        self._drop_owners(keys)
        return self.store.pop(keys)

    def residuals(self, keys: Iterable[str]) -> dict[str, Array]:
        return {k: v for k in keys if (v := self.store.view(k)) is not None}

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.describe()}
        out.update({f"residual/{k}": v for k, v in self.store.arrays().items()})
        out.update(shape_entries(self.store))
        out.update({f"owner/{k}": v for k, v in self.owner_residuals.arrays().items()})
        out.update({f"inner/{k}": v for k, v in self.inner.state_dict().items()})
        return out

    def load_state_dict(self, state: Mapping[str, Any], shapes: Mapping[str, tuple] | None = None) -> None:
        state = dict(state)
        owner = type(self).__name__
        take_config(state, owner, self.describe(), "compressor")
        known = pop_shapes(state, owner, shapes)
        residuals = tensor_arrays(state, "residual/", owner, known)
        missing = sorted(k for k in residuals if k not in known)
        if missing:
            raise ValueError(f"{owner} state: no 'shape/{missing[0]}' for 'residual/{missing[0]}'")
        owners = tensor_arrays(state, "owner/", owner, None)
        for key, value in owners.items():
            if value.ndim != 1:
                raise ValueError(f"{owner} state: 'owner/{key}' must be 1-D, got shape {value.shape}")
        inner = {k[len("inner/"):]: state.pop(k) for k in [k for k in state if k.startswith("inner/")]}
        reject_leftovers(state, owner)
        if inner or self.inner.state_dict():
            self.inner.load_state_dict(inner, known)  # checks its part before anything changes
        self.store.load(residuals)
        self.owner_residuals.load(owners)
        self._owner_tensors = {}
        self._claims.loaded()
