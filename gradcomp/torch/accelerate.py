"""Hugging Face Accelerate: register gradcomp's hook on the prepared model, and put the compressor
state into ``accelerator.save_state`` / ``load_state``.

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = gradcomp.torch.accelerate.register(accelerator, model, "int8")
    accelerator.load_state(folder)             # when resuming: after register, as for any object

Why not ``DistributedDataParallelKwargs(comm_hook=...)``: Accelerate takes only its own hook names
there (``DDPCommunicationHookType``); a callable is silently ignored. ``accelerator.prepare``
returns the DDP-wrapped model in a multi-process job, which ``gradcomp.torch.register`` takes.

Logging: Accelerate has no callbacks; its trackers log what ``accelerator.log`` is handed, where
the training loop calls it. ``log(accelerator, state, step)`` beside that call hands it
``gradcomp.metrics`` of the compressor's ``stats()`` under ``gradcomp/`` (docs/guides/observing.md)
and logs a warning (Python ``logging``, on the main process) once when the method backs off.

Why not ``accelerator.register_for_checkpointing(state)`` on the ``HookState`` itself: Accelerate
writes the main process's ``state_dict()`` only, and every rank loads that file, so every rank
would resume with rank 0's error-feedback residuals. ``register`` hands Accelerate an
``EveryRankState`` instead (``gradcomp.torch.ranks``): the main process's file holds each rank's
state, each rank loads its own, and a checkpoint of another compressor or another number of ranks
is refused. A checkpoint saved without it is refused by Accelerate itself (its count of custom
objects differs).
"""
from __future__ import annotations

import logging
from typing import Any

from ..comm import Communicator
from ..compressors import Compressor
from . import hook
from .hook import HookState
from .ranks import EveryRankState

LOG = logging.getLogger(__name__)


def register(accelerator: Any, model: Any, compressor: Compressor | str,
             comm: Communicator | None = None, hierarchical: bool | None = None,
             allow_partial: bool = False, all_gather: str | None = None) -> HookState:
    """Compress ``model``'s gradient averaging with ``compressor`` (a gradcomp ``Compressor`` or a
    registry name) and checkpoint the compressor with ``accelerator``'s ``save_state``.

    ``model``: what ``accelerator.prepare`` returned (a ``DistributedDataParallel`` in a job of
    several processes). Call it on every rank, before the first backward and before
    ``accelerator.load_state``. ``comm``, ``hierarchical``, ``allow_partial``, ``all_gather``
    (FSDP2: the parameter all-gathers in int8 codes): ``gradcomp.torch.register``'s.
    Returns the ``HookState`` (``.compressor.stats()``: the traffic figures)."""
    try:
        state = hook.register(model, compressor, comm, hierarchical=hierarchical, allow_partial=allow_partial,
                              all_gather=all_gather)
    except TypeError as exc:
        raise TypeError(
            f"gradcomp.torch.accelerate.register compresses a model that Accelerate wrapped in "
            f"DistributedDataParallel (accelerator.prepare(model) in a job of several processes, "
            f"e.g. under torchrun or `accelerate launch`); this accelerator runs "
            f"{accelerator.distributed_type} with {accelerator.num_processes} process(es): {exc}") from exc
    everywhere = bool(getattr(accelerator.project_configuration, "save_on_each_node", False))
    accelerator.register_for_checkpointing(EveryRankState(state, everywhere=everywhere))
    return state


def log(accelerator: Any, state: Any, step: int | None = None) -> dict[str, float]:
    """Log ``state``'s metrics (what ``register`` returned: ``HookState.metrics()``, with the recent
    figures since the previous call) through ``accelerator.log(..., step=step)``, to the trackers
    the accelerator was built with (``log_with=``, after ``accelerator.init_trackers``), and warn
    once per back-off. Call it on every rank at the loop's logging steps; returns the values."""
    values = state.metrics()
    accelerator.log(values, step=step)
    if accelerator.is_main_process:  # the same lines on every rank (agreed decisions)
        for line in state.meter.events:
            LOG.warning(line)
    return values
