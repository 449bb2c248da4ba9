"""The stage record: which algorithm a module runs, with its settings and rollout settings, saved in the module's own
checkpoint so that a resumed fit builds the right optimizer whatever order a strategy restores things in.

Why a module-level record and a peek: under single-device and DDP strategies Lightning restores the module
(``on_load_checkpoint``) *before* it calls ``configure_optimizers``, so the record alone suffices. Under FSDP1, FSDP2
(``ModelParallelStrategy``) and DeepSpeed (``restore_checkpoint_after_setup=True``) it builds the optimizers first and
loads their state inside ``strategy.load_checkpoint`` — before any module or callback hook sees the checkpoint — so an
optimizer of the first stage's kind would receive the second stage's state. For those strategies the module wraps
``strategy.load_checkpoint`` (:func:`peek_stage_on_load`): it reads the record from the checkpoint path (a file, or the
``meta.pt`` that Lightning writes into a distributed-checkpoint directory), switches the module to that stage and
rebuilds the optimizers, and only then lets Lightning load the states into them. DeepSpeed wraps its optimizer at setup,
so a resume there that changes stage is refused with a clear error rather than rebuilt.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning import LightningModule

#: the key of the stage record in a checkpoint
STAGE_KEY = "es_lightning_stage"
#: where Lightning's ModelParallelStrategy / FSDPStrategy put a distributed checkpoint's non-tensor state
_DISTRIBUTED_METADATA = "meta.pt"


def read_stage_record(path: Any) -> dict[str, Any] | None:
    """The stage record of the checkpoint at ``path`` (a file or a distributed-checkpoint directory), or ``None``."""
    path = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if path is None:
        return None
    if os.path.isdir(path):
        path = os.path.join(path, _DISTRIBUTED_METADATA)
    if not os.path.isfile(path):
        return None
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False, mmap=True)  # tensors stay on disk
    except RuntimeError:  # not a zip-format file: mmap unsupported
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    return checkpoint.get(STAGE_KEY) if isinstance(checkpoint, dict) else None


def peek_stage_on_load(module: LightningModule, strategy: Any) -> None:
    """Make ``strategy.load_checkpoint`` restore the module's stage (and rebuild the optimizers) before it loads the
    optimizer states. Idempotent; only needed when ``strategy.restore_checkpoint_after_setup``."""
    if getattr(strategy, "_es_lightning_stage_peek", None) is module:
        return
    original = type(strategy).load_checkpoint

    def load_checkpoint(checkpoint_path, *args, **kwargs):
        record = read_stage_record(checkpoint_path)
        if record is not None and module.restore_stage(record):
            rebuild_optimizers(module, strategy)
        return original(strategy, checkpoint_path, *args, **kwargs)

    strategy.load_checkpoint = load_checkpoint
    strategy._es_lightning_stage_peek = module


def rebuild_optimizers(module: LightningModule, strategy: Any) -> None:
    """Replace the strategy's optimizers and LR schedulers by the module's (active algorithm's) fresh ones."""
    from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers

    if type(strategy).__name__ == "DeepSpeedStrategy":
        raise RuntimeError(
            "this checkpoint was saved in another training stage than the module starts in (a SequentialStrategy "
            "switch), and DeepSpeed wraps the first stage's optimizer at setup; resume it with DDP or FSDP"
        )
    strategy.optimizers, strategy.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(module)
