"""Every registered name and both optimizers on DDP layouts a real model has: several buckets and
the rebuild after the first step, randomized bucket caps and parameter orders,
``find_unused_parameters``, ``static_graph``, ``gradient_as_bucket_view`` on and off and ``no_sync``
accumulation, under momentum SGD and AdamW, at 4 ranks.

What a method keeps between steps must follow each tensor whatever reaches it: the governor moves
tensors between rungs on their own, so a warm-up behind it sees a different set of tensors from
step to step (issue 65: ``Settling: got 7 levels, 11 before`` on a GRU LM). The governor's and the
warm-ups' pace is shortened here (``quicken``) so that one short run passes every warm-up's end,
several audits and rung changes (up and down) and the adaptive optimizer's first try of the method:
the same code paths as a run of thousands of steps. Each case asserts that it trained on every rank
to the same bits, that its warm-ups ended and that its governor decided.
"""
from __future__ import annotations

import importlib.util
import random

import numpy as np
import pytest

from tests.mpi_launch import leave_before_torch_teardown, run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")

STEPS = 90
#: the shortened pace: the governor's period, window and hold, the adaptive optimizer's hold, and
#: the auto warm-up's window, earliest and latest end (the defaults: 50, 10, 100, 400; 10, 30, 300):
#: warm-ups long against the governor's period, so that rungs change while they warm up
EVERY, WINDOW, HOLD, ADAPTIVE_HOLD = 6, 2, 8, 10
SETTLE_WINDOW, SETTLE_EARLIEST, SETTLE_LATEST = 3, 24, 45
FIXED_WARMUP = 6  # a fixed warm-up's steps (int8's 50, randomk's 100)


def quicken(root, budget: float | None = None) -> tuple[list, list]:
    """Shorten the pace of every governor and warm-up found under ``root`` (a compressor or a
    gradcomp optimizer); ``budget``: the governors' instead of theirs (one near the costs
    measured moves some buckets and not others, so that each rung sees a changing set of
    tensors). Returns (governors, warm-ups: settlings and recipes with a fixed warm-up)."""
    from gradcomp.planning import governor as gov_module
    from gradcomp.planning.governor import Governed
    from gradcomp.schedule import Schedule
    from gradcomp.settling import Settling

    gov_module.ADAPTIVE_HOLD = ADAPTIVE_HOLD
    governors, warmups, seen = [], [], set()

    def visit(obj, owner):
        if id(obj) in seen or obj is None or isinstance(obj, (int, float, str, bytes, np.ndarray)):
            return
        seen.add(id(obj))
        if isinstance(obj, Settling):
            obj.window, obj.earliest, obj.latest = SETTLE_WINDOW, SETTLE_EARLIEST, SETTLE_LATEST
            warmups.append(obj)
            if isinstance(owner, Schedule):
                owner.start_later_stages(obj.latest)
            elif hasattr(owner, "_settled"):
                owner._settled(obj.latest)
            return
        if isinstance(obj, Governed):
            obj.every, obj.window, obj.hold = EVERY, WINDOW, HOLD
            obj.budget = obj.budget if budget is None else budget
            governors.append(obj)
        if isinstance(obj, Schedule) and getattr(obj, "settling", None) is None and len(obj.starts) > 1 \
                and obj.starts[1] > FIXED_WARMUP and type(obj).__name__ == "Recipe":
            obj.start_later_stages(FIXED_WARMUP)
            warmups.append(obj)
        if isinstance(obj, (list, tuple)):
            for item in obj:
                visit(item, owner)
            return
        for name, value in vars(obj).items() if hasattr(obj, "__dict__") else ():
            if name.startswith("__") or callable(value) and not hasattr(value, "__dict__"):
                continue
            if type(value).__module__.split(".")[0] in ("gradcomp", "builtins"):
                visit(value, obj)

    visit(root, None)
    return governors, warmups


def _cases() -> list[tuple[str, str, int]]:
    """(method, optimizer, seed): every name under SGD and AdamW, the optimizers under their own."""
    import gradcomp

    names = sorted(gradcomp.REGISTRY)
    out = [(name, opt, 2 * i + j) for i, name in enumerate(names) for j, opt in enumerate(("sgd", "adamw"))]
    return out + [("opt:onebitadam", "onebitadam", 101), ("opt:dgc", "dgc", 102)]


def rank_layouts(cases):
    import warnings

    import torch

    torch.set_num_threads(1)
    import gradcomp
    import gradcomp.torch as gt
    from mpi4py import MPI

    warnings.simplefilter("ignore", RuntimeWarning)  # randomk says it is not recommended
    launch = gt.init_process_group()
    world = MPI.COMM_WORLD
    F = torch.nn.functional
    failures, comms = [], []
    for method, optimizer, seed in cases:
        layout = random.Random(seed)  # the same draws on every rank
        cap = layout.choice([0.004, 0.008, 0.016, 0.03])
        options = dict(find_unused_parameters=layout.random() < 0.4, static_graph=layout.random() < 0.3,
                       gradient_as_bucket_view=layout.random() < 0.5)
        accumulate = layout.random() < 0.4
        order = list(range(6))
        layout.shuffle(order)
        torch.manual_seed(seed)
        net = _Net(order, unused=options["find_unused_parameters"])
        model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=cap, **options)
        what = f"{method} under {optimizer}, cap {cap} MB, {options}, no_sync={accumulate}, order {order}"
        if method.startswith("opt:"):
            cls = gt.OneBitAdam if optimizer == "onebitadam" else gt.DGC
            lr = 3e-3 if optimizer == "onebitadam" else 0.05
            opt = cls(model.parameters(), lr=lr, model=model, bucket_cap_mb=cap)
            root = holder = opt.method_state
        else:
            compressor = gradcomp.make(method)
            state = gt.register(model, compressor)
            root, holder = state.compressor, state
            opt = (torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01)
                   if optimizer == "adamw" else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
        governors, warmups = quicken(root, layout.choice([0.03, 0.1, 0.3, 1.0]))
        data = torch.Generator().manual_seed(1000 * seed + launch.rank)
        first = last = None
        try:
            for step in range(STEPS):
                x = torch.randint(0, 64, (8, 12), generator=data)
                y = (x * 7 + 3) % 64  # a learnable map
                if accumulate and step % 3 == 1:
                    with model.no_sync():
                        F.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1)).backward()
                    continue
                loss = F.cross_entropy(model(x).reshape(-1, 64), y.reshape(-1))
                loss.backward()
                opt.step()
                opt.zero_grad()
                first = loss.item() if first is None else first
                last = loss.item()
        except Exception as exc:  # every rank fails alike (agreed state): collect, go on
            failures.append(f"{what}: {type(exc).__name__}: {exc}")
            continue
        comms.append(holder.comm)
        flat = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).numpy()
        rows = np.empty((world.size, flat.nbytes), np.uint8)
        world.Allgather(np.ascontiguousarray(flat).view(np.uint8), rows)
        if not (rows == rows[0]).all():
            failures.append(f"{what}: the replicas differ")
        if not np.isfinite(flat).all() or not last < first:
            failures.append(f"{what}: the loss went from {first} to {last}")
        warm = [w for w in warmups if (w.ended_at is None if hasattr(w, "ended_at") else w.step <= w.starts[1])]
        if governors and not any(g.audits for g in governors):
            failures.append(f"{what}: the governor audited nothing")
        if launch.rank == 0:
            moves = sum(len(g.decisions) for g in governors)
            print(f"{what}: loss {first:.3f} -> {last:.3f}, {moves} governor decisions, "
                  f"{len(warmups) - len(warm)} of {len(warmups)} warm-ups ended", flush=True)
    assert not failures, "\n".join(failures)
    leave_before_torch_teardown(*{id(c): c for c in comms if c is not None}.values())


class _Net:  # (built inside the job, where torch is imported)
    def __new__(cls, order, unused):
        import torch

        class Net(torch.nn.Module):
            """A small byte model whose parameters register in ``order`` (so DDP buckets them in
            another order), with a branch that takes no part when ``unused``."""

            def __init__(self):
                super().__init__()
                parts = {"embed": torch.nn.Embedding(64, 24), "inner": torch.nn.Linear(24, 48),
                         "norm": torch.nn.LayerNorm(48), "mix": torch.nn.Linear(48, 48),
                         "head": torch.nn.Linear(48, 64), "spare": torch.nn.Linear(48, 48)}
                for i in order:
                    name = list(parts)[i]
                    self.add_module(name, parts[name])
                self.unused = unused

            def forward(self, x):
                h = torch.relu(self.inner(self.embed(x)))
                h = h + torch.tanh(self.mix(self.norm(h)))
                if not self.unused:
                    h = h + 0.1 * self.spare(h)
                return self.head(h)

        return Net()


def _split(cases, parts):
    return [cases[i::parts] for i in range(parts)]


@pytest.mark.parametrize("part", range(2))
def test_every_name_on_many_bucket_layouts(part):
    cases = _split(_cases(), 2)[part]
    run_ranks(4, "tests.torch_adapter.test_layouts:rank_layouts", cases, timeout=900)


def rank_memory_follows_the_layout():
    """What the hook keeps is sized by the model's buckets, not by DDP's first step (which hands
    it every parameter in one bucket) or by layouts gone: the first step is reduced in pieces
    (``layouts.PIECE_BYTES``, shrunk here), so no workspace grows past a piece; after the rebuild the
    slice owners' residuals are those of the buckets in use, none of the first step's pieces. Nor
    does anything of gradcomp hold the first step's bucket once DDP has rebuilt its buckets (in
    the second step's forward), without Python's cycle collector: a reference cycle or the
    pipeline's threads between two jobs kept it, every gradient once more, for a step or for
    good."""
    import gc
    import weakref

    import torch

    torch.set_num_threads(1)
    import gradcomp
    import gradcomp.torch as gt
    from gradcomp.torch import layouts

    layouts.PIECE_BYTES = 24 * 1024
    launch = gt.init_process_group()
    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(12)])  # 16.6 KB a layer
    model = torch.nn.parallel.DistributedDataParallel(net, bucket_cap_mb=0.04)
    handed = []  # a weak reference to each bucket DDP hands the hook
    register_comm_hook = model.register_comm_hook

    def spied(hook_state, hook):
        def spy(hook_state, bucket):
            buffer = bucket.buffer()  # (alive through the hook's call: the hook's own is the same object)
            handed.append(weakref.ref(buffer))
            return hook(hook_state, bucket)

        register_comm_hook(hook_state, spy)

    model.register_comm_hook = spied
    state = gt.register(model, gradcomp.make("int8:warmup=0"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = []
    gc.disable()  # only reference counts free memory, as between a real run's collections
    for step in range(4):
        loss = model(torch.randn(4, 64)).square().mean()
        if step == 1:
            assert len(handed) == 1 and handed[0]() is None, \
                "DDP's first-step bucket is still held after DDP rebuilt its buckets"
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen.append(len(state.layouts))
        if step == 0:
            largest = max(b.nbytes for w in state.comm._pipeline.workspaces for b in w._buffers.values())
            params = sum(p.numel() for p in net.parameters())  # (a byte per value: a whole-model message)
            assert largest < params // 2, f"a workspace buffer of {largest} bytes after the first step"
    gc.enable()
    feedback = state.compressor.compressors[-1]
    owners = feedback.owner_residuals.arrays()
    assert seen[0] > 1 and len(owners) == seen[-1], (seen, sorted(owners))
    leave_before_torch_teardown(state.comm)


def test_memory_follows_the_layout():
    run_ranks(2, "tests.torch_adapter.test_layouts:rank_memory_follows_the_layout", timeout=300)
