"""Per-tensor compressor state, and the checks every ``load_state_dict`` runs before it changes
anything.

Compressors keep their memory (error-feedback residuals, PowerSGD's warm-start factors) per
*tensor*, under the tensor's key (``Bucket.keys``), so that it follows a tensor through DDP's bucket
rebuild and into a resumed run whose first buckets are laid out differently. They compute on whole
buckets, though, so ``TensorStore`` keeps the values of each layout in one flat region: a layout seen
before gets its region back as it is (the steady state copies nothing); a tensor that moves to
another layout is copied over once.
"""
from __future__ import annotations

import math
import threading
from typing import Any, Iterable, Mapping, Protocol, Sequence

import numpy as np

from .arrays import FLOAT_DTYPES, Array, DTypeLike, array_module, dtype_name, to_host
from .bucket import Bucket

Placement = tuple[str, int, tuple[int, ...]]  # (tensor key, offset in the region, shape)

#: compressor state entries that are one rank's own error memory (``ErrorFeedback``'s worker and
#: slice-owner residuals, PowerSGD's): they hold what that rank's messages lost, so they belong to
#: it (``check_saved_here``) and are not sent to a healing replica (``gradcomp.torch.ft``)
OWN_ERROR = ("residual/", "owner/")


def own_error(key: str) -> bool:
    return any(part in key for part in OWN_ERROR)


class TensorStore:
    """Arrays per tensor key, stored in flat per-layout regions (see the module docstring).

    ``region(placements, total, dtype, like)`` returns ``(flat, missing)``: a flat array of length
    ``total`` holding every placed tensor's values at its offset, and the keys that had no value
    (their part is zero; the caller fills it, e.g. with a fresh random factor). From then on every
    placed key counts as present. ``drop`` forgets keys (a NaN step), ``pop`` hands their values
    over (``Schedule``), ``arrays``/``load`` are the checkpoint forms. Thread-safe for callers that
    work on disjoint keys (the pipeline guarantees that).
    """

    def __init__(self) -> None:
        self._regions: dict[tuple, Array] = {}
        self._layouts: dict[tuple, tuple] = {}  # each layout's one object (``region``)
        self._home: dict[str, tuple[tuple, int, tuple[int, ...]]] = {}
        self._loose: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:  # pickling and deepcopy: the values, as plain host arrays
        return {"values": self.arrays()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        TensorStore.__init__(self)
        self.load(state["values"])

    def __contains__(self, key: str) -> bool:
        return key in self._home or key in self._loose

    def __len__(self) -> int:
        return len(self._home) + len(self._loose)

    def region(self, placements: Sequence[Placement], total: int, dtype: DTypeLike,
               like: Array | None = None) -> tuple[Array, list[str]]:
        xp = array_module(like) if like is not None else np
        sig = (tuple(placements), int(total), np.dtype(dtype).str, str(getattr(like, "device", None)))
        with self._lock:
            # one object per layout: a home's layout then compares by identity, not element by
            # element (per key, that was quadratic in the tensors: minutes for 50,000 small ones)
            sig = self._layouts.setdefault(sig, sig)
            flat = self._regions.get(sig)
            if flat is not None and all(self._home.get(k) == (sig, o, s) for k, o, s in placements):
                return flat, []
            if flat is None:
                flat = self._regions[sig] = xp.zeros(int(total), dtype)
            missing = []
            for key, off, shape in placements:
                n = math.prod(shape)
                home = self._home.get(key)
                if home == (sig, off, shape):
                    continue
                target = flat[off:off + n]
                if home is not None and home[2] == shape:
                    source = self._regions[home[0]][home[1]:home[1] + n]
                    target[...] = source if array_module(source) is xp else xp.asarray(to_host(source))
                elif home is None and key in self._loose and self._loose[key].shape == tuple(shape):
                    target[...] = xp.asarray(self._loose.pop(key).reshape(-1))
                else:
                    self._loose.pop(key, None)
                    target[...] = 0
                    missing.append(key)
                self._home[key] = (sig, off, tuple(shape))
            self._collect()
            return flat, missing

    def _collect(self) -> None:
        used = {id(home[0]) for home in self._home.values()}  # by identity: a layout's hash is O(tensors)
        for sig in [s for s in self._layouts if id(s) not in used]:
            self._regions.pop(sig, None)
            del self._layouts[sig]

    def _value(self, key: str) -> Array | None:
        home = self._home.get(key)
        if home is None:
            return self._loose.get(key)
        sig, off, shape = home
        return self._regions[sig][off:off + math.prod(shape)].reshape(shape)

    def unclaimed(self) -> list[str]:
        """Keys loaded (``load``) that no region has placed since."""
        with self._lock:
            return sorted(self._loose)

    def view(self, key: str) -> Array | None:
        """``key``'s value, live (writes go through), shaped like its tensor; None if absent."""
        with self._lock:
            return self._value(key)

    def drop(self, keys: Iterable[str]) -> None:
        """Forget ``keys``: the next ``region`` reports them missing."""
        with self._lock:
            for key in keys:
                self._home.pop(key, None)
                self._loose.pop(key, None)
            self._collect()

    def pop(self, keys: Iterable[str]) -> dict[str, Array]:
        """Remove ``keys`` and return their values (copies), for the keys that had one."""
        out: dict[str, Array] = {}
        with self._lock:
            for key in keys:
                value = self._value(key)
                if value is not None:
                    out[key] = value.copy()
                self._home.pop(key, None)
                self._loose.pop(key, None)
            self._collect()
        return out

    def arrays(self) -> dict[str, np.ndarray]:
        """Every key's value as a host array (a copy), shaped like its tensor."""
        with self._lock:
            keys = list(self._home) + list(self._loose)
            return {k: np.array(to_host(self._value(k)), copy=True) for k in sorted(keys)}

    def load(self, values: Mapping[str, np.ndarray]) -> None:
        """Replace everything with ``values`` (already checked; placed on first use)."""
        with self._lock:
            self._regions.clear()
            self._layouts.clear()
            self._home.clear()
            self._loose = {k: np.array(v, copy=True) for k, v in values.items()}

    def clear(self) -> None:
        self.load({})


class Claimable(Protocol):
    """What holds loaded per-tensor state (a ``TensorStore``, the governor's rungs)."""

    def unclaimed(self) -> Iterable[str]:
        """Keys loaded and not placed since."""
        ...


class ClaimCheck:
    """Loaded state that no tensor claims is an error, never silently dropped.

    After ``load_state_dict``, or unpickling (``__setstate__``), every loaded tensor must be
    carried by a bucket of the first full step (placed or not: a vector PowerSGD does not
    compress keeps no residual): state saved under parameter names (``gradcomp.torch.register``)
    but reduced by a hook that keys tensors by bucket index (``comm_hook`` without the model), or
    saved from another model, would otherwise be ignored, and the resumed run would silently
    differ from the uninterrupted one. ``saw`` is
    called from the compressor's local stage with each bucket after its state was placed; at the
    step's last bucket it raises ``ValueError`` naming what no bucket claimed (the local stage's
    failure is then a ``CollectiveError`` on every rank).
    """

    def __init__(self) -> None:
        self.pending = False
        self.seen: list[str] = []

    def __getstate__(self) -> dict[str, Any]:
        return {"pending": True}  # (not empty: pickle skips __setstate__ for a false state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled (``torch.load(weights_only=False)`` of a compressor or a ``HookState``) or
        copied: its compressor's stores were unpickled too, their values all loaded and not yet
        placed (``TensorStore.__setstate__``), as after ``load_state_dict``; so the next step
        must claim them just the same."""
        self.pending, self.seen = True, []

    def loaded(self) -> None:
        self.pending, self.seen = True, []

    def saw(self, bucket: Bucket, stores: Sequence[Claimable], owner: str) -> None:
        """``bucket`` was placed. Behind a router (``bucket.step`` set: the governor's
        rungs, ``auto``) a tensor's state may wait for the tensor to come back to this method, so
        nothing is concluded there: the router checks the tensors it keeps state for (the
        governor's), and the DDP hook and ``GradientReducer`` check names against the model's
        when the state loads."""
        if not self.pending:
            return
        if bucket.step is not None:
            self.pending, self.seen = False, []
            return
        self.seen.extend(bucket.keys)
        if not bucket.is_last:
            return
        self.pending = False
        carried = set(self.seen)
        left = sorted({k for store in stores for k in store.unclaimed()} - carried)
        if left:
            shown = ", ".join(map(repr, left[:3])) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
            named = ", ".join(map(repr, self.seen[:3]))
            raise ValueError(
                f"{owner}: the loaded state holds tensors that no bucket of this step carries ({shown}; "
                f"this step's buckets name theirs {named}, ...). State saved through "
                "gradcomp.torch.register(model, ...) is keyed by parameter name: attach the compressor "
                "the same way (gradcomp.torch.register(model, compressor), then load; a pickled one: "
                "gradcomp.torch.register(model, restored), or register(model, None, state=restored) "
                "for a pickled HookState; a compressor pickled after register keeps its names and "
                "attaches through comm_hook() too), not as a state_dict loaded into a compressor that "
                "comm_hook() attached, whose tensors are keyed by bucket index; NumPy: the same arrays, "
                "in the same order, as when it was saved.")


# ---------------------------------------------------------------------------------------------
# checks for load_state_dict: every one raises ValueError naming the key and what was expected
# ---------------------------------------------------------------------------------------------
def take_config(state: dict, owner: str, expected: str, what: str) -> None:
    """Pop ``state["config"]`` and refuse a state saved by another configuration than
    ``expected`` (the owner's ``describe()``; ``what``: "compressor", "optimizer")."""
    if "config" not in state:
        raise ValueError(f"{owner} state: missing 'config' (expected the output of state_dict())")
    saved = str(np.asarray(state.pop("config")))
    if saved != expected:
        raise ValueError(f"{owner} state: 'config' was saved by {saved}, but this {what} is {expected}")


def take_int(state: dict, key: str, owner: str, minimum: int | None = 0) -> int:
    """``state.pop(key)`` as an int (a Python or NumPy integer, or a 0-d integer array)."""
    if key not in state:
        raise ValueError(f"{owner} state: missing {key!r}")
    value = state.pop(key)
    arr = np.asarray(value)
    if isinstance(value, bool) or arr.shape != () or arr.dtype.kind not in "iu":
        raise ValueError(f"{owner} state: {key!r} must be an integer, got {value!r}")
    number = int(arr)
    if minimum is not None and number < minimum:
        raise ValueError(f"{owner} state: {key!r} must be >= {minimum}, got {number}")
    return number


def check_array(value: Any, key: str, owner: str, shape: Sequence[int] | None = None,
                dtypes: Sequence[str] = FLOAT_DTYPES, ndim: int | None = None) -> np.ndarray:
    """``value`` as a host array of one of ``dtypes`` (and ``shape`` / ``ndim`` where given)."""
    if hasattr(value, "detach"):  # a torch tensor: gradcomp.torch converts, but be forgiving
        raise ValueError(f"{owner} state: {key!r} is a torch tensor; load it through "
                         "gradcomp.torch's HookState.load_state_dict")
    arr = np.asarray(to_host(value))
    if dtype_name(arr.dtype) not in dtypes:
        raise ValueError(f"{owner} state: {key!r} must have dtype {' or '.join(dtypes)}, got {arr.dtype}")
    if shape is not None and tuple(arr.shape) != tuple(shape):
        raise ValueError(f"{owner} state: {key!r} must have shape {tuple(shape)}, got {tuple(arr.shape)}")
    if ndim is not None and arr.ndim != ndim:
        raise ValueError(f"{owner} state: {key!r} must be {ndim}-D, got shape {tuple(arr.shape)}")
    return arr


def tensor_arrays(state: dict, prefix: str, owner: str, shapes: Mapping[str, tuple] | None = None,
                  dtypes: Sequence[str] = FLOAT_DTYPES) -> dict[str, np.ndarray]:
    """Pop every ``prefix + tensor key`` entry from ``state`` as checked arrays; with ``shapes``
    (the tensors the caller will reduce, by key), each must have its tensor's shape."""
    out: dict[str, np.ndarray] = {}
    for name in [k for k in state if k.startswith(prefix)]:
        key = name[len(prefix):]
        expect = None if shapes is None or key not in shapes else shapes[key]
        out[key] = check_array(state.pop(name), name, owner, expect, dtypes)
    return out


def shape_entries(store: TensorStore) -> dict[str, np.ndarray]:
    """``shape/<key>``: the shape of each stored tensor, so that a load can check the arrays even
    when the caller does not know the model's tensors."""
    return {f"shape/{k}": np.array(v.shape, dtype=np.int64) for k, v in store.arrays().items()}


def pop_shapes(state: dict, owner: str, known: Mapping[str, tuple] | None) -> dict[str, tuple]:
    """Pop the ``shape/<key>`` entries; combined with the caller's ``known`` shapes (which win,
    and must agree with what was saved). Returns the shapes to check arrays against."""
    recorded: dict[str, tuple] = {}
    for name in [k for k in state if k.startswith("shape/")]:
        value = check_array(state.pop(name), name, owner, dtypes=("int64", "int32"), ndim=1)
        if (value < 0).any():
            raise ValueError(f"{owner} state: {name!r} holds a negative extent")
        recorded[name[len("shape/"):]] = tuple(int(d) for d in value)
    for key, shape in (known or {}).items():
        if key in recorded and recorded[key] != tuple(shape):
            raise ValueError(f"{owner} state: tensor {key!r} was saved with shape {recorded[key]}, but "
                             f"this model's has shape {tuple(shape)}")
        recorded[key] = tuple(shape)
    return recorded


def saved_by(comm: Any) -> dict[str, np.int64]:
    """The entries that record which rank of how many saved a state (``check_saved_here``)."""
    return {"saved_by/rank": np.int64(comm.rank), "saved_by/size": np.int64(comm.size)}


def take_saved_by(state: dict) -> tuple[int | None, int | None]:
    """Pop ``saved_by``'s entries from ``state``: (rank, size), None where absent (older states)."""
    rank, size = (state.pop(key, None) for key in ("saved_by/rank", "saved_by/size"))
    return (None if rank is None else int(rank)), (None if size is None else int(size))


def check_saved_here(keys: Iterable[str], saved_rank: Any, saved_size: Any, rank: int, size: int,
                     owner: str, fix: str) -> None:
    """Refuse compressor state with a rank's own error memory (``own_error`` among ``keys``) that
    another rank, or a job of another size, saved: it holds what *that* rank's gradients lost, so
    loading it here would drop this rank's own and pay that rank's into the wrong gradients,
    silently. State without it (counters, agreed factors) fits every rank. ``None``: a checkpoint
    from before the rank was kept (accepted, as it always was). ``fix``: how to save per rank."""
    if (saved_rank is None and saved_size is None) or not any(own_error(k) for k in keys):
        return
    if (saved_rank, saved_size) != (rank, size):
        raise ValueError(f"{owner}: this compressor state was saved by rank {saved_rank} of {saved_size}, "
                         f"and this is rank {rank} of {size}: error-feedback residuals belong to the "
                         f"rank that made them, so each rank must load its own. {fix}")


def reject_leftovers(state: dict, owner: str) -> None:
    if state:
        raise ValueError(f"{owner} state: unexpected keys {sorted(state)[:8]}")
