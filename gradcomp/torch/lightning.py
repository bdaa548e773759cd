"""PyTorch Lightning: a callback that compresses the DDP strategy's gradient traffic, and FSDP2's
(``ModelParallelStrategy``, ``fully_shard`` in ``configure_model``: ``gradcomp.torch.register``
takes the FSDP2 root as it is).

    from gradcomp.torch.lightning import Compression
    trainer = Trainer(strategy="ddp", callbacks=[Compression("int8")])

Why a callback and not ``DDPStrategy(ddp_comm_hook=...)``: Lightning registers that hook on CUDA
only (on the CPU it is silently ignored), and building the hook needs torch.distributed up, which
it is not where a Trainer is built. The callback registers gradcomp's hook in ``on_fit_start``:
the strategy has started the process group and wrapped the model in DDP by then (``strategy.setup``
runs just before), and no backward has run yet. Another ``fit`` wraps the model anew; the callback
registers its same state on the new wrapper.

Logging (``log=True``, the default): at the steps Lightning logs (``log_every_n_steps``), the
callback hands ``gradcomp.metrics`` of the compressor's ``stats()`` to ``pl_module.log_dict``, so
they reach every logger the Trainer has (CSV, TensorBoard, W&B, ...) and ``trainer.logged_metrics``
under ``gradcomp/`` (docs/guides/observing.md), and warns once (``rank_zero_warn``) when the method
backs off (``gradcomp.backoffs``). ``log=False``: neither.

Checkpoints: the callback's ``state_dict()`` is every rank's compressor state (residuals are per
rank, Lightning writes rank 0's file: ``gradcomp.torch.ranks``), stored under the key
``gradcomp.Compression`` in Lightning's own checkpoint. ``trainer.fit(..., ckpt_path=...)`` loads
it before the model is wrapped; it is kept and loaded into the hook state at registration, each
rank taking its own entry. A state saved by another compressor or another number of ranks is
refused (ValueError), and a resume from a checkpoint without compressor state warns that the
compressor starts afresh: loaded state is used or refused, never dropped.
"""
from __future__ import annotations

import warnings
from typing import Any

from ..comm import Communicator
from ..compressors import Compressor
from ..metrics import Meter
from .hook import HookState, register
from .ranks import gather_every_rank, own_rank_state

try:
    import pytorch_lightning as pl
except ImportError:
    try:  # the unified package (pip install lightning); a Trainer of the other package rejects this callback
        import lightning.pytorch as pl  # type: ignore[no-redef]
    except ImportError as exc:
        raise ImportError("gradcomp.torch.lightning needs PyTorch Lightning: "
                          "pip install 'gradcomp[torch,integrations]'") from exc


class Compression(pl.Callback):
    """Compress the gradients a Lightning DDP strategy averages, with ``compressor`` (a gradcomp
    ``Compressor`` or a registry name: ``"int8"``, ``"powersgd:rank=4"``, ...). ``comm``,
    ``hierarchical``, ``allow_partial`` and ``all_gather`` (FSDP2: the parameter all-gathers in int8
    codes) are ``gradcomp.torch.register``'s. ``log``: log the compressor's metrics and back-off
    warnings at Lightning's logging steps (see the module). ``stats()`` is the compressor's traffic
    figures; ``hook_state`` the registered ``HookState`` (None before ``fit`` starts)."""

    STATE_KEY = "gradcomp.Compression"

    def __init__(self, compressor: Compressor | str, comm: Communicator | None = None,
                 hierarchical: bool | None = None, allow_partial: bool = False, all_gather: str | None = None,
                 log: bool = True):
        self.compressor = compressor
        self.log_enabled = log  # (not `log`: Lightning sets a callback's `log` to the module's)
        self.meter = Meter()  # the previous logged reading: the recent figures and events are since it
        self.all_gather = all_gather
        self.comm = comm
        self.hierarchical = hierarchical
        self.allow_partial = allow_partial
        self.hook_state: HookState | None = None
        self._wrapper: Any = None        # the DDP model the hook is registered on
        self._loaded: dict[str, Any] | None = None  # loaded before registration: applied at it

    @property
    def state_key(self) -> str:
        # one fixed key: a checkpoint of another compressor reaches load_state_dict and is refused
        # there, instead of being skipped by Lightning as an unknown callback's state
        return self.STATE_KEY

    def __repr__(self) -> str:
        return f"Compression({self.compressor!r})"

    def stats(self) -> dict[str, Any]:
        """The compressor's ``stats()`` (bytes sent, compression ratio, ...)."""
        if self.hook_state is None:
            raise RuntimeError("gradcomp.torch.lightning.Compression: no statistics before "
                               "trainer.fit() has started")
        return self.hook_state.compressor.stats()

    # -- registration -------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if model is self._wrapper:
            return
        try:
            if self.hook_state is None:
                self.hook_state = register(model, self.compressor, self.comm,  # type: ignore[arg-type]
                                           hierarchical=self.hierarchical, allow_partial=self.allow_partial,
                                           all_gather=self.all_gather)
            else:
                self.hook_state = register(model, None, self.comm, state=self.hook_state,  # type: ignore[arg-type]
                                           allow_partial=self.allow_partial, all_gather=self.all_gather)
        except TypeError as exc:
            raise TypeError(
                f"gradcomp.torch.lightning.Compression compresses a DDP strategy's gradients "
                f"(Trainer(strategy='ddp', ...)); this Trainer runs {type(trainer.strategy).__name__}, "
                f"whose model is a {type(model).__name__}: {exc}") from exc
        self._wrapper = model
        if self._loaded is not None:
            self.hook_state.load_state_dict(own_rank_state(self._loaded))
            self._loaded = None

    # -- logging ----------------------------------------------------------------------------------------------
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        # Lightning's own monitors (LearningRateMonitor, DeviceStatsMonitor) ask the same question;
        # what is logged here reaches the loggers right after this hook, at this step
        if not self.log_enabled or self.hook_state is None or not trainer._logger_connector.should_update_logs:
            return
        values = self.meter.update(self.stats())
        for line in self.meter.events:  # the same on every rank (agreed decisions): rank 0 says it
            pl.utilities.rank_zero_warn(line)
        if trainer.loggers:  # (no logger: Lightning would warn that log_dict has nowhere to go)
            pl_module.log_dict(values, on_step=True, on_epoch=False, batch_size=1)

    # -- checkpoints --------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        if self.hook_state is None:
            return {}  # nothing to save before fit (Lightning then stores nothing for us)
        return gather_every_rank(self.hook_state)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.hook_state is None:  # DDP restores callbacks before it wraps the model
            own_rank_state(state_dict)  # refuse a wrong checkpoint now, not at the first step
            self._loaded = state_dict
        else:  # strategies that restore after setup
            self.hook_state.load_state_dict(own_rank_state(state_dict))

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self.STATE_KEY not in (checkpoint.get("callbacks") or {}):
            warnings.warn("gradcomp.torch.lightning.Compression: this checkpoint holds no gradcomp "
                          "compressor state (saved without the callback?); the compressor starts "
                          "afresh", stacklevel=2)
