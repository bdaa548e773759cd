"""The conformance kit (``python -m gradcomp.conformance``) over every registered compressor, and
the kit itself: it must fail compressors that are wrong in each way it promises to catch, and
pass a correct one written outside gradcomp, including one written against the old
``run(bucket, comm)`` contract."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import gradcomp as gc
from gradcomp.conformance import run as run_kit
from gradcomp.registry import steady

#: every registered name, and the variants a name's parameter switches to another codec
NAMES = sorted(gc.REGISTRY) + ["topk:stages=2", "int4:chunk=64", "int4:exact_zero=False", "powersgd:factor_bits=8"]


@pytest.mark.parametrize("name", NAMES)
def test_registered_compressor_conforms(name):
    """Every registered name's method, from its first step (``steady``: the warm-up is exact
    averaging, which ``allreduce`` covers)."""
    failures = [o for o in run_kit(f"registry:{steady(name)}", ranks=(1, 2, 3), timeout=600) if not o.ok]
    assert not failures, "\n".join(f"{o.ranks} ranks: {o.failed}" for o in failures)


@pytest.mark.parametrize("name", ["onebit", "topk:ramp=40"])
def test_recipes_conform_as_registered(name):
    """A recipe as registered, warm-up and ramp included (the kit runs past ``warmup_steps``)."""
    failures = [o for o in run_kit(f"registry:{name}", ranks=(2,), checks=("accuracy", "checkpoint"),
                                   timeout=600) if not o.ok]
    assert not failures, "\n".join(f"{o.ranks} ranks: {o.failed}" for o in failures)


THIRD_PARTY = '''
import numpy as np
import gradcomp


class Halve(gradcomp.Codec):
    """A codec written outside gradcomp: float16 on the wire, summed by allreduce."""
    collective = "allreduce"
    message_dtype = np.float16
    nan_effect = "element"

    def message_size(self, n):
        return n

    def encode(self, x, message, workspace):
        message[...] = x

    def decode(self, message, out, workspace, add=False):
        if add:
            out += message
        else:
            out[...] = message

    def error_bound(self, inputs, dtype):
        mean_abs = np.abs(inputs).mean(axis=0)
        return (inputs.shape[0] + 3) * 2.0 ** -10 * mean_abs + 1e-7


class OldStyle(gradcomp.Compressor):
    """Written against run(bucket, comm) only, as before codecs existed."""
    nan_effect = "element"

    def run(self, bucket, comm):
        return comm.allreduce(bucket.buffer / bucket.buffer.dtype.type(comm.size))


class Zeros(gradcomp.Codec):
    collective = "allreduce"
    message_dtype = np.float32

    def message_size(self, n):
        return n

    def encode(self, x, message, workspace):
        message[...] = 0

    def decode(self, message, out, workspace, add=False):
        if not add:
            out[...] = 0


class Constant(Zeros):
    def decode(self, message, out, workspace, add=False):
        out[...] = 0.5


class Muted(Zeros):
    """Wrong like Zeros, and its output never reaches mpiexec: as when MPI_Abort ends the job
    before the launcher forwards the failing rank's last lines."""
    def encode(self, x, message, workspace):
        import os
        quiet = os.open(os.devnull, os.O_WRONLY)
        os.dup2(quiet, 1)
        os.dup2(quiet, 2)
        super().encode(x, message, workspace)


class ForgetsState(gradcomp.PowerSGD):
    """Saves nothing of its error-feedback state: a resumed run differs."""
    def __init__(self):
        super().__init__(rank=1, start_iter=2)

    def config(self):
        return {}

    def load_state_dict(self, state, shapes=None):
        pass


class DrawsPerRank(gradcomp.Compressor):
    """Replicas differ: each rank scales by its own factor."""
    def run(self, bucket, comm):
        return comm.allreduce(bucket.buffer / comm.size) * (1 + 1e-3 * comm.rank)
'''


@pytest.fixture(scope="module")
def third_party(tmp_path_factory):
    folder = tmp_path_factory.mktemp("outside")
    (folder / "my_codecs.py").write_text(textwrap.dedent(THIRD_PARTY))
    return folder


def kit(folder, target, ranks="2", checks=None):
    cmd = [sys.executable, "-m", "gradcomp.conformance", target, "--ranks", ranks]
    if checks:
        cmd += ["--checks", checks]
    return subprocess.run(cmd, cwd=folder, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("factory", ["Halve", "OldStyle"])
def test_a_correct_compressor_from_outside_passes(third_party, factory):
    done = kit(third_party, f"my_codecs:{factory}", ranks="1,3")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failing job(s)" in done.stdout


@pytest.mark.parametrize("factory, check, words", [
    ("Zeros", "accuracy", "relative error 1 "),
    ("Constant", "accuracy", "relative error"),
    ("Muted", "accuracy", "relative error 1 "),
    ("ForgetsState", "checkpoint", "resumed run differs"),
    ("DrawsPerRank", "shapes", "ranks hold different results"),
])
def test_the_kit_fails_wrong_compressors(third_party, factory, check, words):
    done = kit(third_party, f"my_codecs:{factory}", checks=check)
    assert done.returncode == 1, done.stdout + done.stderr
    assert words in done.stdout, done.stdout
