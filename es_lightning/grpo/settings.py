"""GRPOSettings: every GRPO knob in one dataclass, named as in TRL's ``GRPOConfig`` where they exist and documented once
(the docstrings are ``GRPOModule``'s ``--help``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from es_lightning.algorithms import validate_choice
from es_lightning.grpo.loss import LOSS_TYPES, SCALE_REWARDS


@dataclass
class GRPOSettings:
    """The GRPO knobs, named as in TRL's ``GRPOConfig`` where they exist (these docs are ``GRPOModule``'s ``--help``)."""

    group_size: int = 8
    """Completions per prompt, G (Ba et al. 2026 use 8); at least 2, the group mean is the baseline."""
    lr: float = 1e-6
    """AdamW learning rate (Ba et al. 2026: 1e-6 for 0.5-7B models; the 1M-parameter built-in model wants ~1e-4 to
    3e-4, see recipes/grpo.yaml)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    warmup_steps: int = 0
    """Linear LR warm-up over this many optimizer steps, then constant."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (None or 0 = no clipping); TRL's default 1.0."""
    num_iterations: int = 1
    """Optimisation passes over each batch of rollouts (μ in Shao et al. 2024, Alg. 1); each is one optimizer step, so
    global_step advances num_iterations per batch."""
    mini_batch_size: int | None = None
    """Completions per forward/backward (None = all B·G at once); gradients accumulate (a memory knob). Must divide
    the B·G completions of a rank's batch (checked at fit setup; larger = all at once): equal mini-batches."""
    epsilon_low: float = 0.2
    """PPO clip below: the ratio is clipped to [1 − epsilon_low, 1 + epsilon_high]."""
    epsilon_high: float = 0.2
    """PPO clip above; DAPO's "clip-higher" (Yu et al. 2025) uses 0.28."""
    beta: float = 0.0
    """Coefficient of the k3 KL estimate (Schulman 2020) to a frozen copy of the starting policy; 0 (TRL's and DAPO's
    default) skips loading the reference."""
    kl_importance_correction: bool = True
    """Weight the KL term by the importance ratio (TRL's use_bias_correction_kl): the unbiased reverse-KL gradient."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient (loss −= coef × mean token entropy)."""
    loss_type: str = "dapo"
    """Token aggregation as TRL 1.16 defines it: 'grpo' (per-sequence mean, Shao et al.), 'bnpo' (mini-batch token
    mean), 'dr_grpo' (÷ rows × max_new_tokens, Liu et al. 2025), 'dapo' (÷ tokens of the whole batch, Yu et al. 2025;
    TRL's default)."""
    scale_rewards: str = "group"
    """Advantage scaling: 'group' (GRPO), 'batch' (std of the whole batch, across ranks), 'none' (Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """Drop completions that hit max_new_tokens from the loss (DAPO's overlong filtering)."""
    share_prompt_prefix: bool = True
    """In the training forward, run each prompt once and share its key/value cache across its G completions (same
    log-probs and gradients to float tolerance, fewer FLOPs); false runs every prompt + completion row in full, as TRL
    does (for models whose cache cannot be reordered)."""
    gradient_checkpointing: bool = False
    """Recompute each transformer block in the backward instead of keeping its activations (non-reentrant activation
    checkpointing, as TRL's and verl's ``gradient_checkpointing``): per token and layer 2H bytes kept instead of
    ~30H + 8I — Qwen2.5-1.5B: 216 KB instead of 3.3 MB per token — for ~33% more step FLOPs
    (es_lightning/grpo/logprobs.py has the memory model). Needs share_prompt_prefix: false (checkpointed layers drop
    the key/value cache the completions would read the prompt from)."""
    logprob_chunk_size: int = 512
    """Completion tokens projected to the vocabulary at once in the training forward (memory, not results): ~18·V
    bytes per token while a chunk runs — 1.4 GB at V = 151,936 and 512 — and nothing of size V kept for the backward
    (TRL's selective_log_softmax idea, chunked)."""

    def __post_init__(self) -> None:
        self.betas = tuple(self.betas)
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (GRPO's baseline is the group mean), got {self.group_size}; try 8")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite number > 0, got {self.lr}; Ba et al. use 1e-6")
        if self.epsilon_low < 0 or self.epsilon_high < 0:
            raise ValueError(f"epsilon_low and epsilon_high must be >= 0 (e.g. 0.2 and 0.28), got {self.epsilon_low}, "
                             f"{self.epsilon_high}")
        if self.epsilon_low >= 1:
            raise ValueError(f"epsilon_low must be < 1 (the ratio's lower clip 1 - epsilon_low must be > 0), got "
                             f"{self.epsilon_low}")
        if self.beta < 0:
            raise ValueError(f"beta (KL coefficient) must be >= 0, got {self.beta}; 0 disables the KL term")
        validate_choice("loss_type", self.loss_type, LOSS_TYPES, "'dapo' is TRL's default")
        validate_choice("scale_rewards", self.scale_rewards, SCALE_REWARDS, "'none' = Dr. GRPO")
        if self.num_iterations < 1:
            raise ValueError(f"num_iterations must be >= 1, got {self.num_iterations}")
        if self.mini_batch_size is not None and self.mini_batch_size < 1:
            raise ValueError(f"mini_batch_size must be >= 1 or None (all completions at once), got {self.mini_batch_size}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.gradient_checkpointing and self.share_prompt_prefix:
            raise ValueError("gradient_checkpointing: true needs share_prompt_prefix: false (checkpointed layers drop the "
                             "key/value cache the completions would read the shared prompt from); set share_prompt_prefix: "
                             "false, or gradient_checkpointing: false")
        if self.logprob_chunk_size < 1:
            raise ValueError(f"logprob_chunk_size must be >= 1 (tokens per vocabulary projection), got "
                             f"{self.logprob_chunk_size}; 512 is a good size")
        if self.max_grad_norm is not None and self.max_grad_norm < 0:
            raise ValueError(f"max_grad_norm must be >= 0 or None (no clipping), got {self.max_grad_norm}")
