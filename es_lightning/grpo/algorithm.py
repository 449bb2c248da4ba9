"""GRPO: group-relative policy optimisation (Shao et al. 2024, DeepSeekMath §4.1) — settings and training step.

One training step (one batch of prompts):

1. **Rollout** — ``group_size`` completions per prompt from the current policy, seeded from ``(seed, global_step,
   rank)`` so a resumed run draws the same samples; graded once each by the task (:meth:`ReasoningModule.score`).
2. **Advantages** — ``(r − mean_G r) / (std_G r + ε)``; ``scale_rewards="none"`` is Dr. GRPO (Liu et al. 2025). A group
   with a NaN/inf reward is dropped (zero advantage, masked out of the loss; :mod:`es_lightning.scoring`).
3. **Update** — ``num_iterations`` passes (μ in the GRPO paper); each pass runs forward/backward over mini-batches of
   ``mini_batch_size`` completions, accumulating gradients, then takes **one** optimizer step (clip, AdamW, LR
   schedule). ``trainer.global_step`` counts optimizer steps: ``num_iterations`` per batch. This is TRL's default
   layout (``steps_per_generation == gradient_accumulation_steps``): ``mini_batch_size`` is a memory knob that leaves the
   objective unchanged for ``dapo``/``dr_grpo`` and splits the normalisation per mini-batch for ``grpo``/``bnpo``, as TRL.

π_old is the log-prob the generator recorded while sampling (same weights, same temperature): no extra forward pass; for
``num_iterations > 1`` the importance ratio measures the drift of the later passes. The training forward runs each
prompt once and shares its key/value cache with the G completions of its group (``share_prompt_prefix``).

Precision (README "Design", "Master weights in fp32"): with bf16/fp16 weights the optimizer is
:class:`~es_lightning.precision.MasterAdamW` — AdamW applied to an fp32 master of each weight kept in the optimizer's
state (fp32 moments too), the weight being the master rounded once per step — so a step at Ba et al.'s lr = 1e-6,
~1/100 of a bf16 ulp at a weight of 0.02, is kept instead of rounded away. Not fp32 parameters with bf16 autocast
(Lightning's ``bf16-mixed``, verl's FSDP actor): the GPU trainer fragments use ``bf16-true``, which makes the
parameters bf16 whatever the module asks; generation (and vLLM, and ES after a switch) runs on the weights the model
holds, which are then bf16 at half the memory and bandwidth; and a master keyed by the model's own parameter goes
through ``torch.distributed.checkpoint``'s sharded optimizer state unchanged (es_lightning/precision.py has the
reasons and the memory table: 16 bytes per parameter, as fp32 training). ``master_dtype: same`` is plain AdamW on the
weights. Under ``bf16-mixed`` the parameters are fp32 (no master) and Lightning runs the step, generation included,
under bf16 autocast: the log-probs a rollout records and the training forward's come from the same autocast forward.

Memory: ``mini_batch_size`` completions per forward/backward, log-probs projected ``logprob_chunk_size`` tokens at a
time (:mod:`es_lightning.grpo.logprobs`: never ``[rows, C, V]`` in fp32), ``gradient_checkpointing`` for the
activations; the Qwen recipes' headers give the memory model.

Features: DDP and FSDP through the Trainer's strategy (groups stay on one rank; the ``dapo`` token count and the
``batch`` reward std are global); exact resume; a frozen reference for the KL term loaded only when ``beta > 0`` and kept
out of checkpoints (not sharded by FSDP: a plain module on each rank).
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from es_lightning.algorithms import Algorithm, register_algorithm
from es_lightning.generation import Rollout, SamplingParams
from es_lightning.grpo.logprobs import completion_logprobs, enable_gradient_checkpointing
from es_lightning.grpo.loss import group_advantages, grpo_loss
from es_lightning.grpo.settings import GRPOSettings
from es_lightning.metrics.training import StepMetrics, device_time, masked_token_mean
from es_lightning.policy import load_policy
from es_lightning.precision import MasterAdamW
from es_lightning.scoring import check_some_kept

if TYPE_CHECKING:
    from es_lightning.modules.base import ReasoningModule

__all__ = ["GRPOAlgorithm", "GRPOSettings"]


class _Frozen:
    """Holds the reference policy outside ``nn.Module`` registration: not in ``state_dict``, checkpoints or the
    optimizer, and never wrapped by DDP."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model


@register_algorithm
class GRPOAlgorithm(Algorithm):
    """GRPO / Dr. GRPO / DAPO with the knobs and metrics of TRL's ``GRPOTrainer`` (names kept where they exist)."""

    name = "grpo"
    Settings = GRPOSettings
    settings: GRPOSettings

    def __init__(self, settings: GRPOSettings | dict | None = None) -> None:
        super().__init__(settings)
        self._reference: _Frozen | None = None

    @classmethod
    def default_sampling(cls) -> dict[str, Any]:
        return {"temperature": 1.0}  # sample the policy as it is

    @classmethod
    def check_sampling(cls, sampling: SamplingParams) -> None:
        if sampling.temperature <= 0:
            raise ValueError(f"GRPO samples its groups: temperature must be > 0 (greedy groups are identical), got "
                             f"{sampling.temperature}; use 1.0")

    @property
    def steps_per_batch(self) -> int:
        return self.settings.num_iterations

    # ------------------------------------------------------------------ models and optimizer
    def configure_model(self, module: ReasoningModule) -> None:
        """Train mode (``from_pretrained`` returns eval mode), activation checkpointing when asked and, only when
        ``beta > 0``, the frozen reference."""
        module.model.train()
        if self.settings.gradient_checkpointing:
            enable_gradient_checkpointing(module.model)
        if self.settings.beta > 0 and self._reference is None:
            ref = load_policy(module.model_name, **module.policy_load_options()).model
            ref.eval().requires_grad_(False)
            self._reference = _Frozen(ref)

    def reference_model(self, module: ReasoningModule) -> torch.nn.Module | None:
        """The frozen reference policy (``None`` when ``beta == 0``), moved to the policy's device and cast to its
        parameters' dtype on use, as TRL loads its reference: under ``bf16-true`` Lightning converts the policy to
        bf16 after it loaded, and an fp32 reference would double the reference's memory."""
        if self._reference is None:
            return None
        ref, dtype = next(self._reference.model.parameters()), next(module.model.parameters()).dtype
        if ref.device != module.device or (ref.dtype != dtype and dtype.is_floating_point):
            self._reference.model.to(device=module.device, dtype=dtype)  # buffers too, as Lightning's conversion
        return self._reference.model

    def configure_optimizers(self, module: ReasoningModule):
        """AdamW over the policy's trainable parameters — on fp32 masters of bf16/fp16 ones (:class:`MasterAdamW`,
        ``module.master_dtype``; see the module docstring) — with a linear warmup to a constant LR (stepped per
        optimizer step by :meth:`training_step`). PyTorch's fused AdamW kernel where the parameters live on a CPU or a
        CUDA device, as TRL's ``GRPOTrainer`` steps by default (transformers' ``optim="adamw_torch_fused"``); on the
        built-in model's CPU step it takes ~1 ms instead of ~3.5. Not under Lightning's mixed precisions
        (``16-mixed``, ``bf16-mixed``): there a fused optimizer would unscale the gradients itself, and Lightning
        then refuses the gradient clipping ``max_grad_norm`` asks for."""
        s = self.settings
        params = [p for p in module.model.parameters() if p.requires_grad]
        trainer = getattr(module, "_trainer", None)
        mixed = trainer is not None and "mixed" in str(trainer.precision)
        fused = bool(params) and not mixed and all(p.device.type in ("cpu", "cuda") for p in params)
        optimizer = MasterAdamW(params, lr=s.lr, betas=s.betas, weight_decay=s.weight_decay,
                                master_dtype=module.master_dtype_for(params), fused=fused or None)
        warmup = s.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / (warmup + 1)))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def apply_settings(self, optimizers, schedulers, changed) -> None:
        """A changed ``betas`` or ``weight_decay`` into AdamW's param groups; a changed ``lr`` (or ``warmup_steps``) as
        the warm-up scheduler's base, with the current LR recomputed from it by ``LambdaLR``'s own formula."""
        s = self.settings
        values = {k: v for k, v in (("betas", tuple(s.betas)), ("weight_decay", s.weight_decay)) if k in changed}
        if "lr" in changed:
            values.update(lr=s.lr, initial_lr=s.lr)
        for opt in optimizers:
            for group in opt.param_groups:
                group.update(values)
        if "lr" not in changed and "warmup_steps" not in changed:
            return
        for scheduler in schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
                scheduler.base_lrs = [s.lr] * len(scheduler.base_lrs)
                for group, base, factor in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
                    group["lr"] = base * factor(scheduler.last_epoch)
                scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]

    def check_batch(self, batch_size: int) -> None:
        """``mini_batch_size`` must divide the ``batch_size × group_size`` completions of a rank's batch (or hold them
        all): equal mini-batches keep ``grpo``/``bnpo``'s per-mini-batch normalisation the same for every row."""
        s = self.settings
        rows = batch_size * s.group_size
        if s.mini_batch_size is not None and s.mini_batch_size < rows and rows % s.mini_batch_size:
            fits = [d for d in range(1, rows + 1) if rows % d == 0 and d <= s.mini_batch_size]
            raise ValueError(
                f"mini_batch_size={s.mini_batch_size} does not divide the {rows} completions of a batch (data.batch_size "
                f"{batch_size} × group_size {s.group_size}); use a divisor of {rows}, e.g. mini_batch_size: {fits[-1]}"
            )

    # ------------------------------------------------------------------ the training step
    def rollout_seed(self, module: ReasoningModule, step: int) -> int:
        """Seed of the rollouts at optimizer step ``step``: a pure function of (seed, step, rank), so resuming repeats
        the samples and ranks draw independent streams."""
        rank = module.trainer.global_rank if module._trainer is not None else 0
        return int(np.random.SeedSequence([module.seed, step, rank]).generate_state(1)[0])

    def training_step(self, module: ReasoningModule, batch: list[dict[str, Any]], batch_idx: int) -> None:
        G, step = self.settings.group_size, module.global_step
        t0 = device_time(module.device)  # the clocks wait for the GPU: its queued work belongs to the phase before
        with torch.no_grad():
            rollout = module.sample(batch, G, seed=self.rollout_seed(module, step), return_logprobs=True)
        t1 = time.perf_counter()
        scores = module.score(rollout.texts, [e for e in batch for _ in range(G)], step=step)
        t2 = time.perf_counter()
        kept = self._kept_rows(module, scores.finite, step)  # [B*G] bool: rows of groups with finite rewards
        rewards = torch.where(kept, scores.rewards, torch.zeros_like(scores.rewards)).to(module.device)  # [B*G]
        advantages, group_std = self.advantages(module, rewards)  # [B*G] each; a dropped group: all 0
        stats = self.update(module, rollout, advantages, kept.to(module.device))
        t3 = device_time(module.device)  # the last backward and optimizer step may still be running on a GPU

        kept_cpu = kept.cpu()
        # shares of this rank's kept groups / rows; log_step logs them under DDP as shares of every rank's counts (a
        # rank whose groups were all dropped has none of its own). No rank keeps a group: _kept_rows stopped the fit.
        kept_group = kept_cpu.view(-1, G)[:, 0]  # [B]
        flat_group = torch.isclose(group_std, torch.zeros_like(group_std)).cpu().view(-1, G)[:, 0]  # [B]
        flat_groups, kept_groups = int((flat_group & kept_group).sum()), int(kept_group.sum())
        correct_rows, kept_rows = int(scores.correct[kept_cpu].sum()), int(kept_cpu.sum())
        logged = module.log_step(StepMetrics(
            rewards=torch.where(kept_cpu, scores.rewards, torch.full_like(scores.rewards, float("nan"))),
            frac_reward_zero_std=flat_groups / kept_groups if kept_groups else float("nan"),
            accuracy=correct_rows / kept_rows if kept_rows else float("nan"),
            mean_length=float(rollout.completion_lengths.to(torch.float32).mean()),
            clipped_ratio=float(rollout.truncated.to(torch.float32).mean()),
            entropy=masked_token_mean(rollout.entropy, rollout.completion_mask),
            batch_size=len(batch),
            times={"generate": t1 - t0, "score": t2 - t1, "update": t3 - t2},
            extra=stats,
            shares={"frac_reward_zero_std": (flat_groups, kept_groups), "accuracy": (correct_rows, kept_rows)},
        ))
        self._warn_flat(module, logged["train/frac_reward_zero_std"], scores.rewards[kept_cpu], step)

    def _warn_flat(self, module: ReasoningModule, frac_flat: float, rewards: Tensor, step: int) -> None:
        """Once a fit: a step whose every group (of every rank) scored one reward within the group has advantages all 0,
        so its policy-gradient update is zero; a run of such steps learns nothing, and only
        ``train/frac_reward_zero_std`` (1.0) would say so. ``frac_flat``: that metric as :meth:`ReasoningModule.log_step`
        logged it, the share of flat groups among every rank's kept groups — 1.0 exactly when every kept group of every
        rank is flat, so every rank decides alike without a collective of its own (a rank whose groups were all dropped
        for NaN/inf rewards adds no group). Not when only some ranks' groups are flat: the gradients DDP averages are
        then not zero. ``rewards`` [kept rows]: this rank's (none on a rank that kept no group)."""
        if frac_flat != 1.0:
            return
        s = self.settings
        values = sorted({float(r) for r in rewards.tolist()})
        scored = f"all {values[0]:g}" if len(values) == 1 else "one value per group"
        others = [f"{name}={value:g}" for name, value in (("beta", s.beta), ("entropy_coef", s.entropy_coef),
                                                          ("weight_decay", s.weight_decay)) if value]
        self.warn_once("flat", (
            f"GRPO step {step}: the {s.group_size} completions of every group scored the same reward ({scored}), so "
            "every advantage is 0 and the policy-gradient update is zero"
            + (f" (only the {' and '.join(others)} term{'s move' if len(others) > 1 else ' moves'} the weights)"
               if others else "")
            + " (train/frac_reward_zero_std is 1.0; a fit of such steps learns nothing). Give the groups something to "
            "tell apart: a larger group_size, a higher temperature (now "
            f"{module.sampling.temperature:g}), an easier task or a shaped reward (e.g. the task's format_reward for a "
            "well-formed answer)"))

    def _kept_rows(self, module: ReasoningModule, finite: Tensor, step: int) -> Tensor:
        """Rows whose whole group has finite rewards; stop when no rank has any such group."""
        G = self.settings.group_size
        groups = finite.view(-1, G).all(-1)  # [B]
        kept, total = int(groups.sum()), groups.numel()
        trainer = module._trainer
        if trainer is not None and trainer.world_size > 1:  # every rank stops together, or none does
            counts = torch.tensor([kept, total], dtype=torch.float64, device=module.device)
            kept, total = (int(x) for x in trainer.strategy.reduce(counts, reduce_op="sum").tolist())
        check_some_kept(kept, total, "group", step)
        if not bool(groups.all()):
            rank_zero_warn(f"GRPO step {step}: {int((~groups).sum())} of {groups.numel()} groups have a NaN/inf reward; "
                           "they are dropped from this update (check the task's reward function)")
        return groups.repeat_interleave(G)

    def advantages(self, module: ReasoningModule, rewards: Tensor) -> tuple[Tensor, Tensor]:
        """Group advantages; with ``scale_rewards="batch"`` under DDP the std is that of every rank's rewards (TRL)."""
        s = self.settings
        world = module.trainer.world_size if module._trainer is not None else 1
        if s.scale_rewards != "batch" or world == 1:
            return group_advantages(rewards, s.group_size, s.scale_rewards)
        everyone = module.all_gather(rewards).reshape(-1)  # [world*B*G], rank-major
        advantages, group_std = group_advantages(everyone, s.group_size, "batch")
        rows = slice(module.global_rank * rewards.numel(), (module.global_rank + 1) * rewards.numel())
        return advantages[rows], group_std[rows]

    def update(self, module: ReasoningModule, rollout: Rollout, advantages: Tensor, kept: Tensor) -> dict[str, Tensor]:
        """``num_iterations`` optimizer steps, each accumulating gradients over the mini-batches of this rollout."""
        s = self.settings
        opt, scheduler = module.optimizers(), module.lr_schedulers()
        loss_mask = rollout.completion_mask.to(torch.float32) * kept.to(torch.float32).unsqueeze(1)  # [N, C]
        if s.mask_truncated_completions:
            loss_mask = loss_mask * (~rollout.truncated).unsqueeze(1).to(torch.float32)
            if bool(rollout.truncated.all()):
                rank_zero_warn(
                    f"GRPO step {module.global_step}: every completion hit max_new_tokens="
                    f"{module.sampling.max_new_tokens}, and mask_truncated_completions drops them all from the loss, so "
                    "this step trains on nothing; raise max_new_tokens or set mask_truncated_completions: false"
                )
        num_items = loss_mask.sum()
        world = module.trainer.world_size
        if world > 1:  # dapo divides by the global token count; DDP averages gradients over ranks
            num_items = module.trainer.strategy.reduce(num_items.clone(), reduce_op="sum") / world
        n = loss_mask.shape[0]
        self.check_batch(n // s.group_size)  # a data loader other than ReasoningDataModule's: checked here
        size = s.mini_batch_size or n
        chunks = [slice(i, min(i + size, n)) for i in range(0, n, size)]
        sums: dict[str, Tensor] = {}
        grad_norms = []
        module.model.train()
        for _ in range(s.num_iterations):
            for j, rows in enumerate(chunks):
                sync = j == len(chunks) - 1  # all-reduce gradients once per optimizer step
                with nullcontext() if sync or world == 1 else module.trainer.strategy.block_backward_sync():
                    loss, stats = self._minibatch_loss(module, rollout, rows, advantages[rows], loss_mask[rows],
                                                       num_items, len(chunks))
                    module.manual_backward(loss)
                tokens = stats.pop("num_tokens")
                sums["_tokens"] = sums.get("_tokens", 0) + tokens
                for k, v in stats.items():  # token-weighted over mini-batches and passes
                    sums[k] = sums.get(k, 0) + (v * tokens if k != "policy_loss" else v)
            grad_norms.append(self._clip_and_norm(module, opt))
            opt.step()
            module.policy_updated()  # a vLLM engine takes the new weights before the next rollout
            opt.zero_grad(set_to_none=True)
            if scheduler is not None:
                scheduler.step()
        tokens = sums.pop("_tokens").clamp(min=1.0)
        # policy_loss: dapo's mini-batch losses add up to the batch loss; the others are means per mini-batch
        passes = s.num_iterations * (1 if s.loss_type == "dapo" else len(chunks))
        out = {k: (v / passes if k == "policy_loss" else v / tokens) for k, v in sums.items()}
        out["grad_norm"] = torch.stack(grad_norms).mean()
        return out

    def _minibatch_loss(self, module: ReasoningModule, rollout: Rollout, rows: slice, advantages: Tensor,
                        loss_mask: Tensor, num_items: Tensor, accumulation_steps: int) -> tuple[Tensor, dict[str, Tensor]]:
        s = self.settings
        T = module.sampling.temperature
        with_entropy = s.entropy_coef != 0.0  # the logged entropy is the rollout's (ReasoningModule.log_step)
        logps, entropy = completion_logprobs(module.model, rollout, rows, T, entropy=with_entropy,
                                             entropy_grad=with_entropy, share_prompt=s.share_prompt_prefix,
                                             chunk_size=s.logprob_chunk_size)
        ref_logps = None
        if s.beta > 0:
            with torch.no_grad():
                ref_logps, _ = completion_logprobs(self.reference_model(module), rollout, rows, T, entropy=False,
                                                   share_prompt=s.share_prompt_prefix, chunk_size=s.logprob_chunk_size)
        loss, stats = grpo_loss(
            logps, rollout.logprobs[rows].to(logps), advantages, loss_mask,
            loss_type=s.loss_type, epsilon_low=s.epsilon_low, epsilon_high=s.epsilon_high,
            ref_logps=ref_logps, beta=s.beta, kl_importance_correction=s.kl_importance_correction,
            entropy=entropy, entropy_coef=s.entropy_coef, max_completion_length=module.sampling.max_new_tokens,
            num_items=num_items, accumulation_steps=accumulation_steps,
        )
        stats.pop("entropy", None)  # logged once, as train/entropy, from the rollout
        return loss, stats

    def _clip_and_norm(self, module: ReasoningModule, opt) -> Tensor:
        """Global gradient norm before clipping (logged as ``grad_norm``), then clip through Lightning."""
        grads = [p.grad for p in module.model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros((), dtype=torch.float32, device=module.device)
        if hasattr(norm, "full_tensor"):  # DTensor under FSDP2
            norm = norm.full_tensor()
        elif module.trainer.world_size > 1 and module.sharded:  # FSDP1: each rank holds a disjoint piece of every grad
            from es_lightning.es.sharding import all_reduce_sum

            norm = torch.tensor(all_reduce_sum([float(norm) ** 2], norm.device)[0] ** 0.5, dtype=torch.float32,
                                device=norm.device)
        if self.settings.max_grad_norm:
            module.clip_gradients(opt, gradient_clip_val=self.settings.max_grad_norm, gradient_clip_algorithm="norm")
        return norm.detach().float()
