"""gradcomp.jax under real mpiexec: the NumPy reducer's bits through pytrees and optax (outside jit
and inside it), training, checkpoints that resume bit for bit, the optimizers against
gradcomp.optim, the conformance kit on JAX arrays, bad input, and a failing rank ending the job."""
from __future__ import annotations

import io
import textwrap

import numpy as np
import pytest

pytest.importorskip("jax")
pytest.importorskip("optax")

from gradcomp.conformance import run as run_kit  # noqa: E402
from gradcomp.launcher import run  # noqa: E402
from tests.mpi_launch import ROOT, run_ranks  # noqa: E402

SPECS = ["allreduce", "fp16", "int8:warmup=0", "powersgd:start_iter=2", "topk:warmup=0"]
CAP = 0.004  # MiB: several buckets, float16 and bfloat16 ones among them


def _tree(rank: int, step: int, odd: str = ""):
    """A gradient-like pytree: nested dict and list, a scalar, float16 and bfloat16 leaves."""
    import jax.numpy as jnp
    import ml_dtypes

    rng = np.random.default_rng([rank, step])
    t = lambda *s: rng.standard_t(4, s).astype(np.float32)  # noqa: E731
    tree = {"conv": {"w": t(8, 3, 3, 3), "b": t(8)}, "dense": [t(40, 24), t(24)], "scale": t(),
            "emb": t(50, 7).astype(np.float16), "norm": t(300).astype(ml_dtypes.bfloat16)}
    if odd == "key":
        tree["embedding"] = tree.pop("emb")
    if odd == "dtype":
        tree["dense"][1] = tree["dense"][1].astype(np.float16)
    if odd == "shape":
        tree["dense"][1] = t(25)
    if odd == "int":
        tree["dense"][1] = np.arange(24, dtype=np.int32)
    return {k: _to_jax(v) for k, v in tree.items()}


def _to_jax(v):
    import jax
    import jax.numpy as jnp

    return jax.tree_util.tree_map(jnp.asarray, v)


def _bits(a) -> bytes:
    return np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8).tobytes()


def _same_tree(got, want_leaves, where: str) -> None:
    import jax

    leaves = jax.tree_util.tree_leaves(got)
    assert len(leaves) == len(want_leaves), f"{where}: {len(leaves)} leaves, expected {len(want_leaves)}"
    for i, (g, w) in enumerate(zip(leaves, want_leaves)):
        assert isinstance(g, jax.Array), f"{where}: leaf {i} is {type(g).__name__}, not a jax.Array"
        assert g.shape == w.shape and np.dtype(g.dtype) == w.dtype, f"{where}: leaf {i} {g.dtype}{g.shape}"
        assert _bits(g) == _bits(w), f"{where}: leaf {i} differs from the NumPy reducer's bits"


def _digest(tree) -> int:
    import hashlib

    import jax

    h = hashlib.sha256()
    for leaf in jax.tree_util.tree_leaves(tree):
        h.update(_bits(leaf))
    return int.from_bytes(h.digest()[:8], "little")


# ---------------------------------------------------------------------------------------------
# the NumPy reducer's bits, on every rank, outside jit and inside it
# ---------------------------------------------------------------------------------------------
def rank_same_bits_as_numpy(specs):
    import jax

    import gradcomp as gc
    import gradcomp.jax as gj

    comm = gc.MPICommunicator()
    like = _tree(0, 0)
    for spec in specs:
        ref = gc.GradientReducer([np.array(x) for x in jax.tree_util.tree_leaves(like)], gc.make(spec),
                                 comm, CAP)
        assert len(ref.buckets) >= 4, "the tree should span several buckets"
        tree_reducer = gj.TreeReducer(like, spec, comm, CAP)
        eager = gj.mean(gc.make(spec), comm, CAP)
        eager_state = eager.init(like)
        inside = gj.mean(gc.make(spec), comm, CAP)
        inside_state = inside.init(like)
        jitted = jax.jit(inside.update)
        for step in range(6):
            grads = _tree(comm.rank, step)
            local = [np.array(x) for x in jax.tree_util.tree_leaves(grads)]
            want = ref.step([x.copy() for x in local])
            _same_tree(tree_reducer.step(grads), want, f"{spec} TreeReducer step {step}")
            out, eager_state = eager.update(grads, eager_state)
            _same_tree(out, want, f"{spec} mean() outside jit, step {step}")
            out, inside_state = jitted(grads, inside_state)
            _same_tree(out, want, f"{spec} mean() inside jit, step {step}")
            assert jax.tree_util.tree_structure(out) == jax.tree_util.tree_structure(grads)
            digests = comm.comm.allgather(_digest(out))
            assert len(set(digests)) == 1, f"{spec} step {step}: ranks hold different means"
            if spec == "allreduce":  # and the means are means
                everyone = comm.comm.allgather([x.astype(np.float64) for x in local])
                for i, w in enumerate(want):
                    mean = sum(e[i] for e in everyone) / comm.size
                    assert np.allclose(w.astype(np.float64), mean, rtol=1e-2, atol=1e-2), f"leaf {i} is no mean"
        assert int(inside_state.count) == 6 and int(eager_state.count) == 6
    print(f"rank {comm.rank}: same bits as the NumPy reducer for {', '.join(specs)}", flush=True)


def test_same_bits_as_the_numpy_reducer_on_every_rank():
    run_ranks(3, "tests.jax_adapter.test_jax:rank_same_bits_as_numpy", SPECS, timeout=400)


# ---------------------------------------------------------------------------------------------
# optax: trains; checkpoints resume bit for bit
# ---------------------------------------------------------------------------------------------
def _problem(rank: int):
    """Softmax regression on 3 Gaussian blobs, this rank's own 64 samples."""
    rng = np.random.default_rng([7, rank])
    centers = np.random.default_rng(7).standard_normal((3, 10)) * 2
    y = rng.integers(0, 3, 64)
    x = (centers[y] + rng.standard_normal((64, 10))).astype(np.float32)
    return x, y


def _model():
    import jax.numpy as jnp

    rng = np.random.default_rng(3)
    return {"w": jnp.asarray(rng.standard_normal((10, 3)).astype(np.float32) * 0.1),
            "b": jnp.zeros(3, jnp.float32), "t": jnp.ones((), jnp.float32)}


def _loss(params, x, y):
    import optax

    logits = (x @ params["w"] + params["b"]) * params["t"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def rank_optax_trains(where):
    import jax
    import optax

    import gradcomp as gc
    import gradcomp.jax as gj

    comm = gc.MPICommunicator()
    x, y = _problem(comm.rank)
    params = _model()
    tx = optax.chain(gj.mean("int8:warmup=0", comm), optax.adamw(0.05))
    state = tx.init(params)

    def step(params, state):
        grads = jax.grad(_loss)(params, x, y)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    grad = jax.jit(jax.grad(_loss))
    apply = jax.jit(optax.apply_updates)
    jitted = jax.jit(step)
    everyone = [_problem(r) for r in range(comm.size)]
    total = lambda p: float(np.mean([_loss(p, a, b) for a, b in everyone]))  # noqa: E731
    before = total(params)
    for _ in range(60):
        if where == "inside":
            params, state = jitted(params, state)
        else:
            updates, state = tx.update(grad(params, x, y), state, params)
            params = apply(params, updates)
        digests = comm.comm.allgather(_digest(params))
        assert len(set(digests)) == 1, "ranks hold different parameters"
    after = total(params)
    assert after < 0.3 * before, f"did not train: loss {before:.3f} -> {after:.3f}"
    print(f"rank {comm.rank}: jit {where}: loss {before:.3f} -> {after:.3f}", flush=True)


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_optax_transform_trains(where):
    run_ranks(2, "tests.jax_adapter.test_jax:rank_optax_trains", where, timeout=300)


def _savez(state: dict) -> dict:
    buf = io.BytesIO()
    np.savez(buf, **state)
    buf.seek(0)
    with np.load(buf, allow_pickle=False) as f:  # what a user's np.load gives back: arrays
        return {k: f[k] for k in f.files}


def rank_checkpoint_resumes():
    import jax
    import optax

    import gradcomp as gc
    import gradcomp.jax as gj

    comm = gc.MPICommunicator()
    x, y = _problem(comm.rank)
    builders = {
        "mean int8, jit inside": (lambda: (lambda r: (r, optax.chain(r, optax.adamw(0.02))))(gj.mean("int8:warmup=0", comm)), True),
        "mean powersgd": (lambda: (lambda r: (r, optax.chain(r, optax.sgd(0.1, momentum=0.9))))(
            gj.mean("powersgd:start_iter=2", comm)), False),
        "dgc": (lambda: (lambda t: (t, t))(gj.dgc(0.05, ratio=0.2, warmup=3, comm=comm)), False),
        "onebit_adam, jit inside": (lambda: (lambda t: (t, t))(gj.onebit_adam(0.02, warmup=3, comm=comm)), True),
    }
    for name, (build, jit) in builders.items():
        def steps(link, tx, params, state, n):
            def one(params, state):
                updates, state = tx.update(jax.grad(_loss)(params, x, y), state, params)
                return optax.apply_updates(params, updates), state
            fn = jax.jit(one) if jit else one
            for _ in range(n):
                params, state = fn(params, state)
            return params, state

        link, tx = build()
        straight, _ = steps(link, tx, _model(), tx.init(_model()), 10)
        link, tx = build()
        params, state = steps(link, tx, _model(), tx.init(_model()), 5)
        saved_params = _savez({str(i): np.asarray(v) for i, v in enumerate(jax.tree_util.tree_leaves(params))})
        saved_state = _savez({str(i): np.asarray(v) for i, v in enumerate(jax.tree_util.tree_leaves(state))})
        saved_host = _savez(link.state_dict())

        def restore():
            link, tx = build()
            fresh = tx.init(_model())
            params = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(_model()),
                                                  [saved_params[str(i)] for i in range(len(saved_params))])
            params = jax.tree_util.tree_map(jax.numpy.asarray, params)
            state = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(fresh),
                                                 [jax.numpy.asarray(saved_state[str(i)]) for i in range(len(saved_state))])
            return link, tx, params, state

        link, tx, params, state = restore()
        link.load_state_dict(saved_host)
        resumed, _ = steps(link, tx, params, state, 5)
        for i, (a, b) in enumerate(zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed))):
            assert _bits(a) == _bits(b), f"{name}: the resumed run differs from the straight one (leaf {i})"
        # the optax state without the host state: an error on every rank, not a silent restart
        link, tx, params, state = restore()
        try:
            steps(link, tx, params, state, 1)
        except Exception as exc:  # CollectiveError, or JAX's runtime error carrying it (inside jit)
            assert "load_state_dict" in str(exc), f"{name}: unclear error: {exc}"
        else:
            raise AssertionError(f"{name}: stepped from a restored optax state without the compressor's state")
        # damaged host state: refused
        broken = dict(saved_host)
        broken["no-such-key"] = np.zeros(3)
        try:
            link.load_state_dict(broken)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{name}: load_state_dict accepted an unknown key")
    print(f"rank {comm.rank}: checkpoints resume bit for bit", flush=True)


def test_checkpoint_round_trip_resumes_bit_for_bit():
    run_ranks(2, "tests.jax_adapter.test_jax:rank_checkpoint_resumes", timeout=400)


# ---------------------------------------------------------------------------------------------
# gradcomp.optim through optax: the NumPy optimizer's bits
# ---------------------------------------------------------------------------------------------
def rank_optimizers_match_numpy():
    import jax
    import jax.numpy as jnp
    import optax

    import gradcomp as gc
    import gradcomp.jax as gj

    comm = gc.MPICommunicator()
    schedule = optax.linear_schedule(0.02, 0.005, 12)
    f32 = lambda t: jax.tree_util.tree_map(lambda a: a.astype(jnp.float32), t)  # noqa: E731  (Adam in float16 overflows)
    # (name, transformation, the NumPy optimizer, its rate at step k, dtype cast, inside jit exact?)
    cases = [
        ("dgc", lambda: gj.dgc(0.05, ratio=0.1, warmup=3, comm=comm),
         lambda p: gc.optim.DGC(p, lr=0.05, ratio=0.1, warmup=3, comm=comm), lambda k: 0.05, lambda t: t, True),
        ("onebit_adam", lambda: gj.onebit_adam(0.02, weight_decay=0.01, warmup=4, comm=comm),
         lambda p: gc.optim.OneBitAdam(p, lr=0.02, weight_decay=0.01, warmup=4, comm=comm), lambda k: 0.02, f32, True),
        # a schedule is evaluated where update runs: eagerly outside jit, by XLA inside it, which
        # may round the rate by an ulp: the jitted path is then checked against the eager one
        ("onebit_adam, a schedule", lambda: gj.onebit_adam(schedule, weight_decay=0.01, warmup=4, comm=comm),
         lambda p: gc.optim.OneBitAdam(p, lr=0.02, weight_decay=0.01, warmup=4, comm=comm),
         lambda k: float(jnp.asarray(schedule(jnp.asarray(k, jnp.int32)), jnp.float32)), f32, False),
    ]
    for name, make_tx, make_ref, lr, cast, exact in cases:
        like = cast(_tree(0, 0))
        params = jax.tree_util.tree_map(lambda a: a * 0 + 1, like)
        eager, inside = make_tx(), make_tx()
        eager_state, inside_state = eager.init(params), inside.init(params)
        jitted = jax.jit(inside.update)
        # the NumPy optimizer on the same arrays (a 0-d leaf as a 1-element array, as the transform does)
        ref = make_ref([np.array(v).reshape(np.shape(v) or (1,)) for v in jax.tree_util.tree_leaves(params)])
        shapes = [np.shape(v) for v in jax.tree_util.tree_leaves(params)]
        inside_params = params
        for step in range(12):
            grads = cast(_tree(comm.rank, step))
            for p, v in zip(ref.params, jax.tree_util.tree_leaves(params)):
                p[...] = np.asarray(v)
            before = [p.copy() for p in ref.params]
            ref.step([np.array(g).reshape(p.shape) for g, p in zip(jax.tree_util.tree_leaves(grads), ref.params)],
                     lr=lr(step))
            want = [(p - b).reshape(s) for p, b, s in zip(ref.params, before, shapes)]
            updates, eager_state = eager.update(grads, eager_state, params)
            _same_tree(updates, want, f"{name} outside jit, step {step}")
            params = optax.apply_updates(params, updates)
            assert len(set(comm.comm.allgather(_digest(params)))) == 1, f"{name}: replicas differ"
            updates, inside_state = jitted(grads, inside_state, inside_params)
            if exact:
                _same_tree(updates, want, f"{name} inside jit, step {step}")
            inside_params = optax.apply_updates(inside_params, updates)
            assert len(set(comm.comm.allgather(_digest(inside_params)))) == 1, f"{name}: replicas differ (jit)"
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(inside_params)):
            assert np.allclose(np.asarray(a, np.float64), np.asarray(b, np.float64), rtol=1e-3, atol=1e-4), name
        assert ref.steps == 12 and eager.host.optimizer.steps == 12
    print(f"rank {comm.rank}: optimizers match gradcomp.optim", flush=True)


def test_optimizers_match_gradcomp_optim():
    run_ranks(2, "tests.jax_adapter.test_jax:rank_optimizers_match_numpy", timeout=300)


# ---------------------------------------------------------------------------------------------
# the conformance kit on JAX arrays
# ---------------------------------------------------------------------------------------------
def test_conformance_kit_through_jax_arrays():
    """``python -m gradcomp.conformance gradcomp.jax.kit:SPEC``: every bucket's tensors become JAX
    arrays and the means come back as JAX arrays (the long accuracy run is left to the kit's own
    tests of the same compressors)."""
    checks = ["shapes", "dtypes", "non-finite", "checkpoint", "mismatches", "schedule"]
    outcomes = run_kit("gradcomp.jax.kit:int8", ranks=(2,), checks=checks, timeout=500)
    failures = [o for o in outcomes if not o.ok]
    assert not failures, "\n".join(f"{o.ranks} ranks: {o.failed}" for o in failures)
    assert all(sorted(o.passed) == sorted(checks) for o in outcomes), [o.passed for o in outcomes]


# ---------------------------------------------------------------------------------------------
# bad input: a clear error on every rank
# ---------------------------------------------------------------------------------------------
def rank_bad_input():
    import jax
    import optax

    import gradcomp as gc
    import gradcomp.jax as gj

    comm = gc.MPICommunicator()
    last = comm.rank == comm.size - 1

    def expect(fn, words, kind=gc.CollectiveError):
        try:
            fn()
        except kind as exc:
            for w in words:
                assert w in str(exc), f"{w!r} not in: {exc}"
        else:
            raise AssertionError(f"no {kind.__name__} for {words}")
        good = gj.TreeReducer(_tree(0, 0), "allreduce", comm, CAP)  # the communicator still works
        good.step(_tree(comm.rank, 1))

    # construction: structure, dtype, integer leaves that differ across ranks
    expect(lambda: gj.mean("int8", comm).init(_tree(0, 0, "key" if last else "")),
           ["pytree structure differs across ranks", "rank 0:", "embedding"])
    expect(lambda: gj.TreeReducer(_tree(0, 0, "dtype" if last else ""), "int8", comm),
           ["leaf 3 differs across ranks", "float16 (24,)", "float32 (24,)"])
    expect(lambda: gj.TreeReducer(_tree(0, 0, "int"), "int8", comm), ["cannot be bucketed"])
    # a step whose tree no longer matches on one rank, outside jit and inside it
    tx = gj.mean("int8", comm, CAP)
    state = tx.init(_tree(0, 0))
    _, state = tx.update(_tree(comm.rank, 0), state)
    expect(lambda: tx.update(_tree(comm.rank, 1, "shape" if last else ""), state),
           ["rank(s) [%d] cannot take part" % (comm.size - 1)])
    _, state = tx.update(_tree(comm.rank, 2), state)  # and the transformation goes on
    inside = gj.mean("int8", comm, CAP)
    inside_state = inside.init(_tree(0, 0))
    expect(lambda: jax.block_until_ready(jax.jit(inside.update)(_tree(comm.rank, 1, "key" if last else ""),
                                                                inside_state)),
           ["cannot take part"], Exception)
    # optimizers: parameters that differ across ranks, no parameters, a missing init
    params = _tree(comm.rank if last else 0, 0)
    expect(lambda: gj.dgc(0.1, comm=comm).init(params), ["parameters differ across ranks"])
    dgc = gj.dgc(0.1, comm=comm)
    dgc_state = dgc.init(_tree(0, 0))
    expect(lambda: dgc.update(_tree(comm.rank, 1), dgc_state), ["needs the parameters"], ValueError)
    expect(lambda: gj.mean("int8", comm).update(_tree(0, 0), None), ["call init"], RuntimeError)
    expect(lambda: optax.chain(gj.mean(3, comm)), ["Compressor"], TypeError)
    # init again after steps: refused (the state lives in the transformation)
    expect(lambda: tx.init(_tree(0, 0)), ["init called again"], ValueError)
    print(f"rank {comm.rank}: bad input refused on every rank", flush=True)


def test_bad_input_is_a_clear_error_on_every_rank():
    run_ranks(2, "tests.jax_adapter.test_jax:rank_bad_input", timeout=300)


FAIL_SCRIPT = '''
import sys
import jax, numpy as np, optax
import gradcomp as gc, gradcomp.jax as gj

comm = gc.MPICommunicator()
pattern = sys.argv[1]

class Failing(gc.Allreduce):
    """Fails halfway on rank 1: one collective done, the second never joined."""
    def run(self, bucket, comm):
        comm.allreduce(bucket.buffer)
        if comm.rank == 1:
            raise ArithmeticError("compressor failed halfway")
        return comm.allreduce(bucket.buffer)

params = {"w": jax.numpy.ones((16, 8)), "b": jax.numpy.zeros(8)}
tx = optax.chain(gj.mean(Failing() if pattern == "fail-inside-jit" else gc.make("int8"), comm), optax.sgd(0.1))
state = tx.init(params)
update = jax.jit(tx.update) if pattern == "fail-inside-jit" else tx.update
for step in range(6):
    if comm.rank == 1 and step == 3 and pattern == "raise-between":
        raise RuntimeError("user code failed between two reductions")
    grads = jax.tree_util.tree_map(lambda p: p * (comm.rank + 1), params)
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    jax.block_until_ready(params)
print(f"rank {comm.rank} finished", flush=True)
'''


@pytest.mark.parametrize("pattern, words", [("raise-between", "uncaught RuntimeError"),
                                            ("fail-inside-jit", "ArithmeticError")])
def test_a_failing_rank_ends_the_job(tmp_path, pattern, words):
    """Plain ``mpiexec -n 2 python train.py`` with a JAX loop: the job ends, non-zero, saying why."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(FAIL_SCRIPT))
    result = run(2, [str(script), pattern], timeout=180,
                 env={"PYTHONPATH": str(ROOT), "GRADCOMP_ABORT_GRACE_S": "3"})
    assert not result.hung, f"{pattern}: the job hung:\n{result.output}"
    assert result.returncode != 0, f"{pattern}: the job exited 0:\n{result.output}"
    assert words in result.output, result.output
    assert "rank 0 finished" not in result.output


# ---------------------------------------------------------------------------------------------
# the example (``import gradcomp`` importing no jax: tests/test_core.py)
# ---------------------------------------------------------------------------------------------
def test_example_trains_with_identical_replicas(tmp_path):
    import json

    out = tmp_path / "summary.json"
    result = run(2, [str(ROOT / "examples" / "jax_mlp.py"), "--compressor", "int8", "--epochs", "4",
                     "--jit", "inside", "--json", str(out)], timeout=300, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0 and not result.hung, result.output
    summary = json.loads(out.read_text())
    assert summary["weights_identical"] and len(set(summary["weight_digests"])) == 1
    assert summary["test_accuracy"] > 0.85, summary["test_accuracy"]
    assert summary["bytes_sent"] > 0
    # int8 after its 50 exact steps: about 4x in the last epoch, less over the whole run
    assert 3.5 < summary["last_epoch"]["compression_ratio"] < 4.1, summary["last_epoch"]
    assert 1.0 < summary["run"]["compression_ratio"] < summary["last_epoch"]["compression_ratio"], summary["run"]
    assert "bytes sent per rank per step" in result.output and "compression ratio" in result.output

