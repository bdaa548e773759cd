"""The kit's checks for the optimizer-level methods (``gradcomp.optim``), run on every rank.

    python -m gradcomp.conformance --optimizer dgc onebitadam:warmup=5

Target ``optimizer:NAME[:key=value,...]``, NAME one of ``OPTIMIZERS``. An optimizer takes each
rank's own gradients and updates the parameters in place, so its contract is about parameters:

* ``replicas``: from equal parameters and different gradients on every rank, the parameters stay
  bit-identical on every rank after every step, and they move towards the minimum of the mean of
  the ranks' quadratics (an optimizer that does nothing, or only follows its own rank, fails);
* ``checkpoint``: ``state_dict()`` is plain (``numpy.savez`` without pickling), a fresh optimizer
  loaded with it continues bit for bit, and empty, truncated or unknown state is refused with
  ``ValueError`` without changing anything;
* ``mismatches``: another configuration, another learning rate or a step ahead on one rank is a
  ``CollectiveError`` on every rank before any data moves, and the communicator stays usable.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

import gradcomp as gc

from .signals import digest, savez_round_trip

OPTIMIZERS: dict[str, Callable[..., Any]] = {"dgc": gc.optim.DGC, "onebitadam": gc.optim.OneBitAdam}
SHAPES = [(40, 30), (30,), (1,), (600,)]
STEPS = 12  # past the optimizer's warm-up


def optimizer_factory(spec: str) -> Callable[..., Any]:
    """``NAME[:key=value,...]`` -> ``build(params, comm, **overrides)``."""
    from ..registry import parse_spec

    name, options = parse_spec(spec)
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {name!r}; known: {', '.join(OPTIMIZERS)}")

    def build(params, comm, **overrides):
        return OPTIMIZERS[name](params, comm=comm, bucket_cap_mb=0.001, **{**options, **overrides})
    return build


class OptimizerKit:
    def __init__(self, build, comm):
        self.build, self.comm = build, comm
        self.rank, self.size = comm.rank, comm.size

    def everyone(self, value):
        return self.comm.comm.allgather(value)  # the kit's own bookkeeping, not the library's

    def start(self) -> list[np.ndarray]:
        rng = np.random.default_rng(1)  # the same on every rank
        return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]

    def targets(self, rank: int) -> list[np.ndarray]:
        rng = np.random.default_rng([2, rank])
        return [(rng.standard_t(4, s) * 0.5).astype(np.float32) for s in SHAPES]

    def grads(self, params, rank: int, step: int) -> list[np.ndarray]:
        """The gradient of this rank's quadratic ``|p - target_rank|^2 / 2``, plus noise."""
        noise = np.random.default_rng([3, rank, step])
        return [(p - t + 0.1 * noise.standard_normal(p.shape)).astype(np.float32)
                for p, t in zip(params, self.targets(rank))]

    def steps(self, opt) -> int:
        return opt.warmup + STEPS if hasattr(opt, "warmup") else STEPS

    def lr(self, opt) -> float:
        """A step size that converges on these quadratics, whose coordinates all matter alike:
        a sparse method delays most of them by about ``1 / ratio`` steps (Stich et al. 2018)."""
        if isinstance(opt, gc.optim.DGC):
            return 0.3 * opt.ratio
        if getattr(opt, "local_momentum", False):  # a sparse code's delays, in Adam's units
            return 0.015
        return 0.05


def check_replicas(kit: OptimizerKit) -> None:
    params = kit.start()
    opt = kit.build(params, kit.comm)
    target = [np.mean([kit.targets(r)[i] for r in range(kit.size)], axis=0) for i in range(len(SHAPES))]
    distance = lambda: float(np.sqrt(sum(((p - t) ** 2).sum() for p, t in zip(params, target))))
    before = distance()
    for step in range(max(kit.steps(opt) * 4, 200)):
        opt.step(kit.grads(params, kit.rank, step), lr=kit.lr(opt))
        digests = kit.everyone(digest(np.concatenate([p.reshape(-1) for p in params])))
        assert len(set(digests)) == 1, f"step {step}: ranks hold different parameters"
        assert all(np.isfinite(p).all() for p in params), f"step {step}: non-finite parameters"
    after = distance()
    assert after < 0.5 * before, (f"the parameters did not approach the minimum of the mean objective "
                                  f"({before:.3g} -> {after:.3g})")


def check_checkpoint(kit: OptimizerKit) -> None:
    straight_params, first_params = kit.start(), kit.start()
    straight, first = kit.build(straight_params, kit.comm), kit.build(first_params, kit.comm)
    total = kit.steps(straight) + 4
    stop = total - 5
    for step in range(stop):
        straight.step(kit.grads(straight_params, kit.rank, step), lr=kit.lr(straight))
        first.step(kit.grads(first_params, kit.rank, step), lr=kit.lr(first))
    saved = savez_round_trip(first.state_dict())
    resumed_params = [p.copy() for p in first_params]
    resumed = kit.build(resumed_params, kit.comm)
    resumed.load_state_dict(saved)
    for step in range(stop, total):
        straight.step(kit.grads(straight_params, kit.rank, step), lr=kit.lr(straight))
        resumed.step(kit.grads(resumed_params, kit.rank, step), lr=kit.lr(resumed))
        for i, (a, b) in enumerate(zip(straight_params, resumed_params)):
            assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), f"resumed run differs at step {step}, parameter {i}"
    before = savez_round_trip(resumed.state_dict())
    array_key = next(k for k, v in saved.items() if isinstance(v, np.ndarray) and v.size > 1)
    damaged = [("an empty state", {}),
               (f"{array_key!r} truncated", dict(saved, **{array_key: saved[array_key].reshape(-1)[:-1]})),
               ("an unknown key", dict(saved, **{"no-such-key": np.zeros(3)}))]
    for what, state in damaged:
        try:
            resumed.load_state_dict(state)
        except ValueError:
            pass
        else:
            raise AssertionError(f"load_state_dict accepted {what}")
        after = savez_round_trip(resumed.state_dict())
        assert sorted(after) == sorted(before) and all(
            np.array_equal(np.asarray(after[k]), np.asarray(before[k])) for k in before), \
            f"a refused load ({what}) changed the state"


def check_mismatches(kit: OptimizerKit) -> None:
    if kit.size == 1:
        return
    last = kit.rank == kit.size - 1
    opt = kit.build(kit.start(), kit.comm)
    cases = [("another configuration", dict(warmup=opt.warmup + 1) if last else {}, None, "compressor differs"),
             ("another learning rate", {}, 0.123 if last else None, "state differs"),
             ("a step ahead", {}, None, "state differs")]
    for what, overrides, lr, words in cases:
        params = kit.start()
        odd = kit.build(params, kit.comm, **overrides)
        if what == "a step ahead" and last:
            odd.steps += 1
        try:
            odd.step(kit.grads(params, kit.rank, 0), lr=lr if lr is not None else kit.lr(odd))
        except gc.CollectiveError as exc:
            assert words in str(exc), f"{what}: CollectiveError without {words!r}: {exc}"
        else:
            raise AssertionError(f"{what} on one rank: no CollectiveError")
    params = kit.start()
    fresh = kit.build(params, kit.comm)
    fresh.step(kit.grads(params, kit.rank, 0), lr=kit.lr(fresh))
    digests = kit.everyone(digest(np.concatenate([p.reshape(-1) for p in params])))
    assert len(set(digests)) == 1, "after the mismatches: ranks hold different parameters"


CHECKS = {"replicas": check_replicas, "checkpoint": check_checkpoint, "mismatches": check_mismatches}
