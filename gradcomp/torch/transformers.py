"""Hugging Face Trainer: a callback that compresses the DDP gradient traffic and checkpoints the
compressor with the Trainer's own checkpoints.

    from gradcomp.torch.transformers import Compression
    trainer = Trainer(model, args, train_dataset=data, callbacks=[Compression("int8")])

Trainer has no communication-hook argument. It wraps the model in DDP (through
``accelerator.prepare``) just before ``on_train_begin``, but hands callbacks the unwrapped model.
So ``on_train_begin`` installs a global forward pre-hook (``torch.nn.modules.module``) that waits
for the first training forward (gradients enabled): the first module called whose ``.module`` is
the model, the DDP wrapper, gets gradcomp's hook before any backward, and the pre-hook removes
itself. If the model itself is called first, nothing wrapped it: ``gradcomp.torch.register`` gets
the model as it is, and a clear error says when it is not a kind it takes (one process, DeepSpeed).

Logging (``log=True``, the default): at each of the Trainer's training logs (``logging_steps``:
the ``logs`` that carry ``loss``), ``on_log`` adds ``gradcomp.metrics`` of the compressor's
``stats()`` under ``gradcomp/`` (docs/guides/observing.md) to them and to ``state.log_history``, and
logs a warning (Python ``logging``, ``gradcomp.torch.transformers``, on the main process) once
when the method backs off (``gradcomp.backoffs``). ``log=False``: neither. The Trainer hands the logs
to its ``report_to`` integrations before the callbacks passed to it, so to have the figures in
TensorBoard, W&B, ... pass the integration's callback after this one, with ``report_to="none"``
(``callbacks=[Compression("int8"), TensorBoardCallback()]``).

Checkpoints: on ``on_save`` (every rank) each rank writes its own compressor state,
``gradcomp_rank<process_index>.pt``, into ``<output_dir>/checkpoint-<global_step>``, beside the
Trainer's ``rng_state_<rank>.pth`` (residuals are per rank). A resumed run (``global_step`` > 0 at
``on_train_begin``) loads its file from ``<output_dir>/checkpoint-<global_step>``, or from
``resume=<folder>`` when resuming from a checkpoint elsewhere; a missing file, another compressor
or another number of ranks is an error. ``resume=False`` starts the compressor afresh on purpose.
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
try:
    from transformers import TrainerCallback
except ImportError as exc:
    raise ImportError("gradcomp.torch.transformers needs transformers: "
                      "pip install 'gradcomp[torch,integrations]'") from exc

from ..comm import Communicator
from ..compressors import Compressor
from ..metrics import Meter
from .hook import HookState, register

FORMAT = "gradcomp.torch.transformers/rank-1"
LOG = logging.getLogger(__name__)


def state_file(folder: str, rank: int) -> str:
    """Where rank ``rank``'s compressor state lies in a Trainer checkpoint folder."""
    return os.path.join(folder, f"gradcomp_rank{rank}.pt")


class Compression(TrainerCallback):
    """Compress the gradients the Trainer's DDP model averages, with ``compressor`` (a gradcomp
    ``Compressor`` or a registry name). ``comm``, ``hierarchical``: ``gradcomp.torch.register``'s.
    ``resume``: where a resumed run finds the compressor state (True: the checkpoint folder of
    the resumed step under ``output_dir``; a folder; False: start afresh). ``log``: add the
    compressor's metrics to the Trainer's logs and warn when it backs off (see the module). ``stats()``: the
    compressor's traffic figures; ``hook_state``: the registered ``HookState``."""

    def __init__(self, compressor: Compressor | str, comm: Communicator | None = None,
                 hierarchical: bool | None = None, resume: bool | str = True, log: bool = True):
        self.compressor = compressor
        self.log_enabled = log  # (the Lightning callback's name)
        self.meter = Meter()  # the previous logged reading: the recent figures and events are since it
        self.comm = comm
        self.hierarchical = hierarchical
        self.resume = resume
        self.hook_state: HookState | None = None
        self._wrapper: Any = None
        self._watch: Any = None                     # the global forward pre-hook's handle
        self._loaded: dict[str, Any] | None = None  # read at on_train_begin, applied at registration

    def __repr__(self) -> str:
        return f"Compression({self.compressor!r})"

    def stats(self) -> dict[str, Any]:
        """The compressor's ``stats()`` (bytes sent, compression ratio, ...)."""
        if self.hook_state is None:
            raise RuntimeError("gradcomp.torch.transformers.Compression: no statistics before "
                               "the first training step")
        return self.hook_state.compressor.stats()

    # -- registration -------------------------------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is None:
            raise RuntimeError("gradcomp.torch.transformers.Compression: the Trainer passed no model")
        if state.global_step > 0:
            self._loaded = self._read(args, state)
        if self._watch is None:
            self._watch = torch.nn.modules.module.register_module_forward_pre_hook(
                lambda module, _inputs: self._first_forward(module, model))

    def _first_forward(self, module: torch.nn.Module, model: torch.nn.Module) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation (eval_on_start) runs the bare model under no_grad: not our moment
        if getattr(module, "module", None) is not model and module is not model:
            return
        self._watch.remove()
        self._watch = None
        if module is self._wrapper:  # another train() on the same wrapper: registered already
            return
        try:
            if self.hook_state is None:
                self.hook_state = register(module, self.compressor, self.comm,  # type: ignore[arg-type]
                                           hierarchical=self.hierarchical)
            else:
                self.hook_state = register(module, None, self.comm, state=self.hook_state)  # type: ignore[arg-type]
        except TypeError as exc:
            raise TypeError(
                "gradcomp.torch.transformers.Compression compresses the gradients of a model the "
                "Trainer wrapped in DistributedDataParallel (a job of several processes: torchrun "
                f"or `accelerate launch`); the Trainer trains a {type(module).__name__}: {exc}") from exc
        self._wrapper = module
        if self._loaded is not None:
            self.hook_state.load_state_dict(self._loaded)
            self._loaded = None

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._watch is not None:  # training ended before any training forward (max_steps reached)
            self._watch.remove()
            self._watch = None

    # -- logging ----------------------------------------------------------------------------------------------
    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None,
               **kwargs: Any) -> None:
        if not self.log_enabled or self.hook_state is None or logs is None or "loss" not in logs:
            return  # (evaluation's logs and the run's summary carry no "loss")
        values = self.meter.update(self.stats())
        logs.update(values)  # the callbacks after this one see them (the printer, a user's logger)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # the Trainer appended a copy of these logs just before
        if state.is_world_process_zero:  # the same lines on every rank (agreed decisions)
            for line in self.meter.events:
                LOG.warning(line)

    # -- checkpoints --------------------------------------------------------------------------------------
    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.hook_state is None:
            return
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        torch.save({"format": FORMAT, "world_size": _world_size(), "rank": args.process_index,
                    "state": self.hook_state.state_dict()}, state_file(folder, args.process_index))

    def _read(self, args: Any, state: Any) -> dict[str, Any] | None:
        """This rank's saved compressor state for a run resumed at ``state.global_step``."""
        if self.resume is False:
            warnings.warn("gradcomp.torch.transformers.Compression(resume=False): the resumed run's "
                          "compressor starts afresh", stacklevel=3)
            return None
        folder = (self.resume if isinstance(self.resume, str)
                  else os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
        path = state_file(folder, args.process_index)
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"gradcomp.torch.transformers.Compression: this run resumes at step {state.global_step} "
                f"but {path} does not exist. Pass Compression(..., resume=<the checkpoint folder>) when "
                "resuming from a folder outside output_dir, or resume=False to start the compressor "
                "afresh (e.g. a checkpoint saved without compression)")
        saved = torch.load(path, weights_only=True)
        if not isinstance(saved, dict) or saved.get("format") != FORMAT:
            raise ValueError(f"gradcomp.torch.transformers.Compression: {path} is not a compressor "
                             "state saved by this callback")
        if saved.get("world_size") != _world_size():
            raise ValueError(f"gradcomp.torch.transformers.Compression: {path} was saved by a job of "
                             f"{saved.get('world_size')} ranks, this one has {_world_size()}: "
                             "error-feedback residuals belong to the ranks that made them. Resume with "
                             "the same number of ranks, or pass resume=False")
        return saved["state"]


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1
