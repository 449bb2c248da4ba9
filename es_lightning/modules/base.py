"""What ES and GRPO share: the policy, rollouts, scoring, evaluation, the shared training metrics and the stage record.

``ReasoningModule`` is concrete so that ``es-lightning validate`` can evaluate a policy without training it. A module
that trains holds an :class:`~es_lightning.algorithms.Algorithm` object (``module.algorithm``): ``training_step`` and
``configure_optimizers`` are the algorithm's, everything else is here. ``ESModule`` / ``GRPOModule`` are this class
bound to one algorithm (``class ESModule(ReasoningModule, algorithm=ESAlgorithm)``: its arguments are this class's plus
the algorithm's settings, see :mod:`es_lightning.modules.signature`). :class:`~es_lightning.SequentialStrategy`
switches a running fit by :meth:`set_algorithm` — the module's class never changes; ``module.algorithm.name`` says
which stage runs. Manual optimization throughout (README "Design", "Lightning is the loop").

Resuming: the active stage (algorithm name, settings, rollout settings) is saved in the module's checkpoint
(:mod:`es_lightning.modules.stage`). A resumed fit continues in the checkpoint's stage: when that is the algorithm the
module was built with, the settings it was built with apply (you may change e.g. ``lr`` on resume); when the checkpoint
had switched to another algorithm, that stage comes back with the settings it ran with.

The policy is loaded in :meth:`configure_model` — Lightning's hook for building large models inside the strategy's
context (FSDP, meta device) — and lazily on first use of :attr:`policy` in plain scripts.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, ClassVar

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod
from torch import Tensor

from es_lightning.algorithms import SAMPLING_KEYS, Algorithm, get_algorithm
from es_lightning.generation import Generator, Rollout, SamplingParams, check_generation_options, make_generator
from es_lightning.generation.base import close_after_failure
from es_lightning.generation.config import (
    DERIVED_MAX_MODEL_LEN,
    SHORTEN_PROMPTS,
    KVCacheTooSmall,
    position_limit,
    prompt_limit,
)
from es_lightning.metrics.training import StepMetrics, shared_metrics
from es_lightning.modules.stage import STAGE_KEY, peek_stage_on_load
from es_lightning.policy import Policy, load_policy, model_fix_local, prompt_token_counts, resolve_dtype
from es_lightning.precision import (
    COMPUTE_DTYPE_OF_PRECISION,
    PARAMETER_NAMES_KEY,
    WEIGHT_DTYPE_OF_PRECISION,
    check_device_dtype,
    check_master_dtype,
    lower_precision,
    master_dtype_for,
    masters_from_weights,
    optimizer_parameter_names,
)
from es_lightning.scoring import Scores, check_reward_signature, score_completions
from es_lightning.tasks import Task, get_task
from es_lightning.tasks.base import TASK_KEY, task_disagreement, task_record


@dataclass
class EvalBatch:
    """Per-problem evaluation results of one batch: ``n`` samples for each of ``P`` problems."""

    correct: Tensor  # [P, n] bool
    answers: list[list[str | None]]  # [P][n] extracted answers (None = unparseable)
    rewards: Tensor  # [P, n]
    entropy: Tensor  # [P*n, C] per-token entropy of the policy at the sampling temperature (Rollout.entropy)
    mask: Tensor  # [P*n, C] completion mask
    rollout: Rollout


#: where the refusals below turn from Lightning's words to the modules' options (``cli_errors`` cuts there)
_MANUAL_OPTIMIZATION_FIX = " — es-lightning's modules optimize manually: "


def _check_manual_optimization_flags(trainer: L.Trainer) -> None:
    """Refuse ``Trainer(gradient_clip_val=...)`` / ``Trainer(accumulate_grad_batches=...)`` naming the module options
    that do the same: Lightning refuses them under manual optimization with "... or switch to automatic optimization",
    which these modules cannot. Lightning's sentence is kept (the command's error line swaps the options named)."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    if trainer.gradient_clip_val is not None and trainer.gradient_clip_val > 0:
        raise MisconfigurationException(
            "Automatic gradient clipping is not supported for manual optimization: remove "
            f"`Trainer(gradient_clip_val={trainer.gradient_clip_val})`" + _MANUAL_OPTIMIZATION_FIX
            + "GRPO clips the gradient norm itself (GRPOModule(max_grad_norm=...), 1.0 by default); ES takes no "
            "gradient, nothing to clip")
    if trainer.accumulate_grad_batches != 1:
        raise MisconfigurationException(
            "Automatic gradient accumulation is not supported for manual optimization: remove "
            f"`Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches})`" + _MANUAL_OPTIMIZATION_FIX
            + "GRPO accumulates gradients over mini-batches of one step's completions (GRPOModule(mini_batch_size=...)); "
            "ES takes no gradient (more prompts a step: ReasoningDataModule(batch_size=...))")


class ReasoningModule(L.LightningModule):
    """A policy plus a task: sample, score, evaluate; with an algorithm, train.

    Args:
        model: ``builtin:<name>``, a local Hugging Face directory, or a hub id (e.g. ``Qwen/Qwen2.5-1.5B-Instruct``).
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16``, or ``auto`` / null (the checkpoint's own).
        trust_remote_code: allow custom modelling code from the model repository.
        task: the task whose verifier scores rollouts; ``None`` takes the data module's (one place to configure it), else,
            in a module from ``load_from_checkpoint``, the one its checkpoint records it was trained on.
        max_new_tokens: completion length cap for training rollouts.
        temperature: training rollout temperature (0 = greedy; ES defaults to 0 as Ba et al., GRPO to 1).
        top_p: training rollout nucleus threshold.
        generation_backend: ``"hf"`` (transformers ``generate`` on the policy) or ``"vllm"`` (a vLLM engine colocated in
            the training process, fed the policy's weights: the ``vllm`` extra; ``configs/generation/vllm.yaml``).
            Both sample alike (seeded, common random numbers across ES members) but from different random streams.
        generation_options: the vLLM engine's settings (:class:`~es_lightning.generation.vllm.VLLMGenerator`'s
            arguments — ``max_model_len``, ``gpu_memory_utilization``, ``dtype``, ``engine_side_es`` … — and any
            ``vllm.LLM`` engine argument); none for ``"hf"``. Checked at construction.
        seed: base seed of the module's sampling streams and ES noise (a pure function of it and the step, so a resumed
            run draws the same samples as an uninterrupted one).
        master_dtype: dtype of the master weights the optimizer updates when the policy's weights have less precision
            (``float32``, the default: an fp32 master for bf16/fp16 weights, none for fp32 ones; ``float64``; or
            ``same``: no master, updates rounded to the weights' dtype). A bf16 weight has 8 significant bits: an ES
            step (α/√N ≈ 4e-5) or an AdamW step at lr 1e-6 is mostly rounded away without a master (ES keeps ~43% of
            the elements, norm weights freeze). Memory: +4 bytes per parameter (1.5B model: +6.2 GB); for ES +2 net, as
            the master doubles as the exact copy the in-place evaluation restores from; GRPO totals 16 bytes per
            parameter, as fp32 training (table in ``es_lightning/precision.py``).
        attn_implementation: the policy's attention kernels, transformers' ``attn_implementation`` (``sdpa``,
            ``eager``, ``flash_attention_2`` …; TRL's ``model_init_kwargs``); null lets transformers choose (sdpa).
            The policy's forward only: a vLLM engine picks its own.
        revision: the hub commit, branch or tag of the model (a hub id only), as ``from_pretrained(revision=...)``;
            a GRPO reference loads the same one (a vLLM engine is built from the policy's own config and tokenizer).
    """

    #: the algorithm a subclass is bound to (``class ESModule(ReasoningModule, algorithm=ESAlgorithm)``)
    algorithm_class: ClassVar[type[Algorithm] | None] = None

    def __init_subclass__(cls, algorithm: type[Algorithm] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if algorithm is not None:
            from es_lightning.modules.signature import build_module_init

            cls.algorithm_class = algorithm
            build_module_init(cls, ReasoningModule, algorithm)

    def __init__(
        self,
        model: str = "builtin:countdown-tiny",
        dtype: str | None = "float32",
        trust_remote_code: bool = False,
        task: Task | str | None = None,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generation_backend: str = "hf",
        generation_options: dict[str, Any] | None = None,
        seed: int = 0,
        master_dtype: str | None = "float32",
        attn_implementation: str | None = None,
        revision: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["task"])
        self.automatic_optimization = False
        check_generation_options(generation_backend, generation_options)
        self.model_name = model
        self.dtype_name = dtype
        self.trust_remote_code = trust_remote_code
        self.attn_implementation = attn_implementation
        self.revision = revision
        self._task = get_task(task) if task is not None else None
        self._checkpoint_task: Task | dict[str, Any] | None = None  # the task a loaded checkpoint records (`task`)
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.generation_backend = generation_backend
        self.generation_options = dict(generation_options or {})
        #: engine settings an algorithm needs on top of ``generation_options`` (:meth:`require_generation_options`)
        self._needed_generation_options: dict[str, Any] = {}
        self.seed = seed
        check_master_dtype(dtype, master_dtype)
        self.master_dtype = master_dtype
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._generator: Generator | None = None
        #: the algorithm ``training_step`` and ``configure_optimizers`` run (``None``: evaluation only)
        self.algorithm: Algorithm | None = None
        #: the rewards the last training update used (ES: one per member; GRPO: one per completion)
        self.last_rewards: Tensor | None = None
        self._warned_no_chat_template = False

    @_restricted_classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any):
        """Lightning's ``load_from_checkpoint``, refusing in one line a checkpoint another module class wrote (an
        ``ESModule``'s loaded as a ``GRPOModule`` or the reverse): Lightning keeps the hyperparameters the class
        accepts and drops the others without a word, so the algorithm's settings were the class's defaults — a
        ``GRPOModule`` of an ES checkpoint failed on ES's greedy temperature, an ``ESModule`` of a GRPO checkpoint came
        back training GRPO (its stage record) with ES's default settings. ``ReasoningModule`` evaluates any of them."""
        _check_checkpoint_class(cls, checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    # ------------------------------------------------------------------ policy
    def configure_model(self) -> None:
        """Load the policy once (Lightning calls this inside the strategy's context before fit/validate/test)."""
        if self.model is None:
            # a hub model that cannot be loaded: from a script, the way out is this class's argument
            policy = load_policy(self.model_name, **self.policy_load_options(),
                                 local_fix=model_fix_local(f"{type(self).__name__}(model=...)"))
            self.model = policy.model
            self.tokenizer = policy.tokenizer
        if self._device_mesh is not None:  # ModelParallelStrategy: FSDP2-shard the policy (es_lightning/distributed.py)
            from es_lightning.distributed import fully_shard_policy

            fully_shard_policy(self.model, self._device_mesh)
        elif self._trainer is not None:  # FSDPStrategy (FSDP1): one unit per transformer block unless configured
            from es_lightning.distributed import default_fsdp1_wrapping

            default_fsdp1_wrapping(self._trainer.strategy, self.model)
        if self.algorithm is not None:
            self.algorithm.configure_model(self)

    @property
    def sharded(self) -> bool:
        """Whether the policy's parameters are sharded (FSDP2 DTensors or FSDP1 units). Sharded generation runs in
        lockstep across ranks (``generate(synced_gpus=True)``, marked here); ES then splits prompts, not members."""
        from es_lightning.distributed import sync_sharded_generation

        root = self._trainer.strategy.model if self._trainer is not None else None
        return self.model is not None and sync_sharded_generation(self.model, root)

    def policy_load_options(self) -> dict[str, Any]:
        """The :func:`~es_lightning.policy.load_policy` keywords of this module's policy (a GRPO reference is loaded
        alike)."""
        return dict(dtype=self.dtype_name, trust_remote_code=self.trust_remote_code,
                    attn_implementation=self.attn_implementation, revision=self.revision)

    @property
    def policy(self) -> Policy:
        self.configure_model()
        return Policy(model=self.model, tokenizer=self.tokenizer)

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            options = self.engine_options()
            if self.generation_backend == "vllm" and self.trust_remote_code:  # the engine builds the policy's model
                options.setdefault("trust_remote_code", True)
            self._generator = make_generator(self.generation_backend, self.policy, **options)
        return self._generator

    def engine_options(self) -> dict[str, Any]:
        """The options the generator is (or will be) built with: ``generation_options`` and what the algorithm
        needs (:meth:`require_generation_options`)."""
        return {**self.generation_options, **self._needed_generation_options}

    def require_generation_options(self, **options: Any) -> None:
        """Engine settings the algorithm needs (e.g. LoRA adapters for low-rank ES on vLLM), on top of
        ``generation_options``. A generator already built without them is closed and built again with them (once, at
        fit start or at a stage switch)."""
        needed = {**self._needed_generation_options, **options}
        if needed == self._needed_generation_options:
            return
        self._needed_generation_options = needed
        self.close_generator()

    def close_generator(self) -> None:
        """Shut down a generator that holds resources of its own (a vLLM engine: its copy of the weights, its KV cache,
        GPU memory); the next rollout builds one again (:attr:`generator`)."""
        if self._generator is not None:
            close = getattr(self._generator, "close", None)
            if close is not None:
                close()
            self._generator = None

    def policy_updated(self) -> None:
        """The policy's weights changed (an optimizer step, a restored checkpoint, a stage switch): a generator with
        its own copy of them (vLLM) takes them before it next generates. HF reads the policy: nothing to do."""
        if self._generator is not None:
            self._generator.weights_changed()

    def start_generator(self, splits: Sequence[str] = ()) -> None:
        """Build a vLLM engine now, before anything trains or evaluates, so that a model it cannot load is refused
        with vLLM's reason in one line at fit start (not at the first rollout); an existing one takes the current
        weights (e.g. a resumed checkpoint's) before it next generates. An engine whose own ``max_model_len`` is lower
        than the limit the rows of ``splits`` were checked against (vLLM derives one where ``generation_options`` sets
        none) has them checked again (:meth:`check_prompt_lengths`), before any step; refused, the engine is closed
        (as ``evaluate_policy`` closes its own), so a failed fit holds no engine and the next one builds its own."""
        if self.generation_backend == "hf":
            return
        if self.sharded:
            raise ValueError(
                f"generation_backend={self.generation_backend!r} cannot generate from an FSDP-sharded policy (the engine "
                "holds its own full copy of the weights, pushed by name); use generation_backend: hf with FSDP, or vLLM "
                "with DDP (configs/trainer/ddp.yaml) when the model fits on one device"
            )
        if self._generator is None:
            checked = self.prompt_token_limit()
            try:
                _ = self.generator  # built from, and holding, the current weights
            except KVCacheTooSmall as err:  # name the max_model_len the data needs where it is known
                need = self.longest_sequence(splits)
                if need is None:
                    raise
                raise err.with_need(need) from err.__cause__
            limit = self.prompt_token_limit()
            if limit is not None and (checked is None or limit < checked):  # vLLM derived a lower max_model_len
                try:
                    self.check_prompt_lengths(splits)
                except BaseException:  # refused: the engine's memory is not held while the user's script goes on
                    self.close_generator()
                    raise
        else:
            self._generator.weights_changed()

    @property
    def task(self) -> Task:
        if self._task is not None:
            return self._task
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and getattr(dm, "task", None) is not None:
            return dm.task
        recorded = getattr(self, "_checkpoint_task", None)
        if isinstance(recorded, dict):  # load_from_checkpoint: the task the checkpoint records it was trained on
            recorded = self._checkpoint_task = get_task(recorded["class_path"], **recorded.get("init_args", {}))
        if recorded is not None:  # kept apart from _task: a data module fitted later still gives its own
            return recorded
        raise RuntimeError(
            f"{type(self).__name__} has no task: pass task=... or fit with a ReasoningDataModule (its task is used)"
        )

    @property
    def shares_batch_across_ranks(self) -> bool:
        """Whether every rank gets the same training batch (read by the data module when it builds the stream). Fixed
        by the algorithm the module was built with, so a fit keeps one data layout across a stage switch."""
        first = type(self).algorithm_class
        return bool(first is not None and first.shares_batch_across_ranks)

    # ------------------------------------------------------------------ precision
    def master_dtype_for(self, params: Sequence[Tensor]) -> torch.dtype | None:
        """The master dtype of an optimizer over ``params`` (``None``: no master), from the ``master_dtype`` knob and
        the parameters' dtype as they are now — under Lightning's ``bf16-true`` bf16, whatever ``dtype`` loaded."""
        return master_dtype_for(params, self.master_dtype)

    def check_precision(self) -> None:
        """Refuse, naming the fix, weights the device cannot compute in — or, under ``bf16-mixed``/``16-mixed``, the
        autocast dtype — before anything generates or steps (:func:`~es_lightning.precision.check_device_dtype`)."""
        if self.model is None:
            return
        dtypes = {p.dtype for p in self.model.parameters() if p.is_floating_point()}
        precision = str(getattr(self._trainer, "precision", "")) if self._trainer is not None else ""
        computes = COMPUTE_DTYPE_OF_PRECISION.get(precision)  # under *-mixed the autocast dtype, beside the weights'
        configured = resolve_dtype(self.dtype_name)
        for dtype in sorted(dtypes | ({computes} if computes else set()), key=str):
            try:
                check_device_dtype(self.device, dtype, owner=type(self).__name__)
            except ValueError as err:
                if dtype == computes and dtype != configured:
                    from es_lightning.cli_errors import SettingError, spoken  # the trainer's setting

                    other = (["bf16-true", "32-true"] if dtype == torch.float16 else
                             ["16-true", "32-true"] if self.device.type == "cuda" else ["32-true"])
                    why = f"computes in {str(dtype).removeprefix('torch.')}: {str(err).split(';', 1)[0]}"
                    raise SettingError(spoken(
                        f"trainer.precision {precision} {why}; use trainer.precision {' or '.join(other)}",
                        f"Trainer(precision={precision!r}) {why}; use "
                        + " or ".join(f"Trainer(precision={o!r})" for o in other))) from err
                raise

    # ------------------------------------------------------------------ rollouts and scoring
    def prompts(self, examples: Sequence[dict[str, Any]]) -> list[str]:
        """Task prompts, rendered with the chat template when the task asks for it.

        A tokenizer without a chat template (a base checkpoint) gets the task's prompt *as written for no template*
        (Countdown's ``r1``: the "User: … Assistant: … <think>" scaffold), with one warning: the task's templated
        prompt is only the user turn, which the model was left to continue bare. A task with a ``system_prompt`` is
        refused there: the no-template prompt has no place for it (it was dropped without a word)."""
        task = self.task
        policy = self.policy
        if task.use_chat_template and getattr(policy.tokenizer, "chat_template", None) is None:
            if getattr(task, "system_prompt", None) is not None:  # without a template it has no place: it vanished
                raise ValueError(f"the task's system_prompt is a turn of the chat template, but {self.model_name!r} has "
                                 "no chat template (a base model): remove system_prompt (or write its text into the "
                                 "prompt), or use a model whose tokenizer has a chat template")
            if not getattr(self, "_warned_no_chat_template", False):
                self._warned_no_chat_template = True
                rank_zero_warn(f"the task asks for the chat template (use_chat_template=True) but {self.model_name!r} "
                               "has none (a base model): its prompts are written as without a template; set "
                               "use_chat_template: false to silence this")
            task = copy.copy(task)
            task.use_chat_template = False
        return policy.render_prompts([task.prompt(e) for e in examples], task.use_chat_template,
                                     getattr(task, "system_prompt", None))  # a custom task may skip Task.__init__

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """The module's rollout settings with the task's stop strings, optionally overridden."""
        base = dict(
            max_new_tokens=self.sampling.max_new_tokens,
            temperature=self.sampling.temperature,
            top_p=self.sampling.top_p,
            stop=list(self.task.stop_strings),
        )
        base.update({k: v for k, v in overrides.items() if v is not None})
        return SamplingParams(**base)

    def sample(
        self,
        examples: Sequence[dict[str, Any]],
        num_samples: int = 1,
        params: SamplingParams | None = None,
        seed: int | None = None,
        return_logprobs: bool = False,
    ) -> Rollout:
        """``num_samples`` completions per example (prompt-major rows) from the current weights."""
        return self.generator.generate(self.prompts(examples), num_samples, params or self.sampling_params(), seed=seed,
                                       return_logprobs=return_logprobs)

    def score(self, completions: Sequence[str], examples: Sequence[dict[str, Any]], step: int | None = None) -> Scores:
        """Grade completions (one example per completion) with the task, once each, under the bad-reward policy of
        :mod:`es_lightning.scoring` (a reward function that raises or miscounts stops the fit with the fix)."""
        return score_completions(self.task, completions, examples, step)

    def rollout(self, examples: Sequence[dict[str, Any]], num_samples: int = 1, **sample: Any) -> tuple[Rollout, Scores]:
        """:meth:`sample` (``sample``: its ``params``, ``seed``, ``return_logprobs``) then :meth:`score`:
        ``(rollout, scores)`` with ``B * num_samples`` rows."""
        rollout = self.sample(examples, num_samples, **sample)
        return rollout, self.score(rollout.texts, [e for e in examples for _ in range(num_samples)])

    @torch.no_grad()
    def evaluate_batch(
        self, examples: Sequence[dict[str, Any]], num_samples: int, params: SamplingParams, seed: int
    ) -> EvalBatch:
        """``num_samples`` completions per problem → correctness matrix, answers and token entropies."""
        rollout, scores = self.rollout(examples, num_samples, params=params, seed=seed, return_logprobs=True)
        n = num_samples
        return EvalBatch(
            correct=scores.correct.view(-1, n),
            answers=[scores.answers[i:i + n] for i in range(0, len(scores), n)],
            rewards=scores.rewards.view(-1, n),
            entropy=rollout.entropy,
            mask=rollout.completion_mask,
            rollout=rollout,
        )

    # ------------------------------------------------------------------ the algorithm and the stage record
    def set_algorithm(self, algorithm: Algorithm, sampling: dict[str, Any] | None = None) -> None:
        """Make ``algorithm`` the one that trains, with rollout settings ``sampling`` (``temperature``, ``top_p``,
        ``max_new_tokens``) changed where given. Validated before anything changes. The caller rebuilds the optimizers
        when a fit is running (:class:`~es_lightning.SequentialStrategy` does)."""
        unknown = sorted(set(sampling or {}) - set(SAMPLING_KEYS))
        if unknown:
            raise ValueError(f"unknown rollout setting(s) {unknown}; accepted: {list(SAMPLING_KEYS)}")
        new = dataclasses.replace(self.sampling, **(sampling or {}))  # SamplingParams validates its values
        type(algorithm).check_sampling(new)
        algorithm.check_rollouts(new)
        algorithm.check_generation(self.generation_backend, self.generation_options)
        self.sampling = new
        self.algorithm = algorithm
        self.policy_updated()  # a stage switch: the engine (vLLM) takes the weights as the last stage left them
        if self.model is not None:
            algorithm.configure_model(self)

    def stage_record(self) -> dict[str, Any] | None:
        """``{"algorithm": name, "settings": {...}, "sampling": {...}}`` of the active stage (plain values only)."""
        if self.algorithm is None:
            return None
        return {
            "algorithm": self.algorithm.name,
            "settings": dataclasses.asdict(self.algorithm.settings),
            "sampling": {k: getattr(self.sampling, k) for k in SAMPLING_KEYS},
        }

    def restore_stage(self, record: dict[str, Any]) -> bool:
        """Continue in the checkpoint's stage ``record``; returns whether the algorithm changed (see the module
        docstring for which settings apply)."""
        current = self.stage_record()
        if current is not None and record["algorithm"] == current["algorithm"]:
            saved, now = {**record["settings"], **record["sampling"]}, {**current["settings"], **current["sampling"]}
            changed = sorted(k for k in saved.keys() | now.keys() if saved.get(k) != now.get(k))
            if changed:
                values = "; ".join(f"{k}: {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)  # checkpoint's -> now
                rank_zero_warn(f"resuming {record['algorithm']} with the configured settings; the checkpoint's differ "
                               f"in {changed} ({values})")
            self._resumed_changes = tuple(changed)  # written into the restored optimizer at train start
            return False
        cls = get_algorithm(record["algorithm"])
        from es_lightning.callbacks.sequential import SequentialStrategy

        callbacks = self._trainer.callbacks if self._trainer is not None else []
        switches = any(isinstance(cb, SequentialStrategy) and cb.target == record["algorithm"] for cb in callbacks)
        if current is not None and not switches and self._trainer is not None:
            # not a switch this fit's SequentialStrategy makes: most likely another recipe's checkpoint (no trainer:
            # ``load_from_checkpoint``, whose class refuses another module's checkpoint — the run's own later stage)
            rank_zero_warn(f"the checkpoint was written in the {record['algorithm']} stage, so this fit continues "
                           f"{record['algorithm']} with the checkpoint's settings, not the configured "
                           f"{current['algorithm']}; to train {current['algorithm']}, start from the checkpoint's "
                           "weights instead (--model.init_args.model <run>/export, the run's Hugging Face export)")
        self.set_algorithm(cls(dict(record["settings"])), dict(record["sampling"]))
        return True

    def log_step(self, metrics: StepMetrics) -> dict[str, float]:
        """Log a training step's metrics under the shared keys (:mod:`es_lightning.metrics.training`), averaged over
        ranks in one collective; the same call for every algorithm, so a stage switch logs consistently. Returns the
        values logged (``{"train/<name>": value}``, the same on every rank), so an algorithm can decide on a global
        value (GRPO's all-groups-flat warning) without a collective of its own."""
        self.last_rewards = metrics.rewards.detach().cpu().clone()
        values = shared_metrics(metrics, self.optimizers().param_groups[0]["lr"])
        if self.trainer.world_size > 1:
            # rank means (TRL's convention), except the reward mean and spread: of every rank's rewards, from the
            # ranks' count, sum and sum of squares (a mean of the ranks' own spreads misses the spread between them),
            # and the shares of counted things (StepMetrics.shares: GRPO's flat groups of the kept groups), from every
            # rank's counts — a rank that kept nothing has no share of its own, and the mean of the ranks' shares is
            # not the global share when they counted different numbers (the means of the counts: the same ratio)
            rewards = metrics.rewards.detach().double().cpu()
            kept = rewards[torch.isfinite(rewards)]
            moments = [float(kept.numel()), float(kept.sum()), float((kept * kept).sum())]
            counts = [float(c) for pair in metrics.shares.values() for c in pair]
            flat = torch.tensor([*values.values(), *moments, *counts], dtype=torch.float64, device=self.device)
            flat = self.trainer.strategy.reduce(flat, reduce_op="mean").tolist()
            values, flat = dict(zip(values, flat[:len(values)])), flat[len(values):]
            (count, total, squares), counts = flat[:3], flat[3:]
            for i, name in enumerate(metrics.shares):
                counted, out_of = counts[2 * i:2 * i + 2]
                values[f"train/{name}"] = counted / out_of if out_of else float("nan")
            mean = total / count if count else float("nan")
            values["train/reward_mean"] = mean
            values["train/reward_std"] = math.sqrt(max(squares / count - mean * mean, 0.0)) if count else float("nan")
        reward = values.pop("train/reward_mean")
        kw = dict(on_step=True, on_epoch=False, batch_size=metrics.batch_size)
        self.log("train/reward_mean", reward, prog_bar=True, **kw)
        self.log_dict(values, **kw)
        return {"train/reward_mean": reward, **values}

    # ------------------------------------------------------------------ Lightning hooks
    def configure_callbacks(self):
        """Pass@K evaluation and parameter drift are callbacks' jobs; add default ones when the trainer has none. Lightning's
        model summary becomes :mod:`es_lightning.callbacks.model_summary`'s (weights at their dtype plus the fp32
        master copies, where Lightning counts every parameter at the trainer precision's size)."""
        from es_lightning.callbacks.drift import ParameterDrift
        from es_lightning.callbacks.model_summary import swap_model_summary
        from es_lightning.callbacks.pass_at_k import PassAtKCallback

        have = self._trainer.callbacks if self._trainer is not None else []
        swap_model_summary(have)
        if self._trainer is not None and self._trainer.state.fn == "fit":
            _check_manual_optimization_flags(self._trainer)  # Lightning checks them right after this hook
        return [cls() for cls in (PassAtKCallback, ParameterDrift, CloseGeneratorOnFailure)
                if not any(isinstance(cb, cls) for cb in have)]

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Nothing here but the batch's check: :class:`~es_lightning.callbacks.PassAtKCallback` samples and scores each
        validation batch."""
        self._check_batch(batch, "validation")

    def test_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """See :meth:`validation_step`."""
        self._check_batch(batch, "test")

    def _check_batch(self, batch: Any, loop: str) -> None:
        """Refuse, in one line, a batch that is not a list of example dicts: a ``DataLoader`` of the user's with
        PyTorch's default collate gives a dict of columns (or a tensor), which failed deep in prompting or grading
        ("string indices must be integers", "too many indices for tensor of dimension 0")."""
        if isinstance(batch, (list, tuple)) and all(isinstance(example, dict) for example in batch):
            return
        if isinstance(batch, dict):
            got = f"a dict of columns {sorted(map(str, batch))}"
        elif isinstance(batch, (list, tuple)):
            got = f"a {type(batch).__name__} of {type(next(e for e in batch if not isinstance(e, dict))).__name__}"
        else:
            got = f"a {type(batch).__name__}"
        raise TypeError(
            f"{type(self).__name__}: a {loop} batch must be a list of example dicts (one per problem, the task's "
            f"columns), got {got}; give your DataLoader collate_fn=list (PyTorch's default collate makes a dict of "
            "columns), or use ReasoningDataModule's loaders")

    def predict_step(self, batch: Any, batch_idx: int) -> None:
        """Not offered (:meth:`setup` refuses ``trainer.predict`` before the model loads): see :meth:`_no_predict`."""
        raise NotImplementedError(self._no_predict())

    def _no_predict(self) -> str:
        return (f"trainer.predict: {type(self).__name__} has no prediction loop; sample and score completions with "
                "trainer.test(module, datamodule=...) (Pass@k on the held-out problems) or es-lightning eval, and "
                "generate text with module.model.generate")

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        if self.algorithm is None:
            raise NotImplementedError(
                "ReasoningModule only evaluates a policy; train with es_lightning.ESModule or es_lightning.GRPOModule"
            )
        self._check_batch(batch, "training")
        before, algorithm = self.trainer.global_step, self.algorithm
        algorithm.training_step(self, batch, batch_idx)
        made = self.trainer.global_step - before
        if made != algorithm.steps_per_batch and self.algorithm is algorithm:
            # an algorithm of the user's that steps its torch optimizer itself (or not at all): global_step stays put,
            # so max_steps, checkpoints every K steps and logging never come, and a fit without max_epochs never ends
            raise RuntimeError(
                f"{type(algorithm).__name__}.training_step made {made} optimizer step(s) through module.optimizers(), "
                f"not its steps_per_batch ({algorithm.steps_per_batch}): Lightning counts trainer.global_step (what "
                "max_steps, checkpoints and logging go by) in step() calls of the optimizer module.optimizers() returns; "
                "call module.optimizers().step() once per update, or set the algorithm's steps_per_batch")

    def configure_optimizers(self):
        return self.algorithm.configure_optimizers(self) if self.algorithm is not None else None

    def setup(self, stage: str) -> None:
        """Check the training batch against the algorithm (before the model loads); strategies that build optimizers
        before restoring a checkpoint (FSDP, FSDP2) learn the stage first."""
        if stage == "predict":  # Lightning said "`Trainer.predict` requires `forward` method to run."
            raise NotImplementedError(self._no_predict())
        if self.trainer.world_size > 1:  # exit cleanly after the script is done (es_lightning/distributed.py)
            from es_lightning.distributed import destroy_process_group_at_exit

            destroy_process_group_at_exit()
        dm = getattr(self._trainer, "datamodule", None)
        self.check_task_agrees(getattr(dm, "task", None))
        task = self._task if self._task is not None else getattr(dm, "task", None)
        if isinstance(task, Task):  # a reward with TRL's signature: said now, not after the first rollouts
            check_reward_signature(task)
        if stage == "fit" and self.algorithm is not None:
            batch_size = self.train_batch_size()
            if batch_size is not None:
                self.algorithm.check_batch(batch_size)
            check_batch_size_finders(self.trainer, self.algorithm)
        if stage == "fit" and self.algorithm is not None and self.trainer.strategy.restore_checkpoint_after_setup:
            peek_stage_on_load(self, self.trainer.strategy)

    def check_task_agrees(self, data_task: Any) -> None:
        """Refuse, before anything loads, a module ``task=`` that would prompt and grade the data module's problems
        otherwise than its own task (:func:`~es_lightning.tasks.base.task_disagreement`): the module's task wins, so
        another task failed deep in prompting (a ``KeyError`` on a column its problems lack) and another prompt format
        was silently ignored."""
        if not isinstance(self._task, Task) or not isinstance(data_task, Task):
            return
        differ = task_disagreement(self._task, data_task)
        if differ is not None:
            raise ValueError(
                f"{type(self).__name__}(task=...) and the data module's task differ (the module's vs the data module's: "
                f"{differ}): the module's task "
                "prompts and grades the data module's problems; set the same task in both, or give it once, on the data "
                "module (data.init_args.task), and leave the module's task null (it then takes the data module's)")

    def train_batch_size(self) -> int | None:
        """Prompts per training batch on each rank, when the fit's data module says (``ReasoningDataModule``)."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        size = getattr(dm, "batch_size", None)
        return size if isinstance(size, int) else None

    def _check_checkpoint_model(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, in one line naming the model to resume with, a checkpoint of another model than the configured one
        (Lightning's strict loading would print a traceback listing every mismatched key)."""
        saved = checkpoint.get("state_dict")
        if not isinstance(saved, dict) or not saved:
            return  # a sharded checkpoint loads its state elsewhere
        strategy = type(self._trainer.strategy).__name__ if self._trainer is not None else ""
        if "FSDP" in strategy or "ModelParallel" in strategy:
            return  # a sharded module's state_dict() would gather every weight; the strategy's own load checks
        own = self.state_dict()
        missing = [k for k in own if k not in saved]
        extra = [k for k in saved if k not in own]
        shaped = [k for k in own.keys() & saved.keys()
                  if isinstance(saved[k], Tensor) and tuple(saved[k].shape) != tuple(own[k].shape)]
        if not (missing or extra or shaped):
            return
        if shaped:
            k = sorted(shaped)[0]
            detail = f"{k} is {list(saved[k].shape)} there and {list(own[k].shape)} here"
        else:
            keys = missing or extra
            detail = f"{len(keys)} weights {'missing there' if missing else 'unknown here'} (e.g. {sorted(keys)[0]})"
        written = (checkpoint.get("hyper_parameters") or {}).get("model")
        fix = (f"resume it with the model it was written for: --model.init_args.model {written}" if written
               and written != self.model_name else "resume it with the configuration it was written with")
        raise ValueError(f"the checkpoint holds another model than the configured {self.model_name!r}: {detail}; "
                         f"{fix}")

    def _more_precise_weights(self, state: dict[str, Any], lower: bool) -> dict[str, Tensor]:
        """The checkpoint weights more precise than the parameters they load into (or, under bf16-true/16-true,
        which converts the parameters after loading, any fp32/fp64 weight)."""
        params = dict(self.named_parameters())
        return {name: t for name, t in state.items()
                if isinstance(t, Tensor) and t.is_floating_point() and name in params
                and (lower_precision(params[name].dtype, t.dtype) or (lower and t.dtype in (torch.float32, torch.float64)))}

    def on_train_start(self) -> None:
        changed, self._resumed_changes = getattr(self, "_resumed_changes", ()), ()
        if self.algorithm is not None and changed:  # the checkpoint's param groups were restored: the configured apply
            self.algorithm.apply_settings(self.trainer.optimizers, [c.scheduler for c in self.trainer.lr_scheduler_configs],
                                          changed)
        if self.algorithm is not None:
            self._warn_max_steps_overshoot()
        weights, self._checkpoint_weights = getattr(self, "_checkpoint_weights", None), None
        if isinstance(weights, str):  # a sharding strategy loaded the file's weights itself: read them again, lazily
            state = torch.load(weights, map_location="cpu", weights_only=False, mmap=True).get("state_dict", {})
            weights = self._more_precise_weights(state, str(self.trainer.precision) in WEIGHT_DTYPE_OF_PRECISION)
        if weights:
            masters_from_weights(self.trainer.optimizers, self.named_parameters(), weights)

    def _warn_max_steps_overshoot(self) -> None:
        """Say when ``trainer.max_steps`` is not reachable: a batch makes ``steps_per_batch`` optimizer steps (GRPO's
        ``num_iterations``), all of them, so Lightning stops at the first batch end at or past ``max_steps``. Not when
        a :class:`~es_lightning.SequentialStrategy` switches to another algorithm before it (that stage ends the fit)."""
        from es_lightning.callbacks.sequential import SequentialStrategy

        if self.trainer.fast_dev_run:  # it runs N batches, whatever steps they make: the max_steps it sets is its own
            return
        k, step, limit = self.algorithm.steps_per_batch, self.trainer.global_step, self.trainer.max_steps
        switching = any(isinstance(cb, SequentialStrategy) and cb.target != self.algorithm.name and cb.switch_step < limit
                        for cb in self.trainer.callbacks)
        if k > 1 and limit > step and (limit - step) % k and not switching:
            end = step + -(-(limit - step) // k) * k
            reachable = " or ".join(str(x) for x in (end - k, end) if x > step)
            rank_zero_warn(f"trainer.max_steps={limit} is not reachable: each batch makes {k} optimizer steps "
                           f"({self.algorithm.name} num_iterations={k}) from step {step}, so the fit ends at step {end}; "
                           f"use a max_steps {k} steps apart from {step} (e.g. {reachable})")

    def on_fit_start(self) -> None:
        """Mark a sharded policy for lockstep generation before anything generates (FSDP1 wraps only at setup); let
        the algorithm choose its helpers (which may ask for engine settings); start a vLLM engine."""
        self.check_precision()
        _ = self.sharded
        self.check_prompt_lengths(("train", "val"))  # before an engine starts or anything trains
        if self.algorithm is not None:
            self.algorithm.on_fit_start(self)
        self.start_generator(("train", "val"))

    def check_prompt_lengths(self, splits: Sequence[str]) -> None:
        """Refuse a data module's rows whose prompt leaves no room for a completion (:meth:`refuse_overlong_examples`)
        before the first step, over every row of ``splits`` at once. The generators refuse such a prompt too
        (:func:`~es_lightning.generation.base.refuse_overlong_prompts`, whose docstring says why an error and not TRL's
        silent truncation or a dropped row), but only when a batch draws it, steps into the fit, naming its place in
        that batch; this is verl's check at data loading (its default ``data.truncation: error``)."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if not callable(getattr(dm, "describe_row", None)):  # not a ReasoningDataModule: the generators' check
            return
        for split in splits:
            self.refuse_overlong_examples(dm.splits.get(split) or [], f"{split} prompts",
                                          partial(dm.source_row, split), partial(dm.describe_row, split))

    def longest_sequence(self, splits: Sequence[str]) -> int | None:
        """The longest prompt + completion the rows of ``splits`` can take (tokens): their longest prompt as rendered
        and encoded, plus the largest ``max_new_tokens`` (the module's, or a callback's such as ``PassAtKCallback``'s);
        ``None`` without such rows (not a ``ReasoningDataModule``, no ``splits``)."""
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if not callable(getattr(dm, "describe_row", None)):
            return None
        examples = [e for split in splits for e in (dm.splits.get(split) or [])]
        new_tokens = [self.sampling.max_new_tokens] + [
            n for n in (getattr(cb, "max_new_tokens", None) for cb in self._trainer.callbacks)
            if isinstance(n, int) and not isinstance(n, bool)]
        return self.longest_sequence_of(examples, max(new_tokens))

    def longest_sequence_of(self, examples: Sequence[dict[str, Any]], max_new_tokens: int) -> int | None:
        """The longest prompt of ``examples`` as rendered and encoded (tokens) plus ``max_new_tokens``: the
        ``max_model_len`` they need (:meth:`longest_sequence` for a data module's rows, ``evaluate_policy`` for its
        problems); ``None`` without examples."""
        if not examples:
            return None
        return max(prompt_token_counts(self.policy.tokenizer, self.prompts(examples))) + max_new_tokens

    def prompt_token_limit(self) -> int | None:
        """The prompt length (tokens) from which no completion fits (:func:`~es_lightning.generation.config.prompt_limit`):
        the model's positions, or on vLLM the engine's ``max_model_len`` where lower — the built engine's own, else
        ``generation_options``' (unset, vLLM derives its own when it builds the engine: :meth:`start_generator`)."""
        config = getattr(self.policy.model, "config", None)
        if self.generation_backend != "vllm":
            return prompt_limit(config)
        built = getattr(self._generator, "max_model_len", None)
        return prompt_limit(config, built if built is not None else self.engine_options().get("max_model_len"))

    def refuse_overlong_examples(self, examples: Sequence[dict[str, Any]], what: str, row_number: Callable[[int], int],
                                 describe: Callable[[int], str]) -> None:
        """Refuse ``examples`` whose prompt (chat template included) has the model's ``max_position_embeddings``
        tokens or more (on vLLM: the engine's ``max_model_len``, when lower: :meth:`prompt_token_limit`), in one line
        naming how many of them (``what``: "train prompts"), the first by ``row_number`` (its row in the data) as
        ``describe`` names it, its token count and the fixes."""
        if not examples:
            return
        positions = position_limit(getattr(self.policy.model, "config", None))
        limit = self.prompt_token_limit()
        if limit is None:
            return
        derived = not getattr(self._generator, "max_model_len_asked", True)  # vLLM's own max_model_len
        name = ("the model's max_position_embeddings" if limit == positions else
                DERIVED_MAX_MODEL_LEN if derived else "generation_options.max_model_len")
        lengths = prompt_token_counts(self.policy.tokenizer, self.prompts(examples))
        over = [i for i, n in enumerate(lengths) if n >= limit]
        if not over:
            return
        from es_lightning.cli_errors import SettingError  # the data's rows, not an option of the module

        first = min(over, key=row_number)
        longest = max(lengths[i] for i in over)
        fix = SHORTEN_PROMPTS
        if limit != positions and not derived and (positions is None or longest < positions):
            fix = f"raise generation_options.max_model_len above {longest}, {fix}"
        have = "has" if len(over) == 1 else "have"
        raise SettingError(f"{len(over)} of the {len(lengths)} {what} {have} {limit} tokens or more, and {name} is "
                           f"{limit}: no room for a completion; the first is {describe(first)} ({lengths[first]} tokens "
                           f"as prompted); {fix}, or remove those rows from the data")

    def on_validation_start(self) -> None:
        self.check_precision()
        _ = self.sharded
        fn = self._trainer.state.fn if self._trainer is not None else None
        splits = (("val",) if fn == "validate" else ("test",)) if fn in ("validate", "test") else ()
        self.check_prompt_lengths(splits)  # a fit checked its rows at on_fit_start; validate/test check theirs here
        if self._generator is None:
            self.start_generator(splits)

    on_test_start = on_validation_start

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        record = self.stage_record()
        if record is not None:
            checkpoint[STAGE_KEY] = record
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        task = self._task if self._task is not None else getattr(dm, "task", None)
        if isinstance(task, Task):  # how the model was prompted: an evaluation of this checkpoint prompts it the same way
            checkpoint[TASK_KEY] = task_record(task)
        if self._trainer is not None and self.trainer.optimizers:  # which saved master belongs to which weight
            checkpoint[PARAMETER_NAMES_KEY] = optimizer_parameter_names(self.trainer.optimizers, self.model.named_parameters())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.policy_updated()  # the checkpoint's weights are loaded next: a vLLM engine takes them before it generates
        # the task the checkpoint was trained on (a data module's, not a hyperparameter): a module loaded without one
        # (``load_from_checkpoint`` in a script) samples and scores with it; a task or data module given still wins
        self._checkpoint_task = checkpoint.get(TASK_KEY)
        self._check_checkpoint_model(checkpoint)
        # weights more precise than the parameters will be (a 32-true checkpoint resumed under bf16-true, converted
        # after this hook): kept until the optimizers exist, so their masters start from these bits (on_train_start)
        fitting = self._trainer is not None and self._trainer.state.fn == "fit"
        lower = fitting and str(self._trainer.precision) in WEIGHT_DTYPE_OF_PRECISION
        self._checkpoint_weights = {} if not fitting else self._more_precise_weights(checkpoint.get("state_dict", {}), lower)
        path = self._trainer.ckpt_path if fitting else None
        if fitting and "state_dict" not in checkpoint and path is not None and os.path.isfile(path):
            self._checkpoint_weights = str(path)  # ModelParallelStrategy took the state dict out of a file checkpoint
        record = checkpoint.get(STAGE_KEY)
        if self._trainer is not None and self._trainer.state.fn in ("validate", "test") and record is not None:
            # an evaluation samples with the configured settings (it warned "this fit continues grpo ..." of another
            # recipe's checkpoint), or the stage's of a switch the configured SequentialStrategy makes, as the fit did
            from es_lightning.callbacks.sequential import SequentialStrategy

            if not any(isinstance(cb, SequentialStrategy) and cb.target == record["algorithm"]
                       for cb in self._trainer.callbacks):
                return
        if record is None or self.algorithm is None or not self.restore_stage(record):
            return
        trainer = self._trainer
        if trainer is not None and trainer.strategy.restore_checkpoint_after_setup and trainer.strategy.optimizers:
            raise RuntimeError(
                f"the checkpoint was saved in the {record['algorithm']} stage, but {type(trainer.strategy).__name__} "
                "restored its optimizer state into the optimizers of the stage this module starts in, before the stage "
                "was known (the checkpoint path could not be read ahead); resume from a local checkpoint path"
            )


class CloseGeneratorOnFailure(L.Callback):
    """Close the module's generator (a vLLM engine: its weights, KV cache, GPU memory and worker) when a fit,
    ``validate`` or ``test`` fails — an out-of-memory error, a task's verifier bug, Ctrl+C — before the error reaches
    the user's script, which would otherwise go on (a notebook: another fit, an evaluation) beside an engine nothing
    uses. Lightning gives the LightningModule no ``on_exception`` hook; a callback's runs for every trainer entry
    point. The error raised is the original one; the next rollout builds a new engine (:attr:`ReasoningModule.generator`)."""

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        close = getattr(pl_module, "close_generator", None)
        if close is not None:
            close_after_failure(close, exception)


def check_batch_size_finders(trainer: L.Trainer, algorithm: Algorithm) -> None:
    """Refuse, at fit setup, a Lightning ``BatchSizeFinder`` that would try a ``batch_size`` the algorithm cannot split
    (GRPO's ``mini_batch_size`` must divide batch_size × group_size, ES's ``prompt_groups`` the batch).

    The finder replaces the configured batch size with its own trials — ``init_val``, doubled each trial (``power``),
    or any size between two tried (``binsearch``, after an out-of-memory) — and its trials call ``training_step``:
    the refusal came mid-search as a traceback naming a ``data.batch_size`` the user never set."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    for finder in (c for c in trainer.callbacks if isinstance(c, BatchSizeFinder)):
        init, trials, cap = finder._init_val, finder._max_trials, finder._max_val
        if finder._mode == "power":
            sizes = sorted({min(init * 2**k, cap) for k in range(min(trials, 64))})
            shown = ", ".join(map(str, sizes[:4])) + (f", ..., {sizes[-1]}" if len(sizes) > 4 else "")
            tried = f"data.batch_size {shown} (init_val {init}, doubled each trial)"
        else:  # binsearch: doubles, then halves the gap after an out-of-memory: any size up to the largest tried
            sizes = range(1, min(init * 2 ** min(trials, 64), cap) + 1)
            tried = f"any data.batch_size from 1 to {sizes[-1]} (binsearch from init_val {init})"
        for size in sizes:
            try:
                algorithm.check_batch(size)
            except ValueError as err:
                raise ValueError(
                    f"BatchSizeFinder (mode {finder._mode!r}) tries {tried}, and at {size}: {err}. Pick settings "
                    "that fit every size it tries (GRPO: a mini_batch_size that divides init_val × group_size, or "
                    "group_size with binsearch; or none), or leave BatchSizeFinder out") from None


def _module_classes(root: type) -> list[type]:
    """``root`` and its subclasses bound to an algorithm, depth first (``ESModule``, ``GRPOModule``, a user's own)."""
    found = []
    for sub in root.__subclasses__():
        if sub.algorithm_class is not None:
            found.append(sub)
        found += [c for c in _module_classes(sub) if c not in found]
    return found


def _check_checkpoint_class(cls: type, checkpoint_path: Any) -> None:
    """Refuse a checkpoint whose hyperparameters another module class wrote (see ``load_from_checkpoint``)."""
    import inspect

    if cls.algorithm_class is None or not isinstance(checkpoint_path, (str, os.PathLike)):
        return  # ReasoningModule evaluates any; a stream or URL is Lightning's to read
    path = os.fspath(checkpoint_path)
    if not os.path.isfile(path):
        return  # Lightning says what is wrong with it
    try:
        # weights_only: a peek must not run a checkpoint's pickled code, which Lightning's own load refuses to
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors stay on disk
    except Exception:  # not a zip archive (mmap), objects weights_only refuses, not a checkpoint: Lightning's load says
        return
    hparams = checkpoint.get("hyper_parameters") if isinstance(checkpoint, dict) else None
    if not isinstance(hparams, dict):
        return
    accepted = inspect.signature(cls).parameters
    foreign = [name for name in hparams if not name.startswith("_") and name not in accepted]
    class_path = hparams.get("_class_path")
    if isinstance(class_path, str):  # the command's: Lightning builds the class it names, or blocks it ("import the
        # module that defines the class"), which misleads when the class is the other of ours
        writers = [c for c in _module_classes(ReasoningModule) if not issubclass(c, cls)
                   and class_path in (f"{c.__module__}.{c.__qualname__}", f"es_lightning.{c.__qualname__}")]
    elif foreign:
        writers = [c for c in _module_classes(ReasoningModule) if c is not cls and
                   all(name in inspect.signature(c).parameters for name in hparams if not name.startswith("_"))]
    else:
        return
    if class_path is not None and not writers:
        return
    writer = writers[0].__name__ if writers else "another module class"
    use = f"{writer}.load_from_checkpoint" if writers else "the class that wrote it"
    which = f" (its hyperparameters {', '.join(foreign[:4])}{', ...' if len(foreign) > 4 else ''} are not {cls.__name__}'s)"
    raise ValueError(f"{path}: a checkpoint of {writer}, not {cls.__name__}{which if foreign else ''}: load it with {use}, "
                     "or with ReasoningModule.load_from_checkpoint to evaluate it")
