"""The training metrics ES and GRPO share, computed in one place and logged under the same keys (README "Design", "Same
metrics for both algorithms"), so a GRPO run, an ES run and a GRPO→ES run can be read side by side.

Each algorithm fills a :class:`StepMetrics` after its update; :meth:`ReasoningModule.log_step` turns it into

=================================  ===========================================================================
``train/reward_mean``, ``_std``    mean / spread (population std) of the finite rewards the update used
                                   (ES: one per population member; GRPO: one per completion)
``train/frac_reward_zero_std``     ES: 1 when every member scored the same (a zero update), with
                                   ``prompt_groups`` the share of member groups that did; GRPO: share of groups
                                   whose completions scored the same (zero advantage) — TRL's name; under DDP
                                   GRPO's is of every rank's kept groups (``StepMetrics.shares``), ES's of the
                                   whole population (every rank scores it from the ranks' summed scores)
``train/accuracy``                 share of the step's completions the verifier accepts (GRPO: of the kept ones)
``train/completions/mean_length``  mean completion length in tokens; ``clipped_ratio``: share that hit
                                   ``max_new_tokens`` (TRL's names)
``train/entropy``                  mean token entropy (nats) of the policy at the sampling temperature (before
                                   top-p; ``Rollout.entropy``) — only when the
                                   rollouts are sampled (temperature > 0) and, for ES, the policy's forward holds
                                   each member (not vLLM members perturbed engine-side or served as LoRA adapters)
``train/lr``                       the optimizer's learning rate (GRPO: AdamW's; ES: α)
``train/time/*_s``                 seconds spent generating, scoring and updating on this rank
=================================  ===========================================================================

plus each algorithm's own (``extra``: ES ``js_succ``, ``pass_pop``, ``update_norm``; GRPO ``clip_ratio/*``, ``kl``,
``grad_norm``), and ``train/drift`` from :class:`~es_lightning.callbacks.ParameterDrift`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["StepMetrics", "device_time", "shared_metrics"]


@dataclass
class StepMetrics:
    """What one training step reports. Values are rank-local; the module averages them over ranks (TRL's convention),
    except ``train/reward_mean`` and ``train/reward_std``, which are of every rank's rewards, and the ``shares``, which
    are of every rank's counts."""

    rewards: Tensor  # the rewards the update used: ES [N] (per member), GRPO [B*G] (per completion); non-finite = dropped
    frac_reward_zero_std: float
    accuracy: float
    mean_length: float
    clipped_ratio: float
    entropy: float | None  # None: greedy rollouts (nothing sampled)
    batch_size: int  # prompts in the step's batch
    times: dict[str, float] = field(default_factory=dict)  # {"generate": s, "score": s, "update": s}
    extra: dict[str, float] = field(default_factory=dict)  # the algorithm's own, keys without the "train/" prefix
    # metrics that are a share of counted things, {name: (counted, out of)} on this rank (GRPO's frac_reward_zero_std:
    # flat groups of the kept groups), keys without the "train/" prefix: under DDP the share of every rank's counts
    # (sum over ranks, then divided), not the mean of the ranks' shares — a rank that kept no group has no share (NaN)
    # and ranks that kept different numbers weigh by their counts. Its value in the other fields is this rank's share.
    shares: dict[str, tuple[float, float]] = field(default_factory=dict)


def shared_metrics(step: StepMetrics, lr: float) -> dict[str, float]:
    """``{"train/<name>": value}`` for the shared keys, the timings and the algorithm's own metrics."""
    rewards = step.rewards.detach().double().cpu()
    kept = rewards[torch.isfinite(rewards)]
    out = {
        "train/reward_mean": float(kept.mean()) if kept.numel() else float("nan"),
        "train/reward_std": float(kept.std(unbiased=False)) if kept.numel() else float("nan"),
        "train/frac_reward_zero_std": float(step.frac_reward_zero_std),
        "train/accuracy": float(step.accuracy),
        "train/completions/mean_length": float(step.mean_length),
        "train/completions/clipped_ratio": float(step.clipped_ratio),
        "train/lr": float(lr),
    }
    if step.entropy is not None:
        out["train/entropy"] = float(step.entropy)
    out.update({f"train/time/{k}_s": float(v) for k, v in step.times.items()})
    out.update({f"train/{k}": _scalar(v) for k, v in step.extra.items()})
    return out


def device_time(device: torch.device | str) -> float:
    """``time.perf_counter()`` once the work queued on ``device`` is done: CUDA runs kernels asynchronously, so a clock
    read right after the last call of a phase stops before the GPU has finished it (a GRPO update's last backward and
    optimizer step) and that time is counted in the next phase instead. The clock of the ``train/time/*_s`` metrics."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def masked_token_mean(values: Tensor, mask: Tensor) -> float:
    """Token mean of ``values [R, C]`` over ``mask [R, C]`` (0 when there are no tokens)."""
    mask = mask.to(torch.float64)
    tokens = float(mask.sum())
    return float((values.to(torch.float64) * mask).sum()) / tokens if tokens else 0.0


def _scalar(v) -> float:
    return float(v.detach().float().cpu()) if isinstance(v, Tensor) else float(v)
