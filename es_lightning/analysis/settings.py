"""How the analyses evaluate a policy: one settings dataclass for ``eval``, ``ablation``, ``forgetting``, ``sweep`` and
``compare``, documented once.

Each field's docstring is its ``--help`` text (jsonargparse reads attribute docstrings, as litgpt's ``args.py``); on the
command line the fields are ``--eval.<field>``, e.g. ``es-lightning eval --checkpoints … --eval.num_samples 64``, or a
YAML/JSON file for the whole group: ``--eval settings.yaml``. The defaults are Ba et al. 2026's evaluation (§3: n = 32
samples per problem at T = 0.6, Pass@k by the unbiased estimator of Chen et al. 2021); ``sweep`` and ``compare``, which
evaluate the built-in model that was trained and is measured at T = 1, start from :data:`SWEEP_EVAL` and
:data:`COMPARE_EVAL` instead of :data:`PAPER_EVAL`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["COMPARE_EVAL", "PAPER_EVAL", "REMOTE_CODE_OPTION", "SWEEP_EVAL", "EvalSettings", "default_ks", "eval_option",
           "remote_code_option", "resolve_device"]

#: how a refusal of a model needing its own code names the setting in ``es-lightning eval`` / ``analyze``
REMOTE_CODE_OPTION = "--eval.trust_remote_code true"


def remote_code_option() -> str:
    """How a refusal of a model needing its own code names the setting: :data:`REMOTE_CODE_OPTION` in the command,
    the field of the settings object a script passes (``EvalSettings(trust_remote_code=True)``)."""
    from es_lightning.cli_errors import spoken

    return spoken(REMOTE_CODE_OPTION, "EvalSettings(trust_remote_code=True)")


def eval_option(field: str, command_value: str | None = None, python_value: str = "...", lead: str = "") -> str:
    """An evaluation setting in the words of whoever set it (:func:`~es_lightning.cli_errors.spoken`): the option
    ``<lead>--eval.<field> <command_value>`` in the ``es-lightning`` command (``lead="option "``: "(option
    --eval.device)"), the argument ``EvalSettings(<field>=<python_value>)`` from a script, which has no ``--eval.*``
    options."""
    from es_lightning.cli_errors import spoken

    command = f"{lead}--eval.{field}" if command_value is None else f"{lead}--eval.{field} {command_value}"
    return spoken(command, f"EvalSettings({field}={python_value})")


def default_ks(num_samples: int) -> list[int]:
    """1, 2, 4, … up to ``num_samples`` (and ``num_samples`` itself when it is not a power of two)."""
    ks = [1 << i for i in range(num_samples.bit_length()) if 1 << i <= num_samples]
    return ks if ks[-1] == num_samples else ks + [num_samples]


def resolve_device(device: str) -> torch.device:
    """``auto`` → CUDA when available, else CPU. A device this machine does not have is refused naming the fix."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device("cuda" if device == "gpu" else device)
    except RuntimeError as err:
        raise ValueError(f"eval.device {device!r} is not a device ({err}); use auto, cpu or cuda "
                         f"({eval_option('device', lead='option ')})") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"eval.device {device!r}: this machine has no CUDA GPU (or torch was built without CUDA); use "
                         f"{eval_option('device', 'cpu', repr('cpu'))}, or auto")
    return resolved


@dataclass(frozen=True)
class EvalSettings:
    """How models are evaluated: which held-out problems, how many samples, how they are sampled. Every model a command
    compares is evaluated with the same settings and seeds (common random numbers), so rows differ by their weights."""

    num_problems: int = 100
    """held-out problems per task (the same problems for every model)."""
    num_samples: int = 32
    """samples per problem, the n of the unbiased Pass@k estimator (Ba et al. 2026: 32)."""
    ks: list[int] | None = None
    """the k of Pass@k and Maj@k, each at most num_samples (default: 1, 2, 4, ... n for eval and forgetting; 1 and n for
    ablation and sweep; 1, 4, 16 for compare, which needs those three)."""
    temperature: float = 0.6
    """sampling temperature (Ba et al. 2026: 0.6; 0 = greedy)."""
    top_p: float = 1.0
    """nucleus sampling threshold (1.0 = the whole distribution)."""
    max_new_tokens: int | None = 32
    """completion length cap (the built-in tasks need ~16 tokens, reasoning models ~1024); null = the fitted recipe's
    own cap (sweep's default; the other commands need a number)."""
    seed: int = 0
    """seeds the choice of held-out problems and the sampling (the same for every model)."""
    batch_size: int = 64
    """problems per generation call; the sampling seeds follow the batches, so keep it fixed across evaluations you
    compare. On the transformers backend a call holds batch_size × num_samples rows of KV cache: at 64 × 32 and 1,024
    new tokens ~72 GB for a 1.5B model — use 4 there, or generation_backend vllm."""
    source: str = "procedural"
    """where held-out problems come from: procedural (the held-out pool of a procedural task), hub (the task's hub
    dataset), a hub dataset name, or a local jsonl/parquet file."""
    column_mapping: dict[str, str] | None = None
    """renames a source file's columns to the task's, {file column: task column} (as data.column_mapping in a fit)."""
    device: str = "auto"
    """where models are evaluated: auto (CUDA when available), cpu, cuda, cuda:1, ..."""
    chat_template: bool | None = None
    """wrap prompts in the models' chat template: null = as the evaluated checkpoint was trained (a .ckpt, or a run's
    export directory, records its task: a task of the same name is prompted as in training, others take its chat
    template; nothing recorded: no template); true / false: for every model and task alike."""
    generation_backend: str = "hf"
    """how completions are generated: hf (transformers generate) or vllm (a vLLM engine per model, the optional extra:
    the fast path for 0.5B–7B checkpoints on a GPU). Greedy completions are the same on both; sampled ones differ (each
    draws its own random numbers), so compare models evaluated with one backend."""
    generation_options: dict[str, Any] | None = None
    """vLLM engine settings (generation_backend vllm only), as a fit's model.generation_options, e.g.
    {"max_model_len": 4096, "gpu_memory_utilization": 0.8}."""

    trust_remote_code: bool = False
    """run the evaluated models' own modelling code: a model directory or hub id whose config.json's auto_map names
    *.py files of its repository is refused without it. That code runs on this machine, so read it first. It reaches
    transformers and the vLLM engine alike; a .ckpt whose fit set trust_remote_code takes it from there, and sweep's and
    compare's fits from their recipe's model.trust_remote_code."""

    def __post_init__(self) -> None:
        def bad(field: str, rule: str) -> ValueError:
            return ValueError(f"eval.{field} must be {rule}, got {getattr(self, field)!r} ({eval_option(field, lead='option ')})")

        if self.num_problems < 1:
            raise bad("num_problems", ">= 1")
        if self.num_samples < 1:
            raise bad("num_samples", ">= 1")
        if not self.temperature >= 0:
            raise bad("temperature", ">= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", "in (0, 1]")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise bad("max_new_tokens", ">= 1 (or null for a recipe's own cap in sweep)")
        if self.batch_size < 1:
            raise bad("batch_size", ">= 1")
        if self.ks is not None:
            self.pass_at_ks()  # k > n or k < 1: refused at construction, before anything is loaded
        resolve_device(self.device)  # a device this machine lacks: refused now, not after the models load
        from es_lightning.generation import check_generation_options

        if self.generation_backend == "hf" and self.generation_options:  # the fit's hint names a fit's config fragment
            raise ValueError(f"eval.generation_backend 'hf' takes no generation_options, got "
                             f"{sorted(self.generation_options)}; they are vLLM engine settings: add "
                             f"{eval_option('generation_backend', 'vllm', repr('vllm'))}, or drop "
                             f"{eval_option('generation_options')}")
        try:  # an unknown backend or engine option: refused now, named as an evaluation option
            check_generation_options(self.generation_backend, self.generation_options)
        except ValueError as err:
            raise ValueError(f"{err} ({eval_option('generation_backend', lead='options ')}, "
                             f"{eval_option('generation_options')})") from None
        except ImportError as err:  # vllm without its extra: the install line, and the option that asked for it
            raise ImportError(f"{err} ({eval_option('generation_backend', lead='option ')})") from None

    def pass_at_ks(self, default: Sequence[int] | None = None) -> list[int]:
        """The k to report: ``ks`` when set, else the command's ``default``, else 1, 2, 4, … n; sorted, each <= n."""
        ks = self.ks if self.ks is not None else default if default is not None else default_ks(self.num_samples)
        ks = sorted({int(k) for k in ks})
        if not ks or ks[0] < 1:
            raise ValueError(f"every k of eval.ks must be a positive integer, got ks={ks}")
        if ks[-1] > self.num_samples:
            raise ValueError(
                f"k={ks[-1]} exceeds num_samples={self.num_samples}: Pass@k needs n >= k samples per problem. Raise "
                f"{eval_option('num_samples')} to at least {ks[-1]} or drop the larger ks."
            )
        return ks

    def completion_cap(self) -> int:
        """``max_new_tokens``, which must be set by now (sweep fills a null from the recipe before evaluating)."""
        if self.max_new_tokens is None:
            raise ValueError(f"eval.max_new_tokens is null; set {eval_option('max_new_tokens')} (null means a recipe's own "
                             "cap, in sweep only)")
        return self.max_new_tokens


#: Ba et al. 2026's evaluation (§3): the default of ``eval``, ``ablation`` and ``forgetting``
PAPER_EVAL = EvalSettings()
#: ``sweep``'s defaults: 16 samples at T = 1 (the built-in model's training and evaluation temperature), the recipe's cap
SWEEP_EVAL = EvalSettings(num_samples=16, temperature=1.0, max_new_tokens=None)
#: ``compare``'s defaults: 200 problems × 32 samples at T = 1 (a prototype saw Pass@16 move by up to 0.07 between a
#: 100×16 and a 200×32 evaluation), one cap for every recipe, and its own seed
COMPARE_EVAL = EvalSettings(num_problems=200, num_samples=32, temperature=1.0, max_new_tokens=24, seed=1234)
