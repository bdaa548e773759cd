"""Compressed training on torchft while a replica group dies: examples/torch_lm.py's LM at 4 groups,
one killed with SIGKILL and restarted twice, against the same run without failures.

    python benchmarks/scripts/ft_lm.py --mode ddp --compressor int8 --kills 2 --json ddp_int8_kills.json
    python benchmarks/scripts/ft_lm.py --mode ddp --compressor int8 --kills 0 --json ddp_int8.json
    python benchmarks/scripts/ft_lm.py --mode diloco --compressor int4 --kills 2 --json diloco_int4_kills.json
    python benchmarks/scripts/ft_lm.py --mode diloco --compressor int4 --kills 0 --json diloco_int4.json

A lighthouse runs in this process; each group is one process of this script (``--worker``), on
free ports, over ``ProcessGroupGloo``. ``--mode ddp``: ``gradcomp.torch.ft.DistributedDataParallel``
(the compressor on the gradients, every step) with ``torchft.Optimizer``; ``--mode diloco``:
``gradcomp.torch.DiLoCo(..., manager=)`` (the compressor on the pseudo-gradients, an outer step
every ``--sync-every`` inner steps). The model, corpus, AdamW and its schedule are torch_lm.py's;
each group draws its batches from (seed, step, group), so a restarted group draws what the killed
one would have. The last group is killed when group 0 reaches steps ``k * steps / (kills + 1)``
and restarted at once (a new process: it heals from a survivor and rejoins).

The JSON: the final validation loss (group 0, nats per byte on torch_lm.py's fixed windows), the
groups' parameter digests at the end (all the same), the bytes each group sent, and per kill: the
survivors' stall (their longest step, or outer step, after the kill, minus the median one) and
the restarted group's heal (its healing step and the time from its start to its first commit).
Every group's log (one JSON line per step or outer step) is kept under ``--out``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

T0 = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent.parent
sys.path.insert(0, str(ROOT))  # examples/ (the checkout)


def parse_args(argv=None):
    from examples.torch_lm import model_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("ddp", "diloco"), default="ddp")
    p.add_argument("--compressor", default="int8")
    p.add_argument("--groups", type=int, default=4)
    p.add_argument("--kills", type=int, default=2, help="times the last group is killed and restarted")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--budget", default="default", help="diloco: the exchange's governor (a number; none: off; "
                   "default: the library's)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    model_arguments(p)
    p.add_argument("--val-windows", type=int, default=256)
    p.add_argument("--corpus-mb", type=float, default=3.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--heartbeat-ms", type=int, default=2000, help="the lighthouse's heartbeat timeout")
    p.add_argument("--join-timeout-ms", type=int,
                   help="the lighthouse's join timeout: how long a quorum waits for a live group that is "
                        "late. Default 1000 for ddp (a survivor still blocked in the failed step's "
                        "collective is left out, not waited for), 30000 for diloco (longer than the "
                        "groups' spread at an outer step on this busy host)")
    p.add_argument("--out", help="the groups' logs (default: a temporary folder)")
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--replica", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--lighthouse", help=argparse.SUPPRESS)
    p.add_argument("--restarted", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- one replica group ------------------------------------------------------------------------------
def lighthouse_heartbeats(lighthouse: str) -> int:
    """Groups sending heartbeats, from the lighthouse's status page (torchft 0.2's text), or -1."""
    status = urllib.request.urlopen(f"{lighthouse}/status", timeout=10).read().decode()
    found = re.search(r"(\d+) heartbeating", status)
    return int(found.group(1)) if found else -1


def worker(args) -> None:
    import torch
    import torch.nn.functional as F
    from torch.distributed import TCPStore
    from torchft import Manager, Optimizer, ProcessGroupGloo

    import gradcomp.torch as gt
    import gradcomp.torch.ft as gft
    from examples.torch_lm import TinyLM, rate_factor, stdlib_corpus, windows

    torch.set_num_threads(1)
    train_text, val_text = stdlib_corpus(args.corpus_mb * 1e6)
    torch.manual_seed(args.seed)  # the same start everywhere (torchft's init_sync checks it too)
    net = TinyLM(args.layers, args.d_model, args.heads, args.context)
    decay = [p for p in net.parameters() if p.dim() == 2]
    other = [p for p in net.parameters() if p.dim() != 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))

    def rate(step: int) -> float:  # torch_lm.py's schedule
        return args.lr * rate_factor(step, args.warmup, args.steps)

    ddp = args.mode == "ddp"
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=60)),
        load_state_dict=(lambda s: (net.load_state_dict(s["model"]), opt.load_state_dict(s["optim"]))) if ddp
        else (lambda s: opt.load_state_dict(s["optim"])),  # DiLoCo: the parameters are its synced ones
        state_dict=(lambda: {"model": net.state_dict(), "optim": opt.state_dict()}) if ddp
        else (lambda: {"optim": opt.state_dict()}),
        min_replica_size=1, use_async_quorum=False, replica_id=f"lm_{args.replica}",
        lighthouse_addr=args.lighthouse, hostname="localhost", store_addr="localhost",
        store_port=store.port, rank=0, world_size=1, timeout=timedelta(seconds=60),
        quorum_timeout=timedelta(seconds=300), connect_timeout=timedelta(seconds=60))
    log = open(Path(args.out) / f"g{args.replica}.log", "a")

    def write(**record) -> None:
        log.write(json.dumps({"time": time.time(), **record}) + "\n")
        log.flush()

    write(event="start", pid=os.getpid(), since_start=time.perf_counter() - T0)
    while not args.restarted and lighthouse_heartbeats(args.lighthouse) < args.groups:
        time.sleep(0.05)  # the job's start: every group in the first quorum

    def batch(step: int):
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + args.replica)
        starts = torch.randint(0, len(train_text) - args.context - 1, (args.batch_size,), generator=gen)
        return windows(train_text, starts, args.context)

    if ddp:
        model = gft.DistributedDataParallel(manager, net, args.compressor)
        optimizer = Optimizer(manager, opt)
        while manager.current_step() < args.steps:
            t = time.perf_counter()
            optimizer.zero_grad()  # the quorum; heals this group if it is behind
            step = manager.current_step()
            for g in opt.param_groups:
                g["lr"] = rate(step)
            x, y = batch(step)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()  # only if the manager commits the step
            write(event="step", step=step, committed=manager.current_step() > step,
                  participants=manager.num_participants(), seconds=time.perf_counter() - t,
                  loss=float(loss.detach()))
        stats = dict(model.compressor.stats(), rolled_back=model.steps_rolled_back,
                     failures=model.comm.failures)
    else:
        t = time.perf_counter()
        budget = {} if args.budget == "default" else {"budget": None if args.budget.lower() == "none" else float(args.budget)}
        diloco = gt.DiLoCo(net, opt, sync_every=args.sync_every, compressor=args.compressor, manager=manager, **budget)
        write(event="outer", step=diloco.steps, seconds=time.perf_counter() - t, **diloco.ft.last)
        while diloco.steps < args.steps:
            step = diloco.steps
            for g in opt.param_groups:
                g["lr"] = rate(step)
            x, y = batch(step)
            diloco.zero_grad()
            loss = F.cross_entropy(net(x).flatten(0, 1), y.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            acts = diloco.outer.acts()
            t = time.perf_counter()
            diloco.step()
            if acts:
                write(event="outer", step=diloco.steps, seconds=time.perf_counter() - t,
                      loss=float(loss.detach()), **diloco.ft.last)
        stats = diloco.stats()
    h = hashlib.sha256()
    for p in net.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    result = dict(event="done", replica=args.replica, manager_step=manager.current_step(),
                  digest=h.hexdigest()[:16], stats={k: v for k, v in stats.items() if isinstance(v, (int, float))})
    if args.replica == 0:
        val_starts = torch.randint(0, len(val_text) - args.context - 1, (args.val_windows,),
                                   generator=torch.Generator().manual_seed(12345))
        total = 0.0
        with torch.no_grad():
            for i in range(0, len(val_starts), 32):
                x, y = windows(val_text, val_starts[i:i + 32], args.context)
                total += F.cross_entropy(net(x).flatten(0, 1), y.flatten(), reduction="sum").double().item()
        result["val_loss"] = total / (len(val_starts) * args.context)
    write(**result)
    log.close()
    manager.shutdown(wait=False)
    sys.stdout.flush()
    os._exit(0)  # torchft's servers and threads need no orderly teardown


# -- the driver -------------------------------------------------------------------------------------
def records(out: Path, replica: int) -> list[dict]:
    path = out / f"g{replica}.log"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def summary(args, out: Path, kills: list[dict]) -> dict:
    """The numbers the JSON reports (module docstring)."""
    logs = {g: records(out, g) for g in range(args.groups)}
    done = {g: next(r for r in reversed(log) if r["event"] == "done") for g, log in logs.items()}
    kind = "step" if args.mode == "ddp" else "outer"
    survivor = [r for r in logs[0] if r["event"] == kind and r.get("committed") is not None]
    typical = statistics.median(r["seconds"] for r in survivor)
    for kill in kills:
        after = [r for r in survivor if kill["killed"] < r["time"] < kill["killed"] + 60]
        longest = max(after, key=lambda r: r["seconds"])
        kill["survivor_stall_s"] = longest["seconds"] - typical
        back = [r for r in logs[args.groups - 1] if r["event"] == kind and r["time"] > kill["restarted"]
                and r.get("committed")]
        first = back[0]
        kill["healed"] = bool(first.get("healed", first["step"] > 0))  # (DDP: healed to the survivors' step)
        kill["heal_step_s"] = first["seconds"]
        kill["restart_to_first_commit_s"] = first["time"] - kill["restarted"]
        kill["healed_at_step"] = first["step"]
        at_heal = [r for r in survivor if r["step"] == first["step"] and r.get("committed")]
        kill["survivor_heal_step_s"] = at_heal[0]["seconds"] - typical if at_heal else None
        kill["discarded_on_survivor"] = sum(1 for r in after if not r["committed"])
    return dict(mode=args.mode, compressor=args.compressor, groups=args.groups, kills=kills,
                steps=args.steps, sync_every=args.sync_every if args.mode == "diloco" else None,
                final_val_loss=done[0]["val_loss"], digests=[done[g]["digest"] for g in range(args.groups)],
                same_bits=len({done[g]["digest"] for g in range(args.groups)}) == 1,
                manager_steps=[done[g]["manager_step"] for g in range(args.groups)],
                bytes_sent=[done[g]["stats"]["bytes_sent"] for g in range(args.groups)],
                stats=[done[g]["stats"] for g in range(args.groups)], median_step_s=typical,
                heartbeat_timeout_s=args.heartbeat_ms / 1000, join_timeout_s=args.join_timeout_ms / 1000,
                seconds=time.perf_counter() - T0,
                config={k: v for k, v in vars(args).items() if k not in ("worker", "replica", "lighthouse", "json")})


def drive(args) -> dict:
    from torchft.coordination import LighthouseServer

    out = Path(args.out or tempfile.mkdtemp(prefix="ft_lm_"))
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("g*.log"):
        old.unlink()
    if args.join_timeout_ms is None:
        args.join_timeout_ms = 1000 if args.mode == "ddp" else 30000
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms,
                                  heartbeat_timeout_ms=args.heartbeat_ms)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    options = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
               if k not in ("worker", "replica", "lighthouse", "json", "out", "restarted") and v is not None]

    def start(g: int, *more: str) -> subprocess.Popen:
        output = open(out / f"g{g}.out", "a")
        return subprocess.Popen([sys.executable, __file__, *options, "--worker", f"--replica={g}",
                                 f"--lighthouse={lighthouse.address()}", f"--out={out}", *more],
                                env=env, stdout=output, stderr=subprocess.STDOUT)

    procs = [start(g) for g in range(args.groups)]
    kills = []
    at = [args.steps * (k + 1) // (args.kills + 1) for k in range(args.kills)]
    victim = args.groups - 1
    for target in at:
        while True:
            log = [r for r in records(out, 0) if r["event"] in ("step", "outer")]
            if log and log[-1]["step"] >= target:
                break
            if any(p.poll() is not None for p in procs):
                raise SystemExit(f"a group ended early; see {out}")
            time.sleep(0.05)
        procs[victim].send_signal(signal.SIGKILL)
        killed = time.time()
        procs[victim].wait()
        restarted = time.time()
        procs[victim] = start(victim, "--restarted")
        kills.append(dict(at_step=log[-1]["step"], killed=killed, restarted=restarted))
        print(f"killed group {victim} at step {log[-1]['step']}; restarted it", flush=True)
    for p in procs:
        if p.wait(timeout=3600) != 0:
            raise SystemExit(f"a group failed ({p.returncode}); see {out}")
    lighthouse.shutdown()
    result = summary(args, out, kills)
    result["logs"] = str(out)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return
    result = drive(args)
    print(json.dumps({k: v for k, v in result.items() if k not in ("stats", "config")}), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
