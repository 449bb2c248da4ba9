"""SIGTERM on several processes, and SLURM's requeue signal: every rank stops at the same step boundary.

Lightning 2.6's SIGTERM handler does a ``torch.distributed.broadcast`` *inside the signal handler*, wherever the
signal interrupts the rank, and each rank then stops at the end of the step in which its own signal arrived. A scheduler
signals the ranks of a job at the same moment, not at the same point of their code: the handler's broadcast then pairs
with another collective of another rank (gloo aborts the job, "Connection reset by peer"; NCCL hangs until its timeout),
and a rank that got the signal one step later runs a step more than the others. Either way no checkpoint is written and
the job ends with status 1 (measured: 2 DDP processes under torchrun, the signal reaching rank 0 a step before rank 1).

Under SLURM, Lightning's ``SLURMEnvironment(auto_requeue=True)`` (its default, so every ``srun`` fit) handles the
requeue signal (``SIGUSR1``, sent by ``#SBATCH --signal=SIGUSR1@90``) the same way: its handler calls
``trainer.save_checkpoint`` *inside the signal handler*, i.e. in the middle of a step — of several processes a collective
begun at a different point on each rank (deadlock or a gloo abort), on one process a checkpoint of half a step (an ES
step's centre weights still perturbed by a member's noise) — written to ``hpc_ckpt_N.ckpt`` outside the run's
``last.ckpt``, and the fit then goes on until SLURM kills it.

:func:`install` (called at ``setup`` by :class:`~es_lightning.RunCheckpoint`, by the ``es-lightning`` command and by
the fits of ``es-lightning analyze compare`` / ``sweep``, :mod:`es_lightning.analysis.runs`) takes
over both of Lightning's handlers on the trainer's own signal connector — the methods Lightning composes into its
handlers when it registers them after ``setup`` — so that they only note the signal: SIGTERM when the fit, validate or
test has more than one process (and it is passed on to processes Lightning launched, as Lightning's handler does), the
requeue signal whenever SLURM auto-requeue is on (one process too). Done from the project's callbacks rather than a cluster-environment
plugin of its own: the environment stays Lightning's (ranks, addresses; ``SLURMEnvironment(auto_requeue=False)`` still
turns requeueing off), a recipe or job script needs no plugin in its configuration, and the callbacks already hold the
hooks where the signal is taken over (``setup``) and agreed (``on_train_batch_end``). :func:`agree` (at
``on_train_batch_end``, on every rank) then takes the max of the ranks' notes in one ``all_reduce``: when any rank was
signalled, every rank sets ``trainer.received_sigterm`` at the same batch, Lightning's training loop stops them all at
the end of it, and :class:`~es_lightning.RunCheckpoint` saves that step on all of them (its ``on_exception``, the atomic
``last.ckpt`` save). After a requeue signal, :func:`requeue` then runs ``scontrol requeue $SLURM_JOB_ID`` (``<array
job>_<task>`` for an array job), on global rank 0 only, as Lightning does, and the ``es-lightning`` command exits with
128 + the signal's number (138 for ``SIGUSR1``). The requeued job runs its script again: give its command ``--ckpt_path
last`` and it resumes from that ``last.ckpt``. An analysis's fit stops the same way but saves nothing and never
requeues (it has nothing to resume from: :mod:`es_lightning.analysis.runs`). One process without SLURM auto-requeue:
Lightning's own handlers.

``validate`` / ``test`` under SLURM auto-requeue: Lightning's handler would save ``hpc_ckpt_N.ckpt`` of a model the
evaluation does not change, in the middle of an evaluation batch (of several processes, a collective begun at another
point on each rank: a hang). An evaluation has nothing to resume, and requeueing it would only start it over, to meet
the same time limit again (a job requeued for ever); so the requeue signal is noted here as well, the ranks agree on it
after each evaluation batch (:func:`agree_evaluation`, one ``all_reduce`` per batch when there are several), Lightning's
evaluation loop stops them all after the same batch, and the command says in one line that the evaluation was cut,
nothing was saved and the job was not requeued, and exits 138. SIGTERM during a ``validate`` / ``test`` of several
processes: Lightning's handler would broadcast inside the signal handler as in a fit; it is noted instead and agreed in
the same ``all_reduce`` after each batch, every rank stops after the same one, and the command says in one line that the
evaluation was cut and nothing was saved, and exits 143 (the requeue signal wins when both arrive in one batch, as in a
fit). SIGTERM on one process: Lightning's own handler, in an evaluation too (no collective there; it stops the
evaluation after the batch, and the command says the same line).
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
from typing import Any

import lightning as L

log = logging.getLogger("lightning.pytorch.trainer.connectors.signal_connector")  # where Lightning says it

_STATE = "_es_lightning_sigterm"
_HANDLERS = ("_sigterm_notifier_fn", "_slurm_sigusr_handler_fn")


def requeue_signal(trainer: L.Trainer) -> signal.Signals | None:
    """The signal SLURM sends before a job's end when the fit is to requeue it (``SLURMEnvironment(auto_requeue=True)``,
    Lightning's default under ``srun``), else ``None``."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    environment = trainer._accelerator_connector.cluster_environment
    if isinstance(environment, SLURMEnvironment) and environment.auto_requeue and hasattr(signal, "SIGUSR1"):
        return environment.requeue_signal or signal.SIGUSR1
    return None


def install(trainer: L.Trainer, stage: str, requeue_job: bool = True) -> None:
    """At ``setup``, before Lightning registers its handlers: make ``trainer``'s SIGTERM handler (several processes)
    and SLURM requeue handler (auto-requeue on) only note the signal — during a fit, agreed by :func:`agree`;
    during ``validate``/``test``, agreed by :func:`agree_evaluation`, never saved nor requeued; otherwise (one process
    without requeueing) leave Lightning's. ``requeue_job=False``: a fit's requeue signal stops it as agreed, but
    :func:`requeue` never requeues the job (an analysis's fits: a rerun would start the analysis over)."""
    connector = trainer._signal_connector
    for name in (*_HANDLERS, _STATE):  # a trainer that fitted before: Lightning's handlers again
        connector.__dict__.pop(name, None)
    several = trainer.world_size > 1
    requeue_on = requeue_signal(trainer)
    evaluating = stage in ("validate", "test")  # stage: Lightning's TrainerFn, a str enum
    if not (stage == "fit" or evaluating) or not (several or requeue_on):
        return
    state: dict[str, Any] = {"pending": False, "requeue_pending": False, "agreed_batch": -1, "requeue": None,
                             "requeue_job": requeue_job}
    if evaluating:  # an evaluation: stopped after an agreed batch, never saved nor requeued
        state["evaluation_cut"] = None  # the signal that cut it
    setattr(connector, _STATE, state)
    until = f"stopping after this {'test' if stage == 'test' else 'validate'} batch" if evaluating else "stopping after this step"

    if several:
        def note_sigterm(signum, frame) -> None:  # replaces _SignalConnector._sigterm_notifier_fn: no collective here
            log.info(f"[rank: {trainer.global_rank}] Received SIGTERM: {signum}; {until}")
            if not state["pending"]:
                launcher = trainer.strategy.launcher
                if launcher is not None:  # the processes Lightning started itself get it too, as Lightning's handler does
                    launcher.kill(signum)
            state["pending"] = True

        connector._sigterm_notifier_fn = note_sigterm

    if requeue_on:
        def note_requeue(signum, frame) -> None:  # replaces _SignalConnector._slurm_sigusr_handler_fn: no save here
            log.info(f"[rank: {trainer.global_rank}] Received SLURM requeue signal {signum}; {until}")
            state["requeue_pending"] = True

        connector._slurm_sigusr_handler_fn = note_requeue


def _agreed(trainer: L.Trainer, state: dict[str, Any], batch: int, notes: list[bool]) -> list[bool] | None:
    """Each of ``notes`` true on any rank (one ``all_reduce`` of their max when there are several), once per ``batch``:
    ``None`` when this batch was agreed already (RunCheckpoint and the command both ask)."""
    if state["agreed_batch"] == batch:
        return None
    state["agreed_batch"] = batch
    if trainer.world_size <= 1:
        return notes
    import torch
    import torch.distributed as dist

    flags = torch.tensor([int(x) for x in notes], device=trainer.strategy.root_device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return [bool(x) for x in flags.tolist()]


def agree(trainer: L.Trainer) -> None:
    """All ranks: whether any was signalled, agreed once per training batch; if so Lightning stops them after it."""
    state = getattr(trainer._signal_connector, _STATE, None)
    if state is None:
        return
    notes = _agreed(trainer, state, trainer.fit_loop.epoch_loop.batch_progress.total.ready,
                    [state["pending"], state["requeue_pending"]])
    if notes is None:
        return
    if notes[1] and state["requeue"] is None:
        # requeue() runs it once the step is saved (never, when the job is not to be requeued)
        state["requeue"] = {"job": None, "status": None, "done": not state["requeue_job"]}
    if any(notes):
        trainer._signal_connector.received_sigterm = True


def agree_evaluation(trainer: L.Trainer) -> None:
    """All ranks, after each ``validate`` / ``test`` batch: whether any got SLURM's requeue signal or (several
    processes) SIGTERM; if so Lightning's evaluation loop stops them all after this batch."""
    state = getattr(trainer._signal_connector, _STATE, None)
    if state is None or "evaluation_cut" not in state:
        return
    loop = trainer.test_loop if trainer.testing else trainer.validate_loop
    notes = _agreed(trainer, state, loop.batch_progress.total.ready, [state["pending"], state["requeue_pending"]])
    if notes is not None and any(notes):
        state["evaluation_cut"] = requeue_signal(trainer) if notes[1] else signal.SIGTERM  # the requeue signal first, as in a fit
        trainer._signal_connector.received_sigterm = True


def evaluation_cut(trainer: L.Trainer) -> signal.Signals | None:
    """The signal that stopped a ``validate`` / ``test`` (agreed by :func:`agree_evaluation`): SLURM's requeue signal
    or SIGTERM; ``None`` when none did (or Lightning's own handler did: one process, SIGTERM)."""
    state = getattr(trainer._signal_connector, _STATE, None)
    return None if state is None else state.get("evaluation_cut")


def requeue_requested(trainer: L.Trainer) -> dict[str, Any] | None:
    """After the ranks agreed on a requeue signal: ``{"job": id, "status": scontrol's exit status}`` (both ``None``
    until :func:`requeue` ran; on ranks other than 0 they stay ``None``); otherwise ``None``."""
    state = getattr(trainer._signal_connector, _STATE, None)
    return None if state is None else state["requeue"]


def _job_id() -> str:
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job is not None else os.environ["SLURM_JOB_ID"]
    if not re.fullmatch(r"[0-9_]+", job):
        raise ValueError(f"SLURM job id {job!r} is not a number; scontrol requeue needs the job's numeric id")
    return job


def requeue(trainer: L.Trainer) -> None:
    """After the step the ranks stopped at is saved (every rank calls it; once per fit): ``scontrol requeue <job>`` on
    global rank 0, as Lightning's handler does. Nothing when no requeue signal was agreed."""
    asked = requeue_requested(trainer)
    if asked is None or asked["done"]:
        return
    asked["done"] = True
    if not trainer.is_global_zero:
        return
    asked["job"] = job = _job_id()
    log.info(f"requeueing SLURM job {job}...")
    try:
        asked["status"] = subprocess.call(["scontrol", "requeue", job])
    except FileNotFoundError:
        asked["status"] = 127  # the shell's status for a command it cannot find
    if asked["status"] == 0:
        log.info(f"Requeued SLURM job: {job}")
    else:
        log.warning(f"Requeuing SLURM job {job} failed with error code {asked['status']}")
