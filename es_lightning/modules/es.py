"""ESModule: evolution-strategies post-training without autograd.

Per step, on one batch of prompts shared by the whole population (Ba et al. 2026, App. G; Qiu et al. 2025, Alg. 2):
for n = 1..N perturb θ + σ ε_n with seeded noise, score the perturbed model on the batch with the task's reward (mean
over prompts, ``samples_per_member`` completions each, greedy or at ``temperature``), restore θ bit for bit, normalise
the N rewards and apply θ ← θ + (α/N) Σ z_n ε_n through :class:`~es_lightning.es.update.ESOptimizer`.

Invariants (each tested): no autograd (``torch.no_grad``; no ``.grad`` is ever allocated); one ``global_step`` per
update; noise a pure function of (seed, step, member, parameter name, element index); exact restore of the centre
weights (a copy of θ is the one model-sized buffer); fp32 accumulation of the update; non-finite rewards dropped;
population-parallel under DDP (each rank evaluates members ``rank, rank + W, …`` on the same batch, rewards are summed
across ranks, and every rank applies the same update); prompt-parallel under FSDP, when the parameters are sharded
(every rank evaluates every member on its share of the batch, perturbing and updating only its own shard:
:mod:`es_lightning.modules.es_sharded`).

When sampling (``temperature > 0``) all members share the prompts *and* the sampling random numbers (common random
numbers: one rollout seed per step), so reward differences come from the weights, not from sampling luck.
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from es_lightning.es.noise import param_noise
from es_lightning.es.population import PopulationForward
from es_lightning.es.sharding import clean_name, local_snapshot, localize, shard_views, sharded_drift
from es_lightning.es.update import NORMALIZATIONS, ESOptimizer, normalize_rewards
from es_lightning.metrics import js_succ, population_pass
from es_lightning.modules.base import ReasoningModule
from es_lightning.modules.es_sharded import check_sharded_settings, evaluate_population_sharded
from es_lightning.tasks import Task


def _derive_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=4).digest(), "little") >> 1


class ESModule(ReasoningModule):
    """Evolution strategies over the policy's weights.

    To run: ``es-lightning fit --config recipes/es.yaml``; in a script,
    ``Trainer(max_steps=50).fit(ESModule(sigma=5e-3, lr=1e-2), datamodule=ReasoningDataModule("countdown"))``.

    Args:
        model, dtype, trust_remote_code, task, max_new_tokens, top_p, generation_backend: see
            :class:`~es_lightning.modules.base.ReasoningModule`.
        population_size: N, members per step (Ba et al.: 32). Antithetic sampling needs it even.
        sigma: noise scale σ (Ba et al.: 1.5e-3 for Qwen2.5; the built-in ~1M-parameter model needs ~5e-3 — a
            prototype found σ ≥ 3e-2 destroys it).
        lr: step size α (Ba et al.: 2.5e-4 with 1/σ folded in; the built-in model: 3e-3, 1e-2 lost Pass@1).
        update_scale: ``"alpha"`` (θ += α/N Σ z ε, both papers) or ``"textbook"`` (θ += α/(Nσ) Σ z ε).
        reward_normalization: ``"zscore"`` (papers), ``"rank"``, ``"centered"`` or ``"none"``.
        antithetic: mirrored pairs (ε, −ε) (Salimans et al. 2017); off in both papers.
        samples_per_member: completions per prompt per member (Ba et al.: 1, greedy).
        members_per_batch: members evaluated together in one batched ``generate`` (member-major rows, each member's
            block through its own weights: :mod:`es_lightning.es.population`). 1 (default) perturbs the model in place
            member by member and keeps one model-sized buffer; k > 1 holds k perturbed copies at once (and, when a rank's
            members all fit in one batch, their fp32 noise, which the update reuses) and is much
            faster when per-call overhead dominates (small models; large batches on a GPU). Same rewards either way.
        temperature: 0 = greedy (Ba et al.); > 0 samples with common random numbers across members.
        trainable: regex; only parameters whose name matches are perturbed and updated (default: all).
        seed: base seed of noise and rollouts; a resumed run regenerates the same noise.
        log_drift_every_n_steps: log ‖θ − θ₀‖/‖θ₀‖ this often (θ₀ is kept on the CPU; 0 disables it).
    """

    #: the population shares each batch of prompts (the data module gives every rank the same batch)
    shares_batch_across_ranks = True

    def __init__(
        self,
        model: str = "builtin:countdown-tiny",
        dtype: str = "float32",
        trust_remote_code: bool = False,
        task: Task | str | None = None,
        population_size: int = 32,
        sigma: float = 1.5e-3,
        lr: float = 2.5e-4,
        update_scale: str = "alpha",
        reward_normalization: str = "zscore",
        antithetic: bool = False,
        samples_per_member: int = 1,
        members_per_batch: int = 1,
        temperature: float = 0.0,
        max_new_tokens: int = 32,
        top_p: float = 1.0,
        trainable: str | None = None,
        seed: int = 0,
        log_drift_every_n_steps: int = 1,
        generation_backend: str = "hf",
    ) -> None:
        super().__init__(
            model=model, dtype=dtype, trust_remote_code=trust_remote_code, task=task, max_new_tokens=max_new_tokens,
            temperature=temperature, top_p=top_p, generation_backend=generation_backend, seed=seed,
        )
        self.configure_es(
            population_size=population_size, sigma=sigma, lr=lr, update_scale=update_scale,
            reward_normalization=reward_normalization, antithetic=antithetic, samples_per_member=samples_per_member,
            members_per_batch=members_per_batch, trainable=trainable, log_drift_every_n_steps=log_drift_every_n_steps,
        )

    def configure_es(
        self,
        population_size: int = 32,
        sigma: float = 1.5e-3,
        lr: float = 2.5e-4,
        update_scale: str = "alpha",
        reward_normalization: str = "zscore",
        antithetic: bool = False,
        samples_per_member: int = 1,
        members_per_batch: int = 1,
        trainable: str | None = None,
        log_drift_every_n_steps: int = 1,
    ) -> None:
        """Validate and set the ES settings (also used by :class:`~es_lightning.SequentialStrategy` at a switch)."""
        if population_size < 2:
            raise ValueError(f"population_size must be >= 2 (rewards are normalised across members), got {population_size}")
        if antithetic and population_size % 2:
            raise ValueError(f"antithetic sampling pairs members: population_size must be even, got {population_size}")
        if not sigma > 0 or not math.isfinite(sigma):
            raise ValueError(f"sigma must be a positive noise scale, got {sigma}; Ba et al. use 1.5e-3")
        if lr < 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if reward_normalization not in NORMALIZATIONS:
            raise ValueError(f"reward_normalization must be one of {NORMALIZATIONS}, got {reward_normalization!r}")
        if update_scale not in ("alpha", "textbook"):
            raise ValueError(f"update_scale must be 'alpha' or 'textbook', got {update_scale!r}")
        if samples_per_member < 1:
            raise ValueError(f"samples_per_member must be >= 1, got {samples_per_member}")
        if members_per_batch < 1:
            raise ValueError(f"members_per_batch must be >= 1, got {members_per_batch}")
        self.population_size = population_size
        self.sigma = sigma
        self.lr = lr
        self.update_scale = update_scale
        self.reward_normalization = reward_normalization
        self.antithetic = antithetic
        self.samples_per_member = samples_per_member
        self.members_per_batch = members_per_batch
        self.trainable = trainable
        self.log_drift_every_n_steps = log_drift_every_n_steps
        #: (members evaluated on this rank so far, members this rank evaluates) — read by progress bars
        self.population_progress: tuple[int, int] = (0, 0)
        #: the N member rewards of the last step (after the cross-rank reduction)
        self.last_rewards: torch.Tensor | None = None

    # ------------------------------------------------------------------ parameters and noise
    def es_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The (name, parameter) pairs ES perturbs: all, or those whose name matches ``trainable``."""
        named = [(clean_name(n), p) for n, p in self.policy.model.named_parameters()]  # names are noise keys
        if self.trainable:
            pattern = re.compile(self.trainable)
            named = [(n, p) for n, p in named if pattern.search(n)]
            if not named:
                raise ValueError(f"trainable={self.trainable!r} matches no parameter name of the model")
        return named

    def member_noise(self, member: int) -> tuple[int, float]:
        """(noise id, sign) of a member: antithetic pairs (2k, 2k+1) share noise id k with opposite signs."""
        return (member // 2, 1.0 if member % 2 == 0 else -1.0) if self.antithetic else (member, 1.0)

    def _perturbed(
        self, centre: torch.Tensor, name: str, step: int, noise_id: int, sign: float, eps: torch.Tensor | None = None
    ) -> torch.Tensor:
        """θ + sign·σ·ε for one parameter, computed in fp32 and cast once to the parameter's dtype."""
        if eps is None:
            eps = param_noise(self.seed, step, noise_id, name, centre.numel(), device=centre.device)
        return (centre.float() + (sign * self.sigma) * eps.view_as(centre)).to(centre.dtype)

    def _population_progress(self, done: int, total: int) -> None:
        """Record members evaluated so far and tell callbacks that listen (e.g. StageProgressBar)."""
        self.population_progress = (done, total)
        for cb in self.trainer.callbacks:
            if hasattr(cb, "on_population_progress"):
                cb.on_population_progress(self.trainer, self, done, total)

    def configure_optimizers(self):
        return ESOptimizer(self.es_parameters(), lr=self.lr, sigma=self.sigma, scale=self.update_scale)

    def on_fit_start(self) -> None:
        for _, p in self.policy.model.named_parameters():
            p.grad = None
        if self.sharded:  # FSDP: θ₀ of this rank's elements only (a checkpoint's full θ₀ is cut down to them)
            check_sharded_settings(self)
            if self.log_drift_every_n_steps:
                views = shard_views(self.es_parameters(), self.trainer.strategy.model)
                self._theta0 = local_snapshot(views) if self._theta0 is None else localize(views, self._theta0)
        elif self.log_drift_every_n_steps and self._theta0 is None:
            self._theta0 = {n: p.detach().float().cpu().clone() for n, p in self.es_parameters()}

    # ------------------------------------------------------------------ the step
    def _shared_batch(self, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Every rank scores its members on the same prompts: rank 0's batch."""
        if self.trainer.world_size > 1:
            return self.trainer.strategy.broadcast(batch, src=0)
        return batch

    @torch.no_grad()
    def training_step(self, batch: list[dict[str, Any]], batch_idx: int) -> None:
        examples = self._shared_batch(batch)
        step = self.global_step
        if self.sharded:  # FSDP: every rank evaluates every member on its share of the prompts (es_sharded.py)
            rollout_seed = _derive_seed(self.seed, step, "rollout")
            return self._update_and_log(step, *evaluate_population_sharded(self, examples, step, rollout_seed))
        named = self.es_parameters()
        world, rank = self.trainer.world_size, self.trainer.global_rank
        mine = list(range(rank, self.population_size, world))
        rollout_seed = _derive_seed(self.seed, step, "rollout")
        params = self.sampling_params()
        # one member at a time: a copy of θ is the one model-sized buffer (exact restore); batched members never
        # touch the centre weights
        base = [p.detach().clone() for _, p in named] if self.members_per_batch == 1 else None
        rewards = torch.zeros(self.population_size)
        success = torch.zeros(self.population_size, len(examples))  # [N, B] success rate per member and prompt
        t_gen = t_score = 0.0
        task = self.task
        prompts = self.prompts(examples)  # the same for every member: render once per step
        repeated = [e for e in examples for _ in range(self.samples_per_member)]
        rows = len(repeated)
        self.population_progress = (0, len(mine))
        # when this rank's members fit in one batch their noise is already held (k copies): the update reuses it
        keep_noise = 1 < len(mine) <= self.members_per_batch
        noise_cache: dict[tuple[int, str], torch.Tensor] = {}
        for start in range(0, len(mine), self.members_per_batch):
            chunk = mine[start:start + self.members_per_batch]
            t0 = time.perf_counter()
            if base is not None:  # one member at a time, perturbed in place
                noise_id, sign = self.member_noise(chunk[0])
                for (name, p), b in zip(named, base):
                    p.copy_(self._perturbed(b, name, step, noise_id, sign))
                rollout = self.generator.generate(prompts, self.samples_per_member, params, seed=rollout_seed)
            else:  # ``len(chunk)`` members as one batch, member-major, with common random numbers
                stacked = {}  # {name: [k, *shape]}
                for name, p in named:
                    values = []
                    for m in chunk:
                        noise_id, sign = self.member_noise(m)
                        eps = noise_cache.get((noise_id, name))
                        if eps is None:
                            eps = param_noise(self.seed, step, noise_id, name, p.numel(), device=p.device)
                            if keep_noise:  # the update reuses it instead of drawing it again
                                noise_cache[(noise_id, name)] = eps
                        values.append(self._perturbed(p.detach(), name, step, noise_id, sign, eps=eps))
                    stacked[name] = torch.stack(values)
                with PopulationForward(self.policy.model, stacked):
                    rollout = self.generator.generate(
                        prompts * len(chunk), self.samples_per_member, params, seed=rollout_seed,
                        common_random_blocks=len(chunk),
                    )
                del stacked
            t1 = time.perf_counter()
            _, ok, r = task.grade(rollout.texts, repeated * len(chunk))  # each completion parsed once
            r = torch.tensor(r, dtype=torch.float32).view(len(chunk), rows)  # [k, B*n]
            ok = torch.tensor(ok, dtype=torch.float32).view(len(chunk), len(examples), self.samples_per_member)
            for j, member in enumerate(chunk):
                rewards[member] = r[j].mean()
                success[member] = ok[j].mean(-1)
            t_score += time.perf_counter() - t1
            t_gen += t1 - t0
            self._population_progress(start + len(chunk), len(mine))
        if base is not None:
            for (_, p), b in zip(named, base):
                p.copy_(b)  # bit-for-bit restore of the centre weights
            del base
        if world > 1:  # each rank filled only its members; the others are zero
            rewards = self.trainer.strategy.reduce(rewards.to(self.device), reduce_op="sum").cpu()  # NCCL: on the GPU
            success = self.trainer.strategy.reduce(success.to(self.device), reduce_op="sum").cpu()
        self._update_and_log(step, rewards, success, t_gen, t_score, noise_cache)

    def _update_and_log(
        self,
        step: int,
        rewards: torch.Tensor,
        success: torch.Tensor,
        t_gen: float,
        t_score: float,
        noise_cache: dict[tuple[int, str], torch.Tensor] | None = None,
    ):
        """Normalise the N member rewards (identical on every rank), apply the seeded update through the ES optimizer
        (one ``global_step``) and log the step's metrics."""
        t2 = time.perf_counter()
        self.last_rewards = rewards.clone()
        weights, stats = self._member_weights(rewards)
        noise_ids = torch.tensor([self.member_noise(m)[0] for m in range(self.population_size)])
        signs = torch.tensor([self.member_noise(m)[1] for m in range(self.population_size)])
        opt = self.optimizers()
        opt.optimizer.set_update(self.seed, step, noise_ids, weights * signs, noise_cache=noise_cache)
        del noise_cache
        opt.step()
        t_update = time.perf_counter() - t2

        logs = {
            **stats,
            "train/success_mean": success.mean(),
            "train/success_max": success.mean(-1).max(),
            "train/success_min": success.mean(-1).min(),
            "train/js_succ": js_succ(success),
            "train/pass_pop": population_pass(success),
            "train/update_norm": opt.optimizer.last_update_norm,
            "train/time/generate_s": t_gen,
            "train/time/score_s": t_score,
            "train/time/update_s": t_update,
        }
        if self._theta0 is not None and self.log_drift_every_n_steps and step % self.log_drift_every_n_steps == 0:
            logs["train/drift"] = self.relative_drift()
        # identical on every rank already; sync_dist as GRPOModule logs the same keys, so a SequentialStrategy switch in a
        # multi-process fit logs them with the same arguments (Lightning refuses a change within an epoch)
        sync = self.trainer.world_size > 1
        self.log("train/reward_mean", stats.pop("train/reward_mean"), prog_bar=True, sync_dist=sync)
        logs.pop("train/reward_mean", None)
        self.log_dict({k: float(v) for k, v in logs.items()}, sync_dist=sync)

    def _member_weights(self, rewards: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """Normalised rewards z_n; non-finite rewards are dropped (weight 0) with a warning, never reach the weights."""
        finite = torch.isfinite(rewards)
        if not bool(finite.all()):
            rank_zero_warn(
                f"ES step {self.global_step}: {int((~finite).sum())} of {len(rewards)} member rewards are NaN/inf; "
                "they are dropped from this update (check the task's reward function)"
            )
        weights = torch.zeros_like(rewards)
        kept = rewards[finite]
        if kept.numel() >= 2:
            weights[finite] = normalize_rewards(kept, self.reward_normalization)
        zero_std = float(kept.numel() < 2 or bool((kept == kept[0]).all()))
        stats = {
            "train/reward_mean": float(kept.mean()) if kept.numel() else float("nan"),
            "train/reward_std": float(kept.std(unbiased=False)) if kept.numel() else float("nan"),
            "train/reward_max": float(kept.max()) if kept.numel() else float("nan"),
            "train/reward_min": float(kept.min()) if kept.numel() else float("nan"),
            "train/frac_reward_zero_std": zero_std,
        }
        return weights, stats

    def relative_drift(self) -> float:
        """‖θ − θ₀‖ / ‖θ₀‖ over the ES parameters (Ba et al. §4's D_rel), θ₀ being the weights at fit start."""
        if self._theta0 is None:
            return 0.0
        if self.sharded:  # per-shard sums, reduced across ranks; a θ₀ restored from a checkpoint is full: cut it
            views = shard_views(self.es_parameters(), self.trainer.strategy.model)
            self._theta0 = localize(views, self._theta0)
            return sharded_drift(views, self._theta0)
        num = den = 0.0
        for name, p in self.es_parameters():
            t0 = self._theta0[name]
            num += float((p.detach().float().cpu() - t0).square().sum())
            den += float(t0.square().sum())
        return (num / max(den, 1e-30)) ** 0.5
