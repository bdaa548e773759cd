"""PyTorch Lightning at 2 ranks on the CPU (torchrun), with gradcomp's Compression callback.

Four fits of the digits MLP in one job: uncompressed for 2 epochs; int8 for 2 epochs; int8 for
1 epoch, then trainer.save_checkpoint; a fresh Trainer and callback resuming that checkpoint to
epoch 2. Rank 0 reports the validation losses, the compression ratio, and whether the resumed
run ended where the straight one did."""
from __future__ import annotations

import os
import sys
import warnings

import torch
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from gradcomp.torch.lightning import Compression  # noqa: E402
from tests.torch_adapter.framework_jobs.task import BATCH, LR, digits, flat, mlp, report, same_state, val_loss  # noqa: E402

warnings.filterwarnings("ignore", module="pytorch_lightning")
COMPRESSOR = os.environ.get("GRADCOMP_TEST_COMPRESSOR", "int8:warmup=2")
torch.set_num_threads(1)
X, Y, VX, VY = digits()


class Digits(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = mlp()

    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def fit(epochs, callbacks=(), ckpt_path=None):
    pl.seed_everything(0, verbose=False)
    module = Digits()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=epochs,
                         callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


def main(folder):
    _, plain = fit(2)
    straight_cb = Compression(COMPRESSOR)
    _, straight = fit(2, [straight_cb])
    stats = straight_cb.stats()

    first_cb = Compression(COMPRESSOR)
    trainer, _ = fit(1, [first_cb])
    path = os.path.join(folder, "epoch1.ckpt")
    trainer.save_checkpoint(path)
    mine = first_cb.hook_state.state_dict()
    saved = torch.load(path, weights_only=True)["callbacks"]["gradcomp.Compression"]["ranks"]
    rank = torch.distributed.get_rank()
    residuals = [v for k, v in mine["state"].items() if "residual" in k]
    resumed_cb = Compression(COMPRESSOR)
    _, resumed = fit(2, [resumed_cb], ckpt_path=path)

    wrong = Compression("int4")  # another compressor's checkpoint is refused, not dropped
    try:
        fit(2, [wrong], ckpt_path=path)
        refused = False
    except ValueError as exc:
        refused = "int8" in str(exc)

    if rank == 0:
        report(framework="lightning", val_loss_fp32=val_loss(plain.net, VX, VY),
               val_loss_int8=val_loss(straight.net, VX, VY),
               compression_ratio=stats["compression_ratio"], steps=stats["steps"],
               checkpoint_holds_each_rank=same_state(saved[rank], mine) and not same_state(saved[0], saved[1]),
               residuals_nonzero=bool(residuals) and any(bool(r.abs().sum() > 0) for r in residuals),
               resumed_equals_straight=bool(torch.equal(flat(resumed.net), flat(straight.net))),
               resumed_max_diff=float((flat(resumed.net) - flat(straight.net)).abs().max()),
               other_compressor_refused=refused)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # past torch 2.13's gloo teardown, which aborts now and then (tests.mpi_launch)


if __name__ == "__main__":
    main(sys.argv[1])
