"""What ES and GRPO share: the policy, rollouts, rewards, evaluation and logging. Only the update differs.

``ReasoningModule`` is concrete so that ``es-lightning validate`` can evaluate a policy without training it; ``ESModule``
and ``GRPOModule`` subclass it and add their ``training_step``. Both use manual optimization (DESIGN.md, "Lightning is
the loop").

The policy is loaded in :meth:`configure_model` — Lightning's hook for building large models inside the strategy's
context (FSDP, meta device) — and lazily on first use of :attr:`policy` in plain scripts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning as L
import torch
from torch import Tensor

from es_lightning.generation import Generator, HFGenerator, Rollout, SamplingParams
from es_lightning.policy import Policy, load_policy
from es_lightning.tasks import Task, get_task


@dataclass
class EvalBatch:
    """Per-problem evaluation results of one batch: ``n`` samples for each of ``P`` problems."""

    correct: Tensor  # [P, n] bool
    answers: list[list[str | None]]  # [P][n] extracted answers (None = unparseable)
    rewards: Tensor  # [P, n]
    entropy: Tensor  # [P*n, C] per-token entropy of the sampling distribution
    mask: Tensor  # [P*n, C] completion mask
    rollout: Rollout


class ReasoningModule(L.LightningModule):
    """A policy plus a task: sample, score, evaluate. Subclasses add the training update.

    Args:
        model: ``builtin:<name>``, a local Hugging Face directory, or a hub id (e.g. ``Qwen/Qwen2.5-1.5B-Instruct``).
        dtype: parameter dtype: ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        trust_remote_code: allow custom modelling code from the model repository.
        task: the task whose verifier scores rollouts; ``None`` takes the data module's (one place to configure it).
        max_new_tokens: completion length cap for training rollouts.
        temperature: training rollout temperature (0 = greedy).
        top_p: training rollout nucleus threshold.
        generation_backend: ``"hf"`` (transformers ``generate``), the only backend in this version; a vLLM backend
            (the ``vllm`` extra, CUDA only) is planned behind the same :class:`~es_lightning.generation.Generator`.
        seed: base seed of the module's sampling streams (rollouts are seeded from it and the step, so a resumed run
            draws the same samples as an uninterrupted one).
    """

    def __init__(
        self,
        model: str = "builtin:countdown-tiny",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        task: Task | str | None = None,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generation_backend: str = "hf",
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["task"])
        self.automatic_optimization = False
        if generation_backend == "vllm":
            raise NotImplementedError(
                "generation_backend='vllm' is not available in this version of es-lightning (planned, CUDA only); "
                "use generation_backend: hf"
            )
        if generation_backend != "hf":
            raise ValueError(f"generation_backend must be 'hf', got {generation_backend!r}")
        self.model_name = model
        self.dtype_name = dtype
        self.trust_remote_code = trust_remote_code
        self._task = get_task(task) if task is not None else None
        self.sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.generation_backend = generation_backend
        self.seed = seed
        self.model: torch.nn.Module | None = None
        self.tokenizer = None
        self._generator: Generator | None = None
        #: the weights at the start of training, for drift (kept on the CPU; saved in checkpoints so that a resumed
        #: run — and a run whose algorithm switched stage — reports drift against the same reference)
        self._theta0: dict[str, torch.Tensor] | None = None

    # ------------------------------------------------------------------ policy
    def configure_model(self) -> None:
        """Load the policy once (Lightning calls this inside the strategy's context before fit/validate/test)."""
        if self.model is None:
            policy = load_policy(self.model_name, dtype=self.dtype_name, trust_remote_code=self.trust_remote_code)
            self.model = policy.model
            self.tokenizer = policy.tokenizer
        if self._device_mesh is not None:  # ModelParallelStrategy: FSDP2-shard the policy (es_lightning/distributed.py)
            from es_lightning.distributed import fully_shard_policy

            fully_shard_policy(self.model, self._device_mesh)
        elif self._trainer is not None:  # FSDPStrategy (FSDP1): one unit per transformer block unless configured
            from es_lightning.distributed import default_fsdp1_wrapping

            default_fsdp1_wrapping(self._trainer.strategy, self.model)

    @property
    def sharded(self) -> bool:
        """Whether the policy's parameters are sharded (FSDP2 DTensors or FSDP1 units). Sharded generation runs in
        lockstep across ranks (``generate(synced_gpus=True)``, marked here); ES then splits prompts, not members."""
        from es_lightning.distributed import sync_sharded_generation

        root = self._trainer.strategy.model if self._trainer is not None else None
        return self.model is not None and sync_sharded_generation(self.model, root)

    @property
    def policy(self) -> Policy:
        self.configure_model()
        return Policy(model=self.model, tokenizer=self.tokenizer)

    @property
    def generator(self) -> Generator:
        if self._generator is None:
            self._generator = HFGenerator(self.policy)
        return self._generator

    @property
    def task(self) -> Task:
        if self._task is not None:
            return self._task
        dm = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        if dm is not None and getattr(dm, "task", None) is not None:
            return dm.task
        raise RuntimeError(
            f"{type(self).__name__} has no task: pass task=... or fit with a ReasoningDataModule (its task is used)"
        )

    # ------------------------------------------------------------------ rollouts
    def prompts(self, examples: Sequence[dict[str, Any]]) -> list[str]:
        """Task prompts, rendered with the chat template when the task asks for it."""
        task = self.task
        return self.policy.render_prompts([task.prompt(e) for e in examples], task.use_chat_template)

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

    def rollout(
        self,
        examples: Sequence[dict[str, Any]],
        num_samples: int = 1,
        params: SamplingParams | None = None,
        seed: int | None = None,
        return_logprobs: bool = False,
    ) -> tuple[Rollout, Tensor]:
        """Sample ``num_samples`` completions per example and score them: ``(rollout, rewards [B*n])``."""
        rollout = self.generator.generate(
            self.prompts(examples), num_samples, params or self.sampling_params(), seed=seed,
            return_logprobs=return_logprobs,
        )
        repeated = [e for e in examples for _ in range(num_samples)]
        rewards = torch.tensor(self.task.reward(rollout.texts, repeated), dtype=torch.float32)
        return rollout, rewards

    @torch.no_grad()
    def evaluate_batch(
        self, examples: Sequence[dict[str, Any]], num_samples: int, params: SamplingParams, seed: int
    ) -> EvalBatch:
        """``num_samples`` completions per problem → correctness matrix, answers and token entropies."""
        rollout = self.generator.generate(self.prompts(examples), num_samples, params, seed=seed, return_logprobs=True)
        flat_answers, flat_correct, flat_rewards = self.task.grade(
            rollout.texts, [e for e in examples for _ in range(num_samples)]
        )
        rows = range(0, len(rollout.texts), num_samples)
        correct = [flat_correct[i:i + num_samples] for i in rows]  # [P][n]
        answers = [flat_answers[i:i + num_samples] for i in rows]
        rewards = [flat_rewards[i:i + num_samples] for i in rows]
        return EvalBatch(
            correct=torch.tensor(correct, dtype=torch.bool),
            answers=answers,
            rewards=torch.tensor(rewards, dtype=torch.float32),
            entropy=rollout.entropy,
            mask=rollout.completion_mask,
            rollout=rollout,
        )

    # ------------------------------------------------------------------ Lightning hooks
    def configure_callbacks(self):
        """Evaluation is the PassAtKCallback's job; add a default one when the trainer has none."""
        from es_lightning.callbacks.pass_at_k import PassAtKCallback

        trainer = self._trainer
        if trainer is not None and any(isinstance(cb, PassAtKCallback) for cb in trainer.callbacks):
            return []
        return [PassAtKCallback()]

    def validation_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """Nothing here: :class:`~es_lightning.callbacks.PassAtKCallback` samples and scores each validation batch."""

    def test_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        """See :meth:`validation_step`."""

    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        raise NotImplementedError(
            "ReasoningModule only evaluates a policy; train with es_lightning.ESModule or es_lightning.GRPOModule"
        )

    def configure_optimizers(self):
        return None

    def on_fit_start(self) -> None:
        """Mark a sharded policy for lockstep generation before anything generates (FSDP1 wraps only at setup)."""
        _ = self.sharded

    on_validation_start = on_test_start = on_fit_start

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self._theta0 is not None:
            checkpoint["theta0"] = self._full_theta0() if self.sharded else self._theta0

    def _full_theta0(self) -> dict[str, torch.Tensor]:
        """A sharded run's θ₀ (this rank's elements) assembled into full tensors — a collective, every rank saving a
        checkpoint calls it — so checkpoints store θ₀ alike whatever the sharding and load into either kind of run."""
        from es_lightning.es.sharding import clean_name, gather_full, shard_views

        named = [(clean_name(n), p) for n, p in self.model.named_parameters() if clean_name(n) in self._theta0]
        return gather_full(shard_views(named, self.trainer.strategy.model), self._theta0)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._theta0 = checkpoint.get("theta0", self._theta0)
