"""The ES population evaluation when the policy is sharded (FSDP2 via ``ModelParallelStrategy``, or FSDP1).

Under DDP each rank holds the whole model, so ES splits the *population*: rank r evaluates members r, r + W, … on the
whole batch (``ESModule.training_step``). Under FSDP a forward all-gathers every parameter — a collective every rank
must join — so the ranks cannot run different members. Instead all ranks evaluate **every member together**, each on
**its share of the step's prompts** (a contiguous block of rank 0's batch, :func:`~es_lightning.es.sharding.prompt_share`),
and the per-member reward sums and success counts are summed across ranks:

    for each member n:  every rank perturbs its own shard, θ_local + σ ε_n[local elements]   (no communication)
                        every rank generates on its prompts (forwards all-gather the perturbed weights)
    rewards[n] = Σ_ranks Σ_completions r / (B · samples_per_member)                          (one all-reduce per step)

The perturbation of an element is the one an unsharded run applies (layout-independent noise), the centre shard is
restored bit for bit from a copy of the *local* shard (1/W of a model-sized buffer), and the update is applied shard by
shard by :class:`~es_lightning.es.update.ESOptimizer` — so a sharded run equals an unsharded one up to the float
rounding of the reward sums (tested against a 1-process run).

Sampling at ``temperature > 0`` uses the step's rollout seed on every rank: the completions of rank 0's prompts are
exactly those of an unsharded run; the other ranks' prompts sit at different batch rows and so draw different (equally
valid) random numbers. All members still share the random numbers of each prompt (common random numbers). Greedy
decoding — the papers' ES setting — is layout-independent.

Limits: the vLLM backend is refused; ``members_per_batch > 1`` (population-batched forwards stack full weight copies)
falls back to one member at a time, with a warning; ``data.batch_size`` must be at least the world size.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn

from es_lightning.es.sharding import prompt_share, shard_views

if TYPE_CHECKING:
    from es_lightning.modules.es import ESModule


def check_sharded_settings(module: ESModule) -> None:
    """Refuse ES settings that cannot run on a sharded policy, naming the fix. ``members_per_batch > 1`` (a speed knob:
    the rewards are the same) falls back to one member at a time with a warning, so that a recipe written for one
    device runs sharded by changing only the trainer fragment."""
    if getattr(module, "members_per_batch", 1) > 1:
        rank_zero_warn(
            f"members_per_batch={module.members_per_batch} stacks full copies of the weights, which a sharded (FSDP) "
            "policy does not have: members are evaluated one at a time (same rewards). Use DDP "
            "(configs/trainer/ddp.yaml) to batch members if the model fits on one device."
        )
    if module.generation_backend != "hf":
        raise ValueError(
            f"generation_backend={module.generation_backend!r} cannot generate from an FSDP-sharded policy (vLLM holds its "
            "own full copy of the weights); use generation_backend: hf with FSDP, or vLLM with DDP"
        )


@torch.no_grad()
def evaluate_population_sharded(
    module: ESModule, examples: list[dict[str, Any]], step: int, rollout_seed: int
) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Every member on this rank's share of ``examples``; returns ``(rewards [N], success [N, B], t_gen, t_score)``
    already summed across ranks (identical on every rank)."""
    check_sharded_settings(module)
    trainer = module.trainer
    world, rank = trainer.world_size, trainer.global_rank
    share = prompt_share(len(examples), rank, world)
    local = examples[share]
    root = trainer.strategy.model
    views = shard_views(module.es_parameters(), root)
    module.optimizers().optimizer.shard_root = root  # the update, too, goes shard by shard
    base = [v.read() for v in views]  # this rank's shard of θ: exact restore
    N, spm = module.population_size, module.samples_per_member
    reward_sums = torch.zeros(N, dtype=torch.float64)
    success = torch.zeros(N, len(examples))  # [N, B]: this rank fills its columns, the reduction the rest
    params = module.sampling_params()
    prompts = module.prompts(local)
    repeated = [e for e in local for _ in range(spm)]
    task = module.task
    t_gen = t_score = 0.0
    module.population_progress = (0, N)
    for member in range(N):
        noise_id, sign = module.member_noise(member)
        for v, b in zip(views, base):
            v.write(module._perturbed(b, v.name, step, noise_id, sign, eps=v.noise(module.seed, step, noise_id)))
        t0 = time.perf_counter()
        rollout = module.generator.generate(prompts, spm, params, seed=rollout_seed)
        t1 = time.perf_counter()
        _, ok, r = task.grade(rollout.texts, repeated)  # each completion parsed once
        r = torch.tensor(r, dtype=torch.float64)
        ok = torch.tensor(ok, dtype=torch.float32)
        reward_sums[member] = r.sum()
        success[member, share] = ok.view(len(local), spm).mean(-1)
        t_score += time.perf_counter() - t1
        t_gen += t1 - t0
        module._population_progress(member + 1, N)
    for v, b in zip(views, base):
        v.write(b)  # bit-for-bit restore of this rank's centre shard
    del base
    device = module.device
    reward_sums = trainer.strategy.reduce(reward_sums.to(device), reduce_op="sum").cpu()
    success = trainer.strategy.reduce(success.to(device), reduce_op="sum").cpu()
    rewards = (reward_sums / (len(examples) * spm)).float()
    return rewards, success, t_gen, t_score
