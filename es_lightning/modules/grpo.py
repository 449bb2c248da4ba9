"""GRPOModule: group-relative policy optimisation (Shao et al. 2024, DeepSeekMath §4.1) in a Lightning loop.

To run::

    es-lightning fit --config recipes/grpo.yaml
    es-lightning fit --config recipes/grpo.yaml --model.init_args.lr 1e-4     # override any value

One training step (one batch of prompts from the data module):

1. **Rollout** — ``group_size`` completions per prompt from the current policy, seeded from ``(seed, global_step,
   rank)`` so a resumed run draws the same samples; scored by the task's verifier (shared with ES:
   :meth:`ReasoningModule.rollout`).
2. **Advantages** — ``(r − mean_G r) / (std_G r + ε)``; ``scale_rewards="none"`` is Dr. GRPO (Liu et al. 2025).
3. **Update** — ``num_iterations`` passes (μ in the GRPO paper); each pass runs forward/backward over mini-batches of
   ``mini_batch_size`` completions, accumulating gradients, then takes **one** optimizer step (clip, AdamW, LR
   schedule). So a training step makes ``num_iterations`` optimizer steps and ``trainer.global_step`` counts optimizer
   steps — with the default ``num_iterations=1`` one per batch. This is TRL's default layout
   (``steps_per_generation == gradient_accumulation_steps``): ``mini_batch_size`` is a memory knob that leaves the
   objective unchanged for ``dapo``/``dr_grpo``, and splits the normalisation per mini-batch for ``grpo``/``bnpo``
   exactly as TRL does.

π_old is the log-prob the generator recorded while sampling (same weights, same temperature): no extra forward pass, and
for ``num_iterations > 1`` the importance ratio measures the drift of the later passes. It equals the training forward
to float tolerance (tested), so the first pass has ratio 1. The training forward runs each prompt once and shares its
key/value cache with the G completions of its group (``share_prompt_prefix``; gradients flow through the cache), so the
prompt's FLOPs are paid once per group instead of G times.

Features: DDP and FSDP through the Trainer's strategy (groups stay on one rank; the ``dapo`` token count and the
``batch`` reward std are global); resume from checkpoint (weights, AdamW and scheduler state, step, sampling seeds); a
frozen reference for the KL term loaded only when ``beta > 0`` and kept out of checkpoints. Limits: the reference is
not sharded by FSDP (it is a plain module on each rank). A mid-epoch resume sees the same prompts as an uninterrupted run
(the data module's training stream is positioned by the trainer's batch count).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import numpy as np
import torch
from torch import Tensor

from es_lightning.generation import Rollout
from es_lightning.grpo.logprobs import completion_logprobs
from es_lightning.modules.base import ReasoningModule
from es_lightning.modules.grpo_loss import LOSS_TYPES, SCALE_REWARDS, group_advantages, grpo_loss
from es_lightning.policy import load_policy
from es_lightning.tasks import Task


class _Frozen:
    """Holds the reference policy outside ``nn.Module`` registration: not in ``state_dict``, checkpoints or the
    optimizer, and never wrapped by DDP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


class GRPOModule(ReasoningModule):
    """GRPO / Dr. GRPO / DAPO with the knobs and metrics of TRL's ``GRPOTrainer`` (names kept where they exist).

    Args:
        model, dtype, trust_remote_code, task, generation_backend: see :class:`ReasoningModule`.
        group_size: completions per prompt, G (Ba et al. 2026 use 8; GRPO needs at least 2 for a baseline).
        lr: AdamW learning rate (Ba et al. 2026: 1e-6 for 0.5–7B models; the 1M-parameter built-in model wants ~3e-4,
            see ``recipes/grpo.yaml``).
        betas: AdamW betas.
        weight_decay: AdamW decoupled weight decay.
        warmup_steps: linear LR warmup over this many optimizer steps, then constant.
        max_grad_norm: clip the global gradient norm to this (``None`` or 0 = no clipping).
        num_iterations: optimisation passes over each batch of rollouts (μ in Shao et al. 2024, Alg. 1).
        mini_batch_size: completions per forward/backward (``None`` = all B·G at once); gradients accumulate.
        epsilon_low, epsilon_high: PPO clip range [1 − ε_low, 1 + ε_high]; Yu et al. 2025 (DAPO "clip-higher") use
            ε_high = 0.28.
        beta: coefficient of the k3 KL estimate (Schulman 2020) to a frozen copy of the starting policy; 0 (TRL's and
            DAPO's default) skips loading the reference.
        kl_importance_correction: weight the KL term by the importance ratio (TRL's ``use_bias_correction_kl``).
        entropy_coef: entropy bonus coefficient (loss −= coef × mean token entropy).
        loss_type: token aggregation, as TRL 1.16 defines it: ``"grpo"`` (per-sequence mean, Shao et al.), ``"bnpo"``
            (mini-batch token mean), ``"dr_grpo"`` (÷ rows × max_new_tokens, Liu et al. 2025), ``"dapo"`` (÷ tokens of
            the whole batch, Yu et al. 2025; TRL's default).
        scale_rewards: ``"group"`` (GRPO), ``"batch"`` (std of the whole batch), ``"none"`` (Dr. GRPO).
        mask_truncated_completions: drop completions that hit ``max_new_tokens`` from the loss (DAPO's overlong
            filtering).
        share_prompt_prefix: in the training forward, run each prompt once and share its key/value cache across its G
            completions (same log-probs and gradients to float tolerance, fewer FLOPs); ``false`` runs every
            prompt + completion row in full, as TRL does (for models whose cache cannot be reordered).
        max_new_tokens, temperature, top_p: training rollout settings (temperature 1.0 samples the policy as it is).
        seed: base seed of the rollout streams.
    """

    def __init__(
        self,
        model: str = "builtin:countdown-tiny",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        task: Task | str | None = None,
        group_size: int = 8,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        num_iterations: int = 1,
        mini_batch_size: int | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        beta: float = 0.0,
        kl_importance_correction: bool = True,
        entropy_coef: float = 0.0,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        share_prompt_prefix: bool = True,
        max_new_tokens: int = 32,
        temperature: float = 1.0,
        top_p: float = 1.0,
        generation_backend: str = "hf",
        seed: int = 0,
    ) -> None:
        super().__init__(
            model=model, dtype=dtype, trust_remote_code=trust_remote_code, task=task, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, generation_backend=generation_backend, seed=seed,
        )
        self.save_hyperparameters(ignore=["task"])
        self._reference: _Frozen | None = None
        self.configure_grpo(
            group_size=group_size, lr=lr, betas=betas, weight_decay=weight_decay, warmup_steps=warmup_steps,
            max_grad_norm=max_grad_norm, num_iterations=num_iterations, mini_batch_size=mini_batch_size,
            epsilon_low=epsilon_low, epsilon_high=epsilon_high, beta=beta,
            kl_importance_correction=kl_importance_correction, entropy_coef=entropy_coef, loss_type=loss_type,
            scale_rewards=scale_rewards, mask_truncated_completions=mask_truncated_completions,
            share_prompt_prefix=share_prompt_prefix,
        )

    def configure_grpo(
        self,
        group_size: int = 8,
        lr: float = 1e-6,
        betas: tuple[float, float] = (0.9, 0.999),
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_grad_norm: float | None = 1.0,
        num_iterations: int = 1,
        mini_batch_size: int | None = None,
        epsilon_low: float = 0.2,
        epsilon_high: float = 0.2,
        beta: float = 0.0,
        kl_importance_correction: bool = True,
        entropy_coef: float = 0.0,
        loss_type: str = "dapo",
        scale_rewards: str = "group",
        mask_truncated_completions: bool = False,
        share_prompt_prefix: bool = True,
    ) -> None:
        """Validate and set the GRPO settings (also used by :class:`~es_lightning.SequentialStrategy` at a switch)."""
        _check_config(group_size, lr, epsilon_low, epsilon_high, beta, loss_type, scale_rewards, num_iterations,
                      mini_batch_size, warmup_steps, self.sampling.temperature)
        self.group_size = group_size
        self.lr, self.betas, self.weight_decay, self.warmup_steps = lr, tuple(betas), weight_decay, warmup_steps
        self.max_grad_norm = max_grad_norm
        self.num_iterations = num_iterations
        self.mini_batch_size = mini_batch_size
        self.epsilon_low, self.epsilon_high = epsilon_low, epsilon_high
        self.beta = beta
        self.kl_importance_correction = kl_importance_correction
        self.entropy_coef = entropy_coef
        self.loss_type = loss_type
        self.scale_rewards = scale_rewards
        self.mask_truncated_completions = mask_truncated_completions
        self.share_prompt_prefix = share_prompt_prefix
        if not hasattr(self, "_reference"):  # a module switched from ES by SequentialStrategy
            self._reference = None

    # ------------------------------------------------------------------ models and optimizer
    def configure_model(self) -> None:
        """The policy (base class) and, only when ``beta > 0``, a frozen reference loaded from the same name."""
        super().configure_model()
        self.model.train()  # from_pretrained returns eval mode; GRPO trains it (rollouts switch to eval themselves)
        if self.beta > 0 and self._reference is None:
            ref = load_policy(self.model_name, dtype=self.dtype_name, trust_remote_code=self.trust_remote_code).model
            ref.eval().requires_grad_(False)
            self._reference = _Frozen(ref)

    @property
    def reference_model(self) -> torch.nn.Module | None:
        """The frozen reference policy (``None`` when ``beta == 0``); moved to the policy's device on use."""
        if self._reference is None:
            return None
        if next(self._reference.model.parameters()).device != self.device:
            self._reference.model.to(self.device)
        return self._reference.model

    def configure_optimizers(self):
        """AdamW over the policy's trainable parameters, with a linear warmup to a constant LR (stepped per
        optimizer step by :meth:`training_step`)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=self.lr, betas=self.betas, weight_decay=self.weight_decay)
        warmup = self.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    # ------------------------------------------------------------------ the training step
    def rollout_seed(self, step: int) -> int:
        """Seed of the rollouts at optimizer step ``step``: a pure function of (seed, step, rank), so resuming repeats
        the samples and ranks draw independent streams."""
        rank = self.trainer.global_rank if self._trainer is not None else 0
        return int(np.random.SeedSequence([self.seed, step, rank]).generate_state(1)[0])

    def training_step(self, batch: Sequence[dict[str, Any]], batch_idx: int) -> None:
        t0 = time.perf_counter()
        G = self.group_size
        with torch.no_grad():
            rollout, rewards = self.rollout(batch, G, seed=self.rollout_seed(self.global_step), return_logprobs=True)
            correct = self._correct(rollout, rewards, batch)  # [B*G] bool
        rewards = rewards.to(self.device)  # [B*G]
        advantages, group_std = self._advantages(rewards)  # [B*G] each
        t1 = time.perf_counter()
        stats = self._update(rollout, advantages)
        t2 = time.perf_counter()

        lengths = rollout.completion_lengths.float()  # [B*G]
        metrics = {
            "train/reward_mean": rewards.mean(),
            "train/reward_std": rewards.std(),
            "train/accuracy": correct.float().mean(),
            "train/frac_reward_zero_std": torch.isclose(group_std, torch.zeros_like(group_std)).float().mean(),
            "train/completions/mean_length": lengths.mean(),
            "train/completions/clipped_ratio": rollout.truncated.float().mean(),
            "train/time/generate_s": torch.tensor(t1 - t0),
            "train/time/update_s": torch.tensor(t2 - t1),
            "train/lr": torch.tensor(self.optimizers().param_groups[0]["lr"]),
            **{f"train/{k}": v for k, v in stats.items()},
        }
        metrics = {k: torch.as_tensor(v, dtype=torch.float32, device=self.device) for k, v in metrics.items()}
        sync = self.trainer.world_size > 1  # rank means; a no-op reduction costs real time per key on one device
        self.log("train/reward_mean", metrics.pop("train/reward_mean"), prog_bar=True, on_step=True, on_epoch=False,
                 sync_dist=sync, batch_size=len(batch))
        self.log_dict(metrics, on_step=True, on_epoch=False, sync_dist=sync, batch_size=len(batch))

    def _correct(self, rollout: Rollout, rewards: Tensor, batch: Sequence[dict[str, Any]]) -> Tensor:
        """Which completions are correct. Under the standard reward (correct > format ≥ 0, see Task.reward) that is
        read off the rewards; a task with its own reward is asked again."""
        task = self.task
        if type(task).reward is Task.reward and task.correct_reward > max(task.format_reward, 0.0):
            return rewards == task.correct_reward
        repeated = [e for e in batch for _ in range(rollout.num_samples)]
        return torch.tensor([task.is_correct(t, e) for t, e in zip(rollout.texts, repeated)])

    def _advantages(self, rewards: Tensor) -> tuple[Tensor, Tensor]:
        """Group advantages; with ``scale_rewards="batch"`` under DDP the std is that of every rank's rewards (TRL)."""
        world = self.trainer.world_size if self._trainer is not None else 1
        if self.scale_rewards != "batch" or world == 1:
            return group_advantages(rewards, self.group_size, self.scale_rewards)
        everyone = self.all_gather(rewards).reshape(-1)  # [world*B*G], rank-major
        advantages, group_std = group_advantages(everyone, self.group_size, "batch")
        rows = slice(self.global_rank * rewards.numel(), (self.global_rank + 1) * rewards.numel())
        return advantages[rows], group_std[rows]

    def _update(self, rollout: Rollout, advantages: Tensor) -> dict[str, Tensor]:
        """``num_iterations`` optimizer steps, each accumulating gradients over the mini-batches of this rollout."""
        opt, scheduler = self.optimizers(), self.lr_schedulers()
        loss_mask = rollout.completion_mask.float()  # [N, C]
        if self.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).unsqueeze(1).float()
        num_items = loss_mask.sum()
        world = self.trainer.world_size
        if world > 1:  # dapo divides by the global token count; DDP averages gradients over ranks
            num_items = self.trainer.strategy.reduce(num_items.clone(), reduce_op="sum") / world
        n = loss_mask.shape[0]
        size = self.mini_batch_size or n
        chunks = [slice(i, min(i + size, n)) for i in range(0, n, size)]
        sums: dict[str, Tensor] = {}
        grad_norms = []
        self.model.train()
        for _ in range(self.num_iterations):
            for j, rows in enumerate(chunks):
                sync = j == len(chunks) - 1  # all-reduce gradients once per optimizer step
                with nullcontext() if sync or world == 1 else self.trainer.strategy.block_backward_sync():
                    loss, stats = self._minibatch_loss(rollout, rows, advantages[rows], loss_mask[rows], num_items,
                                                       len(chunks))
                    self.manual_backward(loss)
                tokens = stats.pop("num_tokens")
                sums["_tokens"] = sums.get("_tokens", 0) + tokens
                for k, v in stats.items():  # token-weighted over mini-batches and passes
                    sums[k] = sums.get(k, 0) + (v * tokens if k != "policy_loss" else v)
            grad_norms.append(self._clip_and_norm(opt))
            opt.step()
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        tokens = sums.pop("_tokens").clamp(min=1.0)
        # policy_loss: dapo's mini-batch losses add up to the batch loss; the others are means per mini-batch
        passes = self.num_iterations * (1 if self.loss_type == "dapo" else len(chunks))
        out = {k: (v / passes if k == "policy_loss" else v / tokens) for k, v in sums.items()}
        out["grad_norm"] = torch.stack(grad_norms).mean()
        return out

    def _minibatch_loss(
        self, rollout: Rollout, rows: slice, advantages: Tensor, loss_mask: Tensor, num_items: Tensor,
        accumulation_steps: int,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        T = self.sampling.temperature
        with_entropy_grad = self.entropy_coef != 0.0
        share = self.share_prompt_prefix
        logps, entropy = completion_logprobs(self.model, rollout, rows, T, entropy_grad=with_entropy_grad,
                                             share_prompt=share)
        ref_logps = None
        if self.beta > 0:
            with torch.no_grad():
                ref_logps, _ = completion_logprobs(self.reference_model, rollout, rows, T, entropy=False,
                                                   share_prompt=share)
        return grpo_loss(
            logps, rollout.logprobs[rows].to(logps), advantages, loss_mask,
            loss_type=self.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
            ref_logps=ref_logps, beta=self.beta, kl_importance_correction=self.kl_importance_correction,
            entropy=entropy, entropy_coef=self.entropy_coef, max_completion_length=self.sampling.max_new_tokens,
            num_items=num_items, accumulation_steps=accumulation_steps,
        )

    def _clip_and_norm(self, opt) -> Tensor:
        """Global gradient norm before clipping (logged as ``grad_norm``), then clip through Lightning."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), device=self.device)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        elif self.trainer.world_size > 1 and self.sharded:  # FSDP1: each rank holds a disjoint piece of every gradient
            from es_lightning.es.sharding import all_reduce_sum

            norm = torch.tensor(all_reduce_sum([float(norm) ** 2], norm.device)[0] ** 0.5, device=norm.device)
        if self.max_grad_norm:
            self.clip_gradients(opt, gradient_clip_val=self.max_grad_norm, gradient_clip_algorithm="norm")
        return norm.detach().float()


def _check_config(group_size, lr, epsilon_low, epsilon_high, beta, loss_type, scale_rewards, num_iterations,
                  mini_batch_size, warmup_steps, temperature) -> None:
    """Refuse settings that cannot train, naming the fix."""
    if group_size < 2:
        raise ValueError(f"group_size must be >= 2 (GRPO's baseline is the group mean), got {group_size}; try 8")
    if lr <= 0:
        raise ValueError(f"lr must be > 0, got {lr}")
    if epsilon_low < 0 or epsilon_high < 0:
        raise ValueError(f"epsilon_low and epsilon_high must be >= 0 (e.g. 0.2 and 0.28), got {epsilon_low}, "
                         f"{epsilon_high}")
    if epsilon_low >= 1:
        raise ValueError(f"epsilon_low must be < 1 (the ratio's lower clip 1 - epsilon_low must be > 0), got "
                         f"{epsilon_low}")
    if beta < 0:
        raise ValueError(f"beta (KL coefficient) must be >= 0, got {beta}; 0 disables the KL term")
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}; 'dapo' is TRL's default")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r} ('none' = Dr. GRPO)")
    if num_iterations < 1:
        raise ValueError(f"num_iterations must be >= 1, got {num_iterations}")
    if mini_batch_size is not None and mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be >= 1 or None (all completions at once), got {mini_batch_size}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if temperature <= 0:
        raise ValueError(f"GRPO samples its groups: temperature must be > 0 (greedy groups are identical), got "
                         f"{temperature}; use 1.0")
