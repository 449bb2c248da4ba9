"""Population-size sweep: ES with N ∈ {8, 16, 32, 64} for a fixed number of updates (Ba et al. 2026, Table 6).

To run (the built-in setting, ~10 minutes on one CPU core)::

    es-lightning analyze sweep --recipe recipes/es.yaml --populations 8 16 32 64 --steps 10

Each N is one ``fit`` of the ES recipe — parsed by the same :class:`~es_lightning.lightning_cli.ESLightningCLI` as
``es-lightning fit --config …``, with ``population_size`` and ``max_steps`` overridden — run in this process, one after
the other, from the same base weights, seed and prompts. The recipe's own evaluation callbacks are dropped (no
mid-run evaluations, no validation); instead the final weights of every run are evaluated on the same held-out
problems with the same seeds. The table: the mean training reward over the last ``reward_window`` updates and held-out
Pass@1/Pass@K at the end, against N; the base model's scores are the first row.

Larger N spends N forward passes per update for a less noisy update direction, so at a fixed number of updates it
should reach a higher reward; Ba et al. find the gain saturating around N = 32.
"""

from __future__ import annotations

import functools
import gc
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import lightning as L

from es_lightning.analysis.output import check_out_dir, format_table, write_json
from es_lightning.analysis.settings import SWEEP_EVAL, EvalSettings
from es_lightning.cli_errors import spoken
from es_lightning.policy import save_model, save_tokenizer

DEFAULT_POPULATIONS = (8, 16, 32, 64)


class _RewardRecorder(L.Callback):
    """The logged ``train/reward_mean`` of every update."""

    def __init__(self) -> None:
        self.rewards: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        value = trainer.callback_metrics.get("train/reward_mean")
        if value is not None:
            self.rewards.append(float(value))


@dataclass
class SweepReport:
    """One row per population size (``rows[0]`` is the base model, N = 0), measured with ``settings``."""

    rows: list[dict[str, Any]]
    ks: list[int]
    settings: dict[str, Any] = field(default_factory=dict)

    def table(self) -> str:
        headers = ["N", "updates", "reward", *(f"pass@{k}" for k in self.ks), "entropy", "s/update"]
        body = [
            ["base" if r["population_size"] == 0 else r["population_size"], r["steps"], r["reward"],
             *(r[f"pass@{k}"] for k in self.ks), r["entropy"], r["seconds_per_update"]]
            for r in self.rows
        ]
        return format_table(headers, body)

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings, "ks": self.ks, "rows": self.rows}


def population_sweep(
    recipe: str = "recipes/es.yaml",
    populations: Sequence[int] = DEFAULT_POPULATIONS,
    steps: int = 10,
    batch_size: int | None = None,
    overrides: Sequence[str] | str = (),
    settings: EvalSettings = SWEEP_EVAL,
    reward_window: int = 3,
    out_dir: str | Path = "sweep",
    save_models: bool = False,
) -> SweepReport:
    """Fit the ES recipe once per population size and evaluate every result the same way (see the module docstring)."""
    from es_lightning.analysis.evaluate import evaluate_policy, heldout_of, recipe_heldout, warn_trained_problems
    from es_lightning.analysis.runs import fit_args, fit_run, naming_the_fit_model, now_doing, recipe_cli

    if not Path(recipe).is_file():
        raise FileNotFoundError(
            f"ES recipe {recipe!r} not found; run from the repository root (recipes/es.yaml) or pass "
            + spoken("--recipe path/to/es.yaml", "recipe='path/to/es.yaml'")
        )
    _check_es_recipe(recipe)
    overrides = fit_args(overrides)  # one string: split as a shell splits it
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (prompts per ES step), got {batch_size}")
    sizes = [int(n) for n in populations]
    if not sizes or min(sizes) < 2:
        raise ValueError(f"population sizes must be >= 2 (rewards are normalised across members), got {list(populations)}")
    if steps < 1:
        raise ValueError(f"steps must be >= 1 (ES updates per run), got {steps}")
    if reward_window < 1:
        raise ValueError(f"reward_window must be >= 1, got {reward_window}")
    settings = replace(settings, ks=settings.pass_at_ks(default=[1, settings.num_samples]))
    out = Path(out_dir)
    rows: list[dict[str, Any]] = []
    problems = task = None

    def kept(done: list[str], saving: str | None = None) -> str:  # what is on disk, for a signal's line
        models = f"the models of {', '.join(done)} are in {out / 'models'}" if save_models and done else ""
        if saving is not None:
            models = f"{models}, {saving} may be incomplete" if models else f"{saving} may be incomplete"
        return (f"{models}, nothing else was written" if models else f"nothing was written to {out}") + \
            " (sweep.json comes once every run is done)"

    def args_of(n: int) -> list[str]:
        args = ["--model.init_args.population_size", str(n)]
        if batch_size is not None:
            args += ["--data.init_args.batch_size", str(batch_size)]
        return [*args, *overrides]

    # the held-out problems before any model is built, from the task read off the recipe: a missing --eval.source or
    # one without the task's columns is refused now, not after the base model has loaded
    now_doing("preparing the held-out problems", [], kept([]))
    drawn = recipe_heldout(recipe, args_of(sizes[0]), settings)
    if drawn is not None:
        task, problems = drawn
    # a hub model that cannot be loaded: the way out names the option that gave it (--overrides), or the recipe's key
    with naming_the_fit_model(recipe, {"--overrides": list(overrides)}):
        for n in sizes:
            done = [f"N={r['population_size']}" for r in rows[1:]]
            now_doing(f"setting up the fit of N={n}", done, kept(done))  # what a signal between fits cuts
            cli = recipe_cli(recipe, steps, out / f"N{n}", args_of(n))
            module, trainer = cli.model, cli.trainer
            if getattr(getattr(module, "algorithm", None), "name", None) != "es":
                raise ValueError(f"{recipe!r} configures {type(module).__name__}, not an ES module with a population_size")
            recorder = _RewardRecorder()
            trainer.callbacks.append(recorder)
            cli.datamodule.setup("fit")
            if problems is None:  # a data module of no task before its fit (none of es-lightning's)
                now_doing("preparing the held-out problems", done, kept(done))
                task, problems = heldout_of(cli.datamodule.task, settings)
            if not rows:  # the first fit, once: same problems and seeds for every row
                if settings.source != "procedural":  # the recipe's own data file: past its test rows, training rows
                    warn_trained_problems(task, problems, cli.datamodule.splits["train"], settings.source,
                                          f"the fits of {recipe} (data.source {cli.datamodule.source!r})")
                if settings.max_new_tokens is None:  # the recipe's own cap
                    settings = replace(settings, max_new_tokens=module.sampling.max_new_tokens)
            own_code = replace(settings, trust_remote_code=True) if module.trust_remote_code else settings  # vLLM's too
            evaluate = functools.partial(evaluate_policy, module.policy, task, problems, own_code)
            if not rows:
                now_doing("evaluating the base model", done, kept(done))
                rows.append({"population_size": 0, "steps": 0, "reward": float("nan"), "seconds_per_update": float("nan"),
                             "rewards": [], **evaluate()})
            start = time.perf_counter()
            fit_run(trainer, module, cli.datamodule, f"N={n}", done, kept(done))
            seconds = time.perf_counter() - start
            if trainer.global_step != steps:
                raise RuntimeError(f"N={n}: the fit stopped after {trainer.global_step} of {steps} updates")
            now_doing(f"evaluating N={n}", done, kept(done))
            rewards = recorder.rewards
            row = {"population_size": n, "steps": trainer.global_step,
                   "reward": sum(rewards[-reward_window:]) / len(rewards[-reward_window:]),
                   "seconds_per_update": seconds / steps, "rewards": rewards, **evaluate()}
            if save_models:
                row["path"] = str(out / "models" / f"N{n}")
                now_doing(f"saving the model of N={n}", done, kept(done, row["path"]))
                save_model(module.policy.model, row["path"])  # torch_dtype too: transformers 4 read a bf16 model as fp32
                save_tokenizer(module.policy.tokenizer, row["path"])
            rows.append(row)
            print(f"N={n}: reward {row['reward']:.3f}, pass@1 {row['pass@1']:.3f} ({seconds:.0f}s)", flush=True)
            now_doing(f"releasing the model of N={n}", [*done, f"N={n}"], kept([*done, f"N={n}"]))
            del cli, module, trainer
            gc.collect()
    for row in rows:
        row["base_pass@1"] = rows[0]["pass@1"]
    run_settings = dict(recipe=recipe, steps=steps, batch_size=batch_size, overrides=list(overrides), task=task.name,
                        reward_window=reward_window, eval=asdict(settings))
    return SweepReport(rows=rows, ks=settings.ks, settings=run_settings)


def _check_es_recipe(recipe: str | Path) -> None:
    """Refuse, before any fit, a recipe whose model is a GRPO module: the sweep varies an ES population."""
    import importlib

    import yaml

    from es_lightning.modules.grpo import GRPOModule

    try:
        model = (yaml.safe_load(Path(recipe).read_text()) or {}).get("model") or {}
        path = str(model.get("class_path", "")) if isinstance(model, dict) else ""
        module, _, name = path.rpartition(".")
        cls = getattr(importlib.import_module(module or "es_lightning"), name)
    except Exception:  # not readable here: the fit itself says what is wrong
        return
    if isinstance(cls, type) and issubclass(cls, GRPOModule):
        raise ValueError(f"{str(recipe)!r} configures {cls.__name__}; the sweep varies an ES population, so pass an ES "
                         "recipe (recipes/es.yaml, recipes/es_lowrank.yaml)")


def sweep_command(
    recipe: str = "recipes/es.yaml",
    populations: list[int] = list(DEFAULT_POPULATIONS),  # noqa: B006
    steps: int = 10,
    batch_size: int | None = None,
    overrides: list[str] | str = [],  # noqa: B006
    eval: EvalSettings = SWEEP_EVAL,
    reward_window: int = 3,
    out_dir: str = "sweep",
    save_models: bool = False,
    plot: bool = True,
) -> SweepReport:
    """Population-size sweep: ES with each N for a fixed number of updates; final reward and Pass@1 (Ba et al. Table 6).

    Args:
        recipe: the ES recipe every run starts from (its model, data, sigma, lr, seed).
        populations: the population sizes N to compare.
        steps: ES updates per run (the same for every N).
        batch_size: prompts per update (default: the recipe's).
        overrides: further `es-lightning fit` arguments for every run, a list, e.g. [--model.init_args.sigma, "0.01"],
            or one string split as a shell splits it, e.g. "--model.init_args.sigma 0.01".
        eval: the final evaluation of the base model and of every run (defaults: n = 16 at T = 1, ks 1 and n, the
            recipe's max_new_tokens).
        reward_window: the reward column is the mean training reward of the last this many updates.
        out_dir: where sweep.json, sweep.png (and with save_models the final models) go.
        save_models: write each run's final model (save_pretrained, both dtype keys) under out_dir/models/N<n>.
        plot: write sweep.png.
    """
    check_out_dir(out_dir)  # before any model loads or fit runs
    from es_lightning.analysis.plots import plot_sweep
    from es_lightning.analysis.runs import now_writing, stopping_on_signals

    start = time.perf_counter()
    out = Path(out_dir)
    with stopping_on_signals():  # a SIGTERM or SLURM's requeue signal outside the fits, too: one line, 143 / 138
        report = population_sweep(recipe=recipe, populations=populations, steps=steps, batch_size=batch_size,
                                  overrides=overrides, settings=eval, reward_window=reward_window, out_dir=out_dir,
                                  save_models=save_models)
        now_writing(out, ["sweep.json", *(["sweep.png"] if plot else [])],
                    f"the models are in {out / 'models'}" if save_models else None, ["every run"])
        print(f"\npopulation sweep: {recipe}, {steps} updates per run, final evaluation on {eval.num_problems} held-out "
              f"problems, n={eval.num_samples}, T={eval.temperature} ({time.perf_counter() - start:.0f}s)")
        print(report.table())
        written = [write_json(out / "sweep.json", report.to_json())]
        if plot:
            written.append(plot_sweep(report.rows[1:], out / "sweep.png", k=max(report.ks)))
    print("wrote " + ", ".join(map(str, written)))
    return report
