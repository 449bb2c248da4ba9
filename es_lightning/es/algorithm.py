"""Evolution strategies over the policy's weights: settings and training step (no autograd).

One step, on one batch of prompts shared by the whole population (Ba et al. 2026, App. G; Qiu et al. 2025, Alg. 2):

1. **evaluate** — N members θ + σ ε_n (a matrix's ε_n of rank r with ``noise_rank = r``, EGGROLL), each scored on
   the batch with the task's reward (mean over prompts and ``samples_per_member`` completions), by a
   :class:`~es_lightning.es.evaluators.PopulationEvaluator`;
2. **update** — the N rewards are normalised (z-score) and θ ← θ + (α/N) Σ z_n ε_n is applied by
   :class:`~es_lightning.es.update.ESOptimizer` (one ``global_step``; the noise regenerated from its seeds);
3. **log** — the shared training metrics plus ES's own (``js_succ``, ``pass_pop``, ``update_norm``).

Invariants (each tested): no autograd (no ``.grad`` is ever allocated); noise a pure function of (seed, step, member,
parameter name, element index); exact restore of the centre weights; fp32 accumulation of the update, into an fp32
master θ when the weights are bf16/fp16 (``master_dtype``: members are θ + σε rounded once); a member with a
non-finite reward is dropped (:mod:`es_lightning.scoring`); under DDP the ranks split the population and apply the same
update; under FSDP they split the prompts. Under Lightning's ``bf16-mixed`` (fp32 weights) the members generate under
the bf16 autocast Lightning wraps ``training_step`` in; the update runs outside it, in fp32.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from es_lightning.algorithms import Algorithm, register_algorithm
from es_lightning.es.evaluators import (
    Member,
    PopulationEvaluator,
    PopulationScores,
    group_columns,
    member_groups,
    perturbed_parameters,
    select_evaluator,
)
from es_lightning.es.lowrank import check_noise_rank
from es_lightning.es.settings import ESSettings
from es_lightning.es.update import ESOptimizer, normalize_rewards
from es_lightning.es.vllm_evaluators import check_vllm_settings  # also registers the vLLM evaluators
from es_lightning.metrics import js_succ, population_pass
from es_lightning.metrics.training import StepMetrics
from es_lightning.scoring import check_some_kept

if TYPE_CHECKING:
    from es_lightning.generation import SamplingParams
    from es_lightning.modules.base import ReasoningModule

__all__ = ["ESAlgorithm", "ESSettings"]


@register_algorithm
class ESAlgorithm(Algorithm):
    """ES: evaluate the population → seeded update → log. Greedy rollouts by default (Ba et al.)."""

    name = "es"
    Settings = ESSettings
    shares_batch_across_ranks = True  # the population shares each batch of prompts
    settings: ESSettings

    def __init__(self, settings: ESSettings | dict | None = None) -> None:
        super().__init__(settings)
        #: chosen at fit start (:func:`~es_lightning.es.evaluators.select_evaluator`)
        self.evaluator: PopulationEvaluator | None = None

    @classmethod
    def default_sampling(cls) -> dict[str, Any]:
        return {"temperature": 0.0}  # greedy, as Ba et al.; > 0 samples with common random numbers

    def check_rollouts(self, sampling: SamplingParams) -> None:
        n = self.settings.samples_per_member
        if n > 1 and sampling.temperature == 0:
            raise ValueError(
                f"samples_per_member={n} at temperature 0 gives {n} identical greedy completions per prompt per member "
                f"({n}x the generation for the rewards of one); use temperature > 0 (recipes/es.yaml: 1.0, sampled with "
                "common random numbers) or samples_per_member: 1"
            )

    def members(self) -> list[Member]:
        """The population: antithetic pairs (2k, 2k+1) share noise id k with opposite signs."""
        if self.settings.antithetic:
            return [Member(m, m // 2, 1.0 if m % 2 == 0 else -1.0) for m in range(self.settings.population_size)]
        return [Member(m, m) for m in range(self.settings.population_size)]

    def parameters(self, module: ReasoningModule) -> list[tuple[str, torch.nn.Parameter]]:
        return perturbed_parameters(module.policy.model, self.settings.trainable)

    def configure_optimizers(self, module: ReasoningModule) -> ESOptimizer:
        """The ES optimizer over the perturbed parameters; with bf16/fp16 weights it keeps their fp32 centre θ
        (``module.master_dtype``): members are perturbed from it and the update is added to it
        (:mod:`es_lightning.es.update`)."""
        s = self.settings
        named = self.parameters(module)
        return ESOptimizer(named, lr=s.lr, sigma=s.sigma, scale=s.update_scale,
                           master_dtype=module.master_dtype_for([p for _, p in named]), noise_rank=s.noise_rank)

    def apply_settings(self, optimizers, schedulers, changed) -> None:
        """A changed ``lr``, ``sigma`` or ``update_scale`` into the ES optimizer's param group: the members are
        perturbed with ``settings.sigma``, so the update must use the same σ (and the configured α) after a resume."""
        s = self.settings
        group_keys = {"lr": ("lr", s.lr), "sigma": ("sigma", s.sigma), "update_scale": ("scale", s.update_scale)}
        values = dict(group_keys[name] for name in changed if name in group_keys)
        for opt in optimizers:
            if isinstance(opt, ESOptimizer):
                for group in opt.param_groups:
                    group.update(values)

    def configure_model(self, module: ReasoningModule) -> None:
        """Train mode, as GRPO's (``from_pretrained`` returns eval mode, and Lightning warned of every policy module in
        eval mode at the start of training); the members' rollouts run in eval mode whatever it is (the generator sets
        it), so no dropout reaches a reward."""
        module.model.train()
        if self.settings.noise_rank:  # its bound is the perturbed matrices' sides: known once the model is loaded
            check_noise_rank(self.settings.noise_rank, perturbed_parameters(module.model, self.settings.trainable))

    def check_batch(self, batch_size: int) -> None:
        """``prompt_groups`` splits every batch into equal slices: refuse, at fit setup, a batch size it cannot split."""
        group_columns(batch_size, self.settings.prompt_groups)

    def check_generation(self, backend: str, options) -> None:
        if backend == "vllm":  # several full-rank members per engine call cannot be run (es_lightning/es/vllm_evaluators.py)
            check_vllm_settings(self.settings)

    def check_stage(self, module: ReasoningModule) -> None:
        self.configure_model(module)
        select_evaluator(module, self.settings).check_ahead(module)

    def on_fit_start(self, module: ReasoningModule) -> None:
        for p in module.policy.model.parameters():
            p.grad = None  # ES allocates no gradients (none survive a switch from GRPO either)
        self.evaluator = select_evaluator(module, self.settings)
        self.evaluator.check(module)

    # ------------------------------------------------------------------ the step
    @torch.no_grad()
    def training_step(self, module: ReasoningModule, batch: list[dict[str, Any]], batch_idx: int) -> None:
        examples = module.trainer.strategy.broadcast(batch, src=0) if module.trainer.world_size > 1 else batch
        step = module.global_step
        if self.evaluator is None:
            self.on_fit_start(module)
        members = self.members()
        scores = self.evaluator.evaluate(module, examples, step, members)
        t0 = time.perf_counter()
        weights, stats = self.member_weights(scores.rewards, step)
        if stats["zero_std"] == 1.0:
            self.warn_flat(scores.rewards, step, len(examples))
        update_norm = self.update(module, step, weights, scores.noise_cache)
        self.evaluator.after_update(module, step, members, weights)  # e.g. the same update inside a vLLM engine
        blocks = self.success_blocks(scores.success)  # [N/G, B/G] per group: who saw what
        member_accuracy = torch.cat([b.mean(-1) for b in blocks])  # [N]
        # no StepMetrics.shares (GRPO's): the scores are the whole population's on every rank (MemberTally.finish sums
        # the ranks' members first), so every rank computes the same frac_reward_zero_std and accuracy and their rank
        # mean is the global share, however unevenly the members split or on which rank one was dropped (NaN reward)
        module.log_step(StepMetrics(
            rewards=scores.rewards,
            frac_reward_zero_std=stats["zero_std"],
            accuracy=float(member_accuracy.mean()),
            mean_length=float(scores.mean_length.mean()),
            clipped_ratio=float(scores.clipped_ratio.mean()),
            entropy=_token_weighted(scores),
            batch_size=len(examples),
            times={"generate": scores.generate_s, "score": scores.score_s, "update": time.perf_counter() - t0},
            extra={
                "reward_max": stats["max"], "reward_min": stats["min"],
                "member_accuracy_max": float(member_accuracy.max()), "member_accuracy_min": float(member_accuracy.min()),
                "js_succ": _block_mean(js_succ, blocks), "pass_pop": _block_mean(population_pass, blocks),
                "update_norm": update_norm,
            },
        ))

    def member_weights(self, rewards: torch.Tensor, step: int) -> tuple[torch.Tensor, dict[str, float]]:
        """Normalised rewards z_n, within each prompt group (``prompt_groups``; one group: the whole population).
        A member whose reward is NaN/inf gets weight 0 (dropped, with a warning): bad rewards never reach the weights.
        A step with no finite reward stops the fit (:mod:`es_lightning.scoring`). ``zero_std``: the share of groups
        whose kept rewards are all equal (their members get weight 0)."""
        finite = torch.isfinite(rewards)
        kept = rewards[finite]
        check_some_kept(kept.numel(), rewards.numel(), "population member", step)
        if kept.numel() < rewards.numel():
            rank_zero_warn(f"ES step {step}: {rewards.numel() - kept.numel()} of {rewards.numel()} member rewards are "
                           "NaN/inf; those members are dropped from this update (check the task's reward function)")
        weights = torch.zeros(rewards.shape, dtype=torch.float32)
        flat = 0
        groups = member_groups(rewards.numel(), self.settings.prompt_groups)
        for group in groups:
            ok = torch.arange(group.start, group.stop)[finite[group]]  # the group's members with a finite reward
            r = rewards[ok]
            if ok.numel() >= 2:
                weights[ok] = normalize_rewards(r, self.settings.reward_normalization)
            flat += int(ok.numel() < 2 or bool((r == r[0]).all()))
        stats = {"zero_std": flat / len(groups), "max": float(kept.max()), "min": float(kept.min())}
        return weights, stats

    def warn_flat(self, rewards: torch.Tensor, step: int, prompts: int) -> None:
        """Once a fit: a step whose members all scored the same (within each prompt group) made a zero update; a run
        of such steps learns nothing, and only ``train/frac_reward_zero_std`` (1.0) would say so."""
        s = self.settings
        kept = rewards[torch.isfinite(rewards)]
        values = sorted({float(r) for r in kept.tolist()})
        scored = (f"all scored {values[0]:g}" if len(values) == 1 else
                  f"scored the same within each of the {s.prompt_groups} prompt groups")
        self.warn_once("flat", (
            f"ES step {step}: the {kept.numel()} population members {scored} on the step's {prompts} prompts, so the "
            "normalised rewards are all 0 and the update is zero (train/frac_reward_zero_std is 1.0; a fit of such steps "
            "learns nothing). Give the members something to tell them apart: more prompts per step (data.batch_size) "
            "or samples_per_member (at temperature > 0), a larger sigma (now "
            f"{s.sigma:g}), an easier task or a shaped reward (e.g. the task's format_reward for a well-formed answer)"))

    def success_blocks(self, success: torch.Tensor) -> list[torch.Tensor]:
        """The ``[N/G, B/G]`` blocks of a step's ``[N, B]`` success matrix that were observed: group g's members on
        slice g of the prompts (one block, the whole matrix, when ``prompt_groups`` is 1)."""
        g = self.settings.prompt_groups
        rows, columns = member_groups(success.shape[0], g), group_columns(success.shape[1], g)
        return [success[r, c] for r, c in zip(rows, columns)]

    def update(self, module: ReasoningModule, step: int, weights: torch.Tensor,
               noise_cache: dict[tuple[int, str], torch.Tensor] | None = None) -> float:
        """θ += α/N Σ w_n sign_n ε_n through the ES optimizer (one ``global_step``); returns ‖Δθ‖."""
        members = self.members()
        noise_ids = torch.tensor([m.noise_id for m in members], dtype=torch.int64)
        signs = torch.tensor([m.sign for m in members], dtype=torch.float32)
        opt = module.optimizers()
        if module.sharded:  # FSDP1 units: the update, too, goes shard by shard
            opt.optimizer.shard_root = module.trainer.strategy.model
        opt.optimizer.set_update(module.seed, step, noise_ids, weights * signs, noise_cache=noise_cache)
        with torch.autocast(module.device.type, enabled=False):  # bf16-mixed: the update's matmuls stay fp32
            opt.step()
        return float(opt.optimizer.last_update_norm)


def _block_mean(metric, blocks: list[torch.Tensor]) -> float:
    """A prompt-averaged population metric over the observed blocks (equal prompts each: the mean of their means)."""
    return float(torch.stack([metric(b) for b in blocks]).mean())


def _token_weighted(scores: PopulationScores) -> float | None:
    """The population's token-mean entropy (members weighted by their completion tokens); None when greedy."""
    if scores.entropy is None:
        return None
    tokens = scores.mean_length.double()
    return float((scores.entropy.double() * tokens).sum() / tokens.sum().clamp(min=1e-12))
