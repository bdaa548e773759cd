"""Every way a rank can fail or drift ends in a clear error (NumPy side; the PyTorch side is in
test_torch_trust.py).

The exit tests run plain scripts under ``mpiexec`` (no ``python -m mpi4py``, no test harness
catching exceptions): a job that hangs is killed after the timeout and fails the test.
"""
from __future__ import annotations

import math
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import gradcomp as gc
from gradcomp.launcher import run
from tests.mpi_launch import ROOT, run_ranks

EXIT_SCRIPT = '''
import sys, time
import numpy as np
import gradcomp as gc

comm = gc.MPICommunicator()
grads = [np.ones((64, 64), np.float32), np.ones(10, np.float32)]
comp = gc.make(sys.argv[2])
pattern = sys.argv[1]
for step in range(6):
    if comm.rank == 1 and step == 3:
        if pattern == "raise-between":
            raise RuntimeError("user code failed between two reductions")
        if pattern == "exit-between":
            sys.exit(0)
        if pattern == "exit-nonzero":
            sys.exit(3)
    if step == 3 and pattern == "raise-everywhere":
        raise RuntimeError(f"rank {comm.rank} failed with the others")
    if step == 3 and pattern == "raise-inside":
        class Failing(gc.Allreduce):
            def run(self, bucket, comm):
                comm.allreduce(bucket.buffer)
                if comm.rank == 1:
                    raise ArithmeticError("compressor failed halfway")
                return comm.allreduce(bucket.buffer)
        Failing().reduce(np.ones(8, np.float32), comm).result()
    gc.allreduce_gradients(grads, comp, comm)
print(f"rank {comm.rank} finished", flush=True)
'''


@pytest.fixture(scope="module")
def exit_script(tmp_path_factory):
    path = tmp_path_factory.mktemp("exits") / "train.py"
    path.write_text(textwrap.dedent(EXIT_SCRIPT))
    return path


@pytest.mark.parametrize("pattern, words", [
    ("raise-between", "uncaught RuntimeError"),
    ("raise-inside", "uncaught ArithmeticError"),
    ("exit-between", "left the job"),
    ("exit-nonzero", "left the job"),
])
def test_a_rank_that_fails_or_exits_ends_the_job(exit_script, pattern, words):
    """Plain `mpiexec -n 3 python train.py`: the job ends promptly, non-zero, saying why."""
    result = run(3, [str(exit_script), pattern, "fp16"], timeout=90, env={"PYTHONPATH": str(ROOT)})
    assert not result.hung, f"{pattern}: the job hung:\n{result.output}"
    assert result.returncode != 0, f"{pattern}: the job exited 0:\n{result.output}"
    assert words in result.output, result.output
    assert "rank 0 finished" not in result.output


def test_every_rank_failing_is_not_told_the_others_wait_for_it(exit_script):
    """Each rank that raises says why the job ends; when all of them raise, none may claim that
    the others wait for it (they were failing too): the reason must hold either way."""
    result = run(3, [str(exit_script), "raise-everywhere", "fp16"], timeout=90, env={"PYTHONPATH": str(ROOT)})
    assert not result.hung and result.returncode != 0, result.output
    assert "failed with the others" in result.output and "uncaught RuntimeError: this rank can take no " \
        "further part in the job's collectives, so any rank still running would wait for it forever" in result.output, \
        result.output
    assert "the other ranks would wait" not in result.output, result.output


def test_ending_the_job_never_returns():
    """MPICH's MPI_Abort can return when two ranks abort at once; the rank must not go on."""
    code = ("from gradcomp.comm.exits import end_job\n"
            "class Returns:\n    def Abort(self, code): pass\n"
            "end_job(Returns(), 3)\nprint('went on')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3 and "went on" not in done.stdout, done.stdout + done.stderr


def test_an_abort_that_hangs_still_ends_the_process():
    """MPICH 5's MPI_Abort ends the process with exit(), whose destructors can wait on a live
    thread forever (a torch job under mpiexec once never ended): the process ends regardless."""
    code = ("import threading\nfrom gradcomp.comm import exits\nexits.ABORT_EXIT_S = 1.0\n"
            "class Hangs:\n    def Abort(self, code): threading.Event().wait()\n"
            "exits.end_job(Hangs(), 3)\nprint('went on')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "went on" not in done.stdout, done.stdout + done.stderr
    assert "Timeout" in done.stderr and "in Abort" in done.stderr, done.stderr  # every thread's stack


def test_a_normal_end_is_not_disturbed(exit_script):
    result = run(3, [str(exit_script), "none", "powersgd:start_iter=2"], timeout=90,
                 env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.output
    assert result.output.count("finished") == 3 and "Ending the job" not in result.output


# ---------------------------------------------------------------------------------------------
# state that drifts across ranks
# ---------------------------------------------------------------------------------------------
LAYOUT = [(24, 16), (16,)]


def reduce(comp, comm, g):
    return comp.reduce(gc.Bucket(g, 0, LAYOUT), comm).result()


def rank_state_drift(case):
    """One rank's compressor a step or stage ahead, as a checkpoint from another step would leave
    it: a CollectiveError naming the state on every rank, never a truncation abort or a hang."""
    from mpi4py import MPI

    comm = gc.MPICommunicator()
    builders = {
        "powersgd-warmup": lambda: gc.PowerSGD(rank=2, start_iter=3),
        "schedule-stage": lambda: gc.Schedule([(0, gc.Allreduce()), (2, gc.FP16(gc.Allreduce())),
                                               (4, gc.PowerSGD(rank=1, start_iter=2))]),
        "one-round-phase": lambda: gc.PowerSGD(rank=2, start_iter=2, rounds=1),
    }
    n = sum(math.prod(s) for s in LAYOUT)
    comp = builders[case]()
    ahead = {"powersgd-warmup": 3, "schedule-stage": 2, "one-round-phase": 3}[case]
    if comm.rank == comm.size - 1:  # advance alone, then move the state over
        alone, solo = gc.MPICommunicator(MPI.COMM_SELF), builders[case]()
        for _ in range(ahead):
            reduce(solo, alone, np.ones(n, np.float32))
        comp.load_state_dict(solo.state_dict())
    if case == "one-round-phase":  # everyone past warm-up, the last rank one phase ahead
        for _ in range(2):
            try:
                reduce(comp, comm, np.ones(n, np.float32))
            except gc.CollectiveError:
                pass
    with pytest.raises(gc.CollectiveError, match="compressor state differs .*step="):
        reduce(comp, comm, np.ones(n, np.float32))
    fresh = builders[case]()
    assert np.isfinite(reduce(fresh, comm, np.ones(n, np.float32))).all()  # still in step


@pytest.mark.parametrize("case", ["powersgd-warmup", "schedule-stage", "one-round-phase"])
def test_state_drift_is_a_collective_error(case):
    run_ranks(2, "tests.comm.test_trust:rank_state_drift", case)


def rank_one_compressor_two_communicators():
    a, b = gc.MPICommunicator(), gc.MPICommunicator()
    comp = gc.Schedule([(0, gc.Allreduce()), (1, gc.PowerSGD(rank=1, start_iter=2))])
    comp.reduce(np.ones(10, np.float32), a).result()
    with pytest.raises(ValueError, match="one compressor per communicator"):
        comp.reduce(np.ones(10, np.float32), b)
    import copy
    twin = copy.deepcopy(gc.PowerSGD(rank=1, start_iter=2))  # the way out the error names
    twin.reduce(np.ones(10, np.float32), b).result()


def rank_two_threads():
    comm = gc.MPICommunicator()
    started = threading.Event()
    errors = []

    def other():
        started.wait()
        try:
            comm.allreduce(np.ones(4, np.float32))
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=other)
    thread.start()
    x = np.ones(2_000_000, np.float32)
    futures = [comm.iallreduce(x) for _ in range(4)]  # in flight while the other thread submits
    started.set()
    thread.join()
    for f in futures:
        f.result()
    assert errors and "one thread at a time" in str(errors[0]), errors
    comm.allreduce(np.ones(4, np.float32))  # after the futures: another thread may take over
    done = []
    t = threading.Thread(target=lambda: done.append(comm.allreduce(np.ones(4, np.float32))))
    t.start()
    t.join()
    assert done and (done[0] == comm.size).all()


def rank_byte_order():
    """A big-endian array on one rank: reduce() refuses it on every rank (CollectiveError); the
    gradient path normalizes it and gives every rank the same values."""
    comm = gc.MPICommunicator()
    odd = comm.rank == comm.size - 1
    x = np.arange(12, dtype=">f4" if odd else "<f4")
    with pytest.raises(gc.CollectiveError, match="byte order"):
        gc.Allgather().reduce(x, comm).result()
    grads = [np.arange(12, dtype=">f4" if odd else "<f4").reshape(3, 4)]
    gc.allreduce_gradients(grads, gc.Allgather(), comm)
    assert np.array_equal(grads[0], np.arange(12, dtype=np.float32).reshape(3, 4))


@pytest.mark.parametrize("check", ["rank_one_compressor_two_communicators", "rank_two_threads",
                                   "rank_byte_order"])
def test_misuse_is_refused(check):
    run_ranks(2, f"tests.comm.test_trust:{check}")


# ---------------------------------------------------------------------------------------------
# checkpoints refused before anything changes
# ---------------------------------------------------------------------------------------------
def trained_powersgd():
    comm = gc.MPICommunicator()
    comp = gc.PowerSGD(rank=2, start_iter=2)
    rng = np.random.default_rng(0)
    for _ in range(4):
        reduce(comp, comm, rng.standard_normal(sum(math.prod(s) for s in LAYOUT)).astype(np.float32))
    return comp


@pytest.mark.parametrize("damage, words", [
    (lambda s: {}, "empty"),
    (lambda s: dict(s, step=-1), "'step' must be >= 0"),
    (lambda s: dict(s, step=True), "'step' must be an integer"),
    (lambda s: {k: v for k, v in s.items() if k != "rng/pos"}, "missing 'rng/pos'"),
    (lambda s: dict(s, **{"residual/0.0": s["residual/0.0"][:5]}), "'residual/0.0' must have shape"),
    (lambda s: dict(s, **{"residual/0.0": s["residual/0.0"].astype(np.int64)}), "'residual/0.0' must have dtype"),
    (lambda s: dict(s, **{"q/0.0": np.zeros((16, 3), np.float32)}), "'q/0.0' must be .* <= rank 2"),
    (lambda s: dict(s, **{"q/0.0": np.zeros((15, 2), np.float32)}), "'q/0.0' must have shape \\(16, 2\\)"),
    (lambda s: dict(s, **{"rng/keys": s["rng/keys"][:100]}), "'rng/keys' must have shape"),
])
def test_load_state_dict_checks_before_changing(damage, words):
    comp = trained_powersgd()
    before = comp.state_dict()
    shapes = {"0.0": (24, 16), "0.1": (16,)}
    with pytest.raises(ValueError, match=words):
        comp.load_state_dict(damage(before), shapes)
    after = comp.state_dict()
    assert sorted(after) == sorted(before)
    for key in before:
        assert np.array_equal(np.asarray(after[key]), np.asarray(before[key])), key


@pytest.mark.parametrize("make, words", [
    (lambda: gc.PowerSGD(rank=True), "rank must be an integer"),
    (lambda: gc.PowerSGD(rank=float("inf")), "rank must be an integer"),
    (lambda: gc.PowerSGD(start_iter=-5), "start_iter must be >= 0"),
    (lambda: gc.QuantizePerChannel(bits=True), "bits must be an integer"),
    (lambda: gc.QuantizePerChannel(channel_size=2.5), "channel_size must be an integer"),
    (lambda: gc.make("powersgd:rank=0"), "rank must be >= 1"),
    (lambda: gc.make("fp16:rank=2"), "does not take"),
    (lambda: gc.ErrorFeedback(gc.PowerSGD()), "ErrorFeedback wraps a gradcomp Codec"),
])
def test_bad_parameters_are_value_errors(make, words):
    with pytest.raises((ValueError, TypeError), match=words):
        make()


def test_errors_that_say_what_to_do():
    import subprocess
    import sys

    assert repr(gc.FP16()) == "FP16(inner=Allreduce())"  # FP16() alone means FP16 allreduce
    code = ("import sys; sys.modules['mpi4py'] = None\n"
            "import gradcomp\n"
            "try:\n    gradcomp.MPICommunicator()\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "pip install 'gradcomp[mpi]'" in out, out
    comp = gc.PowerSGD(rank=2)
    s = comp.stats()
    assert s["compressing"] is False and s["warmup_steps_left"] == 1000
    code = ("import torch, gradcomp\n"
            "try:\n    gradcomp.allreduce_gradients([torch.ones(3)], gradcomp.Allreduce())\n"
            "except gradcomp.CollectiveError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "torch tensor: use gradcomp.torch" in out, out
