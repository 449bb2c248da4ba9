"""``es-lightning eval``: Pass@k curves, Maj@k and token entropy of one or more models on one or more tasks.

To run::

    es-lightning eval --checkpoints builtin:countdown-tiny runs/grpo/last.ckpt runs/es/last.ckpt --tasks countdown
    es-lightning eval --checkpoints Qwen/Qwen2.5-1.5B-Instruct --tasks countdown --eval.max_new_tokens 1024 \
        --eval.device cuda

Every model is scored on the *same* held-out problems with the *same* sampling seeds (common random numbers), so
differences between rows come from the weights. The settings (:class:`~es_lightning.analysis.settings.EvalSettings`,
shared by every analysis) default to Ba et al. 2026's evaluation (§3: n = 32 samples per problem at T = 0.6, Pass@k for
k = 1, 2, 4, …, n by the unbiased estimator of Chen et al. 2021). The sampling and
scoring are :meth:`PassAtKCallback.evaluate_examples <es_lightning.callbacks.PassAtKCallback.evaluate_examples>` —
the very code that measures Pass@K during training — on a :class:`~es_lightning.modules.base.ReasoningModule` around
the loaded policy.

Output: a table on the terminal, ``eval.json``, ``eval.md`` and ``pass_at_k.png`` (one panel per task, one line per
model) in ``--out_dir``.
"""

from __future__ import annotations

import copy
import gc
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from es_lightning.analysis.checkpoints import LoadedModel, TrainedWith, check_model_spec, load_model, trained_with
from es_lightning.analysis.output import check_out_dir, format_table, markdown_table, write_json
from es_lightning.analysis.settings import PAPER_EVAL, EvalSettings, eval_option, remote_code_option, resolve_device
from es_lightning.cli_errors import spoken
from es_lightning.data import DROP_INVALID_HINT, ReasoningDataModule, count_trained, procedural_split
from es_lightning.data_files import HUB_CONFIG_HINT, SOURCE_GIVEN_BY, SOURCE_KINDS
from es_lightning.generation.config import KVCacheTooSmall
from es_lightning.policy import Policy
from es_lightning.tasks import Task, get_task


def heldout_problems(task: Task, num_problems: int, seed: int = 0, source: str = "procedural",
                     column_mapping: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """``num_problems`` evaluation problems of ``task``.

    Procedural tasks draw from the held-out pool (``procedural_split(task, "test", …)``: never in training data nor in
    the built-in model's pretraining); other sources (a hub dataset name, ``hub`` for the task's default, or a local
    file or directory, read as :class:`ReasoningDataModule` reads them) give ``num_problems`` rows of their test split,
    shuffled by ``seed`` — or, when the source has a single split of another name (one ``problems.jsonl``), of that
    one; with several splits and no test split, rows carved off its train split as a fit carves them.
    ``column_mapping`` renames a source's columns to the task's (``--eval.column_mapping``, as ``data.column_mapping``
    in a fit). Mistakes name the evaluation settings (``--eval.num_problems`` in the command, ``EvalSettings(num_problems=...)``
    from a script), not training's.
    """
    if num_problems < 1:
        raise ValueError(f"num_problems must be >= 1, got {num_problems}")
    if source == "procedural":
        try:
            return procedural_split(task, "test", num_problems, seed)
        except (ValueError, NotImplementedError) as err:
            raise _in_eval_terms(err) from None
    try:  # the source read as a fit reads it: its refusals (a glob matching nothing, mixed formats) named in eval terms
        dm = ReasoningDataModule(task, source=source, train_size=None, val_size=None, test_size=num_problems,
                                 seed=seed, column_mapping=column_mapping)
        with SOURCE_GIVEN_BY.given(None):  # the evaluation's own source, even drawn inside an analysis's fit's words
            dsets = dm.load_source()
    except (ValueError, FileNotFoundError, ConnectionError) as err:  # ConnectionError: a hub dataset, offline
        raise _in_eval_terms(err, type(err)) from None
    name = dm.test_split if dm.test_split in dsets else next(iter(dsets)) if len(dsets) == 1 else None
    try:
        if name is None:  # several splits, no test split: held-out rows carved off the train split, as a fit would
            dm.setup("test")
            return DrawnProblems(dm.splits["test"], [dm.source_row("test", i) for i in range(len(dm.splits["test"]))],
                                 f"the {dm.train_split!r} split of {_source_named(source)}")
        # the fit's renames, checks and hints; a script's mapping hint reads "with EvalSettings(column_mapping=...), e.g.
        # column_mapping: {...}" (no flag to quote)
        ds = dm.map_columns(dsets[name], repr(name), spoken("--eval.column_mapping", "") or None)
        if len(ds) < num_problems:
            raise ValueError(f"eval.source {source!r} has {len(ds)} problems in its {name!r} split, fewer than "
                             f"eval.num_problems={num_problems}; lower {eval_option('num_problems')} (e.g. to {len(ds)})")
        return _preprocess_drawn(task, ds, num_problems, seed, name, source)
    except ValueError as err:  # a missing column, a malformed record, too few rows
        raise _in_eval_terms(err) from None


def warn_training_overlap(spec: str, trained: TrainedWith, task: Task, problems: Sequence[dict[str, Any]],
                          source: str) -> None:
    """One warning when some of ``problems`` (of ``task``, from ``--eval.source`` ``source``) are among the training
    problems of the checkpoint ``spec`` (``trained``: what it records): a single-split file is evaluated whole, so the
    very file a fit carved its held-out rows off gives its training rows too. The training rows are rebuilt from the
    checkpoint's data settings (a local source only: the fit's own carving, by ``Task.pool_key``); when they cannot
    be, nothing is said."""
    import warnings

    data = trained.data or {}
    path = str(data.get("source") or "")
    record = data.get("task") or {}
    if source == "procedural" or path in ("", "procedural", "hub") or not Path(os.path.expanduser(path)).exists() or (
            record.get("class_path") != f"{type(task).__module__}.{type(task).__qualname__}"):
        return
    quiet = logging.getLogger("lightning.pytorch.utilities.rank_zero")  # the fit's carving line: not this command's
    level = quiet.level
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quiet.setLevel(logging.WARNING)
            dm = ReasoningDataModule(
                task, source=path, hub_config=data.get("hub_config"), train_split=data.get("train_split", "train"),
                val_split=data.get("val_split") or None, test_split=data.get("test_split") or None,
                column_mapping=data.get("column_mapping"), train_size=data.get("train_size"),
                val_size=data.get("val_size"), test_size=data.get("test_size"), seed=data.get("seed", 0))
            dm.setup()
    except Exception:  # the rows it trained on cannot be rebuilt (a file since changed, rows it dropped): unknown
        return
    finally:
        quiet.setLevel(level)
    warn_trained_problems(task, problems, dm.splits["train"], source, f"{spec} (its data.source {path!r})",
                          " (a test file, or the fit's own held-out rows: es-lightning test --config <its run>/config.yaml "
                          "--ckpt_path <the .ckpt>)")


def warn_trained_problems(task: Task, problems: Sequence[dict[str, Any]], train_examples: Sequence[dict[str, Any]],
                          source: str, whose: str, fix: str = "") -> None:
    """One warning when some of ``problems`` (from ``--eval.source`` ``source``) are among ``train_examples``, the
    training problems of ``whose`` (by ``Task.pool_key``): its scores on them would pass for held out."""
    import warnings

    shared = count_trained(task, problems, train_examples)
    if shared:
        warnings.warn(f"{shared} of the {len(problems)} {task.name} problems evaluated ({_source_named(source)}) are "
                      f"training problems of {whose}: its scores on them are not held out; evaluate on problems it did "
                      f"not train on{fix}", stacklevel=3)


def eval_invalid_hint() -> str:
    """What to do about rows the task refuses, in an evaluation (the fit's hint offers data.drop_invalid_rows instead),
    in the words of whoever set the source (:func:`~es_lightning.analysis.settings.eval_option`)."""
    return (f" in the file (or map its columns with {eval_option('column_mapping')}); an evaluation has no "
            "drop_invalid_rows: it scores every row it draws")


def _source_named(source: str) -> str:
    """``source`` as the evaluation was given it: ``--eval.source 'x.jsonl'`` in the command, ``EvalSettings(source=
    'x.jsonl')`` from a script."""
    return eval_option("source", repr(source), repr(source))

_ROW = "__es_lightning_row__"


def _preprocess_drawn(task: Task, ds, num_problems: int, seed: int, split: str, source: str) -> list[dict[str, Any]]:
    """``num_problems`` rows of ``ds`` (split ``split`` of ``source``, its columns already the task's) shuffled by
    ``seed``, preprocessed; rows the task refuses are refused together, in one line naming how many, the first's row
    number in the split and the task's reason, as a fit's data module names them."""
    drawn = ds.add_column(_ROW, list(range(len(ds)))).shuffle(seed=seed).select(range(num_problems))  # the same rows
    problems: list[dict[str, Any]] = []
    rows: list[int] = []
    refused: dict[int, ValueError] = {}  # row number in the split -> the task's reason
    for r in drawn:
        row = dict(r)
        at = row.pop(_ROW)
        try:
            problems.append(task.preprocess(row))
            rows.append(at)
        except ValueError as err:
            refused[at] = err
    if refused:
        first = min(refused)
        raise ValueError(f"{len(refused)} of the {num_problems} rows drawn from the {split!r} split of "
                         f"{_source_named(source)} are refused by task {task.name!r}, the first (row {first}, counting "
                         f"from 0) as: {refused[first]} — fix those rows{eval_invalid_hint()}")
    return DrawnProblems(problems, rows, f"the {split!r} split of {_source_named(source)}")


class DrawnProblems(list):
    """Problems drawn from a data source (a list, as any problems), with each one's row number in its split
    (``rows``) and where that split is (``where``), so a refusal of one names the row to find in the file."""

    def __init__(self, problems: Sequence[dict[str, Any]], rows: Sequence[int], where: str) -> None:
        super().__init__(problems)
        self.rows, self.where = list(rows), where

    def describe(self, index: int) -> str:
        return f"row {self.rows[index]} (counting from 0) of {self.where}"


def eval_hub_config_hint() -> str:
    """What to do about a hub dataset directory of several configs, in an evaluation (which has no data.hub_config)."""
    return f"point {eval_option('source')} at one of them"


def _eval_terms() -> tuple[tuple[str, str], ...]:
    """The data module's options in its error hints → the evaluation settings that set them, in the words of whoever
    set them (the command's ``--eval.*`` options, a script's ``EvalSettings(...)`` arguments)."""
    return (("data.column_mapping", eval_option("column_mapping")), ("data.source", eval_option("source")),
            ("data.test_size", eval_option("num_problems")))


def _in_eval_terms(err: Exception, kind: type[Exception] = ValueError) -> Exception:
    """``err`` (raised by the data module) with its hints naming the settings an evaluation is given (``--eval.*`` in
    the command, ``EvalSettings(...)`` from a script), as a ``kind``."""
    text = str(err)
    if text.startswith("data source ") and text.endswith(f"; give a {SOURCE_KINDS}"):  # a missing file: not training data's
        option = eval_option("source")
        text = f"{option} {text.removeprefix('data source ').removesuffix(f'give a {SOURCE_KINDS}')}give {option} a {SOURCE_KINDS}"
    text = text.replace(DROP_INVALID_HINT, eval_invalid_hint())  # an evaluation scores every row it is given
    text = text.replace(HUB_CONFIG_HINT, eval_hub_config_hint())  # an evaluation has no hub_config: its source names one
    for data_option, evaluation_option in _eval_terms():
        text = text.replace(data_option, evaluation_option)
    return kind(text)


def evaluation_module(policy: Policy, task: Task, max_new_tokens: int, device: torch.device | str = "cpu",
                      generation_backend: str = "hf", generation_options: dict[str, Any] | None = None,
                      trust_remote_code: bool = False):
    """A :class:`ReasoningModule` around an already loaded policy (nothing is loaded again), generating with
    ``generation_backend`` (a vLLM engine is built from the policy's weights at its first rollout, with
    ``trust_remote_code`` for a model of its own code)."""
    from es_lightning.modules.base import ReasoningModule

    module = ReasoningModule(model="(loaded)", task=task, max_new_tokens=max_new_tokens,
                             generation_backend=generation_backend, generation_options=dict(generation_options or {}),
                             trust_remote_code=trust_remote_code)
    module.model, module.tokenizer = policy.model, policy.tokenizer
    module.model.eval()
    return module.to(device)


#: what :func:`_refuse_overlong_problems` last found to fit: (problems, tokenizer, task, the lowest prompt limit)
_fitting: tuple = ()


def _refuse_overlong_problems(module, problems: Sequence[dict[str, Any]]) -> None:
    """Refuse ``problems`` whose prompt leaves no room for a completion
    (:meth:`~es_lightning.modules.base.ReasoningModule.refuse_overlong_examples`), once per problem set: an ablation
    evaluates the same problems with the same tokenizer, task and limit once per setting, and rendering and tokenizing
    every prompt again each time cost as much as the check. The set is known by its identity (the problems are not
    edited between evaluations: :func:`heldout_problems` draws them once); another tokenizer or task, or a lower limit
    than they fit (a model of fewer positions, a smaller ``max_model_len``, the one a vLLM engine derived itself)
    checks them again."""
    global _fitting
    key = (problems, module.policy.tokenizer, module.task, module.prompt_token_limit())
    if key[3] is None or (len(_fitting) == len(key) and all(a is b for a, b in zip(key[:3], _fitting[:3]))
                          and key[3] >= _fitting[3]):  # no limit, or one the set fits under
        return
    rows = getattr(problems, "rows", None)  # a data source's row numbers (DrawnProblems), else their order
    module.refuse_overlong_examples(list(problems), "problems", (lambda i: rows[i]) if rows else (lambda i: i),
                                    problems.describe if rows else lambda i: f"problem {i} of those evaluated")
    _fitting = key


def evaluate_policy(
    policy: Policy,
    task: Task | str,
    problems: Sequence[dict[str, Any]],
    settings: EvalSettings = PAPER_EVAL,
    progress=None,
) -> dict[str, float]:
    """Pass@k, Maj@k, mean token entropy, mean reward and answer-format rate of ``policy`` on ``problems``.

    ``settings`` says how (its ``num_problems``, ``seed`` and ``source`` chose ``problems``, see
    :func:`heldout_problems`). Returns ``{"pass@1": …, …, "maj@1": …, …, "entropy": …, "reward_mean": …, "format": …,
    "distinct_correct": …}``; ``format`` is the fraction of samples whose answer the task could extract at all,
    ``distinct_correct`` the mean number of distinct correct answers per problem (distinct solutions in the task's
    normal form: coverage in kind). ``progress`` (a tqdm bar) advances per problem.
    """
    from es_lightning.callbacks.pass_at_k import PassAtKCallback

    task = get_task(task)
    module = evaluation_module(policy, task, settings.completion_cap(), resolve_device(settings.device),
                               settings.generation_backend, settings.generation_options, settings.trust_remote_code)
    evaluator = PassAtKCallback(
        num_samples=settings.num_samples, ks=settings.pass_at_ks(), temperature=settings.temperature,
        top_p=settings.top_p, max_new_tokens=settings.completion_cap(), batch_size=settings.batch_size,
        seed=settings.seed, prefix="eval",
    )
    _refuse_overlong_problems(module, problems)
    extracted = [0, 0]  # answers extracted, samples
    distinct: list[int] = []  # per problem: distinct correct answers (in the task's normal form)

    def on_batch(examples, result) -> None:
        extracted[0] += sum(answer is not None for row in result.answers for answer in row)
        extracted[1] += result.correct.numel()
        for answers, correct in zip(result.answers, result.correct.tolist()):
            distinct.append(len({a for a, ok in zip(answers, correct) if ok}))
        if progress is not None:
            progress.update(len(examples))

    try:
        if module.generation_backend == "vllm":  # the engine's own max_model_len (vLLM derives one where none is set)
            try:
                module.start_generator()
            except KVCacheTooSmall as err:  # name the max_model_len these problems need, as a fit names its data's
                need = module.longest_sequence_of(list(problems), settings.completion_cap())
                raise (err.with_need(need) if need is not None else err) from err.__cause__
            _refuse_overlong_problems(module, problems)
        metrics = evaluator.evaluate_examples(module, list(problems), on_batch=on_batch)
    finally:  # a vLLM engine holds its own copy of the weights and GPU memory: one engine at a time
        close = getattr(module._generator, "close", None)
        if close is not None:
            close()
    out = {name.split("/", 1)[1]: value for name, value in metrics.items()}
    out["format"] = extracted[0] / max(1, extracted[1])
    out["distinct_correct"] = sum(distinct) / max(1, len(distinct))
    return out


@dataclass
class EvalReport:
    """``results[label][task]`` = metrics of :func:`evaluate_policy`; the settings they were measured with."""

    results: dict[str, dict[str, dict[str, float]]]
    settings: dict[str, Any]
    sources: dict[str, str] = field(default_factory=dict)  #: label → what was loaded

    @property
    def ks(self) -> list[int]:
        return list(self.settings["ks"])

    def table(self, markdown: bool = False) -> str:
        top = max(self.ks)
        headers = ["model", "task", *(f"pass@{k}" for k in self.ks), f"maj@{top}", "entropy", "format"]
        rows = [
            [label, task, *(m[f"pass@{k}"] for k in self.ks), m[f"maj@{top}"], m["entropy"], m["format"]]
            for label, per_task in self.results.items()
            for task, m in per_task.items()
        ]
        return (markdown_table if markdown else format_table)(headers, rows)

    def to_json(self) -> dict[str, Any]:
        return {"settings": self.settings, "sources": self.sources, "results": self.results}


def evaluate_models(
    models: Sequence[str | LoadedModel],
    tasks: Sequence[str | dict[str, Any] | Task] = ("countdown",),
    labels: Sequence[str] | None = None,
    settings: EvalSettings = PAPER_EVAL,
    dtype: str | None = None,
    progress: bool = True,
    task_sources: dict[str, str] | None = None,
    model_options: Sequence[str | None] | None = None,
) -> EvalReport:
    """Evaluate every model on every task, on the same problems with the same seeds; models are loaded one at a time.
    ``task_sources`` overrides ``settings.source`` for the tasks it names (``{task name: source}``); ``model_options``
    names, per model, the command option that gave it (``--checkpoints``), which a hub model's refusal names."""
    from es_lightning.analysis.runs import now_doing  # what a signal cuts, in a command (no handler in this function)

    if not models:
        raise ValueError("name at least one model to evaluate (a .ckpt, an HF directory, a hub id or builtin:<name>)")
    if labels is not None and len(labels) != len(models):
        raise ValueError(f"got {len(labels)} labels for {len(models)} models; give one label per model or none")
    settings = replace(settings, ks=settings.pass_at_ks())
    settings.completion_cap()
    for model in models:  # every path checked before the first model spends minutes being evaluated
        if not isinstance(model, LoadedModel):
            check_model_spec(model)
    if not tasks:
        raise ValueError("name at least one task, e.g. " + spoken("--tasks countdown addition sort",
                                                                       "tasks=['countdown', 'addition', 'sort']"))
    trained = [(m.spec if isinstance(m, LoadedModel) else m, trained_with(m.spec if isinstance(m, LoadedModel) else m))
               for m in models]
    task_objs = tasks_as_trained(tasks, settings.chat_template, trained)
    named = [t.name for t in task_objs]
    if len(set(named)) < len(named):  # rows and problems are keyed by the task's name
        twice = sorted({n for n in named if named.count(n) > 1})
        raise ValueError(f"{spoken('--tasks', 'tasks=')} names {twice} more than once (two settings of one task): "
                         f"evaluate each setting in {spoken('a command', 'a call')} of its own")
    if dtype is None:  # one dtype for every row: a base model is not compared in float32 with a bf16 checkpoint
        recorded = [(spec, t.dtype) for spec, t in trained if t.dtype]
        if recorded:
            dtype = recorded[0][1]
            if len(recorded) < len(trained) or any(d != dtype for _, d in recorded):
                print(f"every model in {dtype}, as {recorded[0][0]} was trained ({spoken('--dtype', 'dtype=')} to choose)")
    now_doing("preparing the held-out problems")
    problems = {t.name: heldout_problems(t, settings.num_problems, settings.seed, (task_sources or {}).get(t.name, settings.source),
                                         settings.column_mapping) for t in task_objs}
    for spec, record in trained:
        for t in task_objs:
            warn_training_overlap(spec, record, t, problems[t.name], (task_sources or {}).get(t.name, settings.source))
    names = list(labels) if labels is not None else [_label(m) for m in models]
    names = _unique(names)
    from es_lightning.console import progress_bar

    bar = progress_bar(total=len(models) * sum(map(len, problems.values())), desc="eval", unit="problem", disable=not progress)
    results: dict[str, dict[str, dict[str, float]]] = {}
    sources: dict[str, str] = {}
    try:
        for name, model, option in zip(names, models, model_options or [None] * len(models)):
            if not isinstance(model, LoadedModel):
                now_doing(f"loading {model}")
            loaded = model if isinstance(model, LoadedModel) else load_model(
                model, dtype=dtype, trust_remote_code=settings.trust_remote_code, remote_code_option=remote_code_option(),
                model_option=option)
            sources[name] = loaded.spec
            results[name] = {}
            for task in task_objs:
                now_doing(f"evaluating {name} on {task.name}")
                bar.set_description(f"eval {name} · {task.name}")
                results[name][task.name] = evaluate_policy(loaded.policy, task, problems[task.name],
                                                           as_loaded(settings, loaded), progress=bar)
            if not isinstance(model, LoadedModel):
                del loaded
                gc.collect()
    finally:
        bar.close()
    return EvalReport(results=results, settings={"tasks": [t.name for t in task_objs], **asdict(settings)}, sources=sources)


def as_loaded(settings: EvalSettings, loaded: LoadedModel) -> EvalSettings:
    """``settings`` for evaluating ``loaded``: with ``trust_remote_code`` when it was loaded with it (a ``.ckpt`` whose
    fit set it), so a vLLM engine builds its architecture as transformers did."""
    return replace(settings, trust_remote_code=True) if loaded.trust_remote_code and not settings.trust_remote_code \
        else settings


def tasks_as_trained(tasks: Sequence[str | dict[str, Any] | Task], chat_template: bool | None,
                     trained: Sequence[tuple[str, TrainedWith]]) -> list[Task]:
    """The task objects an evaluation prompts with: a task named by a string is built as the first model that
    records its training task (:func:`~es_lightning.analysis.checkpoints.trained_with`) was trained with it — its
    prompt format, its chat template — and any other task takes that model's ``use_chat_template`` and
    ``system_prompt`` (the system turn the model was trained under, not the template's default); ``chat_template``
    (``--eval.chat_template``), when set, decides the template for every task. Task objects, and tasks given with their
    settings (``{class_path, init_args}``), are taken as given, except for an explicit ``chat_template``. Prints what
    it took from a checkpoint."""
    source = next(((spec, t.task) for spec, t in trained if t.task), None)
    record = None
    if source is not None:
        try:
            record = get_task(source[1]["class_path"], **source[1].get("init_args", {}))
        except Exception:  # a task class that is gone or changed: the named tasks as they are
            record = None
    out, said = [], []
    for t in tasks:
        if isinstance(t, dict):  # a task with its settings: {class_path: countdown, init_args: {prompt_format: r1}}
            t = _task_from_spec(t)
        if isinstance(t, Task):
            task = copy.copy(t)
        else:
            task = get_task(t)
            if record is not None and type(record) is type(task):
                task = copy.copy(record)
                changed = _changed_settings(t, source[1].get("init_args", {}))
                if changed:
                    said.append(f"{task.name} ({', '.join(f'{k}={v!r}' for k, v in changed.items())})")
            elif record is not None and record.use_chat_template and chat_template is not False:
                task.use_chat_template = True  # and the system turn it was trained under, not the template's default
                task.system_prompt = getattr(record, "system_prompt", None)
                said.append(f"{task.name} (use_chat_template=True"
                            + (f", system_prompt={task.system_prompt!r})" if task.system_prompt is not None else ")"))
        if chat_template is not None:
            task.use_chat_template = bool(chat_template)
        out.append(task)
    if said and source is not None:
        print(f"tasks as {source[0]} was trained: {'; '.join(said)} ({eval_option('chat_template')} to choose the template)")
    return out


def _changed_settings(name: str, recorded: dict[str, Any]) -> dict[str, Any]:
    """The settings of the recorded task (``init_args``, every setting the task keeps) that the training chose: those
    that differ from the task's defaults, less those the others imply — ``max_completion_chars=65536`` of an ``r1``
    Countdown follows from ``prompt_format='r1'`` (its default there), no choice of its own. Dropped one at a time, as
    long as the rest still rebuild every differing value."""
    default = vars(get_task(name))
    changed = {k: v for k, v in recorded.items() if k in default and default[k] != v}
    for key in list(changed):
        rest = {k: v for k, v in changed.items() if k != key}
        try:
            rebuilt = vars(get_task(name, **rest))
        except Exception:  # the others alone are no valid task: the setting is needed
            continue
        if all(rebuilt.get(k) == v for k, v in changed.items()):
            changed = rest
    return changed


def _task_from_spec(spec: dict[str, Any]) -> Task:
    unknown = set(spec) - {"class_path", "init_args"}
    if "class_path" not in spec or unknown:
        example = spoken("--tasks '[{class_path: countdown, init_args: {prompt_format: r1, use_chat_template: true}}]'",
                                "tasks=[{'class_path': 'countdown', 'init_args': {'prompt_format': 'r1', 'use_chat_template': True}}]")
        raise ValueError(f"a task given with its settings needs class_path and optionally init_args, got {spec}; e.g. {example}")
    return get_task(spec["class_path"], **dict(spec.get("init_args") or {}))


def _label(model: str | LoadedModel) -> str:
    from es_lightning.analysis.checkpoints import checkpoint_label

    return model.label if isinstance(model, LoadedModel) else checkpoint_label(model)


def _unique(names: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for n in names:
        seen[n] = seen.get(n, 0) + 1
        out.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return out


def write_eval_report(report: EvalReport, out_dir: str | Path, plot: bool = True) -> list[Path]:
    """``eval.json``, ``eval.md`` and (with ``plot``) ``pass_at_k.png`` in ``out_dir``."""
    from es_lightning.analysis.plots import plot_pass_at_k_curves

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [write_json(out / "eval.json", report.to_json())]
    s = report.settings
    header = (
        f"# Pass@k evaluation\n\n{s['num_problems']} held-out problems per task, n = {s['num_samples']} samples per "
        f"problem, T = {s['temperature']}, top-p = {s['top_p']}, max {s['max_new_tokens']} new tokens, seed {s['seed']}."
        "\n\n"
    )
    (out / "eval.md").write_text(header + report.table(markdown=True) + "\n")
    written.append(out / "eval.md")
    if plot:
        written.append(plot_pass_at_k_curves(report.results, report.ks, out / "pass_at_k.png"))
    return written


def eval_command(
    checkpoints: list[str],
    tasks: list[str | dict[str, Any]] = ["countdown"],  # noqa: B006  (jsonargparse shows the default in --help)
    labels: list[str] | None = None,
    eval: EvalSettings = PAPER_EVAL,
    dtype: str | None = None,
    out_dir: str = "eval",
    plot: bool = True,
    progress: bool = True,
) -> EvalReport:
    """Evaluate models on held-out problems: Pass@k curves, Maj@k and token entropy (Ba et al. 2026, §3).

    Args:
        checkpoints: models to compare: Lightning ``.ckpt`` files of es-lightning runs, exported Hugging Face
            directories, hub ids or ``builtin:<name>``.
        tasks: task names (``countdown``, ``addition``, ``sort``, ``gsm8k``, ``math``) or Task import paths, prompted
            as the first checkpoint that records its task was trained; or a task with its settings,
            ``{class_path: countdown, init_args: {prompt_format: r1, use_chat_template: true}}``.
        labels: one name per checkpoint for tables and the plot (default: from the paths).
        eval: how every model is evaluated (the same for all; defaults: Ba et al.'s n = 32 at T = 0.6).
        dtype: parameter dtype of every model (default: the dtype the first model that records one was trained in,
            as a .ckpt or a run's export/ records it; else float32).
        out_dir: where eval.json, eval.md and pass_at_k.png go.
        plot: write pass_at_k.png.
        progress: show a progress bar.
    """
    from es_lightning.analysis.runs import now_writing, stopping_on_signals

    check_out_dir(out_dir)  # before any model loads or fit runs
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    start = time.perf_counter()
    out = Path(out_dir)
    # a SIGTERM or SLURM's requeue signal while loading, evaluating or writing: one line, 143 / 138
    with stopping_on_signals(f"nothing was written to {out} (eval.json comes once every model is evaluated)",
                             less="fewer models, tasks or problems"):
        report = evaluate_models(checkpoints, tasks=tasks, labels=labels, settings=eval, dtype=dtype, progress=progress,
                                 model_options=[spoken("--checkpoints", "checkpoints=")] * len(checkpoints))
        now_writing(out, ["eval.json", "eval.md", *(["pass_at_k.png"] if plot else [])])
        s = report.settings
        print(
            f"{s['num_problems']} held-out problems/task, n={s['num_samples']}, T={s['temperature']}, seed={s['seed']} "
            f"({time.perf_counter() - start:.0f}s)"
        )
        print(report.table())
        written = write_eval_report(report, out_dir, plot=plot)
    print("wrote " + ", ".join(map(str, written)))
    return report


def heldout_of(fit_task, settings) -> tuple[Any, list[dict[str, Any]]]:
    """The task an analysis evaluates its fits of ``fit_task`` on (the recipe's, ``--eval.chat_template`` if set) and
    its held-out problems drawn by ``settings`` (an :class:`~es_lightning.analysis.settings.EvalSettings`): the same
    problems and samples for every row."""
    task = tasks_as_trained([fit_task], settings.chat_template, [])[0]
    return task, heldout_problems(task, settings.num_problems, settings.seed, settings.source, settings.column_mapping)


def recipe_heldout(recipe: str | Path, args: Sequence[str], settings) -> tuple[Any, list[dict[str, Any]]] | None:
    """:func:`heldout_of` the task of a fit of ``recipe`` with ``args``, read before any fit
    (:func:`~es_lightning.analysis.runs.recipe_task`): a missing ``--eval.source``, or one without the task's columns,
    is refused before a model is loaded or trained, not after the first fit's minutes. ``None`` for a data module
    without a task (drawn after its fit instead)."""
    from es_lightning.analysis.runs import recipe_task

    fit_task = recipe_task(recipe, args)
    return None if fit_task is None else heldout_of(fit_task, settings)
