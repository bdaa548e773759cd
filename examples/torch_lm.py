"""A byte-level transformer language model on the Python standard library, trained with DDP.

    mpiexec -n 4 .venv/bin/python examples/torch_lm.py --compressor powersgd --json lm.json

Why it exists: the digits examples are too easy to tell compressors apart (almost everything
reaches the same accuracy). Next-byte prediction on source code with a small decoder-only
transformer is still improving after a few hundred steps, its weights are matrices of several
shapes (attention in/out projections, MLP, embeddings, output head), and Adam amplifies gradient
error, so a crude compressor shows up as a higher validation loss at the same step count.

The corpus is text every machine has: the ``.py`` files of the running Python's standard library,
in sorted path order, until ``--corpus-mb`` of training text; every tenth file goes to a held-out
validation split instead. Every rank reads the same corpus, then draws its own mini-batches from a
generator seeded by (seed, rank, step). Validation loss is the mean cross-entropy in nats per byte
(ln 256 = 5.55 for a uniform guess) over a fixed set of windows, shared out over the ranks and
summed, so every rank gets the same number. ``--compressor none`` is DDP's own allreduce (no hook),
the reference; any other name is a key of ``gradcomp.REGISTRY``.

The JSON's ``compression_ratio`` and ``bytes_sent_per_step`` cover the second half of training
(``traffic_steps``: from, to), after any warm-up of exact steps (int8's first 50); ``whole_run``
has the same two over every step, and ``stats`` the counters themselves.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradcomp
from gradcomp.registry import compressor_spec, parse_spec
import gradcomp.torch as gt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="allreduce", type=compressor_spec,
                   help="a registry name or name:key=value,... (none: DDP without a hook)")
    p.add_argument("--optimizer", default="adamw",
                   help="adamw or sgd (torch's; momentum 0.9 for sgd; gradients averaged by --compressor), "
                        "or gradcomp's onebitadam or dgc, as name[:key=value,...] (they communicate "
                        "themselves: --compressor none)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--eval-every", type=int, default=25)
    model_arguments(p)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3 suits AdamW; momentum "
                   "SGD and DGC want about 100x more)")
    p.add_argument("--weight-decay", type=float, help="on matrices; default 0.1 for the Adam family "
                   "(decoupled), 1e-4 for sgd and dgc (added to the gradient, so it scales with lr)")
    p.add_argument("--warmup", type=int, default=20, help="linear learning-rate warm-up steps")
    p.add_argument("--val-windows", type=int, default=256, help="validation windows (fixed)")
    p.add_argument("--corpus-mb", type=float, default=3.0, help="training text to read, MB")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25,
                   help="DDP bucket size (small, so the model spans several buckets)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="write a summary here (rank 0)")
    return p.parse_args(argv)


def model_arguments(p: argparse.ArgumentParser) -> None:
    """The model's size and the batch (shared with the LM benchmark scripts)."""
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--d-model", type=int, default=96)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank and step")


def rate_factor(step: int, warmup: int, steps: int) -> float:
    """The learning rate's share of its peak at ``step``: linear warm-up, then cosine decay to a
    tenth of the peak at ``steps``."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(step - warmup, steps - warmup) / max(steps - warmup, 1)))


def stdlib_corpus(train_bytes: float, val_every: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, validation) as uint8 tensors of the stdlib's .py files, read in sorted order; file
    i goes to validation when i % val_every == 0. Third-party packages and unreadable files are
    skipped. The same on every rank (and machine, for one Python version)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted((p for p in root.rglob("*.py")
                    if not {"site-packages", "dist-packages"} & set(p.relative_to(root).parts)),
                   key=lambda p: p.relative_to(root).as_posix())
    train, val, n_train = [], [], 0
    for i, path in enumerate(paths):
        try:
            data = path.read_bytes() + b"\n"
        except OSError:
            continue
        if i % val_every == 0:
            val.append(data)
        else:
            train.append(data)
            n_train += len(data)
            if n_train >= train_bytes:
                break
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"".join(parts)), dtype=torch.uint8).long()
    return as_tensor(train), as_tensor(val)


def windows(text: torch.Tensor, starts: torch.Tensor, context: int):
    """Inputs and next-byte targets of the windows beginning at ``starts``: two (n, context)."""
    idx = starts[:, None] + torch.arange(context + 1, device=starts.device)
    chunk = text[idx]
    return chunk[:, :-1], chunk[:, 1:]


class TinyLM(nn.Module):
    """Decoder-only transformer: byte and position embeddings, pre-norm blocks with causal
    self-attention, a final LayerNorm and an untied output head (256 logits per position)."""

    def __init__(self, layers: int, d_model: int, heads: int, context: int, vocab: int = 256):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, activation="gelu",
                                       batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, x):
        t = x.shape[1]
        h = self.embed(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            h = block(h, src_mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h))


def validation_loss(model, val: torch.Tensor, starts: torch.Tensor, context: int, rank: int,
                    size: int, chunk: int = 32) -> float:
    """Mean cross-entropy (nats per byte) over the fixed windows ``starts``: each rank evaluates
    every size-th window, the sums are added up over ranks in float64."""
    total = torch.zeros(1, dtype=torch.float64, device=val.device)
    mine = starts[rank::size]
    with torch.no_grad():
        for i in range(0, len(mine), chunk):
            x, y = windows(val, mine[i:i + chunk].to(val.device), context)
            total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").double()
    dist.all_reduce(total)
    return total.item() / (len(starts) * context)


def weights_digest(model) -> str:
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def traffic(stats: dict, since: dict) -> tuple[float, float]:
    """(bytes sent per step, compression ratio) between two ``stats()`` snapshots."""
    steps = stats["steps"] - since.get("steps", 0)
    sent = stats["bytes_sent"] - since.get("bytes_sent", 0.0)
    ref = stats["reference_bytes"] - since.get("reference_bytes", 0.0)
    return sent / max(steps, 1), (ref / sent if sent else 1.0)


def make_optimizer(spec: str, groups, lr: float, model):
    """torch's AdamW or momentum SGD, or one of gradcomp's optimizers (``onebitadam``, ``dgc``) from
    a spec."""
    name, options = parse_spec(spec)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, **options)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), **options)
    if name == "onebitadam":
        return gt.OneBitAdam(groups, lr=lr, betas=(0.9, 0.95), model=model, **options)
    if name == "dgc":
        return gt.DGC(groups, lr=lr, model=model, **options)
    raise SystemExit(f"unknown optimizer {name!r} (adamw, sgd, onebitadam, dgc)")


def train_step(model, opt, sched, train_text: torch.Tensor, args, step: int, rank: int) -> torch.Tensor:
    """One AdamW step on this rank's mini-batch of ``step`` (drawn from (seed, step, rank)), the
    gradient clipped at norm 1; returns the loss (also ``examples/torch_fsdp.py``'s step)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, len(train_text) - args.context - 1, (args.batch_size,), generator=gen)
    x, y = windows(train_text, starts.to(train_text.device), args.context)
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    return loss


def train(args) -> dict:
    torch.set_num_threads(1)
    launch = gt.init_process_group()
    rank, size, device = launch.rank, launch.size, launch.device  # cpu and gloo here; cuda and nccl on GPUs
    train_text, val_text = (t.to(device) for t in stdlib_corpus(args.corpus_mb * 1e6))
    val_starts = torch.randint(0, len(val_text) - args.context - 1, (args.val_windows,),
                               generator=torch.Generator().manual_seed(12345))
    torch.manual_seed(args.seed)
    net = TinyLM(args.layers, args.d_model, args.heads, args.context).to(device)
    model = DistributedDataParallel(net, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=True)
    state = None if args.compressor == "none" else gt.register(model, gradcomp.make(args.compressor))
    decay = [p for p in model.parameters() if p.dim() == 2]
    other = [p for p in model.parameters() if p.dim() != 2]
    sgd_like = parse_spec(args.optimizer)[0] in ("sgd", "dgc")
    decay_rate = args.weight_decay if args.weight_decay is not None else (1e-4 if sgd_like else 0.1)
    groups = [{"params": decay, "weight_decay": decay_rate}, {"params": other, "weight_decay": 0.0}]
    opt = make_optimizer(args.optimizer, groups, args.lr, model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: rate_factor(s, args.warmup, args.steps))

    def evaluate(step):
        trained = time.perf_counter() - start - eval_seconds  # training seconds so far
        model.eval()
        loss = validation_loss(net, val_text, val_starts, args.context, rank, size)
        model.train()
        val_curve.append([step, loss, trained])
        # mean training loss since the last evaluation, over all ranks
        window = torch.tensor([sum(train_losses), len(train_losses)], dtype=torch.float64, device=device)
        dist.all_reduce(window)
        shown = ""
        if train_losses:
            train_curve.append([step, window[0].item() / window[1].item()])
            shown = f"train {train_curve[-1][1]:.4f}"
        train_losses.clear()
        if rank == 0:
            print(f"step {step:5d}  val {loss:.4f}  {shown:12s} {time.perf_counter() - start:6.1f} s", flush=True)

    # the traffic counters: the hook's, a communicating optimizer's, or (--compressor none)
    # DDP's own fp32 allreduce, counted as an allreduce hook counts it (``step``, read when
    # called: the last step done)
    stats_of = (state.compressor.stats if state is not None else getattr(opt, "stats", None)
                or (lambda: gt.plain_ddp_stats(model, step + 1)))
    val_curve, train_curve, train_losses = [], [], []
    half_stats, eval_seconds = {}, 0.0
    start = time.perf_counter()
    evaluate(0)
    eval_seconds += time.perf_counter() - start
    for step in range(args.steps):
        loss = train_step(model, opt, sched, train_text, args, step, rank)
        train_losses.append(loss.item())
        if step + 1 == args.steps // 2:
            half_stats = dict(stats_of())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            t = time.perf_counter()
            evaluate(step + 1)
            eval_seconds += time.perf_counter() - t
    seconds = time.perf_counter() - start
    from mpi4py import MPI

    digests = MPI.COMM_WORLD.allgather(weights_digest(net))
    result = dict(compressor=args.compressor, ranks=size, steps=args.steps, val_curve=val_curve,
                  final_val_loss=val_curve[-1][1], train_loss_curve=train_curve,
                  bytes_sent_per_step=None, compression_ratio=None, seconds=seconds - eval_seconds,
                  eval_seconds=eval_seconds, weights_identical=len(set(digests)) == 1,
                  weight_digests=digests, parameters=sum(p.numel() for p in net.parameters()),
                  config={k: v for k, v in vars(args).items() if k not in ("json", "compressor")},
                  train_bytes=len(train_text), val_bytes=len(val_text))
    stats = stats_of()
    # bytes_sent_per_step and compression_ratio: the second half of training, after any warm-up
    # of plain averaging (int8's 50 exact steps, PowerSGD's start_iter); whole_run: every step
    result["bytes_sent_per_step"], result["compression_ratio"] = traffic(stats, half_stats)
    result["traffic_steps"] = [half_stats.get("steps", 0), stats["steps"]]
    whole = traffic(stats, {})
    result["whole_run"] = dict(bytes_sent_per_step=whole[0], compression_ratio=whole[1])
    result["method"] = (f"{args.optimizer} (gradcomp's optimizer: its own exchange)" if hasattr(opt, "stats") else
                        f"{args.optimizer}, DDP's own fp32 allreduce" if state is None else
                        f"{args.optimizer}, gradients averaged by {args.compressor}")
    result["stats"] = {k: v for k, v in stats.items() if isinstance(v, (int, float, str, dict))}
    result["compressor_repr"] = (repr(state.compressor) if state is not None else
                                 repr(getattr(opt, "method_state", "DDP's own fp32 allreduce")))
    return result


def main(argv=None):
    args = parse_args(argv)
    result = train(args)
    if dist.get_rank() == 0:
        ratio, whole = result["compression_ratio"], result["whole_run"]["compression_ratio"]
        print(f"{result['method']} on {result['ranks']} ranks, {result['steps']} steps, "
              f"{result['parameters']:,} parameters: final val loss {result['final_val_loss']:.4f} "
              f"nats/byte, compression x{ratio or 1:.2f} over the second half (x{whole:.2f} over the whole "
              f"run), train {result['seconds']:.1f} s, "
              f"weights identical: {result['weights_identical']}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
