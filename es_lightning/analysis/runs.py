"""Recipe fits inside an analysis (population sweep, method comparison): one way to build them, and to run them.

An analysis fits a shipped recipe exactly as ``es-lightning fit --config recipe`` would — the same
:class:`~es_lightning.lightning_cli.ESLightningCLI` parses it — but quietly and without the recipe's own evaluation and export
callbacks: the analysis evaluates every result itself, the same way, and decides what to write.

A SIGTERM (a scheduler's preemption or time limit) or SLURM's requeue signal during one of those fits stops it after the
step in progress, as it stops ``es-lightning fit`` (:mod:`es_lightning.callbacks.sigterm`: noted, agreed by every rank),
and :func:`fit_run` ends the analysis with :class:`AnalysisStopped` — one line naming the run that was cut, the runs
finished before it and what is kept, status 128 + the signal's number. Nothing is saved and the job is never requeued:
an analysis writes its results once every run is done and has no checkpoint to resume from, so a rerun starts over
(requeued, it would meet the same time limit again). Lightning's own handlers did otherwise: on SIGTERM the fit stopped
and the analysis ended with status 0, saying nothing; on the requeue signal ``hpc_ckpt_N.ckpt`` was saved in the middle
of a step — which a rerun's fit of that run, under SLURM, would silently resume from — the job was requeued to start
over, and the analysis went on.
"""

from __future__ import annotations

import signal
import warnings
from collections.abc import Sequence
from pathlib import Path

import lightning as L

from es_lightning.callbacks import sigterm


class AnalysisStopped(SystemExit):
    """A SIGTERM or SLURM's requeue signal stopped one of an analysis's fits: ``code`` is 128 + the signal's number (as
    the ``es-lightning`` command's status), ``line`` says which run was cut and what is kept (``es-lightning analyze``
    prints it)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(code)
        self.line = line


class _Signals(L.Callback):
    """SIGTERM and SLURM's requeue signal in an analysis's fit: only noted, and every rank stops after the same step
    (:func:`~es_lightning.callbacks.sigterm.install`, :func:`~es_lightning.callbacks.sigterm.agree`); never requeued
    (installed last: a RunCheckpoint given in overrides installs before it, and this install is the one kept)."""

    def setup(self, trainer, pl_module, stage) -> None:
        sigterm.install(trainer, stage, requeue_job=False)  # a rerun would start the analysis over

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sigterm.agree(trainer)


def fit_run(trainer: L.Trainer, module, datamodule, run: str, finished: Sequence[str], kept: str) -> None:
    """``trainer.fit`` of one of an analysis's runs (of :func:`recipe_cli`): ``run`` names it, ``finished`` the runs
    done before it, ``kept`` what is on disk so far. Raises :class:`AnalysisStopped` when a SIGTERM or SLURM's requeue
    signal stopped the fit (or arrived in its last step: the analysis stops before the next run)."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from es_lightning.run_dirs import slurm_leftover

    leftover = slurm_leftover(trainer)
    if leftover is not None:  # Lightning would resume the run from it, without a word, under SLURM
        raise ValueError(f"{leftover} is a SLURM checkpoint (an older es-lightning's, or another tool's) that Lightning "
                         f"would resume the fit of {run} from under SLURM; an analysis starts every fit anew: delete it "
                         "or move it away (or choose another --out_dir)")
    try:
        trainer.fit(module, datamodule=datamodule)
    except SIGTERMException:
        pass
    else:
        if not trainer.received_sigterm:
            return
    requeue = sigterm.requeue_signal(trainer) if sigterm.requeue_requested(trainer) is not None else None
    by = f"SLURM's requeue signal ({requeue.name})" if requeue is not None else "SIGTERM"
    done = f"{', '.join(finished)} finished before it (printed above)" if finished else "no run finished before it"
    line = (f"stopped by {by} at step {trainer.global_step} of the fit of {run}; {done}; {kept}, so the same command "
            "starts over")
    if requeue is not None:
        line += ("; the job was not requeued (it would start over and meet the same time limit): give it more time "
                 "(#SBATCH --time) or fewer runs and submit it again")
    raise AnalysisStopped(line, 128 + int(requeue if requeue is not None else signal.SIGTERM)) from None


def recipe_cli(recipe: str | Path, steps: int, root: str | Path, args: Sequence[str] = (), progress_bar: bool = False):
    """The (not yet run) ``ESLightningCLI`` of ``recipe`` for ``steps`` updates, logging and checkpointing off,
    working directory ``root``, further command-line ``args`` applied last; its PassAtKCallback, TrainingReport and
    HFExport callbacks removed, signals handled as the module docstring says (run it with :func:`fit_run`)."""
    from es_lightning.callbacks import HFExport, PassAtKCallback, TrainingReport
    from es_lightning.lightning_cli import ESLightningCLI

    argv = [
        "--config", str(recipe),
        "--trainer.max_steps", str(steps),
        "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false",
        "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", str(progress_bar).lower(),
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(root),
        *args,
    ]
    with warnings.catch_warnings():  # LightningCLI warns when args= is used while sys.argv holds the analysis's own
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = ESLightningCLI(args=argv, run=False, save_config_callback=None)
    dropped = (PassAtKCallback, TrainingReport, HFExport)
    cli.trainer.callbacks[:] = [cb for cb in cli.trainer.callbacks if not isinstance(cb, dropped)] + [_Signals()]
    return cli
