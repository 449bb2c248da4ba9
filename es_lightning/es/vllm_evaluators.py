"""ES population evaluators for the vLLM backend (``generation_backend: vllm``): the engine holds the weights members
generate with, so each evaluator's job is getting member n's weights into the engine and the centre back.

Three ways, chosen by :func:`select_vllm_evaluator` (same interface and the same :class:`PopulationScores` as
:mod:`es_lightning.es.evaluators`; greedy rewards equal the HF backend's — ``tests/vllm_backend/test_vllm_fit.py``):

* :class:`VLLMEngineEvaluator` — **engine-side** (``generation_options: {engine_side_es: true}``, the default): the
  engine keeps its own copy of the centre θ in the trainer's precision (the ES optimizer's fp32 master of bf16 weights,
  else the weights) and, per member, regenerates ε from (seed, step, noise id) inside the engine, generates, and restores
  θ by a copy; after the ES optimizer's step it applies the same seeded update to its copy
  (:class:`~es_lightning.generation.vllm_es.ESWorkerExtension`), which stays bitwise equal to the trainer's. Only seeds
  and member weights cross into the engine — never full weights (Qiu et al. 2025's design, minus its shared-seed and
  bf16-drift faults): the choice for large models, and for engines in other processes (tensor parallelism).
* :class:`VLLMPushEvaluator` — **pushed** (``engine_side_es: false``): each member is written into the policy in place
  (as :class:`~es_lightning.es.evaluators.InPlaceEvaluator`) and pushed into the engine by name (a model-sized copy per
  member, TRL's colocate ``load_weights``); the new centre follows before the next generation. Needs no worker
  extension and no second copy of θ in the engine.
* :class:`VLLMLowRankEvaluator` — ``noise_rank > 0`` (EGGROLL): ``members_per_batch`` members per engine call, each a
  LoRA adapter over the shared centre weights (:mod:`es_lightning.es.vllm_lora`, where what LoRA covers is decided).

``members_per_batch > 1`` with full-rank noise is refused on vLLM (:func:`check_vllm_settings`): the engine holds one
set of weights, so full-rank members cannot share a call (vLLM has no per-request weights; k perturbed engines would
hold k model copies, what low-rank members avoid).
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from es_lightning.es.evaluators import (
    BACKEND_EVALUATORS,
    Member,
    PopulationEvaluator,
    PopulationStep,
    centre,
    es_optimizer,
    perturb,
    perturbed_parameters,
    report_progress,
)
from es_lightning.es.lowrank import lowrank_factors
from es_lightning.es.noise import param_noise
from es_lightning.es.settings import ESSettings
from es_lightning.es.vllm_lora import check_lora_coverage, lora_engine_options, lora_matrices, write_member_adapter

if TYPE_CHECKING:
    from es_lightning.modules.base import ReasoningModule

__all__ = ["VLLMEngineEvaluator", "VLLMLowRankEvaluator", "VLLMPushEvaluator", "check_vllm_settings",
           "select_vllm_evaluator"]


def check_vllm_settings(settings: ESSettings) -> None:
    """Refuse ES settings the vLLM backend cannot run, naming the fix (called when the module is built)."""
    k = settings.members_per_batch
    if k > 1 and not getattr(settings, "noise_rank", 0):
        raise ValueError(
            f"members_per_batch={k} with full-rank noise cannot run on vLLM: the engine holds one set of weights, so "
            "full-rank members cannot share an engine call; use members_per_batch: 1 (members one at a time, perturbed "
            "inside the engine), or noise_rank > 0 (low-rank members as LoRA adapters, members_per_batch of them per "
            "call), or generation_backend: hf"
        )


def select_vllm_evaluator(module: ReasoningModule, settings: ESSettings) -> PopulationEvaluator:
    """LoRA members for ``noise_rank > 0``; otherwise engine-side unless ``generation_options.engine_side_es`` is false
    (VLLMGenerator's default is true)."""
    if getattr(settings, "noise_rank", 0):
        return VLLMLowRankEvaluator(settings)
    if module.engine_options().get("engine_side_es", True):
        return VLLMEngineEvaluator(settings)
    return VLLMPushEvaluator(settings)


def _mine(module: ReasoningModule, members: Sequence[Member]) -> list[Member]:
    """This rank's members under DDP (r, r + W, …), all of them on one process."""
    return list(members)[module.trainer.global_rank::module.trainer.world_size]


class VLLMEngineEvaluator(PopulationEvaluator):
    """Members perturbed inside the engine from seeds; the engine's copy of θ follows the trainer's update bitwise.

    The engine's copy is (re)taken from the trainer by ``es_set_centre`` whenever the engine does not hold it —
    at the first step of a fit or of an ES stage, after a resume, after anything pushed weights into the engine — from
    :meth:`~es_lightning.es.update.ESOptimizer.centre` (the master when there is one), so the engine's weights are
    bf16(master) exactly as the policy's. Memory in the engine: that copy and a snapshot of its own parameters
    (restores are copies, exact whatever the dtype) — for Qwen2.5-1.5B in bf16 with fp32 masters 6.2 + 3.1 GB on the
    engine's device, the price of never moving full weights (the pushed path needs neither)."""

    def evaluate(self, module, examples, step, members):
        s = self.settings
        gen = module.generator
        mine = _mine(module, members)
        self._set_centre(module)
        run = PopulationStep(module, s, examples, step, entropy=False)  # the member is in the engine, not the policy
        report_progress(module, 0, len(mine))
        try:
            for done, member in enumerate(mine, 1):
                gen.es_perturb(module.seed, step, member.noise_id, member.sign, s.sigma)
                run.run([member])
                report_progress(module, done, len(mine))
        finally:
            gen.es_restore()  # bit-for-bit, also when scoring raised
        return run.tally.finish(module)

    def _set_centre(self, module: ReasoningModule) -> None:
        gen = module.generator
        if gen.es_centre_current:
            return
        opt = es_optimizer(module)
        named = perturbed_parameters(module.policy.model, self.settings.trainable)
        gen.es_set_centre([(n, centre(opt, p, copy=False)) for n, p in named], dtypes={n: p.dtype for n, p in named})

    def after_update(self, module, step, members, weights):
        """The ES optimizer's update, applied to the engine's copy of θ from the same seeds, weights, lr, σ and
        scale (and low-rank factors when ``noise_rank > 0``): no weights cross."""
        opt = es_optimizer(module)
        gen = module.generator
        if opt is None or not gen.es_centre_current:
            module.policy_updated()
            return
        group = opt.param_groups[0]
        signed = weights.float() * torch.tensor([m.sign for m in members], dtype=torch.float32)
        gen.es_update(module.seed, step, [m.noise_id for m in members], signed.tolist(), lr=group["lr"],
                      sigma=group["sigma"], scale=group["scale"], noise_rank=getattr(opt, "noise_rank", 0))


class VLLMPushEvaluator(PopulationEvaluator):
    """One member at a time perturbed in the policy (from the centre, as the in-place evaluator) and pushed into the
    engine by name; the policy is restored bit for bit, and the engine takes the centre again (after the update)
    before it next generates."""

    def evaluate(self, module, examples, step, members):
        s = self.settings
        gen = module.generator
        mine = _mine(module, members)
        opt = es_optimizer(module)
        named = perturbed_parameters(module.policy.model, s.trainable)
        base = [centre(opt, p) for _, p in named]  # fp32 master (no copy) or a copy of the weights: the exact restore
        run = PopulationStep(module, s, examples, step)
        report_progress(module, 0, len(mine))
        try:
            for done, member in enumerate(mine, 1):
                with torch.no_grad():
                    for (name, p), b in zip(named, base):
                        eps = param_noise(module.seed, step, member.noise_id, name, p.numel(), device=p.device)
                        p.copy_(perturb(b, eps, member.sign, s.sigma))  # rounded once to the weight's dtype
                gen.push_weights(named)
                run.run([member])
                report_progress(module, done, len(mine))
        finally:
            with torch.no_grad():
                for (_, p), b in zip(named, base):
                    p.copy_(b)  # bit-for-bit restore of the centre weights
            module.policy_updated()  # the engine holds the last member: the centre goes back before it generates
        return run.tally.finish(module)

    def after_update(self, module, step, members, weights):
        module.policy_updated()  # the new centre is pushed before the next generation


class VLLMLowRankEvaluator(PopulationEvaluator):
    """``noise_rank = r > 0``: ``members_per_batch`` members per engine call, each row block through its member's LoRA
    adapter over the shared centre weights (:mod:`es_lightning.es.vllm_lora`). The factors are drawn once per step
    (:func:`~es_lightning.es.lowrank.lowrank_factors`, the HF low-rank path's numbers), written as adapters, and handed
    to the update (``PopulationScores.noise_cache``); the new centre is pushed before the next generation.

    Args:
        settings: the ES settings.
        noise_rank: the rank, when ``settings`` has no ``noise_rank`` field (default: ``settings.noise_rank``).
    """

    def __init__(self, settings: ESSettings, noise_rank: int | None = None) -> None:
        super().__init__(settings)
        self.rank = int(noise_rank if noise_rank is not None else settings.noise_rank)
        self._dir = tempfile.TemporaryDirectory(prefix="es-lightning-lora-")

    def _per_call(self, module: ReasoningModule) -> int:
        population = self.settings.population_size
        world = module.trainer.world_size if module._trainer is not None else 1
        return max(1, min(self.settings.members_per_batch, -(-population // world)))

    def check(self, module):
        """Refuse matrices LoRA cannot perturb (see :mod:`es_lightning.es.vllm_lora`) and make the engine LoRA-able:
        ``max_loras`` = members per call, ``max_lora_rank`` ≥ r (set before the engine starts, or it is rebuilt)."""
        self.check_ahead(module)
        module.require_generation_options(**lora_engine_options(module.engine_options(), self.rank,
                                                                self._per_call(module)))

    def check_ahead(self, module):
        check_lora_coverage(module.policy.model, perturbed_parameters(module.policy.model, self.settings.trainable),
                            self.rank)

    def evaluate(self, module, examples, step, members):
        s = self.settings
        gen = module.generator
        mine = _mine(module, members)
        named = perturbed_parameters(module.policy.model, s.trainable)
        modules = lora_matrices(module.policy.model)
        k = self._per_call(module)
        run = PopulationStep(module, s, examples, step, entropy=False)  # the members are adapters in the engine
        cache: dict = {}  # (noise id, name) -> (A, B): drawn once this step, reused by the update
        report_progress(module, 0, len(mine))
        for start in range(0, len(mine), k):
            chunk = mine[start:start + k]
            paths = []
            for j, m in enumerate(chunk):
                factors = {}
                for name, p in named:
                    if (m.noise_id, name) not in cache:
                        cache[(m.noise_id, name)] = lowrank_factors(module.seed, step, m.noise_id, name, p.shape,
                                                                    self.rank, device=p.device)
                    factors[name] = cache[(m.noise_id, name)]
                paths.append(f"{self._dir.name}/slot-{j}")
                write_member_adapter(paths[-1], modules, factors, m.sign, s.sigma, self.rank)
            with gen.member_adapters(paths):
                run.run(chunk)
            report_progress(module, start + len(chunk), len(mine))
        return run.tally.finish(module, cache)

    def after_update(self, module, step, members, weights):
        module.policy_updated()  # the engine's base weights take the new centre before the next generation


BACKEND_EVALUATORS["vllm"] = select_vllm_evaluator
