"""FSDP2 (``fully_shard``) through gradcomp on real ranks: exact against FSDP's own
reduce-scatter, bytes against the codec's formula, bit-exact resume, and the errors a user meets."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from tests.mpi_launch import ROOT, leave_before_torch_teardown, run_ranks  # noqa: E402

STEPS = 4


def _model(seed=0, uneven=True):
    """Two blocks and a head, with dims that do not split evenly over 2 or 3 ranks (padded shards)."""
    from torch import nn

    torch.manual_seed(seed)
    width = 37 if uneven else 32
    return nn.Sequential(nn.Linear(12, width), nn.Sequential(nn.Tanh(), nn.Linear(width, width)),
                         nn.Tanh(), nn.Linear(width, 5))


def _shard(model, mp=None):
    from torch.distributed.fsdp import fully_shard

    kwargs = {} if mp is None else {"mp_policy": mp}
    fully_shard(model[0], **kwargs)
    fully_shard(model[1], **kwargs)
    fully_shard(model, **kwargs)
    return model


def _batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 12, generator=g), torch.randn(8, 5, generator=g)


def _backward(model, step, rank):
    x, y = _batch(step, rank)
    loss = ((model(x) - y) ** 2).mean()
    loss.backward()


def _grads(model):
    return [p.grad.to_local().clone() for p in model.parameters()]


def rank_exact_against_fsdp():
    """allreduce (and fp32 allgather) give FSDP's own sharded gradients within float32 rounding."""
    import gradcomp.torch as gt

    launch = gt.init_process_group()
    rank = launch.rank
    own, ours, gathered = _shard(_model()), _shard(_model()), _shard(_model())
    state = gt.register(ours, "allreduce")
    state2 = gt.register(gathered, "allgather")
    worst = 0.0
    for step in range(STEPS):
        for m in (own, ours, gathered):
            m.zero_grad()
            _backward(m, step, rank)
        for a, b, c in zip(_grads(own), _grads(ours), _grads(gathered)):
            scale = a.abs().max().clamp_min(1e-30)
            worst = max(worst, float((a - b).abs().max() / scale), float((a - c).abs().max() / scale))
        with torch.no_grad():
            for m in (own, ours, gathered):
                for p in m.parameters():
                    p -= 0.1 * p.grad
    assert worst <= 1e-5, worst
    stats = state.compressor.stats()
    assert stats["steps"] == STEPS and stats["calls"] == 3 * STEPS, stats
    assert abs(stats["compression_ratio"] - 1.0) < 1e-9, stats
    assert state2.compressor.stats()["steps"] == STEPS
    leave_before_torch_teardown(state.comm)


def rank_int8_bytes_and_quality():
    """int8 (no warm-up): the reduce-scatter sends one int8 message per row, and the gradients
    stay close to FSDP's own."""
    import gradcomp.torch as gt
    from gradcomp.compressors.quantize import QuantizedAllreduce

    launch = gt.init_process_group()
    rank, size = launch.rank, launch.size
    own, ours = _shard(_model()), _shard(_model())
    state = gt.register(ours, "int8:warmup=0")
    for step in range(STEPS):
        for m in (own, ours):
            m.zero_grad()
            _backward(m, step, rank)
        for a, b in zip(_grads(own), _grads(ours)):
            assert float((a - b).abs().max()) <= 0.05 * float(a.abs().max()) + 1e-6, (a, b)
    codec = QuantizedAllreduce(8)
    rows = [sum(_row(p, size) for p in params) for params in _param_rows(ours)]
    expected = STEPS * sum((size - 1) * codec.message_size(r) for r in rows)
    sent = state.compressor.stats()["bytes_sent"]
    assert abs(sent - expected) <= 0.01 * expected, (sent, expected)
    ratio = state.compressor.stats()["compression_ratio"]
    assert 2.0 < ratio < 4.0, ratio  # tiny shards: the per-chunk parameters weigh more than at scale
    leave_before_torch_teardown(state.comm)


def rank_quantized_all_gather(spec, dtype_name):
    """all_gather=int8/int4: the full parameters each forward computes with are the same bits on
    every rank and within the codes' rounding of FSDP's own; the bytes are one message per row and
    call; training moves on; a rank that asked for something else is named on every rank."""
    import numpy as np
    import gradcomp.torch as gt
    from gradcomp.comm import CollectiveError
    from torch.distributed.fsdp import MixedPrecisionPolicy

    launch = gt.init_process_group()
    rank, size = launch.rank, launch.size
    dtype = getattr(torch, dtype_name)
    mp = None if dtype == torch.float32 else MixedPrecisionPolicy(param_dtype=dtype)
    own, ours = _shard(_model(), mp), _shard(_model(), mp)
    state = gt.register(ours, "allreduce", all_gather=spec)
    seen = {}
    for name, m in (("own", own), ("ours", ours)):
        m[1][1].register_forward_hook(lambda mod, args, out, name=name: seen.__setitem__(name, mod.weight.detach().clone()))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-2)
    opt_own = torch.optim.AdamW(own.parameters(), lr=1e-2)
    bits = gt.fsdp_gather.BITS[spec.split(":")[0]]
    for step in range(STEPS):
        exact = ours[1][1].weight.full_tensor().detach().float()  # FSDP's own gather of the shards
        for m, o in ((own, opt_own), (ours, opt)):
            o.zero_grad()
            _backward(m, step, rank)
            o.step()
        coded = seen["ours"].float()
        if step == 0:
            assert torch.equal(seen["own"].float(), exact.to(dtype).float())  # FSDP computes with these
        everyone = [torch.empty_like(coded) for _ in range(size)]
        torch.distributed.all_gather(everyone, coded)
        assert all(torch.equal(everyone[0], e) for e in everyone), "ranks computed with different weights"
        step_size = float(exact.max() - exact.min()) / ((1 << bits) - 1)
        assert float((exact - coded).abs().max()) <= 0.5 * step_size + 1e-2 * float(exact.abs().max()), step
        if bits == 8 and dtype == torch.float32:
            assert not torch.equal(exact, coded)  # the codes did round
    stats = state.all_gather_stats()
    with state.exact_all_gather(), torch.no_grad():  # FSDP's own all-gather: the exact weights
        ours(_batch(0, rank)[0])
        assert torch.equal(seen["ours"], ours[1][1].weight.full_tensor().to(dtype))
    assert state.all_gather_stats() == stats  # none of gradcomp's all-gathers ran inside
    codec = gt.fsdp_gather.gather_codec(spec)
    rows = [sum(_row(p, size) for p in params) for params in _param_rows(ours)]
    # each step: every module gathered before its forward, and again before its backward
    # (reshard_after_forward), except the root, which keeps its parameters through the backward
    per_step = sum(rows) * 2 - rows[0]  # rows[0]: the root's
    assert stats["calls"] == STEPS * (2 * len(rows) - 1), stats
    expected = STEPS * (size - 1) * sum(codec.message_size(r) * (1 if i == 0 else 2)
                                        for i, r in enumerate(rows))
    assert stats["bytes_sent"] == expected, (stats, expected)
    assert stats["bytes_uncompressed"] == STEPS * (size - 1) * per_step * torch.tensor([], dtype=dtype).element_size()
    with pytest.raises(ValueError, match="all-gather takes 'int8' or 'int4'"):
        gt.register(_shard(_model()), "int8", all_gather="fp16")
    with pytest.raises(ValueError, match="DDP"):
        gt.register(object(), "int8", all_gather="int8")
    with pytest.raises(CollectiveError, match="rank 0: .*all_gather=int8.*rank 1: .*all_gather=None"):
        gt.register(_shard(_model()), "allreduce", all_gather="int8" if rank == 0 else None)
    leave_before_torch_teardown(state.comm)


def _param_rows(model):
    """Each FSDP module's parameters (their original shapes), in FSDP's order."""
    from torch.distributed.fsdp import FSDPModule

    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            groups = m._get_fsdp_state()._fsdp_param_groups
            out.extend([[tuple(p._orig_size) for p in g.fsdp_params] for g in groups])
    return out


def _row(shape, size):
    import math

    return -(-shape[0] // size) * math.prod(shape[1:])


def _train(model, state, steps, first, rank, opt):
    for step in range(first, first + steps):
        opt.zero_grad()
        _backward(model, step, rank)
        opt.step()


def rank_resume_is_bit_exact(name, path, all_gather=None):
    """Train 6 steps; or 3, checkpoint (FSDP's model and optimizer state dicts and gradcomp's),
    rebuild everything, load, train 3 more: the weights are equal bit for bit (with the
    parameter all-gathers in codes too: they hold no state)."""
    import gradcomp.torch as gt
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    launch = gt.init_process_group()
    rank = launch.rank
    whole = _shard(_model())
    state = gt.register(whole, name, allow_partial=True, all_gather=all_gather)
    opt = torch.optim.AdamW(whole.parameters(), lr=1e-2)
    _train(whole, state, 6, 0, rank, opt)

    first = _shard(_model())
    state1 = gt.register(first, name, allow_partial=True, all_gather=all_gather)
    opt1 = torch.optim.AdamW(first.parameters(), lr=1e-2)
    _train(first, state1, 3, 0, rank, opt1)
    msd, osd = get_state_dict(first, opt1)
    torch.save({"model": msd, "optim": osd, "gradcomp": state1.state_dict()}, f"{path}.{rank}")

    saved = torch.load(f"{path}.{rank}", weights_only=True)
    second = _shard(_model(seed=7))
    opt2 = torch.optim.AdamW(second.parameters(), lr=1e-2)
    set_state_dict(second, opt2, model_state_dict=saved["model"], optim_state_dict=saved["optim"])
    state2 = gt.register(second, name, allow_partial=True, all_gather=all_gather)
    state2.load_state_dict(saved["gradcomp"])
    _train(second, state2, 3, 3, rank, opt2)
    for a, b in zip(whole.parameters(), second.parameters()):
        assert torch.equal(a.to_local(), b.to_local()), (name, a, b)
    assert state2.compressor.stats()["steps"] == 3
    # and a state saved on another model is refused, naming what differs
    other = _shard(_model())
    state3 = gt.register(other, "int4:warmup=0")
    try:
        state3.load_state_dict(saved["gradcomp"])
    except ValueError as exc:
        assert "saved by" in str(exc), exc
    else:
        raise AssertionError("an int8 checkpoint loaded into int4")
    leave_before_torch_teardown(state.comm)


def rank_refusals():
    import gradcomp.torch as gt

    gt.init_process_group()
    model = _shard(_model())
    for names, needles in ((("powersgd", "randomk", "auto"), ("no reduce-scatter form", "int8")),
                          # 25x and more: refused unless asked for, pointing to what works
                          (("onebit", "topk"), ("int4", "allow_partial=True"))):
        for name in names:
            with pytest.raises(ValueError) as refused:
                gt.register(model, name)
            assert all(n in str(refused.value) for n in needles), (name, refused.value)
            if "no reduce-scatter form" in needles:  # what it suggests, FSDP takes
                listed = str(refused.value).split("use one of: ")[1].split(", ")
                assert "int8" in listed and not {"onebit", "topk", "powersgd"} & set(listed), refused.value
    try:
        gt.register(_model(), "int8")
    except TypeError as exc:
        assert "fully_shard" in str(exc) and "DistributedDataParallel" in str(exc), exc
    else:
        raise AssertionError("a plain module registered")
    state = gt.register(model, "int8")
    try:
        state.load_state_dict({"compressor": "x", "state": {}})
    except ValueError as exc:
        assert "FSDPState.state_dict" in str(exc), exc
    else:
        raise AssertionError("a DDP-shaped state loaded")
    # a second register on the same model: a RuntimeError, as DDP's (its own state may come again)
    with pytest.raises(RuntimeError, match="already has gradcomp's reduce-scatter"):
        gt.register(model, "int4")
    assert gt.register(model, None, state=state) is state
    leave_before_torch_teardown(state.comm)


def rank_bf16_reduce_dtype(name):
    """MixedPrecisionPolicy(reduce_dtype=bfloat16 / float16: FSDP asks for AVG / SUM)."""
    import gradcomp.torch as gt
    from torch.distributed.fsdp import MixedPrecisionPolicy

    launch = gt.init_process_group()
    for dtype in (torch.bfloat16, torch.float16):
        mp = MixedPrecisionPolicy(reduce_dtype=dtype)
        own, ours = _shard(_model(), mp), _shard(_model(), mp)
        state = gt.register(ours, name)
        for m in (own, ours):
            _backward(m, 0, launch.rank)
        for a, b in zip(_grads(own), _grads(ours)):
            assert float((a.float() - b.float()).abs().max()) <= 0.05 * float(a.float().abs().max()) + 1e-6, (a, b)
    leave_before_torch_teardown(state.comm)


def test_allreduce_equals_fsdps_own_reduce_scatter():
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_exact_against_fsdp", timeout=180)


def test_allreduce_equals_fsdps_own_at_three_ranks():
    run_ranks(3, "tests.torch_adapter.test_torch_fsdp:rank_exact_against_fsdp", timeout=240)


def test_int8_bytes_are_the_formula_and_gradients_close():
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_int8_bytes_and_quality", timeout=180)


@pytest.mark.parametrize("name, all_gather", [("int8", None), ("int4:warmup=2", None), ("topk:warmup=1", None),
                                              ("int8:warmup=2", "int8")])
def test_resume_is_bit_exact_under_mpiexec(name, all_gather, tmp_path):
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_resume_is_bit_exact", name, str(tmp_path / "ckpt"),
              all_gather, timeout=240)


def test_refusals_name_what_works():
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_refusals", timeout=180)


@pytest.mark.parametrize("name", ["allreduce", "int8:warmup=0"])
def test_half_reduce_dtypes(name):
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_bf16_reduce_dtype", name, timeout=180)


@pytest.mark.parametrize("spec, dtype", [("int8", "float32"), ("int4:chunk=512", "float32"), ("int8", "bfloat16")])
def test_quantized_parameter_all_gather(spec, dtype):
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_quantized_all_gather", spec, dtype, timeout=180)


def test_quantized_parameter_all_gather_under_torchrun(tmp_path):
    """The same checks through torchrun (TorchCommunicator's allgather)."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nfrom tests.torch_adapter.test_torch_fsdp import "
                      "rank_quantized_all_gather\nrank_quantized_all_gather('int8', 'float32')\n" % str(ROOT))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def test_resume_is_bit_exact_under_torchrun(tmp_path):
    """The same resume through torchrun (TorchCommunicator)."""
    script = tmp_path / "job.py"
    script.write_text("import sys\nsys.path.insert(0, %r)\nfrom tests.torch_adapter.test_torch_fsdp import rank_resume_is_bit_exact\n"
                      "rank_resume_is_bit_exact('int8:warmup=2', %r)\n" % (str(ROOT), str(tmp_path / "ckpt")))
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def rank_accumulation_and_unused():
    """Gradient accumulation (no reduce on the first micro-step) stays exact; a parameter without
    a gradient is named by a clear error, and set_reduce_scatter_unused_params(True) mends it."""
    import gradcomp.torch as gt
    from torch import nn

    launch = gt.init_process_group()
    rank = launch.rank
    own, ours = _shard(_model()), _shard(_model())
    state = gt.register(ours, "allreduce")
    for m in (own, ours):
        m.set_requires_gradient_sync(False)
        _backward(m, 0, rank)
        m.set_requires_gradient_sync(True)
        _backward(m, 1, rank)
    for a, b in zip(_grads(own), _grads(ours)):
        assert float((a - b).abs().max()) <= 1e-5 * float(a.abs().max()), (a, b)
    assert state.compressor.stats()["steps"] == 1

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = nn.Linear(12, 5), nn.Linear(12, 5)

        def forward(self, x):
            return self.used(x)

    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    branchy = fully_shard(Branchy())
    gt.register(branchy, "int8")
    try:
        _backward(branchy, 0, rank)
    except Exception as exc:
        assert "set_reduce_scatter_unused_params" in str(exc), exc
    else:
        raise AssertionError("a parameter without a gradient went unnoticed")
    torch.manual_seed(0)
    mended = fully_shard(Branchy())
    mended.set_reduce_scatter_unused_params(True)
    mended_state = gt.register(mended, "int8")
    _backward(mended, 0, rank)
    assert mended_state.compressor.stats()["steps"] == 1
    leave_before_torch_teardown(state.comm)


def test_accumulation_and_unused_parameters():
    run_ranks(2, "tests.torch_adapter.test_torch_fsdp:rank_accumulation_and_unused", timeout=180)


def _shard_on(model, mesh):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model[0], mesh=mesh)
    fully_shard(model[1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def rank_across_hosts(name, tolerance):
    """2 hosts x 2 ranks: FSDP inside each host, gradcomp's allreduce across hosts (the all-reduce
    hook) gives the gradients of FSDP over all 4 ranks; only the cross-host bytes are counted."""
    import gradcomp.torch as gt
    from torch.distributed.device_mesh import init_device_mesh

    launch = gt.init_process_group()
    rank = launch.rank
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("host", "local"))
    own = _shard(_model())
    ours = _shard_on(_model(), mesh["local"])
    state = gt.register(ours, name, allow_partial=True)
    assert state.comm.size == 2
    for step in range(STEPS):
        for m in (own, ours):
            m.zero_grad()
            _backward(m, step, rank)
        for a, b in zip(own.parameters(), ours.parameters()):
            full_a, full_b = a.grad.full_tensor(), b.grad.full_tensor()
            assert float((full_a - full_b).abs().max()) <= tolerance * float(full_a.abs().max()), (name, full_a, full_b)
    stats = state.compressor.stats()
    assert stats["steps"] == STEPS and stats["calls"] == 3 * STEPS, stats
    # the host's replicas are the same bits: each rank's shard equals the same local rank's on the other host
    digests = [float(p.grad.to_local().double().sum()) for p in ours.parameters()]
    t = torch.tensor(digests, dtype=torch.float64)
    gathered = [torch.zeros_like(t) for _ in range(4)]
    torch.distributed.all_gather(gathered, t)
    assert torch.equal(gathered[rank], gathered[rank ^ 2]), gathered
    leave_before_torch_teardown(state.comm)


@pytest.mark.parametrize("name, tolerance", [("allreduce", 1e-5), ("int8:warmup=0", 0.05), ("powersgd:start_iter=2", 1.0)])
def test_fsdp_inside_hosts_gradcomp_across(name, tolerance):
    run_ranks(4, "tests.torch_adapter.test_torch_fsdp:rank_across_hosts", name, tolerance, timeout=300)
