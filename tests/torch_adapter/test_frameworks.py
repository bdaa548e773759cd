"""gradcomp in the frameworks people train with: PyTorch Lightning, Accelerate and the Hugging Face
Trainer, each for real at 2 ranks on the CPU under torchrun (all three read its environment).

Each test runs one torchrun job (``tests/torch_adapter/framework_jobs/<framework>_job.py``) that trains the
same small task uncompressed and with int8 (warmup=2), checkpoints half-way with the framework's
own checkpointing, resumes in a fresh trainer, and reports one ``RESULT`` line. Checked here:

* bytes were cut: int8's ``compression_ratio`` above 3 over the whole run (fp32 sends 4 bytes a
  value; int8 1 plus a scale per chunk, after 2 warm-up steps at fp32);
* the validation loss with int8 within 1% of the uncompressed run's;
* the checkpoint carries each rank's own compressor state (residuals differ between ranks, and a
  rank's saved entry equals its live state), and the resumed run ends bit for bit where the
  uninterrupted one did (the resumed compressor starts afresh otherwise: 2 more fp32 steps and
  zero residuals; the Trainer job shows that control run differs);
* a checkpoint of another compressor is refused (Lightning, Accelerate).

They skip only when the framework is not installed (``make install`` installs all three: the
``integrations`` extra). ``find_spec``, not ``importorskip``: deciding to skip imports nothing
(Lightning or transformers take seconds to import, and the jobs import them in their own
processes). A job's refusals of a strategy without DDP and of foreign state are checked too.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.mpi_launch import ROOT

JOBS = ROOT / "tests" / "torch_adapter" / "framework_jobs"


def needs(*modules):
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"not installed: {', '.join(missing)}")


def torchrun_job(script: str, tmp_path) -> dict:
    """Run ``script`` at 2 ranks under torchrun; rank 0's RESULT line."""
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    for var in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "HYDI_CONTROL_FD"):  # one torchrun job, not an MPI rank's
        env.pop(var, None)
    done = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(JOBS / script), str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)  # a hang fails; 2 shared cores can be slow
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out
    return json.loads(lines[0][len("RESULT "):])


def check_common(result: dict) -> None:
    assert result["compression_ratio"] > 3, result
    assert abs(result["val_loss_int8"] - result["val_loss_fp32"]) <= 0.01 * result["val_loss_fp32"], result
    assert result["resumed_equals_straight"], result


@needs("torch", "pytorch_lightning")
def test_lightning_callback_compresses_checkpoints_and_resumes(tmp_path):
    result = torchrun_job("lightning_job.py", tmp_path)
    check_common(result)
    assert result["checkpoint_holds_each_rank"] and result["residuals_nonzero"], result
    assert result["other_compressor_refused"], result


@needs("torch", "pytorch_lightning")
def test_lightning_callback_compresses_fsdp2(tmp_path):
    """ModelParallelStrategy (fully_shard in configure_model): the same callback compresses FSDP2's
    reduce-scatters (ratio against FSDP's own), within 1% of the uncompressed loss; with
    all_gather="int8" its parameter all-gathers too."""
    result = torchrun_job("lightning_fsdp_job.py", tmp_path)
    assert result["compression_ratio"] > 3 and result["steps"] > 10, result
    assert abs(result["val_loss_int8"] - result["val_loss_fp32"]) <= 0.01 * result["val_loss_fp32"], result
    assert result["all_gather_ratio"] > 3, result
    assert abs(result["val_loss_int8_all_gather"] - result["val_loss_fp32"]) <= 0.01 * result["val_loss_fp32"], result


@needs("torch", "accelerate")
def test_accelerate_register_compresses_saves_and_loads_state(tmp_path):
    result = torchrun_job("accelerate_job.py", tmp_path)
    check_common(result)
    assert result["checkpoint_holds_each_rank"] and result["loaded_equals_saved"], result
    assert result["other_compressor_refused"], result


@needs("torch", "transformers", "accelerate")
def test_hf_trainer_callback_compresses_checkpoints_and_resumes(tmp_path):
    result = torchrun_job("transformers_job.py", tmp_path)
    check_common(result)
    assert result["ranks_saved_their_own"] and result["residuals_nonzero"], result
    assert result["resumed_steps"] == 20, result  # the resumed run trained its 20 steps compressed
    assert result["afresh_max_diff"] > 0, result  # the control: without the restored state it differs


LIGHTNING_WITHOUT_DDP = """
import torch, pytorch_lightning as pl
from gradcomp.torch.lightning import Compression
class M(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(2, 1)
    def training_step(self, batch, _):
        return self.net(batch[0]).sum()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.ones(4, 2)), batch_size=2)
trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, callbacks=[Compression("int8")])
try:
    trainer.fit(M(), data)
except TypeError as exc:
    print("REFUSED", exc)
"""


@needs("torch", "pytorch_lightning")
def test_lightning_callback_refuses_a_strategy_without_ddp():
    """One process on the CPU: SingleDeviceStrategy, no DDP wrapper; the error names the strategy."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    for var in ("PMI_RANK", "PMI_SIZE", "PMI_FD", "HYDI_CONTROL_FD", "RANK", "WORLD_SIZE"):
        env.pop(var, None)
    done = subprocess.run([sys.executable, "-c", LIGHTNING_WITHOUT_DDP], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    out = done.stdout + done.stderr
    assert "REFUSED" in done.stdout and "SingleDeviceStrategy" in done.stdout, out
    assert "strategy='ddp'" in done.stdout, out


@needs("torch")
def test_every_rank_state_refuses_other_world_sizes_and_foreign_dicts():
    """Outside a process group the world is one rank: a checkpoint of 2 ranks is refused with the
    reason, and so is a plain HookState.state_dict() (one rank's, not every rank's)."""
    import gradcomp
    from gradcomp.torch.hook import HookState
    from gradcomp.torch.ranks import EveryRankState, gather_every_rank, own_rank_state

    state = HookState(gradcomp.make("int8"), None)
    mine = gather_every_rank(state)
    assert mine["world_size"] == 1 and own_rank_state(mine) == mine["ranks"][0]
    with pytest.raises(ValueError, match="holds the compressor state of 2 ranks, but this job has 1"):
        own_rank_state({**mine, "world_size": 2, "ranks": mine["ranks"] * 2})
    with pytest.raises(ValueError, match="expected every rank's compressor state"):
        own_rank_state(state.state_dict())
    with pytest.raises(ValueError, match="holds no rank's entries"):
        own_rank_state({**mine, "ranks": None})
    wrapped = EveryRankState(state)
    wrapped.load_state_dict(wrapped.state_dict())
    with pytest.raises(ValueError, match="saved by"):  # another compressor: HookState refuses it
        EveryRankState(HookState(gradcomp.make("int4"), None)).load_state_dict(mine)
