"""Run a test function on N real MPI ranks under ``mpiexec``.

Test side: ``run_ranks(3, "tests.test_x:check_thing", arg1, arg2)`` launches
``mpiexec -n 3 python -m tests.mpi_launch tests.test_x:check_thing '[arg1, arg2]'`` and fails the
test (with every rank's output) when any rank fails, or when the job does not finish within
``timeout`` seconds: a hang is a failure, never a stuck suite.

Rank side: the function is imported and called on every rank with the JSON-decoded arguments; a
rank first checks that the world really has N ranks. Plain ``assert`` inside it is enough.
"""
from __future__ import annotations

import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def mpiexec() -> str:
    local = Path(sys.executable).parent / "mpiexec"
    return str(local) if local.exists() else (shutil.which("mpiexec") or "mpiexec")


def run_ranks(n: int, target: str, *args, timeout: float = 120, env: dict | None = None,
              expect_failure: bool = False) -> str:
    """Run ``target`` ("module:function") on ``n`` ranks; return the combined output.

    With ``expect_failure`` the job must end (not hang) with a non-zero exit status instead.
    """
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "tests.mpi_launch", target, json.dumps(args)]
    full_env = dict(os.environ, GRADCOMP_TEST_NRANKS=str(n), OMP_NUM_THREADS="1",
                    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{target} on {n} ranks did not finish in {timeout} s (hang):\n{out}")
    if expect_failure:
        if proc.returncode == 0:
            raise AssertionError(f"{target} on {n} ranks was expected to fail but exited 0:\n{out}")
    elif proc.returncode != 0:
        raise AssertionError(f"{target} on {n} ranks failed (exit {proc.returncode}):\n{out}")
    return out


def _main(argv):
    target, args = argv[0], json.loads(argv[1]) if len(argv) > 1 else []
    from mpi4py import MPI

    want = int(os.environ.get("GRADCOMP_TEST_NRANKS", "0"))
    world = MPI.COMM_WORLD
    if want and world.Get_size() != want:
        print(f"rank {world.Get_rank()}: world has {world.Get_size()} ranks, expected {want}", flush=True)
        sys.exit(3)
    module, func = target.split(":")
    try:
        getattr(importlib.import_module(module), func)(*args)
    except BaseException:
        sys.stdout.write(f"[rank {world.Get_rank()}] " + traceback.format_exc())
        sys.stdout.flush()
        world.Abort(1)  # one failing rank must end the job, not leave the others waiting


if __name__ == "__main__":
    _main(sys.argv[1:])
