"""One replica group (one process) of a torchft job with ``gradcomp.torch.DiLoCo(..., manager=)``,
for ``tests/torch_adapter/test_torch_ft_diloco.py``.

    python diloco_replica.py LIGHTHOUSE NAME OUT_DIR --steps N [--sync-every H] [--fragments F]
        [--overlap T] [--pause-at K] [--crash-at K] [--wait-for-joiner S]

Trains a small MLP with SGD (momentum: the inner optimizer's state heals too) on batches drawn from
(inner step, replica), with DiLoCo's outer steps (int8 codes with error feedback on the
pseudo-gradients, Nesterov outer momentum) over the manager's quorum, until ``diloco.steps``
reaches N; with fragments or overlap, a last ``sync_now``. Writes to OUT_DIR:

* ``NAME.log``: one JSON line per outer step (inner step, manager step, committed, participants,
  contributors, healed, quorum and total seconds, the outer step counter, the compressor's step
  counter, and the synced parameters' digest) and a last ``done`` line;
* ``NAME.params``: the parameters' bytes at the end (compared bit for bit).

``--pause-at K``: after committing outer step K, write ``NAME.paused`` and sleep (the test kills
it there: between outer steps). ``--crash-at K``: ``os._exit(3)`` in outer step K, once its
exchange has started (after the quorum and the handshake). ``--wait-for-joiner S``: before inner
step S, wait until another group waits at the lighthouse for a quorum (the restarted one, joining:
read from the lighthouse's status page), so that a survivor's next quorum takes it in (torchft
forms a quorum of the previous one's members at once, without waiting for new ones). Every group
joins once ``--groups`` (2) groups send heartbeats to the lighthouse: the job starts with all.
``--step-sleep T``: sleep T s every inner step; ``--stall-before S --stall-s T``: sleep T s before
inner step S (a straggler, late for the outer step after it).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import time
import urllib.request

T0 = time.perf_counter()

import torch  # noqa: E402

import gradcomp.torch as gt  # noqa: E402
from tests.torch_adapter.ft_jobs import parts  # noqa: E402


def digest(arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        h.update(a.tobytes())
    return h.hexdigest()[:16]


def lighthouse_says(lighthouse: str, pattern: str) -> int:
    """A number from the lighthouse's status page (torchft 0.2's dashboard text), or -1."""
    status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    found = re.search(pattern, status)
    return int(found.group(1)) if found else -1


def wait_for_joiner(lighthouse: str) -> None:
    """Until the lighthouse has a quorum request pending (computed every 100 ms: seen twice, 0.3 s
    apart, so that it is not this group's last request)."""
    seen = None
    while True:
        if lighthouse_says(lighthouse, r"have (\d+) participants") < 1:
            seen = None
        elif seen is None:
            seen = time.monotonic()
        elif time.monotonic() - seen > 0.3:
            return
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("lighthouse")
    p.add_argument("name")
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--fragments", type=int, default=1)
    p.add_argument("--overlap", type=int, default=0)
    p.add_argument("--compressor", default="int8")
    p.add_argument("--pause-at", type=int, default=None)
    p.add_argument("--crash-at", type=int, default=None)
    p.add_argument("--wait-for-joiner", type=int, default=None)
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--stall-before", type=int, default=None)
    p.add_argument("--stall-s", type=float, default=0.0)
    args = p.parse_args()
    index, net, inner = parts.model_and_optimizer(args.name)
    manager = parts.manager(
        args.name, args.lighthouse, quorum_timeout_s=60,
        load_state_dict=lambda s: inner.load_state_dict(s["optim"]),  # the parameters: DiLoCo's
        state_dict=lambda: {"optim": inner.state_dict()})
    log = open(os.path.join(args.out, f"{args.name}.log"), "a")

    def write(**record: object) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    write(event="start", pid=os.getpid(), since_start=time.perf_counter() - T0, time=time.time())
    while lighthouse_says(args.lighthouse, r"(\d+) heartbeating") < args.groups:
        time.sleep(0.05)  # the job's start: every group in the first quorum
    t = time.perf_counter()
    diloco = gt.DiLoCo(net, inner, sync_every=args.sync_every, compressor=args.compressor, lr=0.7,
                       momentum=0.5, fragments=args.fragments, overlap=args.overlap, manager=manager)
    outer, ft = diloco.outer, diloco.ft

    def record(t: float) -> None:
        write(event="outer", step=diloco.steps, manager_step=manager.current_step(),
              outer_steps=outer.outer_steps, seconds=time.perf_counter() - t, time=time.time(),
              since_start=time.perf_counter() - T0,
              compressor_steps=[r.compressor.state_dict().get("step") for r in outer.reducers],
              synced=digest(outer.synced), **ft.last)

    record(t)  # the join (a heal, or the job's start)
    if args.crash_at is not None:
        start = ft.start

        def crash(o, reducer):
            futures = start(o, reducer)
            if manager.current_step() == args.crash_at:
                os._exit(3)
            return futures
        ft.start = crash

    while diloco.steps < args.steps:
        if diloco.steps == args.wait_for_joiner:
            wait_for_joiner(args.lighthouse)
        if diloco.steps + 1 == args.stall_before:
            time.sleep(args.stall_s)  # late for the outer step at inner step stall_before
        if args.step_sleep:
            time.sleep(args.step_sleep)
        g = torch.Generator().manual_seed(diloco.steps * 1000 + index)
        x = torch.randn(8, 16, generator=g)
        y = torch.randn(8, 4, generator=g)
        diloco.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        acts = outer.acts()
        t = time.perf_counter()
        diloco.step()
        if acts:
            record(t)
            if (args.pause_at is not None and ft.last.get("committed")
                    and outer.outer_steps == args.pause_at):
                open(os.path.join(args.out, f"{args.name}.paused"), "w").close()
                time.sleep(600)
    if args.fragments > 1 or args.overlap:
        t = time.perf_counter()
        diloco.sync_now()  # every fragment, and what is in flight
        record(t)

    params = [p.detach().contiguous().numpy() for p in net.parameters()]
    with open(os.path.join(args.out, f"{args.name}.params"), "wb") as f:
        for a in params:
            f.write(a.tobytes())
    stats = diloco.stats()
    write(event="done", step=diloco.steps, manager_step=manager.current_step(), digest=digest(params),
          rolled_back=ft.rolled_back, discarded=stats["outer_steps_discarded"], heals=stats["heals"],
          failures=stats["failures"], exchange_compression_ratio=stats["exchange_compression_ratio"],
          bytes_sent=stats["bytes_sent"], since_start=time.perf_counter() - T0, time=time.time())
    log.close()
    parts.leave(manager)


if __name__ == "__main__":
    main()
