"""Lightning at 2 ranks on the CPU (torchrun): the Compression callback's metrics in the CSVLogger's
file, read back from disk. A governed top-k over a tight budget (it backs off to safer rungs during
the run) for 66 steps, logged every 6; then a short fit with ``log=False``. Rank 0 reports the
rows, the back-off warnings and the final stats (tests/torch_adapter/test_framework_logging.py)."""
from __future__ import annotations

import csv
import os
import sys
import warnings

import torch
import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from gradcomp.torch.lightning import Compression  # noqa: E402
from tests.torch_adapter.framework_jobs.lightning_job import X, Y, Digits  # noqa: E402
from tests.torch_adapter.framework_jobs.task import BATCH, governor_of, leave, report  # noqa: E402

METHOD = "topk:warmup=0,budget=0.05"
torch.set_num_threads(1)


class LoggedDigits(Digits):
    """lightning_job's module, logging its loss as a user's module does (the CSV file exists without gradcomp)."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("loss", loss)
        return loss


def fit(folder, callback, steps):
    pl.seed_everything(0, verbose=False)
    logger = CSVLogger(folder, name="run", version=0)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=steps, log_every_n_steps=6,
                         callbacks=[callback], logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(LoggedDigits(), loader)
    return trainer, [str(w.message) for w in caught if str(w.message).startswith("gradcomp: ")]


def rows(folder):
    with open(os.path.join(folder, "run", "version_0", "metrics.csv")) as f:
        return list(csv.DictReader(f))


def main(folder):
    callback = Compression(METHOD)
    trainer, lines = fit(os.path.join(folder, "on"), callback, 66)
    stats = callback.stats()
    _, silent = fit(os.path.join(folder, "off"), Compression("int8:warmup=2", log=False), 12)
    if torch.distributed.get_rank() == 0:
        report(rows=rows(os.path.join(folder, "on")), off_rows=rows(os.path.join(folder, "off")), lines=lines,
               off_lines=silent, steps=trainer.global_step, **governor_of(stats))
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
