"""Hugging Face Accelerate at 2 ranks on the CPU (torchrun), with gradcomp.torch.accelerate.register.

Four runs of the digits MLP in one job: uncompressed for 2 epochs; int8 for 2 epochs; int8 for
1 epoch, then accelerator.save_state; a fresh model, optimizer and Accelerator that load_state
and train epoch 2. Rank 0 reports the validation losses, the compression ratio, and whether the
resumed run ended where the straight one did."""
from __future__ import annotations

import os
import sys
import warnings

import torch
from accelerate import Accelerator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))))
import gradcomp.torch.accelerate  # noqa: E402
from tests.torch_adapter.framework_jobs.task import BATCH, LR, digits, flat, mlp, report, same_state, val_loss  # noqa: E402

warnings.filterwarnings("ignore", module="accelerate")
COMPRESSOR = os.environ.get("GRADCOMP_TEST_COMPRESSOR", "int8:warmup=2")
torch.set_num_threads(1)
X, Y, VX, VY = digits()


def batches(accelerator, epoch):
    """This rank's share of each global batch of ``epoch`` (the same shuffle on every rank)."""
    order = torch.randperm(len(Y), generator=torch.Generator().manual_seed(epoch))
    step = BATCH * accelerator.num_processes
    for start in range(0, len(Y) - step + 1, step):
        idx = order[start + accelerator.process_index * BATCH:][:BATCH]
        yield X[idx], Y[idx]


def build(compressor):
    accelerator = Accelerator(cpu=True)
    net = mlp()
    model, opt = accelerator.prepare(net, torch.optim.SGD(net.parameters(), lr=LR, momentum=0.9))
    state = gradcomp.torch.accelerate.register(accelerator, model, compressor) if compressor else None
    return accelerator, model, opt, state


def train(accelerator, model, opt, epochs):
    for epoch in epochs:
        for x, y in batches(accelerator, epoch):
            opt.zero_grad()
            accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
            opt.step()


def main(folder):
    accelerator, plain, opt, _ = build(None)
    train(accelerator, plain, opt, range(2))
    accelerator, straight, opt, straight_state = build(COMPRESSOR)
    train(accelerator, straight, opt, range(2))
    stats = straight_state.compressor.stats()

    accelerator, model, opt, first_state = build(COMPRESSOR)
    train(accelerator, model, opt, range(1))
    accelerator.save_state(folder)
    mine = first_state.state_dict()
    accelerator.wait_for_everyone()
    saved = torch.load(os.path.join(folder, "custom_checkpoint_0.pkl"), weights_only=True)["ranks"]
    rank = accelerator.process_index

    accelerator, resumed, opt, resumed_state = build(COMPRESSOR)
    accelerator.load_state(folder)
    loaded = same_state(resumed_state.state_dict(), mine)
    train(accelerator, resumed, opt, range(1, 2))

    wrong_accelerator, _, _, _ = build("int4")  # another compressor's checkpoint is refused
    try:
        wrong_accelerator.load_state(folder)
        refused = False
    except ValueError as exc:
        refused = "int8" in str(exc)

    if rank == 0:
        report(framework="accelerate", val_loss_fp32=val_loss(plain.module, VX, VY),
               val_loss_int8=val_loss(straight.module, VX, VY),
               compression_ratio=stats["compression_ratio"], steps=stats["steps"],
               checkpoint_holds_each_rank=same_state(saved[rank], mine) and not same_state(saved[0], saved[1]),
               loaded_equals_saved=loaded,
               resumed_equals_straight=bool(torch.equal(flat(resumed), flat(straight))),
               resumed_max_diff=float((flat(resumed) - flat(straight)).abs().max()),
               other_compressor_refused=refused)
    torch.distributed.barrier()
    sys.stdout.flush()
    os._exit(0)  # past torch 2.13's gloo teardown, which aborts now and then (tests.mpi_launch)


if __name__ == "__main__":
    main(sys.argv[1])
