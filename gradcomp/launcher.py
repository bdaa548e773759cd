"""Start a Python program on N ranks under ``mpiexec``: the one helper the tests, the conformance
kit, the demo and the benchmarks share.

The mpiexec used is the one beside the running Python (``pip install mpich`` puts it in the
virtual environment), else the first on ``PATH``. A job that outlives its timeout is killed with
its whole process group and reported as a hang, never left running.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence


def mpiexec() -> str:
    """Path of the mpiexec beside this Python, or on PATH; SystemExit with a hint when none."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise SystemExit("gradcomp: mpiexec not found: pip install 'gradcomp[mpi]' (MPICH from PyPI) "
                         "or put an MPI launcher on PATH")
    return found


@dataclass
class Result:
    returncode: int | None  # None: killed after the timeout (a hang)
    output: str             # stdout and stderr together

    @property
    def hung(self) -> bool:
        return self.returncode is None


def run(ranks: int, args: Sequence[str], *, timeout: float, env: dict[str, str] | None = None,
        cwd: str | os.PathLike | None = None, on_line: Callable[[str], bool] | None = None) -> Result:
    """``mpiexec -n ranks python *args``; returns its exit code and output.

    ``env`` is added to this process's environment (plus ``OMP_NUM_THREADS=1`` unless set: the
    ranks share the cores). ``on_line(line)`` sees each output line as it arrives and returns
    whether to keep it in ``Result.output`` (progress lines need not be).
    """
    cmd = [mpiexec(), "-n", str(int(ranks)), sys.executable, *map(str, args)]
    full_env = dict(os.environ)
    full_env.setdefault("OMP_NUM_THREADS", "1")
    full_env.update(env or {})
    proc = subprocess.Popen(cmd, cwd=cwd, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    timer = _Killer(proc, timeout)
    kept = []
    try:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            if on_line is None or on_line(line):
                kept.append(line)
        proc.wait()
    finally:
        timer.cancel()
    return Result(None if timer.fired else proc.returncode, "".join(kept))


class _Killer:
    """Kill a process group after ``timeout`` seconds."""

    def __init__(self, proc: subprocess.Popen, timeout: float):
        import threading

        self.fired = False
        self._proc = proc
        self._timer = threading.Timer(timeout, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        self.fired = True
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def cancel(self) -> None:
        self._timer.cancel()
