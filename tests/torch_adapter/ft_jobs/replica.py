"""One replica group (one process) of a torchft job with gradcomp's compressed DDP, for
``tests/torch_adapter/test_torch_ft.py``.

    python replica.py LIGHTHOUSE NAME OUT_DIR --steps N [--compressor C] [--pause-at K] [--crash-at K]

Trains a small MLP on batches drawn from (step, replica), with ``gradcomp.torch.ft.DistributedDataParallel``
and ``torchft.Optimizer`` (SGD with momentum, so the optimizer's state must heal too), until the
manager has committed N steps. Writes to OUT_DIR:

* ``NAME.log``: one JSON line per step (step, committed, participants, seconds, the compressor's
  ``agreement``-relevant step counter) and a last ``done`` line (stats, steps rolled back, failures);
* ``NAME.params``: the parameters' bytes at the end, concatenated (compared bit for bit).

``--peers P`` (default 2): a step whose quorum has fewer than P participants is discarded
(``manager.report_error``, then ``should_commit`` is False) and tried again a moment later, except
in ``--alone-from K1 --alone-to K2`` (steps K1 <= step < K2 may be committed alone). So a survivor
goes on alone only where the test lets it, and never finishes before the restarted replica joins.
``--pause-at K``: after committing step K, write ``NAME.paused`` and sleep (the test kills it there:
between steps). ``--crash-at K``: ``os._exit(3)`` from a gradient hook in step K, after the quorum
and before the exchange.
"""
from __future__ import annotations

import argparse
import json
import os
import time

T0 = time.perf_counter()

import torch  # noqa: E402
from torchft import Optimizer  # noqa: E402

import gradcomp.torch.ft as gft  # noqa: E402
from tests.torch_adapter.ft_jobs import parts  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("lighthouse")
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--compressor", default="int8:warmup=3")
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--peers", type=int, default=2)
    p.add_argument("--alone-from", type=int, default=0)
    p.add_argument("--alone-to", type=int, default=0)
    args = p.parse_args()
    index, net, inner = parts.model_and_optimizer(args.name)
    manager = parts.manager(
        args.name, args.lighthouse, quorum_timeout_s=30,
        load_state_dict=lambda s: (net.load_state_dict(s["model"]), inner.load_state_dict(s["optim"])),
        state_dict=lambda: {"model": net.state_dict(), "optim": inner.state_dict()})
    model = gft.DistributedDataParallel(manager, net, args.compressor)
    optimizer = Optimizer(manager, inner)

    if args.crash_at is not None:
        def crash(grad: torch.Tensor) -> None:
            if manager.current_step() == args.crash_at:
                os._exit(3)
        net[0].weight.register_hook(crash)

    log = open(os.path.join(args.out, f"{args.name}.log"), "a")

    def write(**record: object) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    write(event="start", pid=os.getpid(), since_start=time.perf_counter() - T0, time=time.time())
    while manager.current_step() < args.steps:
        t = time.perf_counter()
        optimizer.zero_grad()  # the quorum; heals this replica if it is behind
        step = manager.current_step()
        alone_ok = args.alone_from <= step < args.alone_to
        if manager.num_participants() < args.peers and not alone_ok:
            manager.report_error(RuntimeError("waiting for peers"))  # this step is discarded
            optimizer.step()
            time.sleep(0.05)
            continue
        g = torch.Generator().manual_seed(step * 1000 + index)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        committed = manager.current_step() > step
        write(event="step", step=step, committed=committed, participants=manager.num_participants(),
              seconds=time.perf_counter() - t, since_start=time.perf_counter() - T0, time=time.time(),
              loss=float(loss.detach()), compressor_step=model.compressor.state_dict().get("step"))
        if args.pause_at is not None and committed and manager.current_step() == args.pause_at:
            open(os.path.join(args.out, f"{args.name}.paused"), "w").close()
            time.sleep(600)

    with open(os.path.join(args.out, f"{args.name}.params"), "wb") as f:
        for tensor in net.state_dict().values():
            f.write(tensor.detach().contiguous().numpy().tobytes())
    stats = model.compressor.stats()
    write(event="done", step=manager.current_step(), rolled_back=model.steps_rolled_back,
          failures=model.comm.failures, compression_ratio=stats["compression_ratio"],
          bytes_sent=stats["bytes_sent"], since_start=time.perf_counter() - T0, time=time.time())
    log.close()
    parts.leave(manager)


if __name__ == "__main__":
    main()
