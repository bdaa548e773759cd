"""The conformance kit: the contract every gradcomp compressor, built-in or third-party, must meet.

    python -m gradcomp.conformance my_package.topk:make_topk          # your factory, 1-3 ranks
    python -m gradcomp.conformance my_module:MyCodec --ranks 2,4
    python -m gradcomp.conformance --registered fp16 powersgd          # registered names
    python -m gradcomp.conformance --all-registered

It runs the checks below under real ``mpiexec`` at each rank count and exits non-zero on any
failure or hang (``--timeout``). ``module:factory`` is imported from the current directory; the
factory takes no arguments and returns a fresh ``gradcomp.Compressor`` each call.

The checks (``checks.CHECKS``):

* ``shapes``: lengths 0, 1, 511, 512, 513, 1009 and a bucket with tensors, two buckets a step: the
  output keeps the input's length and dtype, the input is untouched, every rank holds the same
  bits, a scratch bucket gives the same bits, and each step is within the declared
  ``error_bound`` (when the compressor declares one);
* ``dtypes``: float16, bfloat16, float32, float64 buckets, the same promises;
* ``accuracy``: on a structured signal (low-rank, heavy-tailed tensors plus per-rank noise), a
  method with error feedback (``error_feedback_on``) must keep the error accumulated over 300 steps
  under half of the summed means and shrinking (by a fifth from step 150 to 300); any other method must stay within its declared
  ``relative_error_limit`` (default 0.9). A compressor that returns zeros or a constant fails;
* ``non-finite``: NaN and Inf on one rank keep replicas identical, reach the output with the
  declared ``nan_effect`` ("element", "chunk", "tensor", "bucket"), and later steps are clean;
* ``checkpoint``: ``state_dict()`` is plain (``numpy.savez`` without pickling), a fresh compressor
  loaded with it continues bit for bit, and empty, truncated, mistyped or unknown state is refused
  with ``ValueError`` without changing anything;
* ``mismatches``: lengths, dtypes, unusable buffers, other configurations and (for stateful
  compressors) one rank a few steps ahead all raise ``CollectiveError`` on every rank, and the
  communicator stays usable;
* ``schedule``: inside ``Schedule`` the compressor reduces exactly as alone and hands its
  error-feedback residuals to the next stage;
* ``scatter``: where the compressor declares a reduce-scatter form (``scatters``, what FSDP2's
  gradients need), each rank gets its row of the mean with the ``accuracy`` promise; where it
  does not, a reduce-scatter bucket is refused on every rank.

Writing a compressor: a single-collective method subclasses ``gradcomp.Codec`` (``message_size``,
``encode``, ``decode``, the collective, and what it promises: ``error_bound``, ``nan_effect``,
``relative_error_limit``); wrap it in ``gradcomp.ErrorFeedback`` for error feedback. A multi-round
method subclasses ``gradcomp.Compressor`` and implements ``run(bucket, comm)`` (or ``prepare`` +
``finish``), declares its configuration through its ``__init__`` parameters and its
step-dependent state in ``agreement_state``, and, if stateful, ``state_dict``/``load_state_dict``.
Register it with ``gradcomp.register(name, factory)`` or the ``gradcomp.compressors`` entry point.
"""
from __future__ import annotations

import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..launcher import run as launch


@dataclass
class Outcome:
    target: str
    ranks: int
    passed: list[str]
    failed: str | None      # the failing check and why, or None
    output: str

    @property
    def ok(self) -> bool:
        return self.failed is None


def run(target: str, ranks: Sequence[int] = (1, 2, 3), checks: Sequence[str] | None = None,
        timeout: float = 600, hosts: int | None = None) -> list[Outcome]:
    """Run the kit on ``target`` (``module:factory``, ``registry:SPEC`` or ``optimizer:SPEC``) at
    each rank count. ``hosts``: the hierarchical run, ``Hierarchical(compressor)`` on that many
    simulated hosts (``GRADCOMP_RANKS_PER_HOST`` = ranks / hosts)."""
    from .checks import CHECKS
    from .job import HIERARCHICAL_ENV, REPORT_ENV
    from .optimizers import CHECKS as OPTIMIZER_CHECKS

    known = OPTIMIZER_CHECKS if target.startswith("optimizer:") else CHECKS
    names = list(checks) if checks else list(known)
    unknown = [c for c in names if c not in known]
    if unknown:
        raise ValueError(f"unknown checks {unknown}; known: {', '.join(known)}")
    cwd = os.getcwd()
    outcomes = []
    for n in ranks:
        with tempfile.TemporaryDirectory(prefix="gradcomp-kit-") as report:
            env = {"PYTHONPATH": cwd + os.pathsep + os.environ.get("PYTHONPATH", ""), REPORT_ENV: report}
            if hosts:
                if n % hosts:
                    raise ValueError(f"{n} ranks cannot form {hosts} hosts of equal size")
                env.update({HIERARCHICAL_ENV: "1", "GRADCOMP_RANKS_PER_HOST": str(n // hosts)})
            result = launch(n, ["-m", "gradcomp.conformance.job", target, *names], timeout=timeout,
                            env=env, cwd=cwd)
            # The report files hold every result line even when MPI_Abort cut the output short.
            reports = [p.read_text() for p in sorted(Path(report).iterdir())]
        passed = re.findall(r"^CONFORMANCE-PASS (\S+)", "".join(reports), re.M)
        fails = [r.split("CONFORMANCE-FAIL ", 1)[1].strip() for r in reports if "CONFORMANCE-FAIL " in r]
        if result.hung:
            failed = f"hang: no result within {timeout:g} s (after {', '.join(passed) or 'no check'})"
        elif fails:
            failed = fails[0]  # a traceback keeps all its lines
        elif result.returncode != 0 or len(passed) != len(names):
            tail = "\n".join(result.output.strip().splitlines()[-12:])
            failed = f"the job failed (exit {result.returncode}):\n{tail}"
        else:
            failed = None
        outcomes.append(Outcome(target, n, passed, failed, result.output))
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from .. import REGISTRY

    p = argparse.ArgumentParser(prog="python -m gradcomp.conformance", description=__doc__.split("\n\n")[0])
    p.add_argument("targets", nargs="*", metavar="MODULE:FACTORY")
    p.add_argument("--registered", nargs="+", default=[], metavar="NAME",
                   help="registered compressor names (or name:key=value specs)")
    p.add_argument("--all-registered", action="store_true", help="every name in gradcomp.REGISTRY")
    p.add_argument("--optimizer", nargs="+", default=[], metavar="NAME",
                   help="gradcomp.optim methods (dgc, onebitadam, or name:key=value specs)")
    p.add_argument("--ranks", default="1,2,3", help="comma-separated rank counts (default 1,2,3)")
    p.add_argument("--hosts", type=int, help="the hierarchical run: Hierarchical(compressor) on this "
                   "many simulated hosts (e.g. --hosts 2 --ranks 4: 2 hosts x 2 ranks)")
    p.add_argument("--checks", default="", help="comma-separated (default: all)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per mpiexec job")
    p.add_argument("-v", "--verbose", action="store_true", help="print each job's output")
    args = p.parse_args(argv)
    targets = list(args.targets) + [f"registry:{n}" for n in args.registered]
    targets += [f"optimizer:{n}" for n in args.optimizer]
    if args.all_registered:
        targets += [f"registry:{n}" for n in REGISTRY]
    if not targets:
        p.error("name a MODULE:FACTORY, --registered NAME, --all-registered or --optimizer NAME")
    ranks = [int(r) for r in args.ranks.split(",") if r.strip()]
    checks = [c for c in args.checks.split(",") if c.strip()]
    failures = 0
    for target in targets:
        for outcome in run(target, ranks, checks, args.timeout, args.hosts):
            status = "ok" if outcome.ok else "FAILED"
            print(f"{target} at {outcome.ranks} rank(s): {status} ({len(outcome.passed)} checks passed)")
            if args.verbose or not outcome.ok:
                if outcome.failed:
                    print("  " + outcome.failed.replace("\n", "\n  "))
            failures += not outcome.ok
    print(f"{len(targets)} compressor(s), {failures} failing job(s)")
    sys.stdout.flush()
    return 1 if failures else 0
