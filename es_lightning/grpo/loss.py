"""The GRPO objective as pure functions: group-relative advantages and the clipped per-token policy loss.

Both follow TRL 1.16's ``GRPOTrainer`` line for line (``_generate_and_score_completions`` for the advantages,
``_compute_loss`` for the loss) so that a run here and a run there optimise the same number; ``tests/test_grpo.py``
checks them against formulas written out by hand and against TRL itself.

* GRPO: Shao et al. 2024, "DeepSeekMath", §4.1 — group baseline, PPO-clipped ratio, k3 KL to a reference.
* Dr. GRPO: Liu et al. 2025, "Understanding R1-Zero-Like Training" — no std scaling, constant length normaliser.
* DAPO: Yu et al. 2025 — clip-higher (``epsilon_high`` > ``epsilon_low``) and token-level normalisation.
* k3: Schulman 2020, "Approximating KL Divergence": ``exp(r) - r - 1`` with ``r = log π_ref - log π_θ``; unbiased
  for KL(π_θ ‖ π_ref) under samples of π_θ and always ≥ 0.
"""

from __future__ import annotations

import torch
from torch import Tensor

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
ADVANTAGE_EPS = 1e-4  # TRL's epsilon in (r - mean) / (std + eps)


def group_advantages(rewards: Tensor, group_size: int, scale_rewards: str = "group") -> tuple[Tensor, Tensor]:
    """Â_i = (r_i − mean_G r) / (std_G r + ε), with the std of the group, of the batch, or none (Dr. GRPO).

    ``rewards`` are prompt-major (row ``i * G + j`` is sample ``j`` of prompt ``i``). For ``"batch"`` pass the rewards
    of every rank (gathered) to match TRL's global std. Returns ``(advantages [N], group_std [N])``; ``group_std`` is 0
    for a group whose rewards are all equal (its advantages are exactly 0: no gradient).
    """
    grouped = rewards.view(-1, group_size)  # [B, G]
    mean = grouped.mean(1, keepdim=True)  # [B, 1]
    group_std = grouped.std(1, keepdim=True).expand_as(grouped).reshape(-1)  # [N] unbiased, as TRL's nanstd
    advantages = (grouped - mean).reshape(-1)  # [N]
    if scale_rewards == "group":
        advantages = advantages / (group_std + ADVANTAGE_EPS)
    elif scale_rewards == "batch":
        advantages = advantages / (rewards.std() + ADVANTAGE_EPS)
    elif scale_rewards != "none":
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    return advantages, group_std


def grpo_loss(
    logps: Tensor,  # [N, C] log π_θ(o_t | q, o_<t), with grad
    old_logps: Tensor,  # [N, C] log π_old of the same tokens (the rollout's), no grad
    advantages: Tensor,  # [N]
    mask: Tensor,  # [N, C] 1 on tokens that enter the loss
    *,
    loss_type: str = "dapo",
    epsilon_low: float = 0.2,
    epsilon_high: float = 0.2,
    ref_logps: Tensor | None = None,  # [N, C] log π_ref; KL term when beta > 0
    beta: float = 0.0,
    kl_importance_correction: bool = True,
    entropy: Tensor | None = None,  # [N, C] policy entropy; with grad when entropy_coef > 0
    entropy_coef: float = 0.0,
    max_completion_length: int | None = None,
    num_items: float | Tensor | None = None,
    accumulation_steps: int = 1,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clipped per-token loss −min(ρÂ, clip(ρ, 1−ε_low, 1+ε_high)Â) + β·KL_k3, aggregated by ``loss_type``.

    Aggregation (TRL 1.16 ``GRPOTrainer._compute_loss``), for one mini-batch of an accumulation window of
    ``accumulation_steps`` mini-batches:

    * ``grpo``: mean over sequences of each sequence's token mean (Shao et al.), ÷ ``accumulation_steps``.
    * ``bnpo``: token mean over the mini-batch, ÷ ``accumulation_steps``.
    * ``dr_grpo``: token sum ÷ (rows × ``max_completion_length``), ÷ ``accumulation_steps`` (Liu et al.).
    * ``dapo``: token sum ÷ ``num_items``, the active tokens of the whole window (all mini-batches; under DDP the
      global count ÷ world size, since DDP averages gradients) (Yu et al.).

    The entropy bonus is ``entropy_coef`` × the token mean of ``entropy``, ÷ ``accumulation_steps`` whatever the loss
    type, as in TRL. With ``kl_importance_correction`` (TRL's ``use_bias_correction_kl``, default on) the k3 term is
    weighted by ρ, which makes its gradient the unbiased reverse-KL gradient (DeepSeek-V3.2 report).

    Returns ``(loss, diagnostics)``; diagnostics are detached token means over ``mask`` (``policy_loss`` is the loss
    before the ÷ ``accumulation_steps``, as TRL logs it) plus ``num_tokens``.
    """
    mask = mask.to(logps.dtype)
    advantages = advantages.unsqueeze(1)  # [N, 1]
    ratio = torch.exp(logps - old_logps)  # [N, C]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)  # [N, C]
    per_token_loss = -torch.min(ratio * advantages, clipped * advantages)  # [N, C]
    per_token_kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs ref_logps (the frozen reference policy's log-probs)")
        log_ref_ratio = ref_logps - logps  # [N, C]
        per_token_kl = torch.exp(log_ref_ratio) - log_ref_ratio - 1  # [N, C] k3 estimator
        if kl_importance_correction:
            per_token_kl = per_token_kl * ratio
        per_token_loss = per_token_loss + beta * per_token_kl

    num_tokens = mask.sum()
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / num_tokens.clamp(min=1.0)
    elif loss_type == "dr_grpo":
        if max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' needs max_completion_length (the constant length normaliser)")
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    elif loss_type == "dapo":
        normalizer = num_tokens if num_items is None else torch.as_tensor(num_items, dtype=logps.dtype)
        loss = (per_token_loss * mask).sum() / normalizer.clamp(min=1.0)
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")
    policy_loss = loss.detach()
    if loss_type != "dapo":
        loss = loss / accumulation_steps
    if entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy of the policy")
        loss = loss - entropy_coef * (entropy * mask).sum() / num_tokens.clamp(min=1.0) / accumulation_steps

    def masked_mean(x: Tensor) -> Tensor:
        return (x.detach() * mask).sum() / num_tokens.clamp(min=1.0)

    is_low = (ratio < 1 - epsilon_low) & (advantages < 0)  # [N, C]
    is_high = (ratio > 1 + epsilon_high) & (advantages > 0)  # [N, C]
    stats = {
        "policy_loss": policy_loss,
        "clip_ratio/low_mean": masked_mean(is_low.to(mask.dtype)),
        "clip_ratio/high_mean": masked_mean(is_high.to(mask.dtype)),
        "clip_ratio/region_mean": masked_mean((is_low | is_high).to(mask.dtype)),
        "num_tokens": num_tokens.detach(),
    }
    if per_token_kl is not None:
        stats["kl"] = masked_mean(per_token_kl)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy)
    return loss, stats
