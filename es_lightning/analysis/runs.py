"""Recipe fits inside an analysis (population sweep, method comparison): one way to build them, and to run them;
and how a SIGTERM or SLURM's requeue signal stops any analysis command, in a fit or outside one.

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

The same signals *between* the fits — while the analysis sets up a fit, loads and evaluates a model (Pass@K on held-out
problems, minutes on a real model) or writes its results — and anywhere in the commands that fit nothing (``eval``,
``analyze ablation`` / ``forgetting`` / ``drift``, which load, evaluate or measure, and write) took their default
action: the process died without a word. Now :func:`stopping_on_signals`, around those commands (``eval``, ``analyze
ablation`` / ``forgetting`` / ``drift`` / ``compare`` / ``sweep``), takes SIGTERM and SLURM's requeue signal (under
SLURM Lightning's ``SIGUSR1``, then whatever each fit's trainer uses; none once auto-requeue is off) where their action
is still the default, and its handler raises :class:`AnalysisStopped` at once — an evaluation is cut, not waited for: a
scheduler sends SIGKILL some 30 s after SIGTERM — with the same kind of line, naming what was cut ("while evaluating
N=4", "while evaluating tuned on countdown", as :func:`now_doing` last said), the runs finished (an analysis with fits)
and what is kept; the job is never requeued. During a fit the handlers are Lightning's, exactly as without the analysis:
at ``on_fit_start``, just before Lightning registers its own, the process's previous handlers are put back, so Lightning
registers and composes what it would anyway; at ``on_train_start`` the analysis's handler becomes what Lightning's
teardown restores (a fit's setup, which loads the model, is the analysis's). The process's handlers are back when the
command ends; a handler the process already had (a script's own, or an ignored signal) is never replaced, and the Python
functions (``evaluate_models``, ``sparsity_ablation``, ``forgetting``, ``parameter_drift``, ``compare_methods``,
``population_sweep``) install nothing.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import lightning as L

from es_lightning.callbacks import sigterm


class AnalysisStopped(SystemExit):
    """A SIGTERM or SLURM's requeue signal stopped an analysis, in one of its fits or outside them: ``code`` is 128 +
    the signal's number (as the ``es-lightning`` command's status), ``line`` says which run (or what else) was cut and
    what is kept (``es-lightning analyze`` prints it)."""

    def __init__(self, line: str, code: int) -> None:
        super().__init__(code)
        self.line = line


def _stopped(signum: signal.Signals, requeue: bool, where: str, finished: Sequence[str] | None, kept: str,
             less: str = "fewer runs") -> AnalysisStopped:
    """The :class:`AnalysisStopped` of ``signum`` (SLURM's requeue signal when ``requeue``), which cut the analysis
    ``where`` ("at step 3 of the fit of N=4", "while evaluating N=4"); ``finished``: the runs done before it (``None``:
    an analysis without runs says nothing of them); ``less``: what the job could do less of, with its time ("": nothing to name)."""
    by = f"SLURM's requeue signal ({signum.name})" if requeue else "SIGTERM"
    done = ("" if finished is None else f"{', '.join(finished)} finished (printed above); " if finished
            else "no run had finished; ")
    line = f"stopped by {by} {where}; {done}{kept}, so the same command starts over"
    if requeue:
        line += ("; the job was not requeued (it would start over and meet the same time limit): give it more time "
                 f"(#SBATCH --time){f' or {less}' if less else ''} and submit it again")
    return AnalysisStopped(line, 128 + int(signum))


class _Between:
    """The handler of SIGTERM and SLURM's requeue signal outside an analysis's fits (:func:`stopping_on_signals`):
    raises :class:`AnalysisStopped` naming what :func:`now_doing` last said the analysis was doing. ``kept``: what
    is on disk until it says otherwise; ``less``: what a job that ran out of time could do less of."""

    def __init__(self, kept: str, less: str) -> None:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        self.where, self.finished, self.kept, self.less = "while setting up", None, kept, less
        self.default_kept = kept
        self.fit_end = "at the end of a fit"  # where a signal after a fit's teardown cuts (fit_run names the run)
        self.taken: set[signal.Signals] = set()  # the signals taken (only from their default action: SIG_DFL after)
        self.requeue: signal.Signals | None = None
        self.stop: AnalysisStopped | None = None  # raised once; again at the next now_doing if it was swallowed
        self._take(signal.SIGTERM)
        if SLURMEnvironment.detect() and hasattr(signal, "SIGUSR1"):  # Lightning's auto-requeue default under SLURM
            self.follow(signal.SIGUSR1)

    def _take(self, signum: signal.Signals) -> None:
        if signal.getsignal(signum) == signal.SIG_DFL:  # ends the process without a word; any other handler stays
            self.taken.add(signum)
            signal.signal(signum, self.handle)

    def follow(self, requeue: signal.Signals | None) -> None:
        """Take SLURM's requeue signal as the fits do: ``requeue`` (``None``: auto-requeue off, not under SLURM)."""
        if requeue == self.requeue:
            return
        if self.requeue in self.taken:
            self.taken.discard(self.requeue)
            signal.signal(self.requeue, signal.SIG_DFL)
        self.requeue = requeue
        if requeue is not None and requeue not in self.taken:
            self._take(requeue)

    def handle(self, signum, frame) -> None:
        signum = signal.Signals(signum)
        self.stop = _stopped(signum, signum == self.requeue, self.where, self.finished, self.kept, self.less)
        raise self.stop

    def take(self) -> None:
        """The analysis's handler again (after a fit: Lightning's teardown restored the process's)."""
        for signum in self.taken:
            signal.signal(signum, self.handle)

    def step_aside(self) -> None:
        """The process's own handlers again: before a fit registers Lightning's, and when the analysis ends."""
        for signum in self.taken:
            signal.signal(signum, signal.SIG_DFL)


_BETWEEN: _Between | None = None  # while stopping_on_signals is on


@contextlib.contextmanager
def stopping_on_signals(kept: str = "nothing was written", less: str = "fewer runs") -> Iterator[None]:
    """Around an analysis command (``eval``, ``analyze ablation`` / ``forgetting`` / ``drift`` / ``compare`` /
    ``sweep``): SIGTERM or SLURM's requeue signal outside its fits raises :class:`AnalysisStopped` at once (see the module docstring),
    saying ``kept`` of what is on disk where :func:`now_doing` says nothing else, and ``less`` of what a job out of time
    could do less of ("fewer runs"); the process's handlers are restored at the end. Nothing in a thread other than the
    main one (no handler can be set there), nor when one is on already."""
    global _BETWEEN
    if _BETWEEN is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    _BETWEEN = between = _Between(kept, less)
    try:
        yield
        if between.stop is not None:  # raised where it was swallowed (a finalizer's "Exception ignored"): end now
            raise between.stop
    finally:
        between.step_aside()
        _BETWEEN = None


def now_doing(doing: str, finished: Sequence[str] | None = None, kept: str | None = None) -> None:
    """What a signal outside an analysis's fits now cuts: ``doing`` ("evaluating N=4", said as "while evaluating
    N=4"), the runs ``finished`` (``None``: an analysis without runs) and what is ``kept`` (as for :func:`fit_run`;
    ``None``: what :func:`stopping_on_signals` was given). Nothing outside :func:`stopping_on_signals`. A stop the
    analysis swallowed (a finalizer ignores exceptions) is raised here."""
    between = _BETWEEN
    if between is None:
        return
    if between.stop is not None:
        raise between.stop
    between.where, between.finished = f"while {doing}", finished
    between.kept = between.default_kept if kept is None else kept


def now_writing(out: Path, files: Sequence[str], models: str | None = None, finished: Sequence[str] | None = None) -> None:
    """:func:`now_doing` "writing the results" of a command: ``files`` (names in ``out``, the first with its path) may
    be incomplete; ``models``: what is said of the models saved before (they are whole); ``finished``: the runs done."""
    names = [str(out / files[0]), *files[1:]]
    written = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    now_doing("writing the results", finished, f"{f'{models}; ' if models else ''}{written} may be incomplete")


class _Signals(L.Callback):
    """SIGTERM and SLURM's requeue signal in an analysis's fit: only noted, and every rank stops after the same step
    (:func:`~es_lightning.callbacks.sigterm.install`, :func:`~es_lightning.callbacks.sigterm.agree`); never requeued
    (installed last: a RunCheckpoint given in overrides installs before it, and this install is the one kept). Under
    :func:`stopping_on_signals`, the analysis's handlers step aside for Lightning's at ``on_fit_start`` and are what
    Lightning's teardown restores."""

    def setup(self, trainer, pl_module, stage) -> None:
        sigterm.install(trainer, stage, requeue_job=False)  # a rerun would start the analysis over

    def on_fit_start(self, trainer, pl_module) -> None:
        if _BETWEEN is not None:  # Lightning registers its handlers next, composing what it finds, as without analysis
            _BETWEEN.step_aside()
            _BETWEEN.where = _BETWEEN.fit_end  # what the analysis's handler cuts once the fit's teardown is past

    def on_train_start(self, trainer, pl_module) -> None:
        if _BETWEEN is not None:  # Lightning's registered: its teardown puts the analysis's back, not the default
            originals = trainer._signal_connector._original_handlers
            originals.update({signum: _BETWEEN.handle for signum in _BETWEEN.taken if signum in originals})

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        sigterm.agree(trainer)


def fit_run(trainer: L.Trainer, module, datamodule, run: str, finished: Sequence[str], kept: str) -> None:
    """``trainer.fit`` of one of an analysis's runs (of :func:`recipe_cli`): ``run`` names it, ``finished`` the runs
    done before it, ``kept`` what is on disk so far. Raises :class:`AnalysisStopped` when a SIGTERM or SLURM's requeue
    signal stopped the fit (or arrived in its last step: the analysis stops before the next run) — under
    :func:`stopping_on_signals` also when one arrives in its setup or after its teardown."""
    from lightning.pytorch.utilities.exceptions import SIGTERMException

    from es_lightning.run_dirs import slurm_leftover

    now_doing(f"setting up the fit of {run}", finished, kept)  # until on_fit_start: the analysis's handlers
    if _BETWEEN is not None:
        _BETWEEN.follow(sigterm.requeue_signal(trainer))  # the fits' requeue signal, between them too
        _BETWEEN.fit_end = f"at the end of the fit of {run}"
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
    finally:
        if _BETWEEN is not None:  # a fit that ended before its teardown could restore them
            _BETWEEN.take()
    requeue = sigterm.requeue_signal(trainer) if sigterm.requeue_requested(trainer) is not None else None
    raise _stopped(requeue or signal.SIGTERM, requeue is not None, f"at step {trainer.global_step} of the fit of {run}",
                   finished, kept) from None


#: the command-line option that sets a fit's model (a recipe's ``model:`` key under ``model.init_args``)
MODEL_OPTION = "--model.init_args.model"


def fit_model_fix(recipe: str | Path, given: Mapping[str, Sequence[str]]) -> str:
    """A hub model's refusal's way out through a local copy, in the words of whoever gave an analysis's fit its model:
    the last of the analysis's options that sets ``--model.init_args.model`` (``given``: each option → the fit
    arguments it gave, in the order the fit applies them, e.g. ``{"--overrides": [...]}``), else the recipe's
    ``model:`` key, or an override in the first option. A script is told of its Python argument (``overrides=``), the
    command of its option (:func:`~es_lightning.cli_errors.spoken`); neither of a fit's bare ``model:``."""
    from es_lightning.cli_errors import spoken

    option = _last_setting(given, MODEL_OPTION)
    if option is not None:
        return f"point {MODEL_OPTION} in {option} at a local directory"
    first = next(iter(given), "--overrides")
    override = spoken(f"{first} '[{MODEL_OPTION}, /path/to/model_dir]'",
                             f"{first.lstrip('-')}=['{MODEL_OPTION}', '/path/to/model_dir']")
    return f"point model: in {recipe} at a local directory, or give {override}"


#: the command-line option that sets a fit's data source (a recipe's ``source:`` key under ``data.init_args``)
SOURCE_OPTION = "--data.init_args.source"


def fit_source_fix(given: Mapping[str, Sequence[str]]) -> str | None:
    """A missing data source's way out, in the words of whoever gave an analysis's fit its source: the last of the
    analysis's options that sets ``--data.init_args.source`` (``given`` as :func:`fit_model_fix` takes it), to a
    script its Python argument (``overrides=``); ``None`` when no option set it (the recipe's own ``source:``, refused
    as a fit refuses it)."""
    from es_lightning.data_files import SOURCE_KINDS

    option = _last_setting(given, SOURCE_OPTION)
    return None if option is None else f"point {SOURCE_OPTION} in {option} at a {SOURCE_KINDS}"


def _last_setting(given: Mapping[str, Sequence[str]], fit_option: str) -> str | None:
    """The last of an analysis's options in ``given`` whose fit arguments set ``fit_option``, in the caller's words
    (``--overrides`` in the command, ``overrides=`` to a script); ``None`` when none does."""
    from es_lightning.cli_errors import spoken

    for option, args in reversed(list(given.items())):
        if any(str(a).split("=", 1)[0] == fit_option for a in args):
            return spoken(option, option.lstrip('-') + '=')
    return None


@contextlib.contextmanager
def naming_the_fit_model(recipe: str | Path, given: Mapping[str, Sequence[str]]) -> Iterator[None]:
    """Around an analysis's fit of ``recipe`` (its CLI built, its model loaded, trained): a hub model that cannot be
    loaded (offline and not cached, no such repository) is refused with the way out :func:`fit_model_fix` words — the
    option the user gave the model in, not ``model:`` (the fit's own key, which an override replaced) — and a data
    source that does not exist with the option that gave it (:func:`fit_source_fix`)."""
    from es_lightning.data_files import SOURCE_GIVEN_BY
    from es_lightning.policy import MODEL_GIVEN_BY

    with MODEL_GIVEN_BY.given(fit_model_fix(recipe, given)), SOURCE_GIVEN_BY.given(fit_source_fix(given)):
        yield


def recipe_task(recipe: str | Path, args: Sequence[str] = ()):
    """The task a fit of ``recipe`` with ``args`` (as :func:`recipe_cli` takes them) trains on, read without building
    the fit: the recipe parsed as ``es-lightning fit`` parses it and only its data module built (no model loaded, no
    data read), so an analysis draws its held-out problems — refusing a missing ``--eval.source`` or one without the
    task's columns — before minutes of training. ``None`` for a data module without a task."""
    import logging

    from jsonargparse import ArgumentParser

    from es_lightning.lightning_cli import _ParseOnlyCLI

    seed_log = logging.getLogger("lightning.fabric.utilities.seed")
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)  # "Seed set to 0": the fit says it, not this look at its recipe
    try:
        with warnings.catch_warnings():  # LightningCLI warns when args= is used while sys.argv holds the analysis's own
            warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
            config = _ParseOnlyCLI(args=["--config", str(recipe), *args], run=False, save_config_callback=None).config
    finally:
        seed_log.setLevel(level)
    parser = ArgumentParser()
    parser.add_subclass_arguments(L.LightningDataModule, "data", required=True)
    return getattr(parser.instantiate(parser.parse_object({"data": config.data.as_dict()})).data, "task", None)


def fit_args(overrides: Sequence[str] | str, option: str = "--overrides") -> list[str]:
    """An analysis's further ``es-lightning fit`` arguments as a list: a YAML list (``'[--model.init_args.sigma,
    "0.01"]'``) as it is, one string (``'--model.init_args.sigma 0.01'``) split as a shell splits it (``shlex``), so
    the way a fit's options are written on a command line works here too. An unbalanced quote is refused naming
    ``option``."""
    import shlex

    from es_lightning.cli_errors import spoken

    if not isinstance(overrides, str):
        return [str(a) for a in overrides]
    try:
        return shlex.split(overrides)
    except ValueError as err:  # "No closing quotation"
        raise ValueError(f"{spoken(option, option.lstrip('-') + '=')} {overrides!r} cannot be split into arguments "
                         f"({err}); close its quotes, or give a list ('[--model.init_args.sigma, 0.01]')") from None


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
