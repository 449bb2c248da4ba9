"""``es-lightning fit | validate | test``: what a user expects around the LightningCLI.

:class:`CommandMixin` goes in front of :class:`~es_lightning.cli.ESLightningCLI` (what scripts and analyses build) to
make the command a user runs (``class CommandCLI(CommandMixin, ESLightningCLI)`` in :mod:`es_lightning.cli`). The command

- refuses mistakes in one line (:mod:`es_lightning.cli_errors`), checks that every output directory can be written
  before anything is loaded (:func:`~es_lightning.run_dirs.check_writable`);
- resolves ``--ckpt_path last`` to the newest run of the recipe, for ``fit``, ``validate`` and ``test``
  (:func:`~es_lightning.run_dirs.resolve_last`), and — each process of a multi-process run resolves it alone —
  stops them all in one line at setup when they would start from different checkpoints (node-local disks);
- stops every process of a multi-process fit after the same step on a SIGTERM, and every process of a SLURM fit on
  SLURM's requeue signal, which it then saves and requeues (:mod:`es_lightning.callbacks.sigterm`); a
  ``validate`` / ``test`` on either stops every process after the same batch, saying nothing was saved (nor requeued);
- shows a step bar on a terminal and progress lines in a log (:mod:`es_lightning.console`);
- ``validate`` runs every validation batch when the recipe turns the validation loop off for its fit
  (``limit_val_batches: 0`` in the GRPO recipes, whose ``PassAtKCallback`` evaluates during training), and says
  that a ``--trainer.val_check_interval`` or ``check_val_every_n_epoch`` given to such a fit runs no validation;
- after a fit, says where everything went — or that nothing was trained; after a failure, removes the run directory
  it had just created if nothing but its startup files landed there;
- does not offer ``predict`` (a reasoning module has no prediction loop; ``es-lightning eval`` samples completions and
  scores them).
"""

from __future__ import annotations

import signal
from pathlib import Path

import lightning as L
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException

from es_lightning import cli_errors, console, run_dirs
from es_lightning.callbacks import PassAtKCallback, TrainingReport, sigterm
from es_lightning.callbacks.log_dir import run_log_dir
from es_lightning.callbacks.report import format_table


class _FitRecord(L.Callback):
    """The global step a fit started training from (``None``: the loop never started).

    Under a launcher that trains in processes of its own (``ddp_spawn``, ``ddp_notebook``: Lightning's
    ``_MultiProcessingLauncher``), the command's process never runs the loop and gets back neither the step nor the
    last checkpoint; rank 0 of the workers, which has both, prints the fit's summary instead, at ``on_fit_end``."""

    def __init__(self) -> None:
        self.start_step: int | None = None
        #: ``(as given, run_dirs.checkpoint_identity of the checkpoint this process resolved)``, set by the command
        self.checkpoint: tuple[str, tuple | None] | None = None

    def setup(self, trainer, pl_module, stage) -> None:
        sigterm.install(trainer, stage)  # SIGTERM (several processes), SLURM requeue: all stop after the same step
        if self.checkpoint is not None:  # every process resolved it alone: the same one on all of them?
            run_dirs.check_same_checkpoint(self.checkpoint[1], self.checkpoint[0])

    def on_train_start(self, trainer, pl_module) -> None:
        self.start_step = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sigterm.agree(trainer)

    def on_validation_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
        sigterm.agree_evaluation(trainer)  # validate / test: all stop after the same batch on SIGTERM or SLURM requeue

    def on_test_batch_end(self, trainer, pl_module, *args, **kwargs) -> None:
        sigterm.agree_evaluation(trainer)

    def on_fit_end(self, trainer, pl_module) -> None:
        if _trains_in_workers(trainer):
            fit_summary(trainer, self.start_step, trainer.log_dir)  # log_dir is a collective under DDP: every rank


def _trains_in_workers(trainer: L.Trainer) -> bool:
    return isinstance(trainer.strategy.launcher, _MultiProcessingLauncher)


def _profiler_outputs(trainer: L.Trainer, root: Path) -> list[str]:
    """What ``trainer.profiler`` wrote into the run directory (its default ``dirpath``): the report of a profiler given a
    ``filename`` (``fit-<filename>.txt``) and the PyTorch profiler's Chrome traces."""
    profiler = getattr(trainer, "profiler", None)
    dirpath = getattr(profiler, "dirpath", None)
    if not dirpath or Path(dirpath).expanduser().resolve() != root.expanduser().resolve():
        return []
    name = getattr(profiler, "filename", None)
    reports = sorted(p.name for p in root.glob(f"*{name}*.txt")) if name else []
    traces = len(list(root.glob("*.pt.trace.json")))
    return reports + ([f"{traces} profiler trace{'s' if traces > 1 else ''} (*.pt.trace.json)"] if traces else [])


@rank_zero_only
def fit_summary(trainer: L.Trainer, start: int | None, log_dir: str | None) -> None:
    """After a fit: where everything went, or that nothing was trained (and why)."""
    if start is None or trainer.global_step == start:
        at = trainer.global_step
        why = (f"trainer.max_steps is {trainer.max_steps}" if trainer.max_steps == 0 else
               f"the run was already at step {at}, trainer.max_steps = {trainer.max_steps}; raise it to continue")
        print(f"nothing was trained: {why}")
        return
    lines = []
    if not any(isinstance(cb, TrainingReport) for cb in trainer.callbacks):  # it prints its own table
        history = next((cb.history for cb in trainer.callbacks if isinstance(cb, PassAtKCallback) and cb.history), [])
        if history:
            step, metrics = history[-1]
            lines.append(format_table([("last evaluation", step, metrics)]))
    if log_dir is not None:
        root = Path(run_log_dir(trainer))
        found = [name for name in ("config.yaml", "metrics.csv", "report.json", "report.png", "export") if (root / name).exists()]
        config = Path(log_dir).expanduser() / "config.yaml"  # Lightning's trainer.log_dir: a W&B logger's save_dir
        if "config.yaml" not in found and config.is_file():
            found.append(f"config.yaml: {config}")
        if any(root.glob("events.out.tfevents.*")):  # a TensorBoardLogger's metrics
            found.insert(1, "TensorBoard events")
        found += _profiler_outputs(trainer, root)
        lines.append(f"run directory: {root}/ ({', '.join(found)})")
        others = [f"{type(lg).__name__}: {lg.log_dir}/" for lg in trainer.loggers[1:] if isinstance(lg, (CSVLogger, TensorBoardLogger))
                  and lg.log_dir is not None and Path(lg.log_dir).expanduser() != root and Path(lg.log_dir).expanduser().is_dir()]
        if others:  # each logger numbers its own versions: one that started later took the next one
            lines.append(f"other loggers' directories: {', '.join(others)}")
    checkpoint = trainer.checkpoint_callback
    if checkpoint is not None and getattr(checkpoint, "last_model_path", ""):
        how = ("weights only: it evaluates, it does not resume" if getattr(checkpoint, "save_weights_only", False) else
               "resume: add --ckpt_path last to the same command")
        lines.append(f"last checkpoint: {checkpoint.last_model_path} ({how})")
    print("\n".join(lines))


#: the exit status of a command stopped by SIGTERM (128 + 15, the shell's convention): a job script or scheduler sees
#: that the fit did not finish
SIGTERM_STATUS = 143


@rank_zero_only
def stopped_summary(trainer: L.Trainer, subcommand: str) -> None:
    """One line after a SIGTERM or SLURM's requeue signal stopped the command (Lightning stops between two steps): the
    step reached, the checkpoint that holds it, whether the job was requeued, and how to go on."""
    checkpoint = trainer.checkpoint_callback
    path = getattr(checkpoint, "last_model_path", "") if checkpoint is not None else ""
    requeued = sigterm.requeue_requested(trainer)
    cut = sigterm.evaluation_cut(trainer)
    by_requeue = requeued is not None or cut not in (None, signal.SIGTERM)
    by = f"SLURM's requeue signal ({sigterm.requeue_signal(trainer).name})" if by_requeue else "SIGTERM"
    if subcommand != "fit" and by_requeue:  # an evaluation has nothing to resume; requeued, it would meet the same limit
        limit = "limit_test_batches" if subcommand == "test" else "limit_val_batches"
        line = (f"stopped by {by} during {subcommand}: the evaluation was cut, nothing was saved and the job was not "
                f"requeued; give the job more time (#SBATCH --time) or fewer batches (--trainer.{limit}) and submit "
                "it again")
    elif subcommand != "fit":  # SIGTERM: agreed by the ranks (several processes), or Lightning's handler (one)
        line = (f"stopped by {by} during {subcommand}: the evaluation was cut and nothing was saved; run the command "
                "again to evaluate from the start")
    elif path:
        saved = getattr(checkpoint, "_last_global_step_saved", None)
        line = (f"stopped by {by} at step {trainer.global_step}; {path} holds step {saved}: resume with the same "
                "command and --ckpt_path last")
    else:
        line = f"stopped by {by} at step {trainer.global_step}, before this run wrote a checkpoint" + (
            f"; the same command with --ckpt_path last resumes from {trainer.ckpt_path} again" if trainer.ckpt_path else "")
    if requeued is not None and requeued["status"] == 0:
        line += f"; SLURM job {requeued['job']} requeued (its command needs --ckpt_path last to resume)"
    elif requeued is not None:
        line += (f"; requeueing SLURM job {requeued['job']} failed (scontrol requeue exited {requeued['status']}): "
                 "submit the job again with --ckpt_path last")
    console.say(f"es-lightning {subcommand}: {line}")


def stopped_status(trainer: L.Trainer) -> int:
    """The command's exit status after a stop by signal: 128 + the signal's number, as a shell reports a process that
    signal ended (143 for SIGTERM, 138 for SLURM's default requeue signal SIGUSR1)."""
    if sigterm.requeue_requested(trainer) is not None:
        return 128 + int(sigterm.requeue_signal(trainer))
    cut = sigterm.evaluation_cut(trainer)
    return SIGTERM_STATUS if cut is None else 128 + int(cut)


def _say_metrics_replaced(trainer: L.Trainer, subcommand: str) -> None:
    """One line when a CSV logger reopens a directory holding a previous run's ``metrics.csv`` (a ``version`` given,
    ``my_run`` or ``0``: the same directory every time): Lightning's CSVLogger deletes that file when it starts writing,
    and its warning, which every run directory also triggers once its ``config.yaml`` is written, is silenced in the
    command (:mod:`es_lightning.console`)."""
    for logger in trainer.loggers:
        if not isinstance(logger, CSVLogger) or logger.log_dir is None:
            continue
        metrics = Path(logger.log_dir).expanduser() / "metrics.csv"
        if metrics.is_file():
            console.say(f"es-lightning {subcommand}: {metrics} of a previous run is replaced by this {subcommand}'s "
                        f"metrics (Lightning's CSVLogger starts it afresh in the directory trainer.logger version "
                        f"{logger.version!r} names every time; config.yaml is rewritten too); leave the version unset "
                        "for a new version_N directory per run, or copy the file now")


def _named(option_prefixes: tuple[str, ...]) -> bool:
    """Whether the command line names one of the options (``--model.init_args.seed 1`` or ``--model.seed=1``)."""
    return any(str(a).split("=")[0] in option_prefixes for a in cli_errors.remembered_argv())


def _say_seed_everything_alone(config, subcommand: str) -> None:
    """One line when ``--seed_everything N`` is the only seed changed on the command line of a fit (or an evaluation)
    of a reasoning module: Lightning users vary it to get another run, but nothing here draws from the global
    generators it seeds — rollouts and ES noise are a pure function of ``model.seed`` (so a resume draws what an
    uninterrupted run draws), the problems and their order of ``data.seed``, evaluation samples of
    ``PassAtKCallback``'s ``seed`` — so the run was the same as before, bit for bit, without a word."""
    if not _named(("--seed_everything",)) or rank_zero_only.rank != 0:
        return
    model, data = config.get("model"), config.get("data")
    model_args = model.get("init_args") if model is not None and hasattr(model, "get") else None
    data_args = data.get("init_args") if data is not None and hasattr(data, "get") else None
    if model_args is None or "seed" not in model_args or data_args is None or "seed" not in data_args:
        return  # not a reasoning module and data module: its own seeds, if any, are not ours to name
    seed = config.get("seed_everything")
    if seed == model_args["seed"] == data_args["seed"]:
        return  # the run a user would get by passing the other seeds as well
    if subcommand == "fit":
        if _named(("--model.init_args.seed", "--model.seed", "--data.init_args.seed", "--data.seed")):
            return
        ours = (f"the rollouts and ES noise follow model.init_args.seed ({model_args['seed']}), the problems and their "
                f"order data.init_args.seed ({data_args['seed']}), so that a resumed run draws what an "
                "uninterrupted one draws")
        fix = f"pass --model.init_args.seed {seed} --data.init_args.seed {seed}"
    else:
        if _named(("--data.init_args.seed", "--data.seed")):
            return
        callbacks = (config.get("trainer") or {}).get("callbacks") or []
        evaluators = [cb for cb in callbacks if str(getattr(cb, "class_path", "")).endswith("PassAtKCallback")]
        sample_seed = f" ({evaluators[0].init_args.get('seed')})" if evaluators and evaluators[0].get("init_args") else ""
        ours = (f"the problems follow data.init_args.seed ({data_args['seed']}), the samples PassAtKCallback's "
                f"seed{sample_seed}")
        fix = f"pass --data.init_args.seed {seed}, or set the PassAtKCallback's seed in the recipe"
    console.say(f"es-lightning {subcommand}: --seed_everything {seed} changes nothing in this {subcommand}: it seeds "
                f"Lightning's global generators, which nothing here draws from; {ours}; for another run {fix}")


class CommandMixin:
    """The ``es-lightning`` command's additions to a LightningCLI (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        self._record = _FitRecord()
        kwargs.setdefault("parser_class", cli_errors.OneLineErrorParser)
        super().__init__(*args, **kwargs)

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {name: keys for name, keys in LightningCLI.subcommands().items() if name != "predict"}

    def _parse_ckpt_path(self) -> None:
        """Check ``--ckpt_path`` before anything loads (:func:`~es_lightning.run_dirs.check_ckpt_path`) — and do not
        let the checkpoint's hyperparameters replace the configured model settings, as Lightning's LightningCLI does
        for a checkpoint file: that silently dropped e.g. ``--model.init_args.lr`` given on resume, while
        ``--ckpt_path last`` (resolved later) kept it. A resume runs the configured settings either way, and the module
        warns which of the checkpoint's stage settings differ (``ReasoningModule.restore_stage``)."""
        subcommand = self.config.get("subcommand")
        if subcommand:
            run_dirs.check_ckpt_path(self.config[subcommand], fitting=subcommand == "fit")

    def before_instantiate_classes(self) -> None:
        super().before_instantiate_classes()
        config = self.config[self.subcommand]
        cli_errors.remember(config=config)
        given = config.get("ckpt_path")
        if self.subcommand in ("fit", "validate", "test") and given == "last":
            run_dirs.resolve_last(config, self.subcommand)
            run_dirs.check_ckpt_path(config, fitting=self.subcommand == "fit")  # the run it found: a sharded one too
        trainer = config.get("trainer")
        if self.subcommand == "validate" and trainer is not None and trainer.get("limit_val_batches") == 0:
            # the GRPO recipes turn Lightning's validation loop off for fit (PassAtKCallback evaluates during training):
            # `validate` ran no batch, said nothing and exited 0
            trainer["limit_val_batches"] = 1.0
            if rank_zero_only.rank == 0:
                console.say("es-lightning validate: trainer.limit_val_batches 0 turns the validation loop off during a "
                            "fit (PassAtKCallback evaluates); validate runs every validation batch (1.0)")
        interval = trainer.get("val_check_interval") if trainer is not None else None
        every_epochs = trainer.get("check_val_every_n_epoch") if trainer is not None else None
        named = any(str(a).split("=")[0] == "--trainer.check_val_every_n_epoch" for a in cli_errors.remembered_argv())
        # a value other than Lightning's default, or one named on the command line (`check_val_every_n_epoch 1` with
        # max_epochs validated at no epoch's end either)
        asked = [(key, value) for key, value, default in (
            ("val_check_interval", interval, isinstance(interval, float) and interval == 1.0),
            ("check_val_every_n_epoch", every_epochs, every_epochs == 1 and not named)) if value is not None and not default]
        if self.subcommand == "fit" and asked and trainer.get("limit_val_batches") == 0 and rank_zero_only.rank == 0:
            # Lightning says "validation will run after every N batches" and runs none: the GRPO recipes turn it off
            key, value = asked[0]
            console.say(f"es-lightning fit: trainer.{key} {value} runs no validation: "
                        "trainer.limit_val_batches is 0 (the recipe's PassAtKCallback evaluates every_n_train_steps); "
                        "add --trainer.limit_val_batches 1.0 to validate on that interval too")
        if given is not None and str(given) not in ("best", "hpc"):  # each process's own; compared at setup
            self._record.checkpoint = (str(given), run_dirs.checkpoint_identity(config.get("ckpt_path")))
        if self.subcommand in ("fit", "validate", "test"):
            _say_seed_everything_alone(config, self.subcommand)
        run_dirs.check_writable(config)

    def instantiate_classes(self) -> None:
        with cli_errors.building():
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs) -> L.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if trainer.progress_bar_callback is not None:
            console.choose_progress_bar(trainer.callbacks)
        trainer.callbacks.append(self._record)
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        leftover = run_dirs.slurm_leftover(self.trainer) if self.config[subcommand].get("ckpt_path") is None else None
        if leftover is not None:  # Lightning would load it without a word
            does, use = {"fit": ("resumes the fit from", "resume from it")}.get(subcommand, (f"{subcommand}s", f"{subcommand} it"))
            raise cli_errors.UserError(
                f"{leftover}: a SLURM checkpoint es-lightning did not write (an older version's or another tool's), which "
                f"Lightning {does} silently under SLURM when no --ckpt_path is given; pass --ckpt_path {leftover} to "
                f"{use}, or move it out of {leftover.parent}"
                + (" (--ckpt_path last resumes the recipe's newest run)" if subcommand == "fit" else "")
            )
        log_dir = self.trainer.log_dir
        existed = log_dir is not None and Path(log_dir).expanduser().exists()
        if rank_zero_only.rank == 0:
            _say_metrics_replaced(self.trainer, subcommand)
        try:
            super()._run_subcommand(subcommand)
        except BaseException as error:
            run_dirs.remove_if_empty(log_dir, existed)
            if isinstance(error, SIGTERMException):  # a SystemExit with no status: it would end the command with 0
                sigterm.requeue(self.trainer)  # SLURM's requeue signal, when no RunCheckpoint did it after its save
                stopped_summary(self.trainer, subcommand)
                raise SystemExit(stopped_status(self.trainer)) from None
            raise
        if subcommand == "fit" and not _trains_in_workers(self.trainer):  # else the workers' rank 0 said it
            fit_summary(self.trainer, self._record.start_step, self.trainer.log_dir)  # log_dir: a collective (DDP)
