"""Hugging Face Trainer at 2 ranks on the CPU (torchrun): the Compression callback's metrics in the
Trainer's logs, read back from disk: ``trainer_state.json`` (``log_history``, by
``trainer.save_state``) and a JSON-lines file written by a callback placed after Compression (what a
``report_to`` integration's callback sees when passed that way). A governed top-k over a tight
budget (it backs off during the run) for 66 steps, logged every 6; then a short run with
``log=False``. Rank 0 reports what was read and the back-off lines the callback logged."""
from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from gradcomp.torch.transformers import Compression  # noqa: E402
from tests.torch_adapter.framework_jobs.task import report  # noqa: E402
from tests.torch_adapter.framework_jobs.transformers_job import Tokens, gpt2  # noqa: E402

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
METHOD = "topk:warmup=0,budget=0.05"
torch.set_num_threads(1)


class JsonLines(TrainerCallback):
    """Each log the Trainer hands its callbacks, one JSON line in ``path`` (the main process)."""

    def __init__(self, path):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({**logs, "step": state.global_step}) + "\n")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def train(folder, compression, steps):
    args = TrainingArguments(output_dir=folder, use_cpu=True, max_steps=steps, per_device_train_batch_size=8,
                             learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, seed=0,
                             logging_strategy="steps", logging_steps=6, report_to="none", disable_tqdm=True,
                             save_strategy="no", ddp_find_unused_parameters=False, dataloader_num_workers=0,
                             ddp_backend="gloo")
    path = os.path.join(folder, "logs.jsonl")
    trainer = Trainer(model=gpt2(), args=args, train_dataset=Tokens(), callbacks=[compression, JsonLines(path)])
    handler = Lines()
    logging.getLogger("gradcomp.torch.transformers").addHandler(handler)
    trainer.train()
    logging.getLogger("gradcomp.torch.transformers").removeHandler(handler)
    trainer.save_state()  # trainer_state.json, on the main process
    torch.distributed.barrier()
    return trainer, path, handler.lines


def read(folder, path):
    with open(os.path.join(folder, "trainer_state.json")) as f:
        history = json.load(f)["log_history"]
    with open(path) as f:
        return history, [json.loads(line) for line in f]


def main(folder):
    on, off = os.path.join(folder, "on"), os.path.join(folder, "off")
    compression = Compression(METHOD)
    trainer, path, lines = train(on, compression, 66)
    stats = compression.stats()
    _, off_path, off_lines = train(off, Compression("int8:warmup=2", log=False), 12)
    if torch.distributed.get_rank() == 0:
        history, rows = read(on, path)
        off_history, off_rows = read(off, off_path)
        report(history=history, rows=rows, off_history=off_history, off_rows=off_rows, lines=lines,
               off_lines=off_lines, steps=trainer.state.global_step, in_memory=trainer.state.log_history == history,
               decisions=stats["governor"]["decisions"], limit=stats["governor"]["limit"])
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # past torch 2.13's gloo teardown, which aborts now and then (tests.mpi_launch)


if __name__ == "__main__":
    main(sys.argv[1])
