"""Run a test function on N real MPI ranks under ``mpiexec``.

Test side: ``run_ranks(3, "tests.test_x:check_thing", arg1, arg2)`` launches
``mpiexec -n 3 python -m tests.mpi_launch tests.test_x:check_thing '[arg1, arg2]'`` (through
``gradcomp.launcher``) and fails the test, with every rank's output, when any rank fails or when
the job does not finish within ``timeout`` seconds: a hang is a failure, never a stuck suite.

Rank side: the function is imported and called on every rank with the JSON-decoded arguments; a
rank first checks that the world really has N ranks. Plain ``assert`` inside it is enough.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import traceback
from pathlib import Path

from gradcomp.launcher import mpiexec, run  # noqa: F401  (mpiexec: used by other test modules)

ROOT = Path(__file__).resolve().parent.parent


def run_ranks(n: int, target: str, *args, timeout: float = 120, env: dict | None = None,
              expect_failure: bool = False) -> str:
    """Run ``target`` ("module:function") on ``n`` ranks; return the combined output.

    With ``expect_failure`` the job must end (not hang) with a non-zero exit status instead.
    """
    full_env = dict(GRADCOMP_TEST_NRANKS=str(n),
                    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    result = run(n, ["-m", "tests.mpi_launch", target, json.dumps(args)], timeout=timeout,
                 env=full_env, cwd=ROOT)
    if result.hung:
        raise AssertionError(f"{target} on {n} ranks did not finish in {timeout} s (hang):\n{result.output}")
    if expect_failure:
        if result.returncode == 0:
            raise AssertionError(f"{target} on {n} ranks was expected to fail but exited 0:\n{result.output}")
    elif result.returncode != 0:
        raise AssertionError(f"{target} on {n} ranks failed (exit {result.returncode}):\n{result.output}")
    return result.output


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
        mod = importlib.import_module(module)
        getattr(mod, func)(*args)
    except BaseException:
        sys.stdout.write(f"[rank {world.Get_rank()}] " + traceback.format_exc())
        sys.stdout.flush()
        world.Abort(1)  # one failing rank must end the job, not leave the others waiting
    after = getattr(mod, "after_rank_success", None)  # a module's own way out, e.g. past torch's teardown
    if after is not None:
        after()


def leave_before_torch_teardown(*comms):
    """End the rank now that every check passed. PyTorch 2.13 sometimes aborts in
    destroy_process_group() or at interpreter exit once gloo has run ("terminate called ...
    Resource deadlock avoided": a thread joining itself, after powerSGD_hook; "terminate called
    without an active exception", exit 6, after the DDP hook tests: about 1 run in 10-20, also in
    a script without gradcomp or MPI). Close ``comms``, finalize MPI properly, skip that teardown.
    Only tests use this: a user's job still destroys its process group at exit
    (``gradcomp.torch.launch``)."""
    from mpi4py import MPI

    for comm in comms:
        comm.close()
    MPI.COMM_WORLD.Barrier()
    sys.stdout.flush()
    MPI.Finalize()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1:])
