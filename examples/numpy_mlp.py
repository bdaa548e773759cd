"""Data-parallel training of a NumPy MLP with gradcomp: no PyTorch anywhere.

    mpiexec -n 4 python examples/numpy_mlp.py --compressor quantize-channel

Every rank builds the same model (same seed) and trains on its own shard of the training split of
scikit-learn's bundled digits (8x8 images, 10 classes). One training step is:

1. forward and backward on the rank's local mini-batch, giving a list of gradient arrays;
2. ``gradcomp.allreduce_gradients(grads, compressor, comm, bucket_cap_mb)``, which packs the
   gradients into flat buckets, averages each bucket over the ranks with the compressor and writes
   the averages back into ``grads`` in place;
3. the same momentum-SGD update on every rank. gradcomp guarantees that every rank receives
   bit-identical averages, so the replicas never drift apart; the script checks it at the end by
   comparing a hash of the weights across ranks.

``--compressor`` takes any name in ``gradcomp.REGISTRY``; the compressor object keeps its own state
(error feedback, warm-up step counters) across steps, so it is built once and reused. A small
``--bucket-cap-mb`` splits this model into several buckets, as a large model would be.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradcomp
from gradcomp.registry import compressor_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="allreduce", type=compressor_spec,
                   help="a registry name or name:key=value,... (e.g. powersgd:rank=4)")
    p.add_argument("--optimizer", default="sgd",
                   help="sgd (momentum SGD here, gradients averaged by --compressor), or gradcomp's dgc or "
                        "onebitadam as name[:key=value,...] (they communicate themselves; --compressor is "
                        "then not used; onebitadam:warmup=100000,warmup_compressor='allreduce' is exact Adam, its "
                        "reference)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay to 0)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--split-seed", type=int, help="the train/test split's seed (default: --seed); the "
                   "demo keeps it to measure the other seeds' noise on the same test images")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05)
    p.add_argument("--json", metavar="PATH", help="write a summary here (rank 0)")
    return p.parse_args(argv)


def load_shard(seed: int, rank: int, size: int):
    """(this rank's training shard, the shared test split), float32 pixels in [0, 1].

    Shards have equal sizes, so every rank runs the same number of steps per epoch."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    per_rank = len(x_tr) // size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return (x_tr[mine], y_tr[mine]), (x_te, y_te)


def init_params(seed: int, sizes: list[int]) -> list[np.ndarray]:
    """[W1, b1, W2, b2, ...], He-initialised; the same on every rank because the seed is."""
    rng = np.random.default_rng(seed)
    params = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        params.append((rng.standard_normal((fan_in, fan_out)) * np.sqrt(2.0 / fan_in)).astype(np.float32))
        params.append(np.zeros(fan_out, dtype=np.float32))
    return params


def forward(params, x):
    """Activations of every layer (ReLU hidden layers), the logits last."""
    acts = [x]
    for i in range(0, len(params), 2):
        z = acts[-1] @ params[i] + params[i + 1]
        acts.append(np.maximum(z, 0) if i + 2 < len(params) else z)
    return acts


def loss_and_grads(params, x, y):
    """Mean softmax cross-entropy over the local batch and its gradient for every parameter."""
    acts = forward(params, x)
    logits = acts[-1] - acts[-1].max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    rows = np.arange(len(y))
    loss = -float(log_p[rows, y].mean())
    delta = np.exp(log_p)
    delta[rows, y] -= 1
    delta /= np.float32(len(y))
    grads = [None] * len(params)
    for i in reversed(range(0, len(params), 2)):
        grads[i], grads[i + 1] = acts[i // 2].T @ delta, delta.sum(axis=0)
        if i:
            delta = (delta @ params[i].T) * (acts[i // 2] > 0)
    return loss, grads


def accuracy(params, x, y) -> float:
    return float((forward(params, x)[-1].argmax(axis=1) == y).mean())


def test_loss(params, x, y) -> float:
    """Mean softmax cross-entropy on (x, y)."""
    logits = forward(params, x)[-1].astype(np.float64)
    logits -= logits.max(axis=1, keepdims=True)
    log_p = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    return -float(log_p[np.arange(len(y)), y].mean())


def weights_digest(params) -> np.ndarray:
    """SHA-256 of all weights, as 32 uint8 (so it can travel through the buffer API)."""
    h = hashlib.sha256()
    for p in params:
        h.update(p.tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


def traffic(before: dict, after: dict) -> dict:
    """Bytes per step and compression ratio between two ``compressor.stats()`` snapshots."""
    steps = max(after["steps"] - before["steps"], 1)
    sent = after["bytes_sent"] - before["bytes_sent"]
    ref = after["reference_bytes"] - before["reference_bytes"]
    return dict(bytes_sent_per_step=sent / steps, reference_bytes_per_step=ref / steps,
                compression_ratio=ref / sent if sent else 1.0)


def main(argv=None) -> dict:
    args = parse_args(argv)
    comm = gradcomp.MPICommunicator()
    (x, y), (x_test, y_test) = load_shard(args.seed if args.split_seed is None else args.split_seed,
                                          comm.rank, comm.size)
    params = init_params(args.seed, [x.shape[1], args.hidden, args.hidden, 10])
    velocity = [np.zeros_like(p) for p in params]
    optimizer = None
    if args.optimizer != "sgd":
        from gradcomp.registry import parse_spec

        name, options = parse_spec(args.optimizer)
        if name == "dgc":
            optimizer = gradcomp.optim.DGC(params, lr=args.lr, momentum=args.momentum, comm=comm,
                                           bucket_cap_mb=args.bucket_cap_mb, **options)
        elif name == "onebitadam":
            optimizer = gradcomp.optim.OneBitAdam(params, lr=args.lr, comm=comm,
                                                  bucket_cap_mb=args.bucket_cap_mb, **options)
        else:
            raise SystemExit(f"unknown optimizer {name!r} (sgd, dgc, onebitadam)")
    compressor = gradcomp.make(args.compressor) if optimizer is None else optimizer.compressor
    steps_per_epoch = len(x) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    ran = f"{args.compressor if optimizer is None else args.optimizer}: {compressor!r}"  # an optimizer's: its exchange too
    say(f"{ran} on {comm.size} ranks, {len(x)} training samples per rank, "
        f"{steps_per_epoch} steps per epoch")

    step_times, epoch_losses, test_curve, last_epoch_start = [], [], [], compressor.stats()
    for epoch in range(args.epochs):
        if epoch == args.epochs - 1:
            last_epoch_start = compressor.stats()
        order = np.random.default_rng([args.seed, epoch, comm.rank]).permutation(len(x))
        losses = []
        for b in range(steps_per_epoch):
            t0 = time.perf_counter()
            batch = order[b * args.batch_size:(b + 1) * args.batch_size]
            loss, grads = loss_and_grads(params, x[batch], y[batch])
            step = epoch * steps_per_epoch + b
            lr = np.float32(args.lr * 0.5 * (1 + np.cos(np.pi * step / total_steps)))
            if optimizer is not None:
                optimizer.step(grads, lr=float(lr))
            else:
                gradcomp.allreduce_gradients(grads, compressor, comm, bucket_cap_mb=args.bucket_cap_mb)
                for p, v, g in zip(params, velocity, grads):
                    v *= np.float32(args.momentum)
                    v += g
                    p -= lr * v
            step_times.append(time.perf_counter() - t0)
            losses.append(loss)
        mean_loss = float(comm.allreduce(np.array([np.mean(losses)]))[0] / comm.size)
        epoch_losses.append(mean_loss)
        test_curve.append([(epoch + 1) * steps_per_epoch, test_loss(params, x_test, y_test),
                           accuracy(params, x_test, y_test)])
        say(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  test loss {test_curve[-1][1]:.4f}")

    digests = comm.allgather(weights_digest(params))
    identical = bool((digests == digests[0]).all())
    final = (compressor if optimizer is None else optimizer).stats()  # an optimizer's: its own warm-up too
    summary = dict(
        compressor=args.compressor if optimizer is None else "none", optimizer=args.optimizer,
        config=repr(compressor if optimizer is None else optimizer), ranks=comm.size, epochs=args.epochs,
        steps=total_steps, batch_size_per_rank=args.batch_size, lr=args.lr, seed=args.seed,
        bucket_cap_mb=args.bucket_cap_mb, epoch_losses=epoch_losses, test_curve=test_curve,
        train_accuracy_shard0=accuracy(params, x, y), test_accuracy=accuracy(params, x_test, y_test), test_images=len(y_test),
        time_per_step_s=float(np.median(step_times)),
        run=traffic({"steps": 0, "bytes_sent": 0.0, "reference_bytes": 0.0}, compressor.stats()),
        last_epoch=traffic(last_epoch_start, compressor.stats()),
        weight_digests=[bytes(d).hex() for d in digests], weights_identical=identical,
        guard=final.get("guard"),
        warmup_ended_at=final.get("warmup_ended_at"),  # warmup="auto": when, and why
        warmup_reason=final.get("warmup_reason"),
        choices=[{k: c[k] for k in ("bucket", "chosen", "why")} for c in final.get("choices", ())] or None)  # auto's
    if summary["warmup_reason"]:
        say(f"warm-up: {summary['warmup_reason']}" + (f" (ended at step {summary['warmup_ended_at']})"
                                                      if summary["warmup_ended_at"] is not None else ""))
    last = summary["last_epoch"]
    say(f"test accuracy {summary['test_accuracy']:.4f}; last epoch: "
        f"{last['bytes_sent_per_step']:.0f} bytes sent per rank per step, "
        f"compression ratio {last['compression_ratio']:.2f}; "
        f"median time per step {1e3 * summary['time_per_step_s']:.2f} ms")
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if not identical:
        raise SystemExit(f"rank {comm.rank}: weights differ across ranks: {summary['weight_digests']}")
    comm.close()
    return summary


if __name__ == "__main__":
    main()
