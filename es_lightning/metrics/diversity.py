"""Population diversity of an ES population as the verifier sees it: JS_succ and population pass.

Ba et al. 2026 ("Understanding Evolution Strategies for LLM Reasoning: Broader Reasoning Coverage than GRPO", §3.1)
argue that ES keeps reasoning coverage because its perturbed population members succeed on *different* prompts. They
measure this in the verifier's projection: each member ``i`` of a population of ``N`` gets a success rate ``p_i`` on a
prompt (fraction of its samples the verifier accepts), i.e. a Bernoulli distribution ``B(p_i)`` over {wrong, right}.
The diversity of the population on that prompt is the equal-weight (generalised, Lin 1991) Jensen–Shannon divergence
of those Bernoullis:

    JS_succ = h(mean_i p_i) - mean_i h(p_i),        h(p) = -p ln p - (1 - p) ln(1 - p),  h(0) = h(1) = 0  (nats)

which is 0 when all members agree (whatever their skill) and at most ln 2, reached when half the population always
solves the prompt and half never does. Alongside it, the population pass

    pass_pop = 1 - prod_i (1 - p_i)

is the probability that at least one member solves the prompt with one sample each: the coverage the population holds
jointly. Both are averaged over prompts.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from es_lightning.metrics.plotting import Plottable
from es_lightning.metrics.state import ExactSums, KeepsStateOnError, sum_dtype

__all__ = ["PopulationDiversity", "binary_entropy", "js_succ", "population_pass"]


def binary_entropy(p: torch.Tensor) -> torch.Tensor:
    """``h(p) = -p ln p - (1-p) ln(1-p)`` in nats, elementwise, with ``h(0) = h(1) = 0`` (via ``xlogy``)."""
    return -(torch.special.xlogy(p, p) + torch.special.xlogy(1 - p, 1 - p))


def _validate_success(success: torch.Tensor) -> torch.Tensor:
    """Check ``[num_members, num_prompts]`` (or ``[num_members]`` for one prompt) success rates; return float 2-D."""
    if not isinstance(success, torch.Tensor):
        raise TypeError(f"success must be a torch.Tensor [num_members, num_prompts], got {type(success).__name__}")
    if success.ndim == 1:
        success = success.unsqueeze(1)  # one prompt
    if success.ndim != 2:
        raise ValueError(
            "success must be [num_members, num_prompts] (row i: population member i's success rate on each prompt), "
            f"got shape {tuple(success.shape)}"
        )
    if success.shape[0] == 0:
        raise ValueError("success has no population members (shape[0] == 0)")
    if success.is_complex():
        raise TypeError(f"success must hold real success rates in [0, 1], got dtype {success.dtype}")
    success = success.to(torch.promote_types(success.dtype, torch.float32))
    if success.numel() and not bool(((success >= 0) & (success <= 1)).all()):
        raise ValueError(
            "success rates must lie in [0, 1] (fraction of a member's samples the verifier accepts); got values "
            f"in [{success.min().item():g}, {success.max().item():g}] — pass rewards through (reward == correct_reward)"
        )
    return success


def js_succ(success: torch.Tensor, per_prompt: bool = False) -> torch.Tensor:
    """Verifier-projected Jensen–Shannon diversity of a population (Ba et al. 2026, §3.1), in nats.

    Args:
        success: ``[num_members, num_prompts]`` success rates ``p_i`` in [0, 1] (bool/0-1 for one sample per member
            works too); a 1-D ``[num_members]`` tensor is one prompt.
        per_prompt: return the ``[num_prompts]`` values instead of their mean.

    Returns:
        ``h(mean_i p_i) - mean_i h(p_i)`` averaged over prompts (0-d), or per prompt. In ``[0, ln 2]``.
    """
    success = _validate_success(success)  # [N, P]
    per_prompt_js = binary_entropy(success.mean(dim=0)) - binary_entropy(success).mean(dim=0)  # [P]
    per_prompt_js = per_prompt_js.clamp_min(0.0)  # Jensen's inequality; clamp float round-off below 0
    return per_prompt_js if per_prompt else per_prompt_js.mean()


def population_pass(success: torch.Tensor, per_prompt: bool = False) -> torch.Tensor:
    """Probability that at least one population member solves a prompt with one sample each: ``1 - prod_i (1 - p_i)``.

    Args:
        success: ``[num_members, num_prompts]`` success rates (see :func:`js_succ`).
        per_prompt: return the ``[num_prompts]`` values instead of their mean.
    """
    success = _validate_success(success)  # [N, P]
    per_prompt_pass = 1 - torch.prod(1 - success, dim=0)  # [P]
    return per_prompt_pass if per_prompt else per_prompt_pass.mean()


class PopulationDiversity(KeepsStateOnError, ExactSums, Plottable, Metric):
    """Prompt-averaged ``js_succ`` and ``population_pass`` over every ES step seen since the last reset.

    ``update(success)`` takes one step's ``[num_members, num_prompts]`` success matrix (the population size may change
    between steps); ``compute()`` returns ``{"js_succ": tensor, "population_pass": tensor}``, each the mean over all
    prompts seen, so steps with more prompts weigh more. NaN when nothing was seen (torchmetrics warns). States are
    sums, synced across processes, so ranks that evaluate different prompts combine exactly.
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False
    _count_states = ("num_prompts",)  # int64 whatever set_dtype makes the sums

    js_succ_sum: torch.Tensor
    population_pass_sum: torch.Tensor
    num_prompts: torch.Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        dtype = sum_dtype()
        self.add_state("js_succ_sum", default=torch.zeros((), dtype=dtype), dist_reduce_fx="sum")
        self.add_state("population_pass_sum", default=torch.zeros((), dtype=dtype), dist_reduce_fx="sum")
        self.add_state("num_prompts", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, success: torch.Tensor) -> None:
        success = _validate_success(success.detach() if isinstance(success, torch.Tensor) else success)
        self.js_succ_sum += js_succ(success, per_prompt=True).sum().to(self.js_succ_sum)
        self.population_pass_sum += population_pass(success, per_prompt=True).sum().to(self.population_pass_sum)
        self.num_prompts += success.shape[1]

    def compute(self) -> dict[str, torch.Tensor]:
        return {
            "js_succ": self.js_succ_sum / self.num_prompts,
            "population_pass": self.population_pass_sum / self.num_prompts,
        }
