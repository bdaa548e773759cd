"""PyTorch Lightning's FSDP2 strategy (ModelParallelStrategy: fully_shard in configure_model) at 2
ranks on the CPU (torchrun), with gradcomp's Compression callback: the same callback compresses
FSDP2's gradient reduce-scatters. Two fits of the digits MLP, uncompressed and with int8; rank 0
reports the validation losses and the compression ratio against FSDP's own reduce-scatter; a third
fit also sends the parameter all-gathers in int8 codes (all_gather="int8")."""
from __future__ import annotations

import os
import sys

import torch
import pytorch_lightning as pl
from pytorch_lightning.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
from gradcomp.torch.lightning import Compression  # noqa: E402
from tests.torch_adapter.framework_jobs.lightning_job import VX, VY, X, Y, Digits  # noqa: E402
from tests.torch_adapter.framework_jobs.task import BATCH, mlp, report, val_loss  # noqa: E402

torch.set_num_threads(1)


class ShardedDigits(Digits):
    """lightning_job's module, its MLP's first layer and the whole module FSDP2 modules."""

    def configure_model(self):
        mesh = self.device_mesh["data_parallel"]
        fully_shard(self.net[0], mesh=mesh)
        fully_shard(self, mesh=mesh)

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, _):  # through forward: FSDP gathers the root's parameters there
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)


def fit(epochs, callbacks=()):
    pl.seed_everything(0, verbose=False)
    module = ShardedDigits()
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs,
                         callbacks=list(callbacks), logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = DataLoader(TensorDataset(X, Y), batch_size=BATCH, shuffle=True)
    trainer.fit(module, loader)
    return module


def full_loss(module):
    with torch.no_grad():
        params = {n: p.full_tensor() for n, p in module.net.named_parameters()}
    net = mlp()
    net.load_state_dict(params)
    return val_loss(net, VX, VY)


def main(folder):
    plain = fit(2)
    callback = Compression("int8:warmup=2")
    compressed = fit(2, [callback])
    stats = callback.stats()
    weights = Compression("int8:warmup=2", all_gather="int8")  # and the parameter all-gathers
    both = fit(2, [weights])
    plain_loss, int8_loss, both_loss = full_loss(plain), full_loss(compressed), full_loss(both)
    if torch.distributed.get_rank() == 0:
        report(framework="lightning-fsdp2", val_loss_fp32=plain_loss, val_loss_int8=int8_loss,
               compression_ratio=stats["compression_ratio"], steps=stats["steps"],
               val_loss_int8_all_gather=both_loss,
               all_gather_ratio=weights.hook_state.all_gather_stats()["compression_ratio"])
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
