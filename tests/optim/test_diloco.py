"""DiLoCo (local steps, compressed outer gradients) under real mpiexec: the outer step against its
definition, error feedback kept across outer steps, bit-identical replicas after every outer step,
streaming fragments, agreement before data moves, checkpoints that resume bit for bit and refuse
what does not fit, and the PyTorch and JAX wrappers."""
from __future__ import annotations

import hashlib
import importlib.util

import numpy as np
import pytest

from tests.mpi_launch import run_ranks

SHAPES = [(6, 5), (5,), (40,)]


def _digest(arrays) -> int:
    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
    return int.from_bytes(h.digest()[:7], "little")


def _same_everywhere(comm, arrays) -> bool:
    table = comm.allgather(np.array([_digest(arrays)], np.int64))
    return bool((table == table[0]).all())


def _start():
    rng = np.random.default_rng(0)  # the same on every rank
    return [rng.standard_normal(s).astype(np.float32) for s in SHAPES]


def _inner(params, rank: int, step: int, lr: float = 0.05) -> None:
    """A rank's own SGD step on a noisy quadratic whose minimum depends on the rank."""
    rng = np.random.default_rng([rank, step])
    for i, p in enumerate(params):
        target = np.float32(rank + i)
        p -= np.float32(lr) * (p - target + rng.standard_normal(p.shape).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------
def test_split_and_schedule():
    from gradcomp.optim.diloco import split

    ps = [np.zeros(n, np.float32) for n in (10, 100, 5, 5, 100, 1000, 3)]
    for f in range(1, len(ps) + 1):
        groups = split(ps, f)
        assert len(groups) == f and all(groups), (f, groups)
        assert [i for g in groups for i in g] == list(range(len(ps))), (f, groups)
    assert split(ps, 2) == [[0, 1, 2, 3, 4], [5, 6]]


# ---------------------------------------------------------------------------------------------
# ranks: the core
# ---------------------------------------------------------------------------------------------
def rank_outer_step_matches_its_definition(momentum: float, nesterov: bool):
    """With an exact exchange, every outer step is ``synced -= lr * nesterov(mean(synced - p_r))``
    (float64 reference); between outer steps the replicas differ, after each they are identical."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    params = _start()
    lr, h = 0.7, 3
    outer = gc.optim.DiLoCo(params, sync_every=h, compressor="allreduce", lr=lr, momentum=momentum,
                            nesterov=nesterov, comm=comm)
    synced = [p.astype(np.float64) for p in params]
    buf = [np.zeros(s) for s in SHAPES]
    for step in range(1, 13):
        _inner(params, comm.rank, step)
        local = [p.copy() for p in params]
        outer.step()
        if step % h:
            assert not _same_everywhere(comm, params), f"step {step}: replicas agree between syncs"
            assert outer.outer_steps == step // h
            continue
        everyone = [comm.allgather(x.reshape(-1)).reshape(comm.size, *x.shape) for x in local]
        for i in range(len(SHAPES)):
            delta = (synced[i] - everyone[i].astype(np.float64)).mean(0)
            buf[i] = momentum * buf[i] + delta
            synced[i] -= lr * ((delta + momentum * buf[i]) if nesterov else buf[i])
            np.testing.assert_allclose(params[i], synced[i], rtol=2e-5, atol=2e-5,
                                       err_msg=f"step {step}, parameter {i}")
            synced[i] = params[i].astype(np.float64)  # follow the float32 path, not float64's drift
        assert _same_everywhere(comm, params), f"step {step}: replicas differ after the outer step"
        assert outer.outer_steps == step // h
    s = outer.stats()
    assert s["outer_steps"] == 4 and s["steps"] == 12 and s["bytes_sent"] > 0
    # 4 fp32 exchanges against 12 fp32 allreduces of the same size: 3x
    assert abs(s["compression_ratio"] - 3.0) < 1e-9, s
    print(f"rank {comm.rank}: ok", flush=True)


@pytest.mark.parametrize("momentum,nesterov", [(0.0, True), (0.9, True), (0.5, False)])
def test_outer_step_matches_its_definition(momentum, nesterov):
    run_ranks(3, "tests.optim.test_diloco:rank_outer_step_matches_its_definition", momentum, nesterov)


def rank_error_feedback_across_outer_steps():
    """int8's residual is kept per tensor from one outer step to the next: with the same
    pseudo-gradient every outer step, plain averaging (lr 1) through int8 with feedback stays
    within one step's rounding of the exact mean, while without feedback the error piles up."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    runs = {}
    for spec in ("allreduce", "int8", "int8:feedback=none"):
        params = _start()
        outer = gc.optim.DiLoCo(params, sync_every=2, compressor=spec, comm=comm)
        drift = [np.random.default_rng([comm.rank, i]).standard_t(3, s).astype(np.float32) * 1e-2
                 for i, s in enumerate(SHAPES)]
        for step in range(20):
            for p, d in zip(params, drift):
                p -= d
            outer.step()
            if spec == "int8" and step == 1:
                kept = outer.compressor.residuals([str(i) for i in range(len(SHAPES))])
                assert sorted(kept) == ["0", "1", "2"], sorted(kept)
                assert any(np.abs(r).max() > 0 for r in kept.values()), "no residual after an outer step"
                assert any(k.startswith("exchange/") and "residual" in k for k in outer.state_dict())
        assert _same_everywhere(comm, params)
        runs[spec] = np.concatenate([p.reshape(-1) for p in params]).astype(np.float64)
    err_fb = np.abs(runs["int8"] - runs["allreduce"]).max()
    err_none = np.abs(runs["int8:feedback=none"] - runs["allreduce"]).max()
    assert err_fb * 3 < err_none, (err_fb, err_none)
    print(f"rank {comm.rank}: error with feedback {err_fb:.2e}, without {err_none:.2e}", flush=True)


def test_error_feedback_across_outer_steps():
    run_ranks(2, "tests.optim.test_diloco:rank_error_feedback_across_outer_steps")


def rank_pseudo_gradients_in_the_replica():
    """Without overlap, the pseudo-gradients are formed and averaged in the replica itself (which
    the landing overwrites): the reducers keep two buckets' buffers, not the model's, and the
    outer steps are the same bits as with a buffer of their own (``keep_local``, which keeps one)."""
    import gradcomp as gc
    from tests.comm.test_memory import flat_bytes

    comm = gc.MPICommunicator()
    shapes = [(20, 10)] * 6 + [(50,)] * 2

    def start():
        rng = np.random.default_rng(0)
        return [rng.standard_normal(s).astype(np.float32) for s in shapes]

    digests, kept = {}, {}
    for keep_local in (False, True):
        params = start()
        outer = gc.optim.DiLoCo(params, sync_every=4, compressor="int8", fragments=2, keep_local=keep_local,
                                bucket_cap_mb=0.0008, comm=comm)  # (a bucket a tensor)
        assert outer.in_replica is not keep_local
        for step in range(1, 14):
            _inner(params, comm.rank, step)
            outer.step()
        outer.sync_now()
        assert _same_everywhere(comm, params)
        digests[keep_local], kept[keep_local] = _digest(params), flat_bytes(outer.reducers)
    model = sum(p.nbytes for p in start())
    assert kept[True] == model and kept[False] <= 4 * 200 * 4, (kept, model)  # 2 of 200 floats a fragment
    assert digests[False] == digests[True], "the pseudo-gradients in the replica changed the outer steps"
    print(f"rank {comm.rank}: ok", flush=True)


def test_pseudo_gradients_in_the_replica():
    run_ranks(2, "tests.optim.test_diloco:rank_pseudo_gradients_in_the_replica")


def rank_streaming_fragments():
    """fragments=2, H=4: fragment 0 synced at steps 2, 6, ..., fragment 1 at 4, 8, ...; each is the
    same on every rank right after its own sync and differs on the others' steps."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    params = _start()
    outer = gc.optim.DiLoCo(params, sync_every=4, compressor="int8", lr=0.7, momentum=0.9, fragments=2,
                            comm=comm)
    assert outer.groups == [[0, 1], [2]], outer.groups
    for step in range(1, 11):
        _inner(params, comm.rank, step)
        outer.step()
        first, second = _same_everywhere(comm, params[:2]), _same_everywhere(comm, params[2:])
        assert (first, second) == (step % 4 == 2, step % 4 == 0), (step, first, second)
    assert outer.outer_steps == 5
    state = outer.state_dict()
    assert any(k.startswith("exchange/0/") for k in state) and any(k.startswith("exchange/1/") for k in state)
    outer.sync_now()
    assert _same_everywhere(comm, params)
    print(f"rank {comm.rank}: ok", flush=True)


def test_streaming_fragments():
    run_ranks(2, "tests.optim.test_diloco:rank_streaming_fragments")


def _resumed(comm, build, last: int, save_at: int, loaded=None):
    """``build(_start())`` trained through step ``last``; a fresh ``build`` given the parameters
    and ``state_dict()`` taken after step ``save_at`` (``loaded`` sees it just loaded), trained to
    ``last`` as well. Returns the uninterrupted run's digest, that state, the resumed optimizer
    and its parameters."""
    params = _start()
    outer = build(params)
    for step in range(1, last + 1):
        _inner(params, comm.rank, step)
        outer.step()
        if step == save_at:
            copies = [p.copy() for p in params]
            saved = {k: np.array(v, copy=True) for k, v in outer.state_dict().items()}
    params2 = _start()
    again = build(params2)
    for p, q in zip(params2, copies):
        p[...] = q
    again.load_state_dict(saved)
    if loaded is not None:
        loaded(again)
    for step in range(save_at + 1, last + 1):
        _inner(params2, comm.rank, step)
        again.step()
    return _digest(params), saved, again, params2


def rank_resume_is_bit_exact():
    """A state taken between outer steps (momentum, residuals, synced parameters, counters)
    resumes bit for bit; mismatched states are refused with the key named."""
    import gradcomp as gc

    comm = gc.MPICommunicator()

    def build(params):
        return gc.optim.DiLoCo(params, sync_every=3, compressor="int8", lr=0.5, momentum=0.5, comm=comm)

    def loaded(again):
        assert (again.steps, again.outer_steps) == (7, 2)

    final, saved, again, params2 = _resumed(comm, build, last=13, save_at=7, loaded=loaded)
    assert _digest(params2) == final, "the resumed run differs from the uninterrupted one"
    # refusals, before anything changes
    bad = dict(saved)
    bad["synced/0"] = np.zeros((5, 6), np.float32)
    with pytest.raises(ValueError, match="synced/0"):
        again.load_state_dict(bad)
    other = gc.optim.DiLoCo(_start(), sync_every=4, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    with pytest.raises(ValueError, match="'config'.*sync_every=3"):
        other.load_state_dict(saved)
    missing = {k: v for k, v in saved.items() if k != "momentum/1"}
    with pytest.raises(ValueError, match="momentum/1"):
        again.load_state_dict(missing)
    assert _digest(params2) == final and again.steps == 13
    print(f"rank {comm.rank}: ok", flush=True)


def test_resume_is_bit_exact():
    run_ranks(2, "tests.optim.test_diloco:rank_resume_is_bit_exact")


def rank_governed_exchange():
    """A compressor that sends fewer bytes than 8-bit codes is governed in outer steps: it starts on
    8-bit codes and tries the rung above after its hold. Where the replicas hardly differ, any
    compression error is large against their spread, so it stays on 8-bit codes and ends far
    closer to the exact exchange than the same compressor ungoverned. Its decisions are the same
    on every rank, its audits are counted, it resumes bit for bit, and a rank with another budget
    gets a CollectiveError on every rank."""
    import gradcomp as gc
    from gradcomp.comm import CollectiveError
    from gradcomp.optim.diloco import GOVERNOR_HOLD
    from gradcomp.planning.governor import Governed

    comm = gc.MPICommunicator()
    assert "governed" in gc.optim.DiLoCo(_start(), compressor="onebit", comm=comm).outer_compressor.describe()
    for spec, budget in (("int8", 1.0), ("allreduce", 1.0), ("onebit", None)):
        plain = gc.optim.DiLoCo(_start(), compressor=spec, budget=budget, comm=comm)
        assert not isinstance(plain.outer_compressor, Governed), spec
    given = Governed(gc.make("int4"), budget=3.0)
    assert gc.optim.DiLoCo(_start(), compressor=given, comm=comm).outer_compressor is given
    runs, stats = {}, {}
    for spec, budget in (("allreduce", None), ("onebit", None), ("onebit", 1.0)):
        params = _start()
        outer = gc.optim.DiLoCo(params, sync_every=2, compressor=spec, budget=budget, comm=comm)
        common = [np.random.default_rng(i).standard_t(3, s).astype(np.float32) * 1e-2
                  for i, s in enumerate(SHAPES)]
        for step in range(40):
            for i, (p, d) in enumerate(zip(params, common)):  # the same drift, a little noise
                p -= d * np.float32(1 + 0.5 * np.sin(step)) + np.random.default_rng(
                    [comm.rank, step, i]).standard_normal(p.shape).astype(np.float32) * 1e-6
            outer.step()
        assert _same_everywhere(comm, params), spec
        runs[spec, budget] = np.concatenate([p.reshape(-1) for p in params]).astype(np.float64)
        stats[spec, budget] = outer.stats()
    governor = stats["onebit", 1.0]["governor"]
    assert governor["tensor_steps"]["method"] == 0 and governor["tensor_steps"]["int8"] > 0, governor["tensor_steps"]
    assert set(governor["levels"].values()) == {"int8"}, governor["levels"]
    assert any(d["to"] == "int8" for d in governor["decisions"]), governor["decisions"]  # a try that failed
    assert governor["audit_bytes"] > 0 and governor["audit_share"] > 0, governor  # (75 values: all audited)
    table = comm.allgather(np.array([len(governor["decisions"]), governor["audit_bytes"]], np.float64))
    assert (table == table[0]).all(), table
    exact = runs["allreduce", None]
    governed, ungoverned = (np.abs(runs["onebit", b] - exact).max() for b in (1.0, None))
    assert governed * 10 < ungoverned, (governed, ungoverned)
    assert "governor" not in stats["onebit", None]

    def build(params):
        return gc.optim.DiLoCo(params, sync_every=2, compressor="topk", comm=comm)

    final, saved, _, params2 = _resumed(comm, build, last=4 * GOVERNOR_HOLD + 3, save_at=2 * GOVERNOR_HOLD + 1)
    assert any("/tensor/" in k for k in saved), sorted(saved)
    assert _digest(params2) == final, "the resumed governed run differs from the uninterrupted one"
    params = _start()
    other = gc.optim.DiLoCo(params, sync_every=2, compressor="onebit", budget=1.0 + comm.rank, comm=comm)
    with pytest.raises(CollectiveError, match="budget"):
        for step in range(1, 3):
            _inner(params, comm.rank, step)
            other.step()
    print(f"rank {comm.rank}: governed {governed:.2e}, ungoverned {ungoverned:.2e}", flush=True)


def test_governed_exchange():
    run_ranks(2, "tests.optim.test_diloco:rank_governed_exchange")


def rank_overlapped_exchange():
    """overlap=2: the exchange starts at the sync step and lands 2 steps later, overwriting the
    replica with the new synced parameters (plain averaging: the ranks' mean at the sync step),
    the same bits on every rank; a state taken with the exchange in flight resumes bit for bit."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    params = _start()
    outer = gc.optim.DiLoCo(params, sync_every=4, compressor="allreduce", lr=1.0, momentum=0.0, overlap=2,
                            comm=comm)
    taken = None
    for step in range(1, 8):
        _inner(params, comm.rank, step)
        if step == 4:
            taken = [comm.allgather(p).mean(axis=0) for p in params]
        outer.step()
        assert outer.landed == ([0] if step == 6 else []), (step, outer.landed)
        assert _same_everywhere(comm, params) == (step == 6), step
        if step == 6:
            for p, mean in zip(params, taken):
                np.testing.assert_allclose(p, mean, rtol=1e-5, atol=1e-6)

    def build(params, overlap=2):
        return gc.optim.DiLoCo(params, sync_every=4, compressor="int8", lr=0.5, momentum=0.5, fragments=2,
                               overlap=overlap, comm=comm)

    # saved after step 5: fragment 0 synced at 2 (landed at 4), fragment 1 at 4, in flight until 6
    final, saved, again, params2 = _resumed(comm, build, last=14, save_at=5)
    assert int(saved["flight/1/lands_at"]) == 6 and "flight/0/lands_at" not in saved, sorted(saved)
    assert _digest(params2) == final, "the resumed run differs from the uninterrupted one"
    with pytest.raises(ValueError, match="overlap"):
        build(_start(), overlap=0).load_state_dict(saved)
    bad = dict(saved, **{"flight/1/lands_at": np.int64(9)})
    with pytest.raises(ValueError, match="flight/1/lands_at"):
        again.load_state_dict(bad)
    with pytest.raises(ValueError, match="overlap"):
        gc.optim.DiLoCo(_start(), sync_every=4, overlap=4, comm=comm)
    again.sync_now()
    assert _same_everywhere(comm, params2) and not again.flight
    print(f"rank {comm.rank}: ok", flush=True)


def test_overlapped_exchange():
    run_ranks(2, "tests.optim.test_diloco:rank_overlapped_exchange")


def rank_ends_with_an_exchange_in_flight():
    """The loop ends one step after a sync whose exchange lands 2 steps later."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    params = _start()
    outer = gc.optim.DiLoCo(params, sync_every=4, compressor="int8", overlap=2, comm=comm)
    for step in range(1, 6):
        _inner(params, comm.rank, step)
        outer.step()
    assert outer.flight, "the exchange started at step 4 is in flight"
    print(f"rank {comm.rank}: done with an exchange in flight", flush=True)


def test_a_run_that_ends_with_an_exchange_in_flight_exits_0():
    """A finished run is a job that exits 0, even when its loop ends between a sync and its
    landing: the exchange is waited for at exit (it was an abort: work in flight at exit)."""
    out = run_ranks(2, "tests.optim.test_diloco:rank_ends_with_an_exchange_in_flight")
    assert out.count("done with an exchange in flight") == 2 and "Abort" not in out, out


def rank_delayed_exchange():
    """keep_local with overlap = H: the exchange of sync s lands at sync s + H as a correction,
    the replica moved by its own pseudo-gradient back and the outer step on (averaging: to the
    mean at s plus its own steps since), the synced parameters the same bits everywhere; a state
    taken in flight resumes bit for bit; overlap = H without keep_local is refused."""
    import gradcomp as gc

    comm = gc.MPICommunicator()
    params = _start()
    outer = gc.optim.DiLoCo(params, sync_every=4, compressor="allreduce", lr=1.0, momentum=0.0, overlap=4,
                            keep_local=True, comm=comm)
    for step in range(1, 13):
        _inner(params, comm.rank, step)
        if step in (8, 12):
            expected = [p - mine + mean for p, mine, mean in zip(params, at_sync, means)]
        outer.step()
        if step % 4 == 0:  # the replicas the pseudo-gradients are taken from (after a landing)
            at_sync = [p.copy() for p in params]
            means = [comm.allgather(p).astype(np.float64).mean(axis=0) for p in params]
        assert outer.landed == ([0] if step in (8, 12) else []), (step, outer.landed)
        assert _same_everywhere(comm, outer.synced), step
        assert not _same_everywhere(comm, params), step  # the replicas keep their own steps
        if step in (8, 12):
            for p, e in zip(params, expected):
                np.testing.assert_allclose(p, e, rtol=1e-5, atol=1e-5)
    outer.sync_now()
    assert _same_everywhere(comm, params) and not outer.flight

    def build(params):
        return gc.optim.DiLoCo(params, sync_every=4, compressor="int8", lr=0.7, momentum=0.5, fragments=2,
                               overlap=4, keep_local=True, comm=comm)

    final, saved, again, _ = _resumed(comm, build, last=15, save_at=9)
    assert {"flight/0/own/0", "flight/1/mean/2"} <= set(saved), sorted(saved)
    assert _digest(again.params) == final, "the resumed run differs from the uninterrupted one"
    with pytest.raises(ValueError, match="flight/0/own"):
        build(_start()).load_state_dict({k: v for k, v in saved.items() if k != "flight/0/own/0"})
    with pytest.raises(ValueError, match="overlap"):
        gc.optim.DiLoCo(_start(), sync_every=4, overlap=4, comm=comm)
    print(f"rank {comm.rank}: ok", flush=True)


def test_delayed_exchange():
    run_ranks(2, "tests.optim.test_diloco:rank_delayed_exchange")


def rank_ranks_must_agree():
    """Ranks that disagree on the configuration, on where they are (a resumed state on one rank
    only) or on the starting parameters get a CollectiveError on every rank, before data moves."""
    import gradcomp as gc
    from gradcomp.comm import CollectiveError

    comm = gc.MPICommunicator()
    # another sync_every on rank 1: rank 0's sync at 2 meets rank 1's at 3
    params = _start()
    outer = gc.optim.DiLoCo(params, sync_every=2 + comm.rank, comm=comm)
    with pytest.raises(CollectiveError, match="sync_every"):
        for step in range(1, 4):
            _inner(params, comm.rank, step)
            outer.step()
    # one rank resumed from a later outer step: its next sync is at another step
    params = _start()
    outer = gc.optim.DiLoCo(params, sync_every=2, comm=comm)
    alone = comm.comm.Split(comm.rank, 0)  # collective; rank 1 builds its state on its own
    if comm.rank == 1:
        ahead = gc.optim.DiLoCo(_start(), sync_every=2, comm=gc.MPICommunicator(alone))
        for _ in range(3):
            ahead.step()
        state = ahead.state_dict()
        with pytest.raises(ValueError, match="saved by rank 0 of 1, and this is rank 1 of 2"):
            outer.load_state_dict(state)  # its residuals are another job's
        # without the saving rank (a checkpoint from before it was recorded) it loads, and the
        # steps disagree at the next sync
        outer.load_state_dict({k: v for k, v in state.items() if not k.startswith("saved_by/")})
    with pytest.raises(CollectiveError, match="step"):
        for step in range(4):
            outer.step()
    # other starting parameters
    start = _start()
    start[1] += np.float32(comm.rank)
    with pytest.raises(CollectiveError, match="differ across ranks"):
        gc.optim.DiLoCo(start, comm=comm)
    # the communicator is still usable
    assert int(comm.allgather(np.array([1], np.int64)).sum()) == comm.size
    with pytest.raises(TypeError, match="no gradients"):
        gc.optim.DiLoCo(_start(), comm=comm).step(_start())
    print(f"rank {comm.rank}: ok", flush=True)


def test_ranks_must_agree():
    run_ranks(2, "tests.optim.test_diloco:rank_ranks_must_agree")


# ---------------------------------------------------------------------------------------------
# PyTorch
# ---------------------------------------------------------------------------------------------
def _torch_problem(seed: int = 0):
    import torch

    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return torch, net


def _torch_batch(torch, rank: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(32, 8, generator=g)
    y = x[:, :1] * 0.5 - x[:, 1:2] * 0.3
    return x, y


def _torch_digest(net) -> int:
    return _digest([p.detach().numpy() for p in net.parameters()])


def rank_torch_diloco():
    """gt.DiLoCo on an unwrapped model over MPI: different replicas between outer steps, the
    same bits after each (parameters broadcast from rank 0 at construction, though seeded per
    rank), loss falls, stats against DDP's fp32 bytes, a torch.save/torch.load(weights_only=True)
    checkpoint resumes bit for bit, a state of another model is refused naming the key."""
    import io

    import gradcomp as gc
    import gradcomp.torch as gt

    comm = gc.MPICommunicator()
    torch, net = _torch_problem(seed=comm.rank)  # broadcast makes them equal
    torch.set_num_threads(1)
    inner = torch.optim.AdamW(net.parameters(), lr=3e-2)
    diloco = gt.DiLoCo(net, inner, sync_every=4, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    assert _same_everywhere(comm, [p.detach().numpy() for p in net.parameters()])
    losses, saved = [], None
    for step in range(1, 25):
        x, y = _torch_batch(torch, comm.rank, step)
        inner.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        synced = diloco.step()
        losses.append(loss.item())
        same = _same_everywhere(comm, [p.detach().numpy() for p in net.parameters()])
        assert synced == (step % 4 == 0) and same == synced, (step, synced, same)
        assert diloco.landed == ([0] if synced else []), diloco.landed
        if step == 10:
            buffer = io.BytesIO()
            torch.save({"model": net.state_dict(), "diloco": diloco.state_dict()}, buffer)
            saved = buffer.getvalue()
    assert np.mean(losses[-4:]) < 0.5 * np.mean(losses[:4]), losses
    s = diloco.stats()
    assert s["outer_steps"] == 6 and s["steps"] == 24, s
    # one exchange per 4 inner steps: 4x the exchange's own ratio against DDP's fp32 bytes (this
    # 161-parameter model is smaller than one int8 chunk, so int8 itself saves nothing here)
    assert abs(s["compression_ratio"] / s["exchange_compression_ratio"] - 4) < 1e-9, s
    final = _torch_digest(net)
    state = torch.load(io.BytesIO(saved), weights_only=True)
    _, fresh = _torch_problem(seed=7)
    inner2 = torch.optim.AdamW(fresh.parameters(), lr=3e-2)
    again = gt.DiLoCo(fresh, inner2, sync_every=4, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    fresh.load_state_dict(state["model"])
    again.load_state_dict(state["diloco"])
    for step in range(11, 25):
        x, y = _torch_batch(torch, comm.rank, step)
        inner2.zero_grad()
        torch.nn.functional.mse_loss(fresh(x), y).backward()
        again.step()
    assert _torch_digest(fresh) == final, "the resumed run differs from the uninterrupted one"
    _, wider = _torch_problem()
    wider[0] = torch.nn.Linear(8, 17)
    wider[2] = torch.nn.Linear(17, 1)
    other = gt.DiLoCo(wider, torch.optim.AdamW(wider.parameters()), sync_every=4, compressor="int8",
                      lr=0.5, momentum=0.5, comm=comm)
    with pytest.raises(ValueError, match="synced/0"):
        other.load_state_dict(state["diloco"])
    with pytest.raises(ValueError, match="'outer'"):
        again.load_state_dict({"inner": state["diloco"]["inner"]})
    # keep_local: the replicas differ after a landing; synced() lends the model the synced
    # parameters (the same bits everywhere) and gives the replica back after
    delayed = gt.DiLoCo(fresh, inner2, sync_every=2, overlap=2, keep_local=True, compressor="int8", comm=comm)
    for step in range(1, 7):
        x, y = _torch_batch(torch, comm.rank, step)
        inner2.zero_grad()
        torch.nn.functional.mse_loss(fresh(x), y).backward()
        assert delayed.step() == (step in (4, 6)), step
    mine = _torch_digest(fresh)
    assert not _same_everywhere(comm, [p.detach().numpy() for p in fresh.parameters()])
    with delayed.synced() as model:
        assert model is fresh and _same_everywhere(comm, [p.detach().numpy() for p in fresh.parameters()])
    assert _torch_digest(fresh) == mine
    print(f"rank {comm.rank}: ok", flush=True)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_diloco():
    run_ranks(2, "tests.optim.test_diloco:rank_torch_diloco")


# ---------------------------------------------------------------------------------------------
# JAX
# ---------------------------------------------------------------------------------------------
def rank_jax_diloco():
    """gradcomp.jax.DiLoCo around a jitted optax step: identical replicas after every outer step
    (returned as JAX arrays), the NumPy core's bits, loss falls, a state resumes bit for bit."""
    import jax
    import jax.numpy as jnp
    import optax

    import gradcomp as gc
    import gradcomp.jax

    comm = gc.MPICommunicator()
    key = jax.random.PRNGKey(0)
    params = {"w": jax.random.normal(key, (8, 4)) * 0.3, "b": jnp.zeros(4), "s": jnp.ones(())}
    tx = optax.adam(1e-2)

    def loss_fn(p, x, y):
        return jnp.mean((jnp.tanh(x @ p["w"] + p["b"]) * p["s"] - y) ** 2)

    @jax.jit
    def train_step(p, state, x, y):
        loss, g = jax.value_and_grad(loss_fn)(p, x, y)
        updates, state = tx.update(g, state, p)
        return optax.apply_updates(p, updates), state, loss

    def batch(step):
        rng = np.random.default_rng([comm.rank, step])
        x = rng.standard_normal((16, 8)).astype(np.float32)
        return x, np.sin(x[:, :4]).astype(np.float32)

    def run(p, state, outer, steps, save_at=None):
        losses, saved = [], None
        for step in steps:
            p, state, loss = train_step(p, state, *batch(step))
            p = outer.step(p)
            losses.append(float(loss))
            leaves = jax.tree_util.tree_leaves(p)
            same = _same_everywhere(comm, [np.asarray(x) for x in leaves])
            assert same == (step % 3 == 0), (step, same)
            assert outer.landed == ([0] if same else []), outer.landed
            assert all(isinstance(x, jax.Array) for x in leaves)
            if step == save_at:
                saved = (p, state, {k: np.array(v, copy=True) for k, v in outer.state_dict().items()})
        return p, losses, saved

    outer = gradcomp.jax.DiLoCo(params, sync_every=3, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    end, losses, saved = run(params, tx.init(params), outer, range(1, 19), save_at=9)
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert outer.stats()["outer_steps"] == 6
    again = gradcomp.jax.DiLoCo(params, sync_every=3, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    again.load_state_dict(saved[2])
    resumed, _, _ = run(saved[0], saved[1], again, range(10, 19))
    for a, b in zip(jax.tree_util.tree_leaves(end), jax.tree_util.tree_leaves(resumed)):
        assert np.array_equal(np.asarray(a), np.asarray(b)), "the resumed run differs"
    # the same bits as the NumPy core given the same replicas
    host = [np.array(np.asarray(x)).reshape(np.shape(x) or (1,)) for x in jax.tree_util.tree_leaves(params)]
    twin = gc.optim.DiLoCo(host, sync_every=1, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    fresh = gradcomp.jax.DiLoCo(params, sync_every=1, compressor="int8", lr=0.5, momentum=0.5, comm=comm)
    moved = jax.tree_util.tree_map(lambda x: x + 0.01 * (comm.rank + 1), params)
    for h, x in zip(host, jax.tree_util.tree_leaves(moved)):
        h[...] = np.asarray(x).reshape(h.shape)
    twin.step()
    out = jax.tree_util.tree_leaves(fresh.step(moved))
    assert all(np.array_equal(np.asarray(o).reshape(-1), h.reshape(-1)) for o, h in zip(out, host))
    print(f"rank {comm.rank}: ok", flush=True)


def test_jax_diloco():
    pytest.importorskip("jax")
    pytest.importorskip("optax")
    run_ranks(2, "tests.optim.test_diloco:rank_jax_diloco", timeout=240)


# ---------------------------------------------------------------------------------------------
# PyTorch under torchrun (TorchCommunicator, no MPI)
# ---------------------------------------------------------------------------------------------
def torchrun_rank() -> None:
    """Under ``torchrun -m tests.optim.test_diloco``: gt.DiLoCo over torch.distributed (gloo) picks the
    TorchCommunicator itself; replicas differ between outer steps and agree after each."""
    import json
    import os
    import sys

    import gradcomp.torch as gt

    launch = gt.init_process_group()
    torch, net = _torch_problem(seed=launch.rank)
    torch.set_num_threads(1)
    inner = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    diloco = gt.DiLoCo(net, inner, sync_every=3, compressor=os.environ.get("TEST_DILOCO_EXCHANGE", "int8"))
    agree = []
    for step in range(1, 10):
        x, y = _torch_batch(torch, launch.rank, step)
        inner.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        synced = diloco.step()
        seen: list = [None] * launch.size
        torch.distributed.all_gather_object(seen, _torch_digest(net))
        agree.append([synced, len(set(seen)) == 1])
    result = {"comm": type(diloco.comm).__name__, "agree": agree, "outer_steps": diloco.stats()["outer_steps"],
              "bytes_sent": diloco.stats()["bytes_sent"], "momentum": diloco.outer.momentum,
              "metrics": diloco.metrics(), "ratio": diloco.stats()["compression_ratio"]}
    if launch.rank == 0:
        print("RESULT " + json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # past torch 2.13's flaky gloo teardown (tests.mpi_launch.leave_before_torch_teardown)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
@pytest.mark.parametrize("exchange", ["int8", "sparseloco"])
def test_torch_diloco_under_torchrun(exchange):
    """(``sparseloco``: its allgathered messages over torch.distributed, counted.)"""
    import json
    import os
    import subprocess
    import sys

    from tests.mpi_launch import ROOT

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TEST_DILOCO_EXCHANGE=exchange)
    for var in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "HYDI_CONTROL_FD"):  # one torchrun job, not an MPI rank's
        env.pop(var, None)
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", "-m", "tests.optim.test_diloco"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out
    result = json.loads(lines[0][len("RESULT "):])
    assert result["comm"] == "TorchCommunicator" and result["outer_steps"] == 3, result
    assert result["agree"] == [[s % 3 == 0, s % 3 == 0] for s in range(1, 10)], result
    assert result["bytes_sent"] > 0 and result["momentum"] == (0.0 if exchange == "sparseloco" else 0.5), result
    assert result["metrics"]["gradcomp/compression_ratio"] == result["ratio"] > 1  # DiLoCo.metrics() for a logger
    assert result["metrics"]["gradcomp/outer_steps"] == 3.0


if __name__ == "__main__":
    torchrun_rank()
