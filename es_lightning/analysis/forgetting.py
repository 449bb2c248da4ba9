"""Forgetting: does post-training on one task cost Pass@K on others? (Ba et al. 2026's coverage question, off-task.)

The base and the tuned model are evaluated on a held-out suite of tasks *other than* the training task — by default the
built-in procedural ``addition`` and ``sort``, which the built-in model learnt in pretraining beside Countdown and
which exercise other skills (carrying; comparing and copying) — and on the training task itself for reference. Both
models see the same problems with the same sampling seeds (:func:`~es_lightning.analysis.evaluate.evaluate_models`),
so a change is the weights' doing. The report is the Pass@k change tuned − base per task: negative off-task changes
are forgetting.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from es_lightning.analysis.evaluate import EvalReport, evaluate_models
from es_lightning.analysis.output import Signed, check_out_dir, format_table, write_json
from es_lightning.analysis.settings import PAPER_EVAL, EvalSettings, remote_code_option
from es_lightning.cli_errors import spoken
from es_lightning.tasks import get_task

#: the built-in held-out suite: procedural tasks unlike Countdown
DEFAULT_SUITE = ("addition", "sort")
#: ``training_task``'s default: the task the tuned model's checkpoint (or run directory) records, else countdown
RECORDED = "auto"


@dataclass
class ForgettingReport:
    """Base and tuned scores per task and their difference; ``training_task`` is the in-domain reference row."""

    evaluation: EvalReport
    training_task: str | None

    @property
    def ks(self) -> list[int]:
        return self.evaluation.ks

    @property
    def changes(self) -> dict[str, dict[str, float]]:
        """``{task: {"pass@k": tuned − base, …, "maj@k": …, "entropy": …}}``."""
        base, tuned = self.evaluation.results["base"], self.evaluation.results["tuned"]
        return {task: {name: tuned[task][name] - value for name, value in base[task].items()} for task in base}

    @property
    def suite(self) -> list[str]:
        return [t for t in self.evaluation.results["base"] if t != self.training_task]

    def table(self) -> str:
        base, tuned, changes = self.evaluation.results["base"], self.evaluation.results["tuned"], self.changes
        shown = sorted({1, max(self.ks)})
        headers = ["task", "role", *(h for k in shown for h in (f"base pass@{k}", f"tuned pass@{k}", f"Δ pass@{k}"))]
        rows = [
            [task, "trained" if task == self.training_task else "held-out",
             *(v for k in shown for v in (base[task][f"pass@{k}"], tuned[task][f"pass@{k}"], Signed(changes[task][f"pass@{k}"])))]
            for task in base
        ]
        return format_table(headers, rows)

    def to_json(self) -> dict[str, Any]:
        return {**self.evaluation.to_json(), "training_task": self.training_task, "suite": self.suite,
                "changes": self.changes}


def forgetting(
    base: Any,
    tuned: Any,
    tasks: Sequence[str] = DEFAULT_SUITE,
    training_task: str | None = RECORDED,
    settings: EvalSettings = PAPER_EVAL,
    dtype: str | None = None,
    progress: bool = True,
    model_options: Sequence[str | None] | None = None,
) -> ForgettingReport:
    """Evaluate ``base`` and ``tuned`` (specs or :class:`LoadedModel`) on ``training_task`` + the held-out ``tasks``
    (``model_options``: the command options that gave them, as :func:`evaluate_models` takes them)."""
    from es_lightning.analysis.checkpoints import LoadedModel

    suite, training_task, trained = _suite(tasks, training_task, tuned.spec if isinstance(tuned, LoadedModel) else str(tuned))
    all_tasks = ([training_task] if trained else []) + list(tasks)  # as given: a class path keeps a custom task
    # --eval.source gives the training task's problems (a file, the hub); the suite's probes stay procedural
    procedural = {name: "procedural" for name in suite} if trained and settings.source != "procedural" else None
    report = evaluate_models([base, tuned], tasks=all_tasks, labels=["base", "tuned"], settings=settings, dtype=dtype,
                             progress=progress, task_sources=procedural, model_options=model_options)
    return ForgettingReport(evaluation=report, training_task=trained)


def _suite(tasks: Sequence[str], training_task: str | None, tuned: str) -> tuple[list[str], str | None, str | None]:
    """``(suite names, training task as given or recorded, its name)``, refused when the suite is empty or holds the
    training task: read from the names and the tuned model's record alone, before any model is loaded."""
    suite = [get_task(t).name for t in tasks]
    if training_task == RECORDED:
        from es_lightning.analysis.checkpoints import recorded_task, trained_with

        training_task = recorded_task(trained_with(tuned))
    trained = get_task(training_task).name if training_task else None
    if trained in suite:
        others = [t for t, name in zip(tasks, suite) if name != trained]
        suggested = others or [t for t in DEFAULT_SUITE if t != trained] or ["countdown"]
        tasks_given = spoken(f"--tasks {' '.join(map(str, suggested))}", f"tasks={list(suggested)!r}")
        fix = tasks_given if others else f"other tasks, e.g. {tasks_given}"
        raise ValueError(
            f"the held-out suite {suite} contains the training task {trained!r}; forgetting is measured on other tasks: "
            f"give {fix} (the training task is added as a reference row by "
            f"{spoken('--training_task', 'training_task=')})"
        )
    if not suite:
        raise ValueError("the held-out suite is empty; name tasks other than the training task, e.g. "
                         + spoken("--tasks addition sort", "tasks=['addition', 'sort']"))
    return suite, training_task, trained


def forgetting_command(
    tuned: str,
    base: str | None = None,
    tasks: list[str] = list(DEFAULT_SUITE),  # noqa: B006,B008
    training_task: str | None = RECORDED,
    eval: EvalSettings = PAPER_EVAL,
    dtype: str | None = None,
    out_dir: str = "forgetting",
    plot: bool = True,
    progress: bool = True,
) -> ForgettingReport:
    """Forgetting: Pass@k change (tuned − base) on held-out tasks other than the training task.

    Args:
        tuned: the tuned model: a .ckpt of an es-lightning run, an exported HF directory, a hub id or builtin:<name>.
        base: the model it started from (default: a .ckpt's 'model' hyperparameter, or the model the config.yaml of
            a run's export/ names).
        tasks: the held-out suite (default: the built-in procedural addition and sort).
        training_task: the task it was trained on, evaluated as a reference row (null to skip); default: the task the
            checkpoint (or a run's export/) records, else countdown (``auto``).
        eval: how both models are evaluated (the same problems and seeds for both); --eval.source gives the training
            task's problems (a data file, the hub), the suite's stay procedural.
        dtype: parameter dtype of both models (default: the dtype the tuned model was trained in, as a .ckpt or a run's
            export/ records it; else float32).
        out_dir: where forgetting.json and forgetting.png go.
        plot: write forgetting.png.
        progress: show a progress bar.
    """
    check_out_dir(out_dir)  # before any model loads or fit runs
    from es_lightning.analysis.checkpoints import load_model, trained_with
    from es_lightning.analysis.drift import _base_of, recorded_base, warn_about_base
    from es_lightning.analysis.plots import plot_forgetting
    from es_lightning.analysis.runs import now_doing, now_writing, stopping_on_signals

    start = time.perf_counter()
    out = Path(out_dir)
    # a SIGTERM or SLURM's requeue signal while loading, evaluating or writing: one line, 143 / 138
    with stopping_on_signals(f"nothing was written to {out} (forgetting.json comes once both models are evaluated)",
                             less="fewer tasks or problems"):
        training_task = _suite(tasks, training_task, tuned)[1]  # a suite holding the training task: refused before loading
        # both models in the dtype the tuned one was trained in (a run's export/ records it in its config.yaml): loaded
        # here, the tuned model is evaluated as it is, so it must not be float32 while the base is loaded in bf16
        recorded = None if dtype else trained_with(tuned).dtype
        if recorded:
            dtype = recorded
            print(f"both models in {dtype}, as {tuned} was trained ({spoken('--dtype', 'dtype=')} to choose)")
        now_doing(f"loading {tuned}")
        tuned_model = load_model(tuned, dtype=dtype, trust_remote_code=eval.trust_remote_code, remote_code_option=remote_code_option(),
                                 model_option=spoken("--tuned", "tuned="))
        base = base or _base_of(tuned_model, "forgetting")
        warn_about_base(tuned, base, recorded_base(tuned_model))
        report = forgetting(base, tuned_model, tasks=tasks, training_task=training_task, settings=eval, dtype=dtype,
                            progress=progress, model_options=[spoken("--base", "base="), spoken("--tuned", "tuned=")])
        report.evaluation.sources = {"base": base, "tuned": tuned}
        now_writing(out, ["forgetting.json", *(["forgetting.png"] if plot else [])])
        print(f"forgetting of {tuned} (base {base}): {eval.num_problems} held-out problems/task, n={eval.num_samples}, "
              f"T={eval.temperature} ({time.perf_counter() - start:.0f}s)")
        print(report.table())
        written = [write_json(out / "forgetting.json", report.to_json())]
        if plot:
            written.append(plot_forgetting(report.changes, sorted({1, max(report.ks)}), out / "forgetting.png"))
    print("wrote " + ", ".join(map(str, written)))
    return report
