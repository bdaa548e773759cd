"""The kit's checks for the optimizer-level methods (``gradcomp.optim``), run on every rank.

    python -m gradcomp.conformance --optimizer dgc onebitadam:warmup=5 diloco:sync_every=4,fragments=2,overlap=1

Target ``optimizer:NAME[:key=value,...]``, NAME one of ``OPTIMIZERS``. An optimizer takes each
rank's own gradients and updates the parameters in place, so its contract is about parameters.
Local steps (``diloco``) take the gradients through the kit's own inner step (plain SGD on the
replica) and meet only at their outer steps, so for them "every step" below reads "every outer
step, for the fragments it synced", and "a step ahead" reads "an outer step ahead" (a rank
resumed from the next checkpoint):

* ``replicas``: from equal parameters and different gradients on every rank, the parameters stay
  bit-identical on every rank after every step, and they move towards the minimum of the mean of
  the ranks' quadratics (an optimizer that does nothing, or only follows its own rank, fails);
* ``checkpoint``: ``state_dict()`` is plain (``numpy.savez`` without pickling), a fresh optimizer
  given this rank's parameters and loaded with it continues bit for bit (for local steps: taken
  between outer steps, with an exchange in flight where ``overlap`` allows), and empty, truncated
  or unknown state is refused with ``ValueError`` without changing anything;
* ``mismatches``: another configuration, another learning rate or a step ahead on one rank is a
  ``CollectiveError`` on every rank before any data moves, and the communicator stays usable.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

import gradcomp as gc

from .signals import digest, savez_round_trip

OPTIMIZERS: dict[str, Callable[..., Any]] = {"dgc": gc.optim.DGC, "onebitadam": gc.optim.OneBitAdam,
                                              "diloco": gc.optim.DiLoCo}
SHAPES = [(40, 30), (30,), (1,), (600,)]
STEPS = 12  # past the optimizer's warm-up
INNER_LR = 0.05  # local steps: the kit's own inner SGD step on each replica


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
        if _local(opt):  # several outer steps, an exchange in flight at the checkpoint's save
            return 3 * opt.sync_every + opt.overlap
        return _warmup(opt) + STEPS

    def lr(self, opt) -> float | None:
        """A step size that converges on these quadratics, whose coordinates all matter alike:
        a sparse method delays most of them by about ``1 / ratio`` steps (Stich et al. 2018).
        Local steps: None, the outer step's own rate."""
        if _local(opt):
            return None
        if isinstance(opt, gc.optim.DGC):
            return 0.3 * opt.ratio
        if getattr(opt, "local_momentum", False):  # a sparse code's delays, in Adam's units
            return 0.015
        return 0.05

    def step(self, opt, params, step: int, lr: float | None = None) -> None:
        """One training step of ``opt`` on this rank's gradients; local steps take an inner SGD
        step on the replica first, then count it (and sync when due)."""
        grads = self.grads(params, self.rank, step)
        lr = self.lr(opt) if lr is None else lr
        if _local(opt):
            for p, g in zip(params, grads):
                p -= np.float32(INNER_LR) * g
            opt.step(lr=lr)
        else:
            opt.step(grads, lr=lr)

    def agreed(self, opt, params) -> list[np.ndarray]:
        """The parameters every rank must hold the same bits of after a step: all of them, or for
        local steps those of the fragments whose outer step just landed (their synced copies
        where landing keeps the replicas' local steps)."""
        if _local(opt):
            source = opt.synced if opt.keep_local else params
            return [source[i] for f in opt.landed for i in opt.groups[f]]
        return params

    def same_everywhere(self, arrays) -> bool:
        return len(set(self.everyone(digest(np.concatenate([a.reshape(-1) for a in arrays]))))) == 1

    def other_configuration(self, opt) -> dict[str, Any]:
        """Keys that build another configuration of ``opt`` (local steps: one that syncs on the
        same steps, so that the ranks meet and compare)."""
        if _local(opt):
            return {"momentum": 0.25 if opt.momentum != 0.25 else 0.5}
        return {"warmup": opt.warmup + 1 if isinstance(opt.warmup, int) else 7}

    def put_ahead(self, opt) -> None:
        if _local(opt):
            opt.steps += opt.sync_every
            opt.outer_steps += 1
        else:
            opt.steps += 1


def _local(opt) -> bool:
    return isinstance(opt, gc.optim.DiLoCo)


def _warmup(opt) -> int:
    """The most steps ``opt``'s warm-up can last: ``warmup="auto"`` ends by its settling's latest."""
    if opt.warmup == "auto":
        return opt.settling.latest if opt.settling is not None else 0
    return int(opt.warmup)


def check_replicas(kit: OptimizerKit) -> None:
    params = kit.start()
    opt = kit.build(params, kit.comm)
    target = [np.mean([kit.targets(r)[i] for r in range(kit.size)], axis=0) for i in range(len(SHAPES))]
    distance = lambda: float(np.sqrt(sum(((p - t) ** 2).sum() for p, t in zip(params, target))))
    before = distance()
    synced = 0
    for step in range(max(kit.steps(opt) * 4, 200)):
        kit.step(opt, params, step)
        agreed = kit.agreed(opt, params)
        if agreed:  # (the same on every rank: when an outer step lands is agreed)
            synced += 1
            assert kit.same_everywhere(agreed), f"step {step}: ranks hold different parameters"
        assert all(np.isfinite(p).all() for p in params), f"step {step}: non-finite parameters"
    assert synced, "no step left the ranks with the same parameters"
    if _local(opt):
        opt.sync_now()
        assert kit.same_everywhere(params), "after sync_now(): ranks hold different parameters"
    after = distance()
    assert after < 0.5 * before, (f"the parameters did not approach the minimum of the mean objective "
                                  f"({before:.3g} -> {after:.3g})")


def check_checkpoint(kit: OptimizerKit) -> None:
    straight_params, first_params = kit.start(), kit.start()
    straight, first = kit.build(straight_params, kit.comm), kit.build(first_params, kit.comm)
    total = kit.steps(straight) + 4
    stop = total - 5
    for step in range(stop):
        kit.step(straight, straight_params, step)
        kit.step(first, first_params, step)
    saved = savez_round_trip(first.state_dict())
    resumed_params = kit.start()  # built from the common start (local steps check it), then
    resumed = kit.build(resumed_params, kit.comm)  # given this rank's parameters as they were saved
    for p, q in zip(resumed_params, first_params):
        p[...] = q
    resumed.load_state_dict(saved)
    for step in range(stop, total):
        kit.step(straight, straight_params, step)
        kit.step(resumed, resumed_params, step)
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
    cases = [("another configuration", kit.other_configuration(opt) if last else {}, None, "compressor differs"),
             ("another learning rate", {}, 0.123 if last else None, "state differs"),
             ("a step ahead", {}, None, "state differs")]
    for what, overrides, lr, words in cases:
        params = kit.start()
        odd = kit.build(params, kit.comm, **overrides)
        if what == "a step ahead" and last:
            kit.put_ahead(odd)
        try:
            # local steps meet at their first sync; the others at once
            for step in range(odd.sync_every + odd.overlap if _local(odd) else 1):
                kit.step(odd, params, step, lr=lr)
        except gc.CollectiveError as exc:
            assert words in str(exc), f"{what}: CollectiveError without {words!r}: {exc}"
        else:
            raise AssertionError(f"{what} on one rank: no CollectiveError")
    params = kit.start()
    fresh = kit.build(params, kit.comm)
    kit.step(fresh, params, 0)
    if _local(fresh):
        fresh.sync_now()
    assert kit.same_everywhere(params), "after the mismatches: ranks hold different parameters"


CHECKS = {"replicas": check_replicas, "checkpoint": check_checkpoint, "mismatches": check_mismatches}
