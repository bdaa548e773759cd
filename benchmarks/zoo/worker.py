"""One zoo job, run under ``mpiexec``: one workload, one length, one seed, every method in turn.

    mpiexec -n 4 python -m benchmarks.zoo.worker --workload cnn-shapes --steps 400 --seed 0 \\
        --methods none int8 dgc --out results/zoo

The methods share the processes (torch is imported once, the data built once) but nothing else:
each starts from the same initial weights (``torch.manual_seed(seed)`` before the model is
built) and sees the same mini-batches in the same order (rank r's batch at step s is drawn from
a generator seeded by (seed, s, r)). Rank 0 writes ``OUT/WORKLOAD/STEPS/METHOD@SEED.json`` as
each method ends, so a job that fails part-way keeps what it finished.

Timing: ``seconds`` is the training loop's wall time on rank 0 (evaluations excluded), from a
barrier before the first step to DiLoCo's final sync; ranks share the cores, so it says how the
methods compare within one job more than what a real cluster would take.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import methods as MT
from . import workloads as W


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", required=True, choices=sorted(W.BY_NAME))
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--methods", nargs="+", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--evals", type=int, default=8, help="held-out evaluations during training (and one at step 0)")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket cap (its default: 25)")
    return p.parse_args(argv)


def result_path(out: Path, workload: str, steps: int, spec: str, seed: int) -> Path:
    return out / workload / str(steps) / f"{MT.filename(spec)}@{seed}.json"


def jsonable(value: Any) -> Any:
    """Numbers, strings, lists and dicts as JSON takes them: NumPy and torch scalars become Python
    numbers, small arrays lists, non-finite floats None; anything else its repr."""
    import numpy as np

    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray):
        return jsonable(value.tolist()) if value.size <= 64 else f"array{value.shape}"
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return repr(value)


def weights_identical(net: torch.nn.Module) -> bool:
    """Whether every rank holds the same bits (a 63-bit digest of the parameters, all-gathered)."""
    h = hashlib.sha256()
    for name, p in net.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    mine = torch.tensor([int.from_bytes(h.digest()[:8], "little") >> 1], dtype=torch.int64)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return len({int(t) for t in every}) == 1


def source_digest(init_file: str) -> str:
    """16 hex digits of sha256 over gradcomp's ``.py`` files (path and contents): which code, committed
    or not, a result measured."""
    root = Path(init_file).resolve().parent
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return f"{h.hexdigest()[:16]} ({root})"


def train(workload: W.Workload, data, method: MT.Method, steps: int, seed: int, rank: int, size: int,
          evals: int, bucket_cap_mb: float) -> dict:
    """Train ``method`` on ``workload`` from scratch; the summary rank 0 writes."""
    torch.manual_seed(seed)
    net = workload.model()
    trainer = MT.Trainer(method, workload, net, bucket_cap_mb)
    sched = torch.optim.lr_scheduler.LambdaLR(trainer.scheduled, W.schedule(workload, steps))
    eval_at = {max(1, round(steps * k / evals)) for k in range(1, evals + 1)}
    curve: list[list[float | None]] = []
    losses: list[float] = []
    eval_seconds = 0.0

    def evaluate(step: int, trained: float) -> dict:
        result = W.evaluate(workload, net, data.eval_x, data.eval_y, rank, size)
        curve.append([step, W.metric_of(workload, result), result["loss"], trained])
        return result

    evaluate(0, 0.0)
    dist.barrier()
    start = time.perf_counter()
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
        x, y = data.train_batch(gen, workload.batch)
        trainer.zero_grad()
        loss = W.loss_fn(workload, trainer.model(x), y)
        loss.backward()
        if workload.clip:
            torch.nn.utils.clip_grad_norm_(net.parameters(), workload.clip)
        trainer.step()
        sched.step()
        losses.append(loss.item())
        if step + 1 == steps:
            trainer.finish()
        if step + 1 in eval_at:
            t = time.perf_counter()
            final = evaluate(step + 1, t - start - eval_seconds)
            eval_seconds += time.perf_counter() - t
    seconds = time.perf_counter() - start - eval_seconds
    tail = losses[-max(steps // 10, 1):]
    window = torch.tensor([sum(tail), len(tail)], dtype=torch.float64)
    dist.all_reduce(window)
    stats = trainer.stats()
    sent, reference = float(stats.get("bytes_sent", 0.0)), trainer.reference_bytes()
    value = W.metric_of(workload, final)
    return dict(
        workload=workload.name, family=workload.family, optimizer=workload.optimizer, half=workload.half,
        method=method.spec, method_kind=method.kind, steps=steps, seed=seed, ranks=size,
        metric=workload.metric, value=value, final=final, diverged=not math.isfinite(final["loss"]),
        train_loss_last_tenth=window[0].item() / window[1].item(), curve=curve,
        bytes_sent=sent, reference_bytes=reference,
        compression_ratio=reference / sent if sent else None,
        bytes_sent_per_step=sent / max(steps, 1), seconds=seconds, eval_seconds=eval_seconds,
        seconds_per_step=seconds / max(steps, 1), weights_identical=weights_identical(net),
        parameters=sum(p.numel() for p in net.parameters()), describe=trainer.describe, stats=jsonable(stats),
        config=dict(lr=workload.lr, batch_per_rank=workload.batch, global_batch=workload.batch * size,
                    weight_decay=workload.weight_decay, clip=workload.clip, bucket_cap_mb=bucket_cap_mb,
                    options=jsonable(workload.options), evals=evals),
        data=jsonable(data.info))


def compare(result: dict, workload: W.Workload, reference: dict | None) -> dict:
    """Add the reference's metric and the gap to it (``workloads.gap``)."""
    if result["method"] == "none":
        reference = result
    ref_value = reference.get("value") if reference and "error" not in reference else None
    result.update(reference_method="none", reference_value=ref_value,
                  gap=W.gap(workload, result.get("value"), ref_value),
                  gap_unit="points" if workload.classifier else "percent")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    import gradcomp
    import gradcomp.torch as gt

    launch = gt.init_process_group()
    rank, size = launch.rank, launch.size
    workload = W.BY_NAME[args.workload]
    data = workload.data()
    for spec in args.methods:
        method = MT.parse(spec)
        if rank == 0:
            print(f"zoo: start {args.workload} {args.steps} {spec} seed {args.seed}", flush=True)
        result = train(workload, data, method, args.steps, args.seed, rank, size, args.evals, args.bucket_cap_mb)
        if rank == 0:
            path = result_path(args.out, args.workload, args.steps, spec, args.seed)
            ref_path = result_path(args.out, args.workload, args.steps, "none", args.seed)
            reference = json.loads(ref_path.read_text()) if ref_path.exists() else None
            result = compare(result, workload, reference)
            result.update(gradcomp_version=gradcomp.__version__, gradcomp_source=source_digest(gradcomp.__file__),
                          torch_version=torch.__version__)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(jsonable(result), indent=1))
            tmp.replace(path)
            gap = result["gap"]
            print(f"zoo: done {args.workload} {args.steps} {spec} seed {args.seed}: {workload.metric} "
                  f"{result['value']:.4g}, gap {'-' if gap is None else f'{gap:+.2f}'} {result['gap_unit']}, "
                  f"x{result['compression_ratio'] or 0:.1f}, {result['seconds']:.1f} s", flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
