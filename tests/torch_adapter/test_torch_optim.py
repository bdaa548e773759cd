"""gradcomp.torch's optimizers (OneBitAdam, DGC) on real DDP, and the hook's loaded-state check,
at 2 ranks under mpiexec."""
from __future__ import annotations

import importlib.util

import pytest

from tests.mpi_launch import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")


def _setup(seed: int = 0):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    import gradcomp.torch as gt
    from examples.torch_ddp import DigitsCNN, digits

    torch.set_num_threads(1)
    launch = gt.init_process_group()
    x, y, _, _ = digits()
    torch.manual_seed(seed)
    model = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    return torch, gt, launch, model, x, y


def _batch(x, y, it, rank, size, n=16):
    start = ((it * size + rank) * n) % (len(y) - n)
    return x[start:start + n], y[start:start + n]


def _train(net, opt, its, x, y, launch) -> None:
    """Cross-entropy steps of ``net`` with ``opt`` on this rank's batches of iterations ``its``."""
    import torch.nn.functional as F

    for it in its:
        xb, yb = _batch(x, y, it, launch.rank, launch.size)
        opt.zero_grad()
        F.cross_entropy(net(xb), yb).backward()
        opt.step()


def _digest(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()


def rank_onebit_adam_is_adamw_then_compresses():
    """In its warm-up, OneBitAdam on DDP with local gradients equals torch's AdamW on DDP's
    averaged gradients (float32 rounding); after it, parameters stay bit-identical across ranks;
    a checkpoint through torch.save / torch.load(weights_only=True) resumes bit for bit."""
    import io

    import torch.nn.functional as F

    torch, gt, launch, model, x, y = _setup()
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    torch.manual_seed(0)
    twin = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    warm = 5
    opt = gt.OneBitAdam(model.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01, warmup=warm,
                        warmup_compressor="allreduce", model=model)
    ref = torch.optim.AdamW(twin.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01)
    saved = None
    for it in range(12):
        xb, yb = _batch(x, y, it, launch.rank, launch.size)
        for net, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            F.cross_entropy(net(xb), yb).backward()
            o.step()
        if it < warm:
            for a, b in zip(model.parameters(), twin.parameters()):
                assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"iteration {it}: {(a - b).abs().max()}"
        if it == warm:
            at_freeze = opt.stats()
        if it == 8:
            buffer = io.BytesIO()
            torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, buffer)
            saved = buffer.getvalue()
        digests = launch_allgather(_digest(model))
        assert len(set(digests)) == 1, f"iteration {it}: ranks differ"
    end = opt.stats()
    compression = (end["reference_bytes"] - at_freeze["reference_bytes"]) / (end["bytes_sent"] - at_freeze["bytes_sent"])
    assert end["phase"] == "frozen variance" and compression > 20, (end, compression)
    final = _digest(model)
    # resume from iteration 8 into a fresh model and optimizer
    state = torch.load(io.BytesIO(saved), weights_only=True)
    torch.manual_seed(1)
    fresh = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    fresh.module.load_state_dict(state["model"])
    opt2 = gt.OneBitAdam(fresh.parameters(), lr=3e-3, betas=(0.9, 0.99), weight_decay=0.01, warmup=warm,
                         warmup_compressor="allreduce", model=fresh)
    opt2.load_state_dict(state["opt"])
    for it in range(9, 12):
        xb, yb = _batch(x, y, it, launch.rank, launch.size)
        opt2.zero_grad()
        F.cross_entropy(fresh(xb), yb).backward()
        opt2.step()
    assert _digest(fresh) == final, "the resumed run differs from the uninterrupted one"
    print(f"rank {launch.rank}: ok", flush=True)


def launch_allgather(value):
    from mpi4py import MPI

    return MPI.COMM_WORLD.allgather(value)


def rank_dgc_on_ddp():
    """DGC with DDP (local hook): bit-identical parameters, 25x fewer bytes after the ramp, and
    it learns, not far behind torch's momentum SGD on DDP's averages over the same batches."""
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    torch, gt, launch, model, x, y = _setup()
    torch.manual_seed(0)
    twin = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    opt = gt.DGC(model.parameters(), lr=0.1, momentum=0.9, ratio=0.01, warmup=20, model=model,
                 budget=None)  # the ramp's bytes, ungoverned
    ref = torch.optim.SGD(twin.parameters(), lr=0.1, momentum=0.9)
    losses: dict = {"dgc": [], "sgd": []}
    for it in range(80):
        xb, yb = _batch(x, y, it, launch.rank, launch.size)
        for name, net, o in (("dgc", model, opt), ("sgd", twin, ref)):
            o.zero_grad()
            loss = F.cross_entropy(net(xb), yb)
            loss.backward()
            o.step()
            losses[name].append(loss.item())
        assert len(set(launch_allgather(_digest(model)))) == 1, f"iteration {it}: ranks differ"
        if it == 20:
            at = opt.stats()
    end = opt.stats()
    compression = (end["reference_bytes"] - at["reference_bytes"]) / (end["bytes_sent"] - at["bytes_sent"])
    dgc, sgd = (sum(losses[k][-10:]) / 10 for k in ("dgc", "sgd"))
    assert dgc < 0.5 * losses["dgc"][0] and dgc < 2 * sgd, (dgc, sgd)  # learning, behind early on
    assert compression > 45, compression  # 2 ranks: 1 / (2 * 1%)
    print(f"rank {launch.rank}: ok: loss dgc {dgc:.3f}, sgd {sgd:.3f}, compression {compression:.1f}", flush=True)


def rank_dgc_sending_everything_is_momentum_sgd():
    """``gt.DGC(ratio=1.0)`` (the default, global momentum) trains as ``torch.optim.SGD`` with the
    same momentum and weight decay on DDP's averages, to float32 rounding; the paper's local form
    with factor masking keeps no momentum there (the issue-57 collapse), and lands far away."""
    torch, gt, launch, model, x, y = _setup()
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    nets = {}
    for name in ("global", "local", "sgd"):
        torch.manual_seed(0)
        nets[name] = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    hyper = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    opts = {form: gt.DGC(nets[form].parameters(), ratio=1.0, warmup=0, momentum_form=form,
                         model=nets[form], **hyper) for form in ("global", "local")}
    opts["sgd"] = torch.optim.SGD(nets["sgd"].parameters(), **hyper)
    for name, net in nets.items():
        _train(net, opts[name], range(30), x, y, launch)
    flat = {k: torch.cat([p.detach().reshape(-1) for p in n.parameters()]) for k, n in nets.items()}
    start = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    moved = (flat["sgd"] - start).norm().item()
    off_global = (flat["global"] - flat["sgd"]).norm().item()
    off_local = (flat["local"] - flat["sgd"]).norm().item()
    assert off_global < 1e-4 * moved, (off_global, moved)
    assert off_local > 0.1 * moved, (off_local, moved)
    assert len(set(launch_allgather(_digest(nets["global"])))) == 1, "ranks differ"
    print(f"rank {launch.rank}: ok: moved {moved:.3g}, global off by {off_global:.3g}, local {off_local:.3g}",
          flush=True)


def rank_onebit_adam_resumes_inside_a_lossy_warmup():
    """The default warm-up averages through int8: a checkpoint taken while its residuals are live
    (int8's own exact steps done, the variance not yet frozen) resumes bit for bit, through the
    freeze, and the warm-up sends fewer bytes than fp32."""
    import io

    torch, gt, launch, model, x, y = _setup()
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    def build(net):
        return gt.OneBitAdam(net.parameters(), lr=3e-3, warmup=8, warmup_compressor="int8:warmup=2", model=net)

    def run(net, opt, its):
        _train(net, opt, its, x, y, launch)

    opt = build(model)
    run(model, opt, range(2))  # int8's own exact steps
    exact = opt.stats()
    run(model, opt, range(2, 5))
    warm = opt.stats()
    ratio = (warm["reference_bytes"] - exact["reference_bytes"]) / (warm["bytes_sent"] - exact["bytes_sent"])
    assert warm["phase"] == "warm-up" and ratio > 3, (warm, ratio)
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict()}, buffer)
    run(model, opt, range(5, 12))
    final = _digest(model)
    assert len(set(launch_allgather(final))) == 1, "ranks differ"
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    torch.manual_seed(1)
    fresh = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    fresh.module.load_state_dict(state["model"])
    opt2 = build(fresh)
    opt2.load_state_dict(state["opt"])
    run(fresh, opt2, range(5, 12))
    assert _digest(fresh) == final, "the resumed run differs from the uninterrupted one"
    print(f"rank {launch.rank}: ok", flush=True)


def rank_auto_warmups_checkpoint_through_torch():
    """The adaptive warm-ups as shipped (the ``onebit`` hook's, ``OneBitAdam``'s default, ``DGC``'s
    ``warmup="auto"``) keep a reason in their state, as text: their checkpoints go through
    torch.save / torch.load(weights_only=True) and resume bit for bit (they once failed to save)."""
    import io

    torch, gt, launch, model, x, y = _setup()
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    def fresh():
        torch.manual_seed(0)
        return DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)

    builds = {  # each: (model) -> (something with state_dict / load_state_dict, the optimizer)
        "onebit hook": lambda net: (gt.register(net, "onebit"), torch.optim.SGD(net.parameters(), lr=0.05)),
        "OneBitAdam": lambda net: (lambda o: (o, o))(gt.OneBitAdam(net.parameters(), lr=3e-3, model=net)),
        "DGC auto": lambda net: (lambda o: (o, o))(gt.DGC(net.parameters(), lr=0.05, warmup="auto", model=net)),
    }
    for what, build in builds.items():
        net = fresh()
        state, opt = build(net)
        _train(net, opt, range(4), x, y, launch)
        buffer = io.BytesIO()
        torch.save({"model": net.module.state_dict(), "state": state.state_dict()}, buffer)
        _train(net, opt, range(4, 8), x, y, launch)
        loaded = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
        again = fresh()
        again.module.load_state_dict(loaded["model"])
        state2, opt2 = build(again)
        state2.load_state_dict(loaded["state"])
        _train(again, opt2, range(4, 8), x, y, launch)
        assert _digest(again) == _digest(net), f"{what}: the resumed run differs from the uninterrupted one"
    print(f"rank {launch.rank}: ok", flush=True)


def rank_hook_state_without_names_is_refused():
    """PyTorch's hook-pickling pattern, ported: PowerSGD state saved from ``register(model, ...)``
    (keyed by parameter name) and attached to a fresh model through ``comm_hook`` +
    ``register_comm_hook`` (keyed by bucket index) is an error on every rank, not silently
    ignored; through ``register`` it resumes bit for bit."""
    import torch.nn.functional as F

    torch, gt, launch, model, x, y = _setup()
    import gradcomp
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    spec = "powersgd:rank=2,start_iter=2"
    state = gt.register(model, gradcomp.make(spec))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for it in range(5):
        xb, yb = _batch(x, y, it, launch.rank, launch.size)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    saved = state.state_dict()

    def fresh():
        torch.manual_seed(0)
        return DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)

    other = fresh()
    hook_state, hook = gt.comm_hook(gradcomp.make(spec))
    hook_state.load_state_dict(saved)
    other.register_comm_hook(hook_state, hook)
    xb, yb = _batch(x, y, 5, launch.rank, launch.size)
    try:
        F.cross_entropy(other(xb), yb).backward()
    except RuntimeError as exc:
        assert "no bucket of this step carries" in str(exc) and "register" in str(exc), exc
    else:
        raise AssertionError("state keyed by parameter name was silently ignored by an unnamed hook")
    named = fresh()
    again = gt.register(named, gradcomp.make(spec))
    again.load_state_dict(saved)
    F.cross_entropy(named(xb), yb).backward()
    print(f"rank {launch.rank}: ok", flush=True)


def rank_pickled_compressor_keeps_its_names():
    """A compressor pickled from a hook registered with the model (residuals keyed by parameter
    name), loaded with torch.load(weights_only=False) and attached through comm_hook() without the
    model (PyTorch's hook-pickling flow): its residuals are not dropped, they follow their
    parameters by name (test_torch_hook_pickling checks the resumed run bit for bit). Through
    register it resumes too, claiming every residual."""
    import io

    import torch.nn.functional as F

    torch, gt, launch, model, x, y = _setup()
    import gradcomp
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    state = gt.register(model, gradcomp.make("int8:warmup=0"))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for it in range(3):
        xb, yb = _batch(x, y, it, launch.rank, launch.size)
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()
    buffer = io.BytesIO()
    torch.save(state.compressor, buffer)
    names = sorted(name for name, _ in model.module.named_parameters())
    assert sorted(state.compressor.residuals(names)) == names  # there is per-parameter state to lose

    def restored():
        return torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)

    def fresh():
        torch.manual_seed(0)
        return DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)

    xb, yb = _batch(x, y, 3, launch.rank, launch.size)
    unnamed = fresh()
    hooked, hook = gt.comm_hook(restored())
    unnamed.register_comm_hook(hooked, hook)
    F.cross_entropy(unnamed(xb), yb).backward()
    kept = hooked.compressor.residuals(names)
    assert sorted(kept) == names and all(float(abs(v).max()) > 0 for v in kept.values())
    named = fresh()
    again = gt.register(named, restored())
    F.cross_entropy(named(xb), yb).backward()
    kept = again.compressor.residuals(names)
    assert sorted(kept) == names and all(float(abs(v).max()) > 0 for v in kept.values())
    print(f"rank {launch.rank}: ok", flush=True)


def rank_ddp_parameters_need_the_model():
    """OneBitAdam and DGC over a DDP model's parameters without model= would let DDP average in
    fp32 first (nothing compressed): refused on every rank, naming model=; with the model's hook
    already gradcomp's, the message names that hook. A model running local_hook, and a model
    without DDP, are accepted."""
    torch, gt, launch, model, x, y = _setup()
    import gradcomp
    from torch.nn.parallel import DistributedDataParallel

    from examples.torch_ddp import DigitsCNN

    for make in (lambda ps: gt.OneBitAdam(ps, lr=1e-3), lambda ps: gt.DGC(ps, lr=0.1)):
        with pytest.raises(ValueError, match=r"belong to a DistributedDataParallel model, which averages "
                                             r"their gradients in fp32 .* model=ddp_model"):
            make(model.parameters())
    hooked = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    gt.register(hooked, gradcomp.make("fp16"))
    with pytest.raises(ValueError, match=r"through its communication hook \(gradcomp_hook\[FP16"):
        gt.DGC(list(hooked.parameters()), lr=0.1)
    local = DistributedDataParallel(DigitsCNN(), bucket_cap_mb=0.01)
    local.register_comm_hook(None, gt.local_hook)
    gt.DGC(local.parameters(), lr=0.1)
    plain = DigitsCNN()
    gt.OneBitAdam(plain.parameters(), lr=1e-3)
    gt.DGC(model.parameters(), lr=0.1, model=model)  # the refused model, passed as it should be
    print(f"rank {launch.rank}: ok", flush=True)


@pytest.mark.parametrize("check", ["rank_ddp_parameters_need_the_model",
                                   "rank_pickled_compressor_keeps_its_names",
                                   "rank_onebit_adam_is_adamw_then_compresses", "rank_dgc_on_ddp",
                                   "rank_dgc_sending_everything_is_momentum_sgd",
                                   "rank_onebit_adam_resumes_inside_a_lossy_warmup",
                                   "rank_hook_state_without_names_is_refused",
                                   "rank_auto_warmups_checkpoint_through_torch"])
def test_torch_optimizers(check):
    run_ranks(2, f"tests.torch_adapter.test_torch_optim:{check}", timeout=300)
