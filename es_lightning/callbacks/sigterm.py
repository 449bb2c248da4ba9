"""SIGTERM on several processes: every rank stops at the same step boundary.

Lightning 2.6's SIGTERM handler does a ``torch.distributed.broadcast`` *inside the signal handler*, wherever the
signal interrupts the rank, and each rank then stops at the end of the step in which its own signal arrived. A scheduler
signals the ranks of a job at the same moment, not at the same point of their code: the handler's broadcast then pairs
with another collective of another rank (gloo aborts the job, "Connection reset by peer"; NCCL hangs until its timeout),
and a rank that got the signal one step later runs a step more than the others. Either way no checkpoint is written and
the job ends with status 1 (measured: 2 DDP processes under torchrun, the signal reaching rank 0 a step before rank 1).

:func:`install` (called at ``setup`` by :class:`~es_lightning.RunCheckpoint` and by the ``es-lightning`` command, when
the fit has more than one process) makes the handler only note the signal (and pass it on to processes Lightning
launched, as Lightning's does). :func:`agree` (at ``on_train_batch_end``, on every rank) then takes the max of the
ranks' notes in one ``all_reduce``: when any rank was signalled, every rank sets ``trainer.received_sigterm`` at the same
batch, Lightning's training loop stops them all at the end of it, and :class:`~es_lightning.RunCheckpoint` saves that
step on all of them (its ``on_exception``). One process: Lightning's own handler, as before.
"""

from __future__ import annotations

import logging
from typing import Any

import lightning as L

log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")  # where Lightning says it

_STATE = "_es_lightning_sigterm"


def install(trainer: L.Trainer, stage: str) -> None:
    """At ``setup``, before Lightning registers its handler: during a fit of several processes, make ``trainer``'s
    SIGTERM handler only note the signal; otherwise (one process, ``validate``/``test``) leave Lightning's."""
    connector = trainer._signal_connector
    if stage != "fit" or trainer.world_size <= 1:
        connector.__dict__.pop("_sigterm_notifier_fn", None)  # a trainer that fitted before: Lightning's handler again
        connector.__dict__.pop(_STATE, None)
        return
    state: dict[str, Any] = {"pending": False, "agreed_batch": -1}
    setattr(connector, _STATE, state)

    def note_sigterm(signum, frame) -> None:  # replaces _SignalConnector._sigterm_notifier_fn: no collective here
        log.info(f"[rank: {trainer.global_rank}] Received SIGTERM: {signum}; stopping after this step")
        if not state["pending"]:
            launcher = trainer.strategy.launcher
            if launcher is not None:  # the processes Lightning started itself get it too, as Lightning's handler does
                launcher.kill(signum)
        state["pending"] = True

    connector._sigterm_notifier_fn = note_sigterm


def agree(trainer: L.Trainer) -> None:
    """All ranks: whether any was signalled, agreed once per training batch; if so Lightning stops them after it."""
    state = getattr(trainer._signal_connector, _STATE, None)
    if state is None or trainer.world_size <= 1:
        return
    batch = trainer.fit_loop.epoch_loop.batch_progress.total.ready
    if state["agreed_batch"] == batch:  # RunCheckpoint and the command both ask: one collective per batch
        return
    state["agreed_batch"] = batch
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if state["pending"] else 0], device=trainer.strategy.root_device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item():
        trainer._signal_connector.received_sigterm = True
