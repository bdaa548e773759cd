"""Data-parallel training of a plain-JAX MLP with gradcomp as an optax transformation.

    mpiexec -n 4 python examples/jax_mlp.py --compressor int8
    mpiexec -n 4 python examples/jax_mlp.py --compressor int8 --jit inside
    mpiexec -n 4 python examples/jax_mlp.py --optimizer dgc:ratio=0.05

Every rank builds the same model (same seed) and trains on its own shard of the training split of
scikit-learn's digits (8x8 images, 10 classes), as ``examples/numpy_mlp.py`` does. The only
change a data-parallel optax loop needs is the first link of the chain:

    tx = optax.chain(gradcomp.jax.mean(compressor), optax.sgd(schedule, momentum=0.9))

``gradcomp.jax.mean`` replaces each rank's gradients by their mean over the ranks (any registered
compressor), so every rank applies the same update and the replicas stay bit-identical; the script
checks that at the end by allgathering a SHA-256 of the parameters. ``--jit outside`` (default)
runs the reduction between a jitted gradient and a jitted apply; ``--jit inside`` jits the whole
step, the reduction running as an ordered host callback. ``--optimizer dgc`` or ``onebitadam``
uses gradcomp's optimizers (``gradcomp.jax.dgc``, ``gradcomp.jax.onebit_adam``), which take the
local gradients and communicate themselves (``--compressor`` is then not used).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

import gradcomp
import gradcomp.jax as gj
from gradcomp.registry import compressor_spec, parse_spec


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="allreduce", type=compressor_spec,
                   help="a registry name or name:key=value,... (e.g. int8, powersgd:rank=4)")
    p.add_argument("--optimizer", default="sgd",
                   help="sgd (momentum SGD after gradcomp.jax.mean), adamw, or gradcomp's dgc / onebitadam "
                        "as name[:key=value,...] (they communicate themselves)")
    p.add_argument("--jit", choices=("outside", "inside"), default="outside",
                   help="reduce between jitted gradient and apply, or inside one jitted step")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.1, help="peak learning rate (cosine decay to 0)")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=0.05)
    p.add_argument("--json", metavar="PATH", help="write a summary here (rank 0)")
    return p.parse_args(argv)


def load_shard(seed: int, rank: int, size: int):
    """(this rank's training shard, the shared test split), float32 pixels in [0, 1]."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.25, random_state=seed, stratify=y)
    per_rank = len(x_tr) // size
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return (x_tr[mine], y_tr[mine]), (x_te, y_te)


def init_params(seed: int, sizes: list[int]) -> list[dict[str, jax.Array]]:
    """[{w, b}, ...] per layer, He-initialised from a NumPy generator: the same on every rank."""
    rng = np.random.default_rng(seed)
    return [{"w": jnp.asarray((rng.standard_normal((i, o)) * np.sqrt(2.0 / i)).astype(np.float32)),
             "b": jnp.zeros(o, jnp.float32)} for i, o in zip(sizes[:-1], sizes[1:])]


def logits_of(params, x):
    for layer in params[:-1]:
        x = jax.nn.relu(x @ layer["w"] + layer["b"])
    return x @ params[-1]["w"] + params[-1]["b"]


def loss_of(params, x, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits_of(params, x), y).mean()


def accuracy(params, x, y) -> float:
    return float((jnp.argmax(logits_of(params, x), axis=1) == y).mean())


def params_digest(params) -> np.ndarray:
    """SHA-256 of every parameter's bytes, as 32 uint8 (so it travels through the buffer API)."""
    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(params):
        h.update(np.asarray(leaf).tobytes())
    return np.frombuffer(h.digest(), dtype=np.uint8)


def traffic(before: dict, after: dict) -> dict:
    """Bytes per step and compression ratio (against fp32 allreduce) between two ``stats()``."""
    steps = max(after["steps"] - before.get("steps", 0), 1)
    sent = after["bytes_sent"] - before.get("bytes_sent", 0.0)
    ref = after["reference_bytes"] - before.get("reference_bytes", 0.0)
    return dict(bytes_sent_per_step=sent / steps, compression_ratio=ref / sent if sent else 1.0)


def build_transform(args, comm, total_steps: int):
    schedule = optax.cosine_decay_schedule(args.lr, total_steps)
    """(the optax transformation, its gradcomp link: traffic figures and checkpoints)."""
    name, options = parse_spec(args.optimizer)
    if name in ("sgd", "adamw"):
        reduce = gj.mean(args.compressor, comm, args.bucket_cap_mb)
        after = optax.sgd(schedule, momentum=args.momentum) if name == "sgd" else optax.adamw(schedule, **options)
        return optax.chain(reduce, after), reduce
    if name == "dgc":
        tx = gj.dgc(schedule, momentum=args.momentum, comm=comm, bucket_cap_mb=args.bucket_cap_mb, **options)
        return tx, tx
    if name == "onebitadam":
        tx = gj.onebit_adam(schedule, comm=comm, bucket_cap_mb=args.bucket_cap_mb, **options)
        return tx, tx
    raise SystemExit(f"unknown optimizer {name!r} (sgd, adamw, dgc, onebitadam)")


def main(argv=None) -> dict:
    args = parse_args(argv)
    comm = gradcomp.MPICommunicator()
    (x, y), (x_test, y_test) = load_shard(args.seed, comm.rank, comm.size)
    params = init_params(args.seed, [x.shape[1], args.hidden, args.hidden, 10])
    steps_per_epoch = len(x) // args.batch_size
    total_steps = args.epochs * steps_per_epoch
    tx, link = build_transform(args, comm, total_steps)
    kind = "mean" if isinstance(link.host, gj.transform.Mean) else "optimizer"
    state = tx.init(params)
    say = print if comm.rank == 0 else (lambda *a, **k: None)
    say(f"{args.optimizer} after {args.compressor if kind == 'mean' else '(its own exchange)'} on "
        f"{comm.size} ranks, jit {args.jit}, {len(x)} samples per rank, {steps_per_epoch} steps per epoch")

    grad_fn = jax.jit(jax.value_and_grad(loss_of))
    apply = jax.jit(optax.apply_updates)

    def outside(params, state, xb, yb):
        loss, grads = grad_fn(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        return apply(params, updates), state, loss

    @jax.jit
    def inside(params, state, xb, yb):
        loss, grads = jax.value_and_grad(loss_of)(params, xb, yb)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    step_fn = inside if args.jit == "inside" else outside
    step_times, epoch_losses, last_epoch_start = [], [], {}
    for epoch in range(args.epochs):
        if epoch == args.epochs - 1:
            last_epoch_start = dict(link.stats())
        order = np.random.default_rng([args.seed, epoch, comm.rank]).permutation(len(x))
        losses = []
        for b in range(steps_per_epoch):
            batch = order[b * args.batch_size:(b + 1) * args.batch_size]
            t0 = time.perf_counter()
            params, state, loss = step_fn(params, state, x[batch], y[batch])
            losses.append(float(loss))  # waits for the step: the time below is the whole step's
            step_times.append(time.perf_counter() - t0)
        mean_loss = float(comm.allreduce(np.array([np.mean(losses)]))[0] / comm.size)
        epoch_losses.append(mean_loss)
        if (epoch + 1) % 10 == 0 or epoch + 1 == args.epochs:
            say(f"epoch {epoch + 1:3d}  loss {mean_loss:.4f}  test accuracy {accuracy(params, x_test, y_test):.4f}")

    digests = comm.allgather(params_digest(params))
    identical = bool((digests == digests[0]).all())
    stats = link.stats()
    summary = dict(optimizer=args.optimizer, compressor=args.compressor if kind == "mean" else "none",
                   jit=args.jit, ranks=comm.size, epochs=args.epochs, steps=total_steps, seed=args.seed,
                   epoch_losses=epoch_losses, test_accuracy=accuracy(params, x_test, y_test),
                   time_per_step_s=float(np.median(step_times)), bytes_sent=stats.get("bytes_sent"),
                   run=traffic({}, stats), last_epoch=traffic(last_epoch_start, stats),
                   weight_digests=[bytes(d).hex() for d in digests], weights_identical=identical)
    last, run = summary["last_epoch"], summary["run"]
    say(f"traffic: last epoch {last['bytes_sent_per_step']:,.0f} bytes sent per rank per step, compression "
        f"ratio {last['compression_ratio']:.2f}; whole run (any warm-up included) ratio "
        f"{run['compression_ratio']:.2f}, {summary['bytes_sent']:,.0f} bytes sent per rank")
    say(f"test accuracy {summary['test_accuracy']:.4f}; median time per step "
        f"{1e3 * summary['time_per_step_s']:.2f} ms; parameters identical on every rank: {identical}")
    if comm.rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    if not identical:
        raise SystemExit(f"rank {comm.rank}: parameters differ across ranks: {summary['weight_digests']}")
    comm.close()
    return summary


if __name__ == "__main__":
    main()
