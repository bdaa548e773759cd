"""Hugging Face Accelerate at 2 ranks on the CPU (torchrun): ``gradcomp.torch.accelerate.log`` beside
the loop's own ``accelerator.log``, into a tracker that writes CSV, read back from disk. A governed
top-k over a tight budget (it backs off during the run) for 66 steps, logged every 6. Rank 0
reports the rows and the back-off lines logged."""
from __future__ import annotations

import csv
import logging
import os
import sys
import warnings

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import gradcomp.torch.accelerate  # noqa: E402
from tests.torch_adapter.framework_jobs.accelerate_job import batches  # noqa: E402
from tests.torch_adapter.framework_jobs.task import LR, governor_of, leave, mlp, report  # noqa: E402
from tests.torch_adapter.framework_jobs.logging_transformers_job import Lines  # noqa: E402

warnings.filterwarnings("ignore", module="accelerate")
METHOD = "topk:warmup=0,budget=0.05"
torch.set_num_threads(1)


class CsvTracker(GeneralTracker):
    """An Accelerate tracker that writes every ``accelerator.log`` to one CSV file (the main process)."""
    name = "csv"
    requires_logging_directory = False

    def __init__(self, path):
        super().__init__()
        self.path = path
        self.rows = []

    @property
    def tracker(self):
        return self.rows

    def log(self, values, step=None, **kwargs):
        self.rows.append({**values, "step": step})
        names = sorted({k for row in self.rows for k in row})
        with open(self.path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names)
            writer.writeheader()
            writer.writerows(self.rows)


def main(folder):
    path = os.path.join(folder, "metrics.csv")
    accelerator = Accelerator(cpu=True, log_with=[CsvTracker(path)])
    accelerator.init_trackers("run")
    net = mlp()
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    state = gradcomp.torch.accelerate.register(accelerator, model, METHOD)
    handler = Lines()
    logging.getLogger("gradcomp.torch.accelerate").addHandler(handler)
    step = 0
    for epoch in range(3):
        for x, y in batches(accelerator, epoch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), y)
            accelerator.backward(loss)
            opt.step()
            step += 1
            if step % 6 == 0:  # the loop's logging interval
                accelerator.log({"loss": float(loss)}, step=step)
                gradcomp.torch.accelerate.log(accelerator, state, step=step)
    stats = state.compressor.stats()
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        with open(path) as f:
            rows = list(csv.DictReader(f))
        report(rows=rows, lines=handler.lines, steps=step, **governor_of(stats))
    leave()


if __name__ == "__main__":
    main(sys.argv[1])
