"""PyTorch's hook-pickling flow on gradcomp's hook, under mpiexec with 2 ranks (issue 65, item 6).

PyTorch's own test (``test_ddp_hook_pickling_powerSGD``) trains under a hook, ``torch.save``s the
hook state, ``torch.load``s it and attaches it to a fresh DDP model with ``register_comm_hook``.
Here: train N steps under ``gt.register(model, c)``, save the model and the compressor, load both,
attach the compressor to a fresh DDP model with ``register_comm_hook(*gt.comm_hook(restored))``
(no model given), continue M steps: the parameters must equal those of N + M uninterrupted steps
bit for bit. The digits CNN spans three buckets after DDP's rebuild (``BUCKET_CAP_MB``), while a
fresh model's first step puts every parameter in one: the restored residuals and warm-start
factors must follow their parameters through both, by name.
"""
from __future__ import annotations

import importlib.util
import io

import numpy as np
import pytest

from tests.mpi_launch import run_ranks
from tests.torch_adapter.test_torch_adapter import (  # noqa: F401  (after_rank_success: mpi_launch calls it)
    BUCKET_CAP_MB, after_rank_success, assert_bitwise, env)

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

N, M = 4, 3  # steps before the save, and after it (M >= 2: through the resumed run's rebuild)


def _train(e, model, opt, steps):
    F = e.torch.nn.functional
    for it in steps:
        x, y = e.batch(it)
        F.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _ddp(e, net, **kwargs):
    return e.torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=BUCKET_CAP_MB, **kwargs)


def check_resumes_exactly(e, spec: str) -> None:
    """N steps under register, torch.save, torch.load(weights_only=False), a fresh DDP model, M
    steps == N + M straight; through both flows: the compressor alone, attached with
    register_comm_hook(*comm_hook(restored)), and PyTorch's own test's (the hook and its state
    saved together and handed back to register_comm_hook as they are); in the schedule register
    chose (``Hierarchical`` on several hosts of several ranks, where the method says it pays)."""
    torch, gc, gt = e.torch, e.gc, e.gt
    straight = _ddp(e, e.fresh_model())
    schedule = type(gt.register(straight, gc.make(spec)).compressor)  # Hierarchical where it pays
    opt = torch.optim.SGD(straight.parameters(), lr=0.1)
    _train(e, straight, opt, range(N + M))
    want = e.flat(straight.parameters())

    model = _ddp(e, e.fresh_model())
    compressor = gc.make(spec)
    first = gt.register(model, compressor)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _train(e, model, opt, range(N))
    names = [name for name, _ in model.module.named_parameters()]
    buffer = io.BytesIO()  # every rank its own: residuals belong to the rank that made them
    torch.save({"model": model.module.state_dict(), "compressor": compressor,
                "comm_hook": model._comm_hooks[0][0], "comm_hook_state": first}, buffer)
    del model, opt, compressor, first

    for flow in ("compressor", "hook and state"):
        saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
        net = e.DigitsCNN()  # other initial values, then the trained ones
        net.load_state_dict(saved["model"])
        fresh = _ddp(e, net)
        if flow == "compressor":
            state, hook = gt.comm_hook(saved["compressor"])
        else:
            state, hook = saved["comm_hook_state"], saved["comm_hook"]
            assert hook.__qualname__.startswith("gradcomp_hook[") and state.comm is None
        fresh.register_comm_hook(state, hook)
        assert type(state.compressor) is schedule, f"{spec}, {flow}: {state.compressor} in place of {schedule}"
        opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
        _train(e, fresh, opt, range(N, N + 1))
        # the state went to the parameters by name, through the fresh model's one first bucket
        assert sorted(state.names.values()) == sorted(names), state.names
        assert len(state.layouts) == 3, f"{spec}: the rebuilt layouts are three buckets, got {state.layouts}"
        if spec.startswith("int8"):  # (in Hierarchical, each rank keeps those of its host group)
            kept = state.compressor.residuals(names)
            if schedule.__name__ == "Hierarchical":
                from mpi4py import MPI
                kept = {k for held in MPI.COMM_WORLD.allgather(sorted(kept)) for k in held}
            assert sorted(kept) == sorted(names), f"{spec}: residuals lost: {sorted(set(names) - set(kept))}"
        _train(e, fresh, opt, range(N + 1, N + M))
        got = e.flat(fresh.parameters())
        assert_bitwise([got], [want], f"{spec}, {flow}: the resumed run against {N + M} uninterrupted steps")
        e.same_on_all_ranks(got, f"{spec}, {flow}: resumed parameters")
        if e.rank == 0:
            print(f"{spec}, {flow}: the resumed run equals the uninterrupted one bit for bit", flush=True)


def check_names_and_refusals(e) -> None:
    """Names come from the model that holds the bucket's parameters, whatever DDP's first buckets
    (several, with find_unused_parameters=True); a restored compressor on a model with other
    parameters is refused from backward() on every rank, naming what to do."""
    torch, gc, gt = e.torch, e.gc, e.gt
    F = torch.nn.functional
    model = _ddp(e, e.fresh_model())
    compressor = gc.make("int8:warmup=0")
    gt.register(model, compressor)
    _train(e, model, torch.optim.SGD(model.parameters(), lr=0.1), range(2))
    pickled = io.BytesIO()
    torch.save(compressor, pickled)

    def restored():
        return torch.load(io.BytesIO(pickled.getvalue()), weights_only=False)

    several = _ddp(e, e.fresh_model(), find_unused_parameters=True)
    state, hook = gt.comm_hook(restored())
    several.register_comm_hook(state, hook)
    _train(e, several, torch.optim.SGD(several.parameters(), lr=0.1), range(2, 3))
    want = {id(p): name for name, p in several.module.named_parameters()}
    assert state.names == want, "names must be the model's own, by identity"

    other = torch.nn.Sequential(torch.nn.Linear(64, 10))  # the digits' inputs, other parameters
    wrong = _ddp(e, other)
    wrong.register_comm_hook(*gt.comm_hook(restored()))
    x, y = e.batch(0)
    with pytest.raises(RuntimeError, match=r"saved from a model with other parameters \(its model had "
                                           r"'conv1.weight'.*same parameters"):
        F.cross_entropy(wrong(x.reshape(len(x), -1)), y).backward()
    # through register, the same refusal before anything is registered
    with pytest.raises(ValueError, match="saved from a model with other parameters"):
        gt.register(_ddp(e, torch.nn.Sequential(torch.nn.Linear(64, 10))), restored())


def rank_pickled_compressor_through_comm_hook():
    e = env()
    e.torch.manual_seed(0)
    check_names_and_refusals(e)
    for spec in ("int8:warmup=0", "powersgd:start_iter=2"):
        check_resumes_exactly(e, spec)


def test_pickled_compressor_attaches_through_comm_hook():
    out = run_ranks(2, "tests.torch_adapter.test_torch_hook_pickling:rank_pickled_compressor_through_comm_hook",
                    timeout=240)
    assert out.count("bit for bit") == 4, out


def rank_pickled_compressor_on_two_hosts():
    e = env()
    e.torch.manual_seed(0)
    for spec in ("int8:warmup=0", "powersgd:start_iter=2"):
        check_resumes_exactly(e, spec)


def test_pickled_compressor_resumes_in_its_host_groups():
    """On 2 hosts of 2 ranks register runs the compressor in Hierarchical, whose ranks keep the
    state of their host groups only; restored through comm_hook (the compressor alone) or as a
    pickled HookState, it runs there again and equals the uninterrupted run bit for bit. (It ran
    flat, or refused its state: a tensor whose group moved to another local rank at DDP's rebuild
    left its residual behind, now handed to the new owner through the host's sum.)"""
    out = run_ranks(4, "tests.torch_adapter.test_torch_hook_pickling:rank_pickled_compressor_on_two_hosts",
                    timeout=240, env={"GRADCOMP_RANKS_PER_HOST": "2"})
    assert out.count("bit for bit") == 4, out
