"""Hugging Face Trainer at 2 ranks on the CPU (torchrun), with gradcomp.torch.transformers.Compression.

A tiny GPT-2 built from a config (no download) learns token sequences that follow a fixed rule.
Four runs in one job: uncompressed for STEPS steps; int8 for STEPS steps with a checkpoint at
STEPS/2; a fresh Trainer and callback resuming that checkpoint to STEPS; the same resume with the
compressor started afresh (resume=False), the control that shows the restored state matters. Rank 0 reports the
validation losses, the compression ratio, and whether the resumed run ended where the straight one
did."""
from __future__ import annotations

import os
import sys
import warnings

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from gradcomp.torch.transformers import Compression, state_file  # noqa: E402
from tests.torch_adapter.framework_jobs.task import flat, report, same_state  # noqa: E402

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
COMPRESSOR = os.environ.get("GRADCOMP_TEST_COMPRESSOR", "int8:warmup=2")
STEPS = 40
VOCAB, LENGTH = 32, 16
torch.set_num_threads(1)


def sequences(n, seed):
    """Token rows where each next token is (5 * token + 3) % VOCAB: learnable from one token."""
    start = torch.randint(0, VOCAB, (n, 1), generator=torch.Generator().manual_seed(seed))
    rows = [start]
    for _ in range(LENGTH - 1):
        rows.append((5 * rows[-1] + 3) % VOCAB)
    return torch.cat(rows, dim=1)


TRAIN, VAL = sequences(1024, 1), sequences(128, 2)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return len(TRAIN)

    def __getitem__(self, i):
        return {"input_ids": TRAIN[i], "labels": TRAIN[i]}


def gpt2():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def train(folder, callbacks=(), resume=None, save_steps=None):
    args = TrainingArguments(output_dir=folder, use_cpu=True, max_steps=STEPS, per_device_train_batch_size=8,
                             learning_rate=3e-3, lr_scheduler_type="constant", warmup_steps=0, seed=0,
                             logging_strategy="no", report_to="none", disable_tqdm=True,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             ddp_find_unused_parameters=False, dataloader_num_workers=0, ddp_backend="gloo")
    model = gpt2()
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=list(callbacks))
    trainer.train(resume_from_checkpoint=resume)
    return model


def val_loss(model):
    with torch.no_grad():
        return float(model(input_ids=VAL, labels=VAL).loss)


def main(folder):
    plain = train(os.path.join(folder, "plain"))
    straight_cb = Compression(COMPRESSOR)
    straight = train(os.path.join(folder, "int8"), [straight_cb], save_steps=STEPS // 2)
    stats = straight_cb.stats()
    rank = torch.distributed.get_rank()
    checkpoint = os.path.join(folder, "int8", f"checkpoint-{STEPS // 2}")
    saved = torch.load(state_file(checkpoint, rank), weights_only=True)["state"]
    residuals = [v for k, v in saved["state"].items() if "residual" in k]

    resumed_cb = Compression(COMPRESSOR, resume=checkpoint)
    resumed = train(os.path.join(folder, "resumed"), [resumed_cb], resume=checkpoint)
    other = torch.load(state_file(checkpoint, 1 - rank), weights_only=True)["state"]
    afresh = train(os.path.join(folder, "afresh"), [Compression(COMPRESSOR, resume=False)], resume=checkpoint)

    if rank == 0:
        report(framework="transformers", val_loss_fp32=val_loss(plain), val_loss_int8=val_loss(straight),
               compression_ratio=stats["compression_ratio"], steps=stats["steps"],
               ranks_saved_their_own=not same_state(saved, other),
               residuals_nonzero=bool(residuals) and any(bool(r.abs().sum() > 0) for r in residuals),
               resumed_steps=resumed_cb.stats()["steps"],
               resumed_equals_straight=bool(torch.equal(flat(resumed), flat(straight))),
               resumed_max_diff=float((flat(resumed) - flat(straight)).abs().max()),
               afresh_max_diff=float((flat(afresh) - flat(straight)).abs().max()))
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # past torch 2.13's gloo teardown, which aborts now and then (tests.mpi_launch)


if __name__ == "__main__":
    main(sys.argv[1])
