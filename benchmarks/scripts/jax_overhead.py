"""The JAX path's overhead over the NumPy reducer, on ResNet-50's 161 gradient shapes (25.6 M floats).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/scripts/jax_overhead.py --compressor int8 --steps 12

Every rank builds the same fake gradients (``benchmarks.shapes.heavy_tailed``, its own seed)
once as NumPy arrays and once as a dict of JAX arrays, then times, interleaved step by step (so
that load from other processes falls on every path alike), one reduction by each of:

* ``numpy-inplace``: ``GradientReducer.step()`` on the reducer's own arrays (``reducer.gradients``:
  nothing copied in or out, the fastest the NumPy path gets);
* ``numpy-copy``: ``GradientReducer.step(my_arrays)``: the gradients copied in and the means back,
  what any caller whose gradients live elsewhere pays, and what the JAX path must do;
* ``jax-eager``: ``gradcomp.jax.mean(...).update(grads, state)`` outside jit (host views in, a NumPy
  copy per mean out, handed to JAX);
* ``jax-jit``: the same ``update`` inside ``jax.jit`` (an ordered ``io_callback``), and
  ``jax.block_until_ready`` on the result.

Rank 0 prints the median step time of each in ms and the ratios of the JAX paths over both NumPy
rows. Each path has its own compressor, so none sees another's state; the first two steps are
warm-up and not counted.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent.parent))  # benchmarks/ (the checkout)

import gradcomp  # noqa: E402
import gradcomp.jax as gj  # noqa: E402
from benchmarks.shapes import heavy_tailed, model_shapes  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compressor", default="int8")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    args = p.parse_args(argv)

    comm = gradcomp.MPICommunicator()
    shapes = model_shapes(args.model)
    local = heavy_tailed(shapes, seed=comm.rank)
    tree = {f"{i:03d}": jnp.asarray(g) for i, g in enumerate(local)}
    cap = args.bucket_cap_mb

    inplace = gradcomp.GradientReducer(local, gradcomp.make(args.compressor), comm, cap)
    own = inplace.gradients
    copying = gradcomp.GradientReducer(local, gradcomp.make(args.compressor), comm, cap)
    mine = [g.copy() for g in local]
    eager_tx = gj.mean(args.compressor, comm, cap)
    eager_state = eager_tx.init(tree)
    jit_tx = gj.mean(args.compressor, comm, cap)
    jit_state = jit_tx.init(tree)
    jitted = jax.jit(jit_tx.update)

    def run_inplace():
        for o, g in zip(own, local):   # refill (as a backward pass would); not timed
            o[...] = g
        start = time.perf_counter()
        inplace.step()
        return time.perf_counter() - start

    def run_copy():
        for m, g in zip(mine, local):
            m[...] = g
        start = time.perf_counter()
        copying.step(mine)
        return time.perf_counter() - start

    def run_eager():
        nonlocal eager_state
        start = time.perf_counter()
        out, eager_state = eager_tx.update(tree, eager_state)
        jax.block_until_ready(out)
        return time.perf_counter() - start

    def run_jit():
        nonlocal jit_state
        start = time.perf_counter()
        out, jit_state = jitted(tree, jit_state)
        jax.block_until_ready(out)
        return time.perf_counter() - start

    paths = {"numpy-inplace": run_inplace, "numpy-copy": run_copy, "jax-eager": run_eager, "jax-jit": run_jit}
    times: dict[str, list[float]] = {k: [] for k in paths}
    for step in range(args.steps + 2):
        for name, fn in paths.items():
            comm.comm.Barrier()
            t = fn()
            if step >= 2:
                times[name].append(t)
    medians = {k: statistics.median(v) for k, v in times.items()}
    # the same bits: the JAX paths' last means against the NumPy reducer's (same steps, same state)
    out, _ = eager_tx.update(tree, eager_state)
    means = copying.step([g.copy() for g in local])
    same = all(np.array_equal(np.asarray(out[f"{i:03d}"]), m) for i, m in enumerate(means))
    if comm.rank == 0:
        n = sum(int(np.prod(s)) for s in shapes)
        print(f"{args.model}: {len(shapes)} tensors, {n / 1e6:.1f} M floats, {args.compressor}, "
              f"{comm.size} ranks, {args.steps} steps each (median), jax {jax.__version__}")
        for k, v in medians.items():
            print(f"  {k:14s} {1e3 * v:8.1f} ms")
        for k in ("jax-eager", "jax-jit"):
            print(f"  {k} / numpy-copy {medians[k] / medians['numpy-copy']:.3f}   "
                  f"{k} / numpy-inplace {medians[k] / medians['numpy-inplace']:.3f}")
        print(f"  same bits as the NumPy reducer: {same}")
    comm.close()
    return medians


if __name__ == "__main__":
    main()
