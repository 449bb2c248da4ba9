"""Base / GRPO / ES / GRPO→ES / ES→GRPO on the built-in model: the miniature of Ba et al. 2026, Tables 2–3.

To run (``make compare``; about 25 minutes on 2 CPU cores for 2 seeds)::

    es-lightning analyze compare --seeds [0,1]
    es-lightning analyze compare --seeds [0] --steps 40 --eval.num_problems 50      # a quick look

Every method gets the same number of updates (``steps``; the sequential ones switch at ``steps // 2``, Ba et al.
§3.2's 50/50 split), each fit is the recipe a user would run (``recipes/grpo.yaml``, ``es.yaml``, ``grpo_es.yaml``,
``es_grpo.yaml``) parsed by the same :class:`~es_lightning.lightning_cli.ESLightningCLI` as ``es-lightning fit``, with the seeds
of the model, the data order and Lightning set to each seed. The recipes' own evaluation callbacks are dropped; all
final models — and the base model — are then evaluated on the *same* held-out problems with the *same* sampling seeds
(a prototype found the Pass@16 of one model moves by up to 0.07 between a 100×16 and a 200×32 evaluation, so rows
evaluated differently are not comparable): Pass@1/4/16, mean token entropy, and the number of distinct correct answers
per problem (distinct solutions in the task's normal form — coverage in kind, not only in count).

The claims the table is checked against (issue 5; Ba et al. §3): GRPO lowers entropy to at most half the base's, lowers
Pass@16 and raises Pass@1; ES keeps Pass@1 at least the base's, Pass@16 within 0.05 and entropy at least 0.9× the
base's; GRPO→ES has Pass@1 above the base's and Pass@16 above GRPO's. Each is printed as held / not held per seed.

"ES low-rank" (``recipes/es_lowrank.yaml``, EGGROLL's low-rank noise with a larger population and more prompts per
step at about ``es.yaml``'s cost) is checked against issue 14's aim for ES: at least half of GRPO's Pass@1 gain with
Pass@16 at least the base's − 0.02. Each fit's updates and training wall-clock (``train_s``: Lightning's
:class:`~lightning.pytorch.callbacks.Timer`, first update to last, so model loading is not counted) are recorded
beside its metrics, so the table also says what each row cost (``fit_s``, the whole ``Trainer.fit`` call, is in
``compare.json``).

``budget="time"`` (``--budget time``) compares at equal wall-clock instead — what a user with one GPU-hour asks: the
first method (GRPO by default) makes its ``steps`` updates, and every other method of that seed then trains for as
long as it did — Lightning's ``Timer(duration=...)``, the mechanism of ``Trainer(max_time=...)``, checked after every
update, so a row may pass the budget by at most one update (its ``train s`` says by how much). Issue 14's aim is then
checked for every ES method (ES, ES low-rank). Only single-algorithm methods take part: the sequential ones switch at
a step, and a time budget gives no step to switch at.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from es_lightning.analysis.output import check_out_dir, format_table, markdown_table, write_json
from es_lightning.analysis.settings import COMPARE_EVAL, EvalSettings
from es_lightning.cli_errors import spoken

#: method label → recipe file (relative to ``recipes_dir``)
METHODS = {"GRPO": "grpo.yaml", "ES": "es.yaml", "GRPO→ES": "grpo_es.yaml", "ES→GRPO": "es_grpo.yaml",
           "ES low-rank": "es_lowrank.yaml"}
COLUMNS = ("pass@1", "pass@4", "pass@16", "entropy", "distinct_correct")
BUDGETS = ("updates", "time")
#: the methods an ES aim is checked for: all of them under a time budget, the low-rank recipe under an update budget
ES_METHODS = ("ES", "ES low-rank")
SEQUENTIAL = ("GRPO→ES", "ES→GRPO")


@dataclass
class CompareReport:
    """``results[seed][method]`` = evaluation metrics; ``base`` = the base model's (the same for every seed)."""

    base: dict[str, float]
    results: dict[int, dict[str, dict[str, float]]]
    settings: dict[str, Any] = field(default_factory=dict)

    def mean(self) -> dict[str, dict[str, float]]:
        methods = next(iter(self.results.values())).keys()
        return {m: {c: sum(r[m][c] for r in self.results.values()) / len(self.results) for c in COLUMNS} for m in methods}

    def _rows(self) -> list[list[Any]]:
        rows = [["base", "-", *(self.base[c] for c in COLUMNS), "-", "-"]]
        for seed, per_method in self.results.items():
            rows += [[m, str(seed), *(r[c] for c in COLUMNS), _updates(r), _seconds(r)] for m, r in per_method.items()]
        if len(self.results) > 1:
            rows += [[m, "mean", *(r[c] for c in COLUMNS), "-", "-"] for m, r in self.mean().items()]
        return rows

    def table(self, markdown: bool = False) -> str:
        headers = ["method", "seed", "Pass@1", "Pass@4", "Pass@16", "entropy", "distinct correct", "updates", "train s"]
        return (markdown_table if markdown else format_table)(headers, self._rows())

    def claims(self) -> list[tuple[str, int, bool, str]]:
        """(claim, seed, held, the numbers) for every claim of the module docstring and every seed."""
        b = self.base
        out = []
        for seed, r in self.results.items():
            g, e, ge = r.get("GRPO"), r.get("ES"), r.get("GRPO→ES")
            if g:
                out.append(("GRPO: entropy <= 0.5 x base", seed, g["entropy"] <= 0.5 * b["entropy"],
                            f"{g['entropy']:.3f} vs {0.5 * b['entropy']:.3f}"))
                out.append(("GRPO: Pass@16 < base", seed, g["pass@16"] < b["pass@16"], f"{g['pass@16']:.3f} vs {b['pass@16']:.3f}"))
                out.append(("GRPO: Pass@1 > base", seed, g["pass@1"] > b["pass@1"], f"{g['pass@1']:.3f} vs {b['pass@1']:.3f}"))
            if e:
                out.append(("ES: Pass@1 >= base", seed, e["pass@1"] >= b["pass@1"], f"{e['pass@1']:.3f} vs {b['pass@1']:.3f}"))
                out.append(("ES: |Pass@16 - base| <= 0.05", seed, abs(e["pass@16"] - b["pass@16"]) <= 0.05,
                            f"{e['pass@16']:.3f} vs {b['pass@16']:.3f}"))
                out.append(("ES: entropy >= 0.9 x base", seed, e["entropy"] >= 0.9 * b["entropy"],
                            f"{e['entropy']:.3f} vs {0.9 * b['entropy']:.3f}"))
            if ge:
                out.append(("GRPO→ES: Pass@1 > base", seed, ge["pass@1"] > b["pass@1"], f"{ge['pass@1']:.3f} vs {b['pass@1']:.3f}"))
                if g:
                    out.append(("GRPO→ES: Pass@16 > GRPO's", seed, ge["pass@16"] > g["pass@16"],
                                f"{ge['pass@16']:.3f} vs {g['pass@16']:.3f}"))
            timed = self.settings.get("budget") == "time"
            for name in ES_METHODS if timed else ("ES low-rank",):  # issue 14's aim
                m = r.get(name)
                if not m:
                    continue
                at = " at equal time" if timed else ""
                out.append((f"{name}: Pass@16 >= base - 0.02{at}", seed, m["pass@16"] >= b["pass@16"] - 0.02,
                            f"{m['pass@16']:.3f} vs {b['pass@16'] - 0.02:.3f}"))
                if g:
                    half = b["pass@1"] + 0.5 * (g["pass@1"] - b["pass@1"])
                    out.append((f"{name}: Pass@1 gain >= 0.5 x GRPO's{at}", seed, m["pass@1"] >= half,
                                f"{m['pass@1']:.3f} vs {half:.3f}"))
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "settings": self.settings, "base": self.base, "results": {str(s): r for s, r in self.results.items()},
            "mean": self.mean(),
            "claims": [{"claim": c, "seed": s, "held": h, "values": v} for c, s, h, v in self.claims()],
        }


#: a time-budgeted fit's update cap: far beyond what any budget reaches, so the clock is what stops it
TIME_BUDGET_MAX_STEPS = 10**7


def _fit(config: Path, seed: int, steps: int, root: Path, overrides: Sequence[str] = (), seconds: float | None = None,
         run: str = "", finished: Sequence[str] = (), kept: str = "nothing was written"):
    """One recipe fit with every seed set to ``seed``: ``steps`` updates, or — ``seconds`` given — until its training
    wall-clock reaches ``seconds`` (checked after each update). Returns the trained module, its data module, its updates and
    its training seconds (Lightning's ``Timer``: from the first update's start to the last one's end). ``run``,
    ``finished``, ``kept``: what :func:`~es_lightning.analysis.runs.fit_run` says when a signal stops the fit."""
    from lightning.pytorch.callbacks import Timer

    from es_lightning.analysis.runs import fit_run, recipe_cli
    from es_lightning.callbacks import SequentialStrategy

    seeds = ["--seed_everything", str(seed), "--model.init_args.seed", str(seed), "--data.init_args.seed", str(seed)]
    cap = steps if seconds is None else TIME_BUDGET_MAX_STEPS
    cli = recipe_cli(config, cap, root, [*seeds, *overrides], progress_bar=True)
    trainer = cli.trainer
    for cb in trainer.callbacks:
        if isinstance(cb, SequentialStrategy):
            cb.switch_step = steps // 2  # the 50/50 split of this comparison's budget
    timer = Timer(duration=None if seconds is None else timedelta(seconds=seconds), interval="step", verbose=False)
    trainer.callbacks.append(timer)
    fit_run(trainer, cli.model, cli.datamodule, run or f"{config.name}, seed {seed}", finished, kept)
    if seconds is None and trainer.global_step != steps:
        raise RuntimeError(f"{config.name} (seed {seed}) stopped after {trainer.global_step} of {steps} updates")
    if seconds is not None and not trainer.global_step:
        raise RuntimeError(f"{config.name} (seed {seed}) made no update in {seconds:.1f} s")
    return cli.model, cli.datamodule, trainer.global_step, timer.time_elapsed("train")


def compare_methods(
    seeds: Sequence[int] = (0, 1),
    steps: int = 120,
    methods: Sequence[str] = tuple(METHODS),
    recipes_dir: str | Path = "recipes",
    settings: EvalSettings = COMPARE_EVAL,
    out_dir: str | Path = "compare",
    overrides: Sequence[str] | str = (),
    budget: str = "updates",
    method_overrides: Mapping[str, Sequence[str] | str] | None = None,
) -> CompareReport:
    """Fit every method for every seed and evaluate everything the same way (see the module docstring).
    ``method_overrides``: further fit arguments for one method's fits, after ``overrides``."""
    from es_lightning.analysis.evaluate import evaluate_policy, heldout_of, recipe_heldout, warn_trained_problems
    from es_lightning.analysis.runs import fit_args, naming_the_fit_model, now_doing
    from es_lightning.policy import load_policy

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {list(METHODS)}")
    if not methods or not seeds:
        raise ValueError(f"compare needs at least one method and one seed, got methods {list(methods)} and seeds "
                         f"{list(seeds)}; e.g. "
                         + spoken('--methods "[GRPO, ES]" --seeds "[0]"', "methods=['GRPO', 'ES'], seeds=[0]"))
    overrides = fit_args(overrides)  # one string: split as a shell splits it
    method_overrides = {m: fit_args(args, "--method_overrides") for m, args in (method_overrides or {}).items()}
    stray = [m for m in method_overrides if m not in methods]
    if stray:
        raise ValueError(f"method_overrides names {stray}, which this comparison does not fit; its methods are "
                         f"{list(methods)}")
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {list(BUDGETS)}, got {budget!r}")
    sequential = [m for m in methods if m in SEQUENTIAL]
    if budget == "time" and sequential:
        kept = [m for m in methods if m not in SEQUENTIAL]
        raise ValueError(f"budget 'time' has no step at which {sequential} could switch; leave them out: "
                         + spoken(f"--methods [{', '.join(kept)}]", f"methods={kept!r}"))
    if budget == "time" and len(methods) < 2:
        raise ValueError(f"budget 'time' gives the first method's training time to the others; name at least two "
                         f"methods, got {list(methods)}")
    if steps < (1 if budget == "time" else 2):
        raise ValueError(f"steps must be >= 2 (the sequential methods switch at steps // 2), got {steps}"
                         if budget == "updates" else f"steps must be >= 1, got {steps}")
    if settings.num_samples < 16:
        raise ValueError(f"eval.num_samples must be >= 16 for Pass@16, got {settings.num_samples}")
    settings = replace(settings, ks=settings.pass_at_ks(default=[1, 4, 16]))
    if not {1, 4, 16} <= set(settings.ks):
        raise ValueError(f"eval.ks must include 1, 4 and 16 (the table's columns), got {settings.ks}")
    settings.completion_cap()
    recipes = {m: Path(recipes_dir) / METHODS[m] for m in methods}
    missing = [str(p) for p in recipes.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"recipes not found: {missing}; run from the repository root or pass "
                                f"{spoken('--recipes_dir', 'recipes_dir=')}")
    out = Path(out_dir)
    problems = task = base_model = base_dtype = None
    base: dict[str, float] = {}
    results: dict[int, dict[str, dict[str, float]]] = {}

    def evaluate(policy, trust_remote_code: bool) -> dict[str, float]:  # a vLLM engine builds the model as loaded
        return evaluate_policy(policy, task, problems, replace(settings, trust_remote_code=trust_remote_code))

    finished: list[str] = []  # "method, seed s" of every fit done: a signal's line names them
    kept = f"nothing was written to {out} (compare.json and compare.md come once every run is done)"
    # the held-out problems before any fit, from the first fit's task read off its recipe: a missing --eval.source or
    # one without the task's columns is refused now, not after the first fit's minutes of training
    now_doing("preparing the held-out problems", finished, kept)
    first = next(iter(recipes))
    drawn = recipe_heldout(recipes[first], [*overrides, *method_overrides.get(first, ())], settings)
    if drawn is not None:
        task, problems = drawn
    for seed in seeds:
        results[int(seed)] = {}
        pace = None  # budget "time": the first method's training seconds on this seed
        for method, recipe in recipes.items():
            run = f"{method}, seed {seed}"
            now_doing(f"setting up the fit of {run}", finished, kept)  # what a signal between fits cuts
            start = time.perf_counter()
            # a hub model that cannot be loaded: the way out names the option that gave it, or the recipe's key
            given = {"--overrides": list(overrides), "--method_overrides": method_overrides.get(method, [])}
            with naming_the_fit_model(recipe, given):
                module, fit_data, updates, train_s = _fit(recipe, int(seed), steps, out / f"seed{seed}" / recipe.stem,
                                                          [*overrides, *method_overrides.get(method, ())],
                                                          seconds=pace, run=run, finished=finished, kept=kept)
            fit_s = time.perf_counter() - start
            if budget == "time" and pace is None:
                pace = train_s
            own_code = settings.trust_remote_code or module.trust_remote_code  # as the fit loaded it
            if problems is None:  # a data module of no task before its fit (none of es-lightning's)
                now_doing("preparing the held-out problems", finished, kept)
                task, problems = heldout_of(fit_data.task, settings)
            if base_model is None:
                base_model = module.model_name
                now_doing(f"evaluating the base model ({base_model})", finished, kept)
                # in the fits' dtype (bf16 for a Qwen recipe), attention and revision: the rows differ by weights alone
                base_policy = load_policy(base_model, **{**module.policy_load_options(), "trust_remote_code": own_code})
                base_dtype = str(base_policy.model.dtype).removeprefix("torch.")
                base = evaluate(base_policy, own_code)
                del base_policy
                print(f"base ({base_model}, {base_dtype}): " + _summary(base), flush=True)
            if settings.source != "procedural":  # a recipe's own data file: past its test rows, training rows
                warn_trained_problems(task, problems, fit_data.splits["train"], settings.source,
                                      f"{run} (data.source {fit_data.source!r})")
            now_doing(f"evaluating {run}", finished, kept)
            results[int(seed)][method] = {**evaluate(module.policy, own_code), "updates": updates, "train_s": round(train_s, 1),
                                          "fit_s": round(fit_s, 1)}
            print(f"seed {seed} {method}: " + _summary(results[int(seed)][method])
                  + f" ({time.perf_counter() - start:.0f}s)", flush=True)
            finished.append(run)
            now_doing(f"releasing the model of {run}", finished, kept)
            del module
            gc.collect()
    run_settings = dict(seeds=list(seeds), steps=steps, budget=budget, overrides=list(overrides),
                        method_overrides=method_overrides, methods=list(methods),
                        recipes={m: str(p) for m, p in recipes.items()}, task=task.name, eval=asdict(settings),
                        base_model=base_model, base_dtype=base_dtype)
    return CompareReport(base=base, results=results, settings=run_settings)


def _updates(metrics: dict[str, float]) -> str:
    return str(metrics["updates"]) if "updates" in metrics else "-"


def _seconds(metrics: dict[str, float]) -> str:
    return f"{metrics['train_s']:.1f}" if "train_s" in metrics else "-"


def _summary(metrics: dict[str, float]) -> str:
    return ", ".join(f"{c} {metrics[c]:.3f}" for c in COLUMNS)


def compare_command(
    seeds: list[int] = [0, 1],  # noqa: B006
    steps: int = 120,
    methods: list[str] = list(METHODS),  # noqa: B006
    recipes_dir: str = "recipes",
    eval: EvalSettings = COMPARE_EVAL,
    out_dir: str = "compare",
    overrides: list[str] | str = [],  # noqa: B006
    budget: str = "updates",
    method_overrides: dict[str, list[str] | str] = {},  # noqa: B006
) -> CompareReport:
    """Base / GRPO / ES / GRPO→ES / ES→GRPO / ES low-rank with the same budget of updates or time, evaluated alike (Ba et al. Tables 2–3).

    Args:
        seeds: one fit of every method per seed (model, data order and Lightning seeds).
        steps: updates per method; the sequential methods switch at steps // 2. With budget time: the first
            method's updates, whose training time the others get.
        methods: any of GRPO, ES, GRPO→ES, ES→GRPO, ES low-rank.
        recipes_dir: where grpo.yaml, es.yaml, grpo_es.yaml, es_grpo.yaml and es_lowrank.yaml are.
        eval: the evaluation of the base model and of every fit, the same for every row (defaults: 200 problems,
            n = 32 at T = 1 — the built-in model's temperature —, 24 new tokens, seed 1234; n >= 16, ks include 1, 4, 16).
        out_dir: where compare.json and compare.md go.
        overrides: further `es-lightning fit` arguments for every fit, a list, e.g. [--data.init_args.batch_size, "32"],
            or one string split as a shell splits it, e.g. "--data.init_args.batch_size 32".
        budget: "updates" (every method makes `steps` updates) or "time" (the first method makes `steps` updates
            and every other one trains for as long on the same seed; only GRPO, ES and ES low-rank).
        method_overrides: further `es-lightning fit` arguments for one method, after overrides, e.g.
            '{"ES": [--model.init_args.population_size, "16"]}' (or its one string, '{"ES": "--model.init_args.population_size 16"}').
    """
    from es_lightning.analysis.runs import now_writing, stopping_on_signals

    check_out_dir(out_dir)  # before any model loads or fit runs
    start = time.perf_counter()
    out = Path(out_dir)
    with stopping_on_signals():  # a SIGTERM or SLURM's requeue signal outside the fits, too: one line, 143 / 138
        report = compare_methods(seeds=seeds, steps=steps, methods=methods, recipes_dir=recipes_dir, settings=eval,
                                 out_dir=out_dir, overrides=overrides, budget=budget, method_overrides=method_overrides)
        now_writing(out, ["compare.json", "compare.md"], finished=["every run"])
        each = (f"{steps} updates per method" if budget == "updates"
                else f"every method trained for {methods[0]}'s time of {steps} updates")
        print(f"\n{len(report.results)} seed(s), {each}, evaluated on {eval.num_problems} held-out "
              f"problems x {eval.num_samples} samples at T={eval.temperature} ({time.perf_counter() - start:.0f}s)")
        print(report.table())
        print()
        for claim, seed, held, values in report.claims():
            print(f"  [{'held' if held else 'NOT held'}] seed {seed}: {claim} ({values})")
        write_json(out / "compare.json", report.to_json())
        (out / "compare.md").write_text(report.table(markdown=True) + "\n")
    print(f"wrote {out / 'compare.json'}, {out / 'compare.md'}")
    return report
