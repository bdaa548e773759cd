"""Fault-tolerant compressed training on torchft: kill a replica group, the others go on.

    python examples/torch_ft.py --demo            # a lighthouse and 2 groups here; one killed, restarted
    python examples/torch_ft.py --demo --diloco 10 --compressor int4   # the same with local steps

    torchft_lighthouse --min_replicas 1 --join_timeout_ms 10000 &    # or your own lighthouse
    TORCHFT_LIGHTHOUSE=http://HOST:29510 python examples/torch_ft.py --replica-id 0
    TORCHFT_LIGHTHOUSE=http://HOST:29510 python examples/torch_ft.py --replica-id 1

One process is one replica group (one rank each here; a group of several ranks is started with
torchrun, as torchft's own examples). Each trains the digits CNN of ``examples/torch_ddp.py`` with
``gradcomp.torch.ft.DistributedDataParallel`` (int8 by default) and ``torchft.Optimizer``; each
step's global batch is split over the groups of that step's quorum. ``--diloco H``: local steps
instead, ``gradcomp.torch.DiLoCo(..., manager=)`` with an outer step over the quorum every H steps
(the compressor on the pseudo-gradients), each group on its own batches. A group that is killed is
dropped by the lighthouse after its heartbeat timeout; one that (re)starts is healed from a healthy
one (model, optimizer and compressor state) and joins. ``--demo`` shows it: it starts a lighthouse
and two groups, kills one with SIGKILL half-way, restarts it, and prints each group's last step,
test accuracy and whether both hold the same bits. Guide: docs/guides/fault-tolerance.md.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent


def train(args: argparse.Namespace) -> dict:
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    import gradcomp.torch.ft as gft
    from torch_ddp import DigitsCNN, accuracy, digits  # beside this script

    torch.set_num_threads(1)
    x, y, x_test, y_test = digits()
    torch.manual_seed(0)  # the same start everywhere (torchft also syncs step 0: init_sync)
    net = DigitsCNN()
    inner = torch.optim.SGD(net.parameters(), lr=args.lr, momentum=0.9)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)  # this group's own
    # what a healing group receives besides gradcomp's part: with DiLoCo, only the inner optimizer
    # (its parameters are the synced ones DiLoCo sends)
    load = ((lambda s: inner.load_state_dict(s["optim"])) if args.diloco else
            (lambda s: (net.load_state_dict(s["model"]), inner.load_state_dict(s["optim"]))))
    save = ((lambda: {"optim": inner.state_dict()}) if args.diloco else
            (lambda: {"model": net.state_dict(), "optim": inner.state_dict()}))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=args.timeout)),
        load_state_dict=load, state_dict=save,
        min_replica_size=1,
        use_async_quorum=False,  # required by gradcomp.torch.ft (the guide says why)
        replica_id=f"digits_{args.replica_id}", hostname="localhost",
        store_addr="localhost", store_port=store.port, rank=0, world_size=1,
        timeout=timedelta(seconds=args.timeout), quorum_timeout=timedelta(seconds=60))
    batch = 32
    if args.diloco:
        return train_diloco(args, manager, net, inner, x, y, x_test, y_test, batch)
    model = gft.DistributedDataParallel(manager, net, args.compressor)
    optimizer = Optimizer(manager, inner)

    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # the quorum: heals this group if it is behind
        step = manager.current_step()
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(step))
        rank = manager.participating_rank() or 0  # this group's place in this step's quorum
        idx = order[rank * batch:(rank + 1) * batch]  # its share of the step's global batch
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        optimizer.step()  # only if the manager commits the step
        if args.step_sleep:
            time.sleep(args.step_sleep)  # (the demo: time to kill a group half-way)

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    stats = model.compressor.stats()
    result = dict(replica_id=args.replica_id, step=manager.current_step(),
                  test_accuracy=accuracy(net, x_test, y_test), params_sha256=digest[:16],
                  compression_ratio=stats["compression_ratio"], steps_rolled_back=model.steps_rolled_back)
    print("RESULT " + json.dumps(result), flush=True)
    manager.shutdown(wait=False)
    return result


def train_diloco(args, manager, net, inner, x, y, x_test, y_test, batch: int) -> dict:
    """Local steps on torchft: each group on its own batches, an outer step every --diloco steps."""
    import gradcomp.torch as gt
    from torch_ddp import accuracy

    diloco = gt.DiLoCo(net, inner, sync_every=args.diloco, compressor=args.compressor, manager=manager)
    while diloco.steps < args.steps:  # (a healed group goes on from its source's inner step)
        step = diloco.steps
        order = torch.randperm(len(y), generator=torch.Generator().manual_seed(step * 1000 + args.replica_id))
        idx = order[:batch]  # this group's own batch of this step
        diloco.zero_grad()
        F.cross_entropy(net(x[idx]), y[idx]).backward()
        diloco.step()  # every --diloco steps: the outer step over the quorum
        if args.step_sleep:
            time.sleep(args.step_sleep)
    if args.steps % args.diloco:
        diloco.sync_now()  # the groups hold the same bits after an outer step
    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in net.parameters())).hexdigest()
    stats = diloco.stats()
    result = dict(replica_id=args.replica_id, step=diloco.steps, outer_steps=stats["outer_steps"],
                  test_accuracy=accuracy(net, x_test, y_test), params_sha256=digest[:16],
                  compression_ratio=stats["compression_ratio"], outer_steps_discarded=stats["outer_steps_discarded"],
                  heals=stats["heals"])
    print("RESULT " + json.dumps(result), flush=True)
    manager.shutdown(wait=False)
    return result


def demo(args: argparse.Namespace) -> None:
    """A lighthouse in this process, two groups as subprocesses; group 1 killed and restarted."""
    from torchft.coordination import LighthouseServer

    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=2000)
    env = dict(os.environ, TORCHFT_LIGHTHOUSE=lighthouse.address(), OMP_NUM_THREADS="1")
    quiet = dict(stderr=subprocess.DEVNULL)  # torchft logs every quorum to stderr

    def group(i: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, __file__, "--replica-id", str(i), "--steps", str(args.steps),
                                 "--compressor", args.compressor, "--step-sleep", "0.05",
                                 "--diloco", str(args.diloco)],
                                env=env, stdout=subprocess.PIPE, text=True, **quiet)

    groups = [group(0), group(1)]
    time.sleep(args.kill_after)
    groups[1].send_signal(signal.SIGKILL)
    groups[1].wait()
    print(f"killed group 1 (SIGKILL) after {args.kill_after:g} s; restarting it", flush=True)
    groups[1] = group(1)
    for g in groups:
        out, _ = g.communicate(timeout=600)
        print(next((line for line in out.splitlines() if line.startswith("RESULT ")), f"no result ({g.returncode})"))
    lighthouse.shutdown()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", action="store_true", help="start a lighthouse and 2 groups here, kill one")
    p.add_argument("--replica-id", type=int, default=0)
    p.add_argument("--compressor", default="int8", help="a registry name (name:key=value,...)")
    p.add_argument("--diloco", type=int, default=0, metavar="H",
                   help="local steps: gradcomp.torch.DiLoCo, an outer step every H steps (0: DDP)")
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--timeout", type=float, default=30, help="seconds: collectives, should_commit, healing")
    p.add_argument("--step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--kill-after", type=float, default=8.0, help="--demo: seconds before the kill")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    if args.demo:
        demo(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
