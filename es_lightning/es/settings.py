"""ESSettings: every ES knob in one dataclass, each documented once (the docstrings are ``ESModule``'s ``--help``)."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from es_lightning.algorithms import validate_choice
from es_lightning.es.lowrank import check_noise_rank
from es_lightning.es.update import NORMALIZATIONS

UPDATE_SCALES = ("alpha", "textbook")


@dataclass
class ESSettings:
    """The ES knobs, each documented once (these docs are ``ESModule``'s ``--help``)."""

    population_size: int = 32
    """N, population members per step (Ba et al. 2026 and Qiu et al. 2025: 30-32). At least 2, since rewards are
    normalised across members; even when antithetic."""
    sigma: float = 1.5e-3
    """Noise scale σ of the perturbations θ + σε (Ba et al.: 1.5e-3 for Qwen2.5; the built-in ~1M-parameter model needs
    ~5e-3, and σ >= 3e-2 destroys it)."""
    lr: float = 2.5e-4
    """Step size α of θ += α/N Σ z ε (Ba et al.: 2.5e-4, with 1/σ folded in; the built-in model: 3e-3, 1e-2 lost
    Pass@1). 0 evaluates the population without moving the weights."""
    update_scale: str = "alpha"
    """'alpha' (θ += α/N Σ z ε, both papers) or 'textbook' (θ += α/(Nσ) Σ z ε, the Gaussian-smoothing gradient of
    Salimans et al. 2017)."""
    reward_normalization: str = "zscore"
    """How member rewards become update weights: 'zscore' (both papers), 'rank' (centred ranks, Salimans et al.),
    'centered' or 'none'."""
    antithetic: bool = False
    """Mirrored pairs (ε, −ε) (Salimans et al. 2017); off in both papers. Needs an even population_size."""
    samples_per_member: int = 1
    """Completions per prompt per member (Ba et al.: 1, greedy); more gives a finer reward when sampling."""
    members_per_batch: int = 1
    """Members scored together in one batched generate, each block of rows through its own weights. 1 perturbs the
    policy in place member by member (one extra model-sized buffer); k > 1 holds k perturbed copies (and, when a rank's
    members fit in one batch, their fp32 noise) and is much faster when per-call overhead dominates. Same rewards."""
    noise_rank: int = 0
    """Rank r of each matrix's perturbation. 0 (default): full-rank Gaussian ε, as Ba et al. 2026 and Qiu et al. 2025.
    r >= 1: EGGROLL's low-rank noise (Sarkar et al. 2025, "Evolution Strategies at the Hyperscale", arXiv 2511.16652):
    a matrix W [m, n] gets σ·A Bᵀ/√r (A [m, r], B [n, r] Gaussian; entries of variance σ², as full-rank), vectors keep
    full-rank noise. Members then run through the shared weights, adding a rank-r term each: no weight copies, so with
    members_per_batch = population_size the whole population is one batched generate at any model size (O(N·r·(m+n))
    extra per matrix, not O(N·m·n)); the update Σ z E is still full-rank (rank up to N·r), one matmul per matrix.
    EGGROLL learns from r = 1. At most the largest smaller side of a perturbed matrix (a thinner matrix, such as an
    MoE's shared-expert gate [1, d], gets a perturbation of its full rank from the r factors); one device, DDP or FSDP2
    (every rank runs the members on its share of the prompts; FSDP1 is refused); on vLLM each member is a LoRA adapter
    over the blocks' linear layers (set trainable to them: es_lightning/es/vllm_lora.py)."""
    prompt_groups: int = 1
    """G: split the population into G groups of consecutive members (N/G each; antithetic pairs stay together) and
    each step's batch into G equal slices of consecutive prompts; group g is scored only on slice g, and
    reward_normalization is applied within each group, so a member is compared only with members that saw the same
    prompts (as GRPO's advantages are within one prompt's group). 1 (default): every member sees every prompt (Ba et al.,
    Qiu et al.). G > 1 is how EGGROLL-style large populations (Sarkar et al. 2025) keep a step's completions at
    N·B·n/G: more noise directions for the same generation cost, each member on fewer prompts. The batch size must be a
    multiple of G; not on a sharded (FSDP) policy."""
    trainable: str | None = None
    """Regex: only parameters whose name matches are perturbed and updated (default: all)."""

    def __post_init__(self) -> None:
        if isinstance(self.population_size, bool) or self.population_size < 2:
            raise ValueError(f"population_size must be >= 2 (rewards are normalised across members), got "
                             f"{self.population_size}; Ba et al. use 32")
        if self.antithetic and self.population_size % 2:
            raise ValueError(f"antithetic sampling pairs members: population_size must be even, got "
                             f"{self.population_size}; use {self.population_size + 1}")
        if not (isinstance(self.sigma, numbers.Real) and math.isfinite(self.sigma) and self.sigma > 0):
            raise ValueError(f"sigma must be a positive finite noise scale, got {self.sigma}; Ba et al. use 1.5e-3")
        if not (math.isfinite(self.lr) and self.lr >= 0):
            raise ValueError(f"lr must be a finite number >= 0, got {self.lr}; Ba et al. use 2.5e-4")
        validate_choice("reward_normalization", self.reward_normalization, NORMALIZATIONS, "'zscore' is both papers'")
        validate_choice("update_scale", self.update_scale, UPDATE_SCALES, "'alpha' is both papers'")
        if self.samples_per_member < 1:
            raise ValueError(f"samples_per_member must be >= 1, got {self.samples_per_member}")
        if self.members_per_batch < 1:
            raise ValueError(f"members_per_batch must be >= 1 (1 = one member at a time), got {self.members_per_batch}")
        g = self.prompt_groups
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"prompt_groups must be an integer >= 1 (1 = every member sees every prompt), got {g!r}")
        if self.population_size % g or self.population_size // g < 2:
            raise ValueError(f"prompt_groups={g} needs population_size to be a multiple of it with at least 2 members "
                             f"per group (rewards are normalised within each group), got population_size="
                             f"{self.population_size}; use population_size: {max(2, -(-self.population_size // g)) * g}")
        if self.antithetic and (self.population_size // g) % 2:
            raise ValueError(f"antithetic pairs must stay in one group: population_size / prompt_groups = "
                             f"{self.population_size // g} must be even; use population_size: "
                             f"{self.population_size + g}")
        check_noise_rank(self.noise_rank, ())  # its bound by the matrices is checked once the model is loaded
        if self.trainable is not None:
            try:
                re.compile(self.trainable)
            except re.error as err:
                raise ValueError(f"trainable={self.trainable!r} is not a valid regular expression ({err}); e.g. "
                                 "'mlp' or 'layers\\.(2[0-9])\\.'") from None
