"""The conformance checks of compressors (``CHECKS``), each collective: every check ends with
every rank agreeing. ``job`` runs them on every rank of one ``mpiexec`` job.
"""
from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np

import gradcomp as gc

from .signals import LAYOUT, LENGTHS, digest, numel, relative_error, savez_round_trip, structured, tensor_of

STEPS = 14          # steps of each check past the compressor's warm-up (``warmup_steps``)
LONG = 300          # steps of the accumulated-error check past the warm-up (random-k at 1% needs a few hundred)
NAN_AT = 700        # a position in the second 512-value chunk, inside LAYOUT's last matrix


class Kit:
    """What every check needs: the factory, the communicator, and collective helpers."""

    def __init__(self, build, comm):
        self.build, self.comm = build, comm
        self.rank, self.size = comm.rank, comm.size

    def everyone(self, value):
        return self.comm.comm.allgather(value)  # the kit's own bookkeeping, not the library's

    def same_everywhere(self, out, where: str) -> None:
        digests = self.everyone(digest(out))
        assert len(set(digests)) == 1, f"{where}: ranks hold different results"

    def inputs(self, local) -> np.ndarray:
        """Every rank's input, as a (ranks, n) float64 array."""
        return np.stack(self.everyone(np.asarray(local).astype(np.float64)))

    def reduce(self, comp, g, index=0, layout=None, last=True, scratch=False):
        given = g.copy()
        bucket = gc.Bucket(g, index, layout, last, scratch=scratch)
        out = comp.reduce(bucket, self.comm).result()
        assert out.dtype == g.dtype, f"output dtype {out.dtype} != input dtype {g.dtype}"
        assert out.shape == g.shape, f"output shape {out.shape} != input shape {g.shape}"
        if not scratch:
            assert np.array_equal(g.view(np.uint8), given.view(np.uint8)), "the input buffer was modified"
        return out

    def check_bound(self, comp, local, out, dtype, where):
        self.same_everywhere(out, where)
        inputs = self.inputs(local)
        limit = comp.error_bound(inputs, dtype)
        if limit is None or not out.size:
            return
        err = np.abs(out.astype(np.float64) - inputs.mean(axis=0))
        worst = int(np.argmax(err - limit))
        assert (err <= limit).all(), (f"{where}: error {err[worst]:.3g} exceeds the declared bound "
                                      f"{limit[worst]:.3g} at position {worst}")


# ---------------------------------------------------------------------------------------------
# the checks
# ---------------------------------------------------------------------------------------------
def check_shapes(kit: Kit) -> None:
    """Lengths 0, 1, 511-513 and a prime next to a bucket with a layout, two buckets a step, past
    any warm-up: output length and dtype, input untouched, bit-identical replicas, the declared
    per-step bound; a scratch bucket gives the same bits."""
    rng = np.random.default_rng(100 + kit.rank)
    for length in LENGTHS:
        comp, twin = kit.build(), kit.build()
        steps = comp.warmup_steps + STEPS
        for step in range(steps):
            a = rng.standard_normal(numel(LAYOUT)).astype(np.float32)
            b = rng.standard_t(4, length).astype(np.float32)
            out_a = kit.reduce(comp, a, 0, LAYOUT, last=False)
            out_b = kit.reduce(comp, b, 1, last=True)
            scratch_a = kit.reduce(twin, a.copy(), 0, LAYOUT, last=False, scratch=True)
            scratch_b = kit.reduce(twin, b.copy(), 1, last=True, scratch=True)
            assert np.array_equal(out_a.view(np.uint8), scratch_a.view(np.uint8)), "scratch bucket differs"
            assert np.array_equal(out_b.view(np.uint8), scratch_b.view(np.uint8)), "scratch bucket differs"
            kit.check_bound(comp, a, out_a, np.float32, f"layout bucket, step {step}")
            kit.check_bound(comp, b, out_b, np.float32, f"length {length}, step {step}")
        stats = comp.stats()
        assert stats["calls"] == 2 * steps and stats["steps"] == steps, f"stats count {stats}"
        if kit.size > 1 and length > 0:
            assert stats["bytes_sent"] > 0, "no bytes counted"


def check_dtypes(kit: Kit) -> None:
    """float16, bfloat16, float32 and float64 buckets keep their dtype and the declared bound."""
    rng = np.random.default_rng(7 + kit.rank)
    for dtype in (np.float16, ml_dtypes.bfloat16, np.float32, np.float64):
        comp = kit.build()
        for step in range(comp.warmup_steps + STEPS):
            x = (rng.standard_normal(777) * 0.1).astype(dtype)
            out = kit.reduce(comp, x, 0, [(37, 21)])
            kit.check_bound(comp, x, out, dtype, f"{np.dtype(dtype).name} step {step}")


def check_accuracy(kit: Kit) -> None:
    """On a structured signal (low-rank heavy-tailed tensors plus per-rank noise): methods with error
    feedback keep the error accumulated over many steps small and shrinking; others stay within
    their declared relative error. A compressor that returns zeros or a constant fails here."""
    comp = kit.build()
    warm = comp.warmup_steps
    shared = np.random.default_rng(11)
    own = np.random.default_rng([12, kit.rank])
    sum_out = np.zeros(numel(LAYOUT))
    sum_mean = np.zeros(numel(LAYOUT))
    lags, errors = {}, []
    signal = structured(LAYOUT, shared, own)
    for step in range(warm + LONG):
        x = (signal + 0.3 * np.abs(signal).mean() * own.standard_normal(signal.size)).astype(np.float32)
        out = kit.reduce(comp, x, 0, LAYOUT)
        kit.same_everywhere(out, f"step {step}")
        if step < warm:
            continue  # the warm-up's error is the warm-up method's; what follows is measured
        mean = kit.inputs(x).mean(axis=0)
        errors.append(relative_error(out, mean))
        sum_out += out
        sum_mean += mean
        if step + 1 - warm in (LONG // 2, LONG):
            lags[step + 1 - warm] = relative_error(sum_out, sum_mean)
    _judge(comp, errors, lags, LONG, 0.8, "")
    if kit.rank == 0:
        print(f"  accuracy: last-step relative error {errors[-1]:.3g}, accumulated {lags[LONG]:.3g}",
              flush=True)


def _judge(comp, errors: list[float], lags: dict[int, float], steps: int, shrink: float, what: str) -> None:
    """The accuracy promise: with error feedback, the error of the outputs summed over ``steps``
    is under half of the summed means and has shrunk (to ``shrink`` of its value halfway, or under
    2%); without, every step after the first ``STEPS`` is within ``relative_error_limit``."""
    if comp.error_feedback_on:
        half, full = lags[steps // 2], lags[steps]
        assert full <= 0.5, (f"{what}error feedback: after {steps} steps the summed output is off by "
                             f"{full:.3g} of the summed means (allowed 0.5)")
        assert full <= 0.02 or full <= shrink * half, (
            f"{what}error feedback: the accumulated error does not shrink relative to the signal "
            f"({half:.3g} after {steps // 2} steps, {full:.3g} after {steps})")
    else:
        limit = comp.relative_error_limit
        worst = max(errors[STEPS:])
        assert worst <= limit, (f"{what}relative error {worst:.3g} on the structured signal exceeds the "
                                f"declared limit {limit} (zeros score 1.0)")


def check_non_finite(kit: Kit) -> None:
    """NaN and Inf on one rank: replicas still agree, the declared effect holds (``nan_effect``),
    and the following steps are clean again."""
    rng = np.random.default_rng(3 + kit.rank)
    n = numel(LAYOUT)
    for bad in (np.nan, np.inf):
        comp = kit.build()
        effect = comp.nan_effect
        at = comp.warmup_steps + STEPS - 1
        for step in range(at + 4):
            x = rng.standard_normal(n).astype(np.float32)
            hit = step == at
            if hit and kit.rank == kit.size - 1:
                x[NAN_AT] = bad
            out = kit.reduce(comp, x, 0, LAYOUT)
            kit.same_everywhere(out, f"{bad} at step {step}")
            finite = np.isfinite(out)
            if hit:
                assert not finite[NAN_AT], f"{bad} did not reach the output (a loss scaler would miss it)"
                expect_bad = np.zeros(n, bool)
                if effect == "element":
                    expect_bad[NAN_AT] = True
                elif effect == "chunk":
                    expect_bad[NAN_AT // 512 * 512:(NAN_AT // 512 + 1) * 512] = True
                elif effect in ("tensor", "bucket", None):
                    expect_bad[tensor_of(LAYOUT, NAN_AT) if effect == "tensor" else slice(None)] = True
                if effect in ("element", "chunk"):  # exact; "tensor"/"bucket" bound where it may go
                    assert not finite[expect_bad].any(), f"{bad}: declared '{effect}' effect incomplete"
                assert finite[~expect_bad].all(), f"{bad}: non-finite values outside the declared '{effect}'"
            elif step > at + 1:
                assert finite.all(), f"{bad}: still non-finite {step - at} steps later"


def check_checkpoint(kit: Kit) -> None:
    """``state_dict`` is plain (numpy.savez with allow_pickle=False), a fresh compressor loaded with it
    continues bit for bit, and a damaged or empty state is refused with ValueError and changes
    nothing."""
    rng = np.random.default_rng([5, kit.rank])
    straight, first = kit.build(), kit.build()
    warm = straight.warmup_steps
    steps = [[(1, None, False, rng.standard_normal(300).astype(np.float32)),
              (0, LAYOUT, True, rng.standard_normal(numel(LAYOUT)).astype(np.float32))]
             for _ in range(warm + STEPS + 4)]
    stop = warm + STEPS - 2
    expected = [[kit.reduce(straight, g, i, lay, last) for i, lay, last, g in step] for step in steps]
    for step in steps[:stop]:
        for i, lay, last, g in step:
            kit.reduce(first, g, i, lay, last)
    saved = savez_round_trip(first.state_dict())
    resumed = kit.build()
    resumed.load_state_dict(saved)
    for k, step in enumerate(steps[stop:], start=stop):
        for (i, lay, last, g), want in zip(step, expected[k]):
            got = kit.reduce(resumed, g, i, lay, last)
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), \
                f"resumed run differs at step {k}, bucket {i}"
    end_a, end_b = savez_round_trip(straight.state_dict()), savez_round_trip(resumed.state_dict())
    assert sorted(end_a) == sorted(end_b), "final states have different keys"
    for key in end_a:
        assert np.array_equal(np.asarray(end_a[key]), np.asarray(end_b[key])), f"final state {key!r} differs"
    # damaged states: refused, nothing changed
    before = savez_round_trip(resumed.state_dict())
    damaged: list[tuple[str, dict]] = []
    if saved:
        damaged.append(("an empty state", {}))
    for key, value in saved.items():
        if isinstance(value, np.ndarray) and value.ndim >= 1 and value.size > 1:
            damaged.append((f"{key!r} truncated", dict(saved, **{key: value.reshape(-1)[:-1]})))
            damaged.append((f"{key!r} as int32", dict(saved, **{key: value.astype(np.int32)})))
            break
    damaged.append(("an unknown key", dict(saved, **{"no-such-key/x": np.zeros(3)})))
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


def check_mismatches(kit: Kit) -> None:
    """Buckets, configurations or state that differ across ranks: CollectiveError on every rank,
    never a hang, and the communicator stays usable."""
    comp = kit.build()
    last = kit.size - 1
    good = np.ones(100, np.float32)
    other = gc.FP16(gc.Allreduce()) if comp.describe() == "Allreduce()" else gc.Allreduce()
    cases = [("length", np.ones(101, np.float32), None),
             ("dtype", np.ones(100, np.float64), None),
             ("cannot be a bucket", np.ones(100, np.int32), None),
             ("cannot be a bucket", np.ones((10, 10), np.float32), None),
             ("cannot be a bucket", np.ones(200, np.float32)[::2], None),
             ("cannot be a bucket", np.ones(100, ">f4"), None),
             ("compressor differs", good, other)]
    for words, odd, odd_comp in cases:
        if kit.size == 1 and words in ("length", "dtype", "compressor differs"):
            continue  # nothing to disagree with
        mine = odd_comp if (odd_comp is not None and kit.rank == last) else comp
        x = odd if (kit.rank == last and odd_comp is None) else good
        try:
            mine.reduce(x, kit.comm).result()
        except gc.CollectiveError as exc:
            assert words in str(exc), f"CollectiveError without {words!r}: {exc}"
        else:
            raise AssertionError(f"no CollectiveError for a {words} mismatch")
        if odd_comp is not None:  # the odd rank's own compressor stood still: start afresh
            comp = kit.build()
        out = comp.reduce(gc.Bucket(np.full(64, kit.rank, np.float32)), kit.comm).result()
        kit.same_everywhere(out, f"the bucket after a {words} mismatch")
    _check_state_mismatch(kit)


def _check_state_mismatch(kit: Kit) -> None:
    """One rank one step ahead (advanced alone on a one-rank communicator, then loaded): a
    CollectiveError naming the state on every rank, when the state decides the collectives."""
    if kit.size == 1:
        return
    from mpi4py import MPI

    comp = kit.build()
    ahead = kit.build()
    if kit.rank == kit.size - 1:
        alone = gc.MPICommunicator(MPI.COMM_SELF)
        for _ in range(STEPS):
            ahead.reduce(gc.Bucket(np.ones(numel(LAYOUT), np.float32), 0, LAYOUT), alone).result()
        alone.close()
        comp.load_state_dict(savez_round_trip(ahead.state_dict()))
    probe = gc.Bucket(np.ones(numel(LAYOUT), np.float32), 0, LAYOUT)
    state = comp.agreement_state(probe, None)
    differs = len(set(kit.everyone(repr(state)))) > 1
    try:
        comp.reduce(probe, kit.comm).result()
    except gc.CollectiveError as exc:
        assert differs, f"CollectiveError although the declared state agrees: {exc}"
        assert "state differs" in str(exc), f"the error does not name the state: {exc}"
    else:
        assert not differs, "ranks at different steps reduced together without an error"


def check_schedule(kit: Kit) -> None:
    """Inside a Schedule the compressor reduces exactly as on its own (it counts its own steps),
    and its error-feedback residuals are handed to the next stage, not lost."""
    rng = np.random.default_rng([9, kit.rank])
    switch_in, switch_out = 2, 2 + STEPS
    alone, exact = kit.build(), gc.Allreduce()
    switch_out += alone.warmup_steps
    sched = gc.Schedule([(0, gc.Allreduce()), (switch_in, kit.build()), (switch_out, gc.Allreduce())])
    for step in range(switch_out + 2):
        g = rng.standard_normal(numel(LAYOUT)).astype(np.float32)
        got = kit.reduce(sched, g, 0, LAYOUT)
        if step < switch_in:
            want = kit.reduce(exact, g, 0, LAYOUT)
        elif step < switch_out:
            want = kit.reduce(alone, g, 0, LAYOUT)
        else:
            if step == switch_out:
                bucket = gc.Bucket(g, 0, LAYOUT)
                handed = alone.take_residual(bucket.keys)
                g = g.copy()
                for key, off, shape in bucket.placements():
                    if key in handed:
                        part = g[off:off + handed[key].size]
                        part += handed[key].reshape(-1).astype(np.float32)
            want = kit.reduce(exact, g, 0, LAYOUT)
        assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"Schedule differs at step {step}"


def check_scatter(kit: Kit) -> None:
    """The reduce-scatter form (``Bucket.scatter``, what FSDP2 uses), where the compressor declares
    one (``scatters``): each rank gets its row of the structured signal's mean, of the row's
    length and the input's dtype, with the accuracy promise of ``accuracy`` on the rows (over
    half as many steps). A compressor without one refuses such a bucket on every rank."""
    comp = kit.build()
    pad = -numel(LAYOUT) % kit.size
    layout = [*LAYOUT, (pad,)] if pad else list(LAYOUT)
    n = numel(LAYOUT) + pad
    row = slice(kit.rank * n // kit.size, (kit.rank + 1) * n // kit.size)
    if not comp.scatters:
        try:
            comp.reduce(gc.Bucket(np.ones(n, np.float32), 0, layout, scatter=True), kit.comm).result()
        except gc.CollectiveError:
            return
        raise AssertionError("scatters is False, but a reduce-scatter bucket was reduced")
    warm, steps = comp.warmup_steps, LONG // 2
    shared, own = np.random.default_rng(21), np.random.default_rng([22, kit.rank])
    signal = np.concatenate([structured(LAYOUT, shared, own), np.zeros(pad)])
    sum_out, sum_mean = np.zeros(n // kit.size), np.zeros(n // kit.size)
    lags, errors = {}, []
    for step in range(warm + steps):
        x = (signal + 0.3 * np.abs(signal).mean() * own.standard_normal(n)).astype(np.float32)
        mean = kit.inputs(x).mean(axis=0)[row]
        out = comp.reduce(gc.Bucket(x, 0, layout, scatter=True), kit.comm).result()
        assert out.dtype == x.dtype and out.shape == (n // kit.size,), (
            f"a reduce-scatter returned {out.shape} {out.dtype}, not this rank's row ({n // kit.size},) {x.dtype}")
        if step < warm:
            continue
        errors.append(relative_error(out, mean))
        sum_out += out
        sum_mean += mean
        if step + 1 - warm in (steps // 2, steps):
            lags[step + 1 - warm] = relative_error(sum_out, sum_mean)
    _judge(comp, errors, lags, steps, 0.9, "reduce-scatter: ")


CHECKS = {"shapes": check_shapes, "dtypes": check_dtypes, "accuracy": check_accuracy,
          "non-finite": check_non_finite, "checkpoint": check_checkpoint,
          "mismatches": check_mismatches, "schedule": check_schedule, "scatter": check_scatter}
