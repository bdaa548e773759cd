"""One job of the conformance kit, run on every rank of one ``mpiexec``.

    mpiexec -n 3 python -m gradcomp.conformance.job TARGET [CHECK ...]

TARGET is ``module:factory`` (importable from the current directory), ``registry:SPEC`` (the
compressor checks, ``checks``) or ``optimizer:SPEC`` (``optimizers``). Every check is collective
and ends with every rank agreeing; an assertion that fails on one rank prints
``CONFORMANCE-FAIL <check>: <why>`` and aborts the job (a failed check must not leave the other
ranks waiting in the next collective). Rank 0 prints ``CONFORMANCE-PASS <check>`` per check.

Each line is also appended to ``$GRADCOMP_CONFORMANCE_REPORT/rank<r>`` when the kit sets that
folder: ``MPI_Abort`` can end the job before mpiexec forwards what the failing rank printed (seen
in CI: a failed job with no output at all), and a file written before the abort cannot be lost.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from typing import Any

import gradcomp as gc

from . import optimizers
from .checks import CHECKS, Kit


def load_factory(target: str):
    """``module:attr`` (a factory or class, importable from the current directory) or
    ``registry:SPEC``."""
    kind, _, rest = target.partition(":")
    if kind == "registry":
        return lambda: gc.make(rest)
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")
    factory = getattr(importlib.import_module(kind), rest)
    comp = factory()
    if not isinstance(comp, gc.Compressor):
        raise TypeError(f"{target}() returned {type(comp).__name__}, not a gradcomp.Compressor")
    return factory


REPORT_ENV = "GRADCOMP_CONFORMANCE_REPORT"
#: set by the kit's hierarchical run (``--hosts``): every compressor is wrapped in ``Hierarchical``
HIERARCHICAL_ENV = "GRADCOMP_CONFORMANCE_HIERARCHICAL"


def say(rank: int, line: str) -> None:
    """Print a result line, and keep it in this rank's report file when the kit asked for one."""
    folder = os.environ.get(REPORT_ENV)
    if folder:  # first: the file is what the kit reads
        with open(os.path.join(folder, f"rank{rank}"), "a") as f:
            f.write(line + "\n")
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv) -> None:
    from ..comm.exits import guard

    target = argv[0]
    comm = gc.MPICommunicator()
    if target.startswith("optimizer:"):
        checks: dict = optimizers.CHECKS
        kit: Any = optimizers.OptimizerKit(optimizers.optimizer_factory(target[len("optimizer:"):]), comm)
    else:
        build = load_factory(target)
        if os.environ.get(HIERARCHICAL_ENV):  # the hierarchical run: the same checks, through it
            from ..compressors.hierarchical import Hierarchical

            flat = build
            build = lambda: Hierarchical(flat())  # noqa: E731
        checks, kit = CHECKS, Kit(build, comm)
    names = argv[1:] or list(checks)
    for name in names:
        try:
            checks[name](kit)
        except BaseException as exc:
            detail = f"{type(exc).__name__}: {exc}" if isinstance(exc, AssertionError) else traceback.format_exc()
            say(comm.rank, f"CONFORMANCE-FAIL {name} (rank {comm.rank} of {comm.size}): {detail}")
            guard().abort(f"conformance check {name} failed")
        comm.comm.Barrier()
        if comm.rank == 0:
            say(0, f"CONFORMANCE-PASS {name}")
    comm.close()


if __name__ == "__main__":
    main(sys.argv[1:])
