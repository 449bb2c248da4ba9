"""Population evaluation behind one interface: score N perturbed copies of the policy on one batch of prompts.

An ES step is *evaluate the population → update → log* (:class:`~es_lightning.es.algorithm.ESAlgorithm`). Only the
first part depends on how the members are run, so it sits behind :class:`PopulationEvaluator`::

    scores = evaluator.evaluate(module, examples, step, members)    # -> PopulationScores, identical on every rank

Member ``n`` is the policy θ + sign·σ·ε(seed, step, noise_id, name) for every perturbed parameter (Qiu et al. 2025,
Alg. 2; antithetic pairs share a noise id with opposite signs), scored on ``samples_per_member`` completions of every
prompt, all members sampling with the same random numbers (common random numbers: one rollout seed per step).

Evaluators (chosen in one place, :func:`select_evaluator`):

* :class:`InPlaceEvaluator` — one member at a time, written into the policy's weights and restored bit for bit from a
  copy: the one model-sized buffer of README "Design", the lowest memory. Under DDP rank r runs members r, r + W, ….
* :class:`BatchedMembersEvaluator` — ``members_per_batch`` members in one batched ``generate``, each block of rows
  through its own weights (:mod:`es_lightning.es.population`); the centre weights are never written. Same rewards.
* :class:`LowRankEvaluator` — ``noise_rank = r > 0`` (EGGROLL): ``members_per_batch`` members (the whole population
  when it equals ``population_size``) in one batched ``generate`` through the *shared* weights, each block of rows
  adding its rank-r term (:mod:`es_lightning.es.lowrank`): no weight copies; the factors, drawn once per step, are
  handed to the update.
* :class:`ShardedEvaluator` — FSDP (the parameters are sharded, a forward is a collective): every rank runs every
  member on its share of the prompts, perturbing only its own shard.

Master weights: with bf16/fp16 weights the ES optimizer keeps the centre θ in fp32 (``master_dtype``). Every evaluator
perturbs from it (:func:`centre`, :meth:`~es_lightning.es.update.ESOptimizer.centre_views`) — a member is θ + σε
rounded once to the weights' dtype — and the in-place ones restore the weights by writing it back (the master, not a
bf16 copy, is then the one model-sized buffer).

Every evaluator fills a :class:`MemberTally` of per-member sums for what it ran; the tally is summed across ranks in one
collective, so member-split and prompt-split layouts produce the same :class:`PopulationScores`.
:class:`PopulationStep` holds a step's shared state and does generate → grade → tally for a block of members.

vLLM's evaluators (members pushed into the engine, perturbed inside it from seeds, or low-rank members as LoRA
adapters) are in :mod:`es_lightning.es.vllm_evaluators`.

Adding an evaluator (EGGROLL low-rank members, vLLM engine-side perturbation) = one subclass of
:class:`PopulationEvaluator` implementing :meth:`~PopulationEvaluator.evaluate` — put the members' weights in place
(or in the engine), ``run = PopulationStep(module, settings, examples, step)``, ``run.run(members)``, return
``run.tally.finish(module)`` — and one line in
:func:`select_evaluator`.
"""

from __future__ import annotations

import hashlib
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from es_lightning.es.lowrank import LowRankPopulationForward
from es_lightning.es.noise import param_noise
from es_lightning.es.population import PopulationForward
from es_lightning.es.settings import ESSettings
from es_lightning.es.sharding import clean_name, is_dtensor, prompt_share, shard_views
from es_lightning.es.update import ESOptimizer
from es_lightning.generation import Rollout
from es_lightning.scoring import Scores

if TYPE_CHECKING:
    from es_lightning.modules.base import ReasoningModule

__all__ = [
    "BatchedMembersEvaluator", "InPlaceEvaluator", "LowRankEvaluator", "Member", "MemberTally", "PopulationEvaluator",
    "PopulationScores", "PopulationStep", "ShardedEvaluator", "centre", "es_optimizer", "perturb", "perturbed_parameters",
    "group_columns", "member_groups", "rollout_seed", "select_evaluator",
]


@dataclass(frozen=True)
class Member:
    """One population member: its position ``index`` in 0..N-1 and its perturbation ``sign`` · ε(``noise_id``)."""

    index: int
    noise_id: int
    sign: float = 1.0


@dataclass
class PopulationScores:
    """What the population earned on one batch: the same tensors on every rank (already reduced across ranks)."""

    rewards: Tensor  # [N] float32 mean reward of each member over its B·n completions; NaN/inf = drop the member
    success: Tensor  # [N, B] float32 share of each member's n samples of prompt b the verifier accepts
    mean_length: Tensor  # [N] float32 mean completion length (tokens)
    clipped_ratio: Tensor  # [N] float32 share of completions that hit max_new_tokens
    entropy: Tensor | None  # [N] float32 token-mean entropy of the policy; None when greedy or not measured (vLLM)
    generate_s: float = 0.0  # seconds this rank spent generating
    score_s: float = 0.0  # seconds this rank spent grading
    #: ``(noise id, parameter name) -> flat fp32 noise`` still held from the evaluation, for the update to reuse
    noise_cache: dict[tuple[int, str], Tensor] = field(default_factory=dict)


class PopulationEvaluator(ABC):
    """Scores a population of perturbed policies on one batch; see the module docstring for the contract.

    Args:
        settings: the ES settings (``sigma``, ``samples_per_member``, ``members_per_batch``, ``trainable``).
    """

    def __init__(self, settings: ESSettings) -> None:
        self.settings = settings

    def check(self, module: ReasoningModule) -> None:
        """Refuse (or warn about) a setting this evaluator cannot run, naming the fix. Called at fit start."""
        return None

    def check_ahead(self, module: ReasoningModule) -> None:
        """What :meth:`check` refuses (and warns about), for a later stage (a :class:`~es_lightning.SequentialStrategy`
        switch), called at fit start on the first stage's module. The default is :meth:`check`; an evaluator whose
        check also prepares something (the vLLM LoRA evaluator asks for engine settings) overrides it."""
        self.check(module)

    @abstractmethod
    def evaluate(
        self, module: ReasoningModule, examples: list[dict[str, Any]], step: int, members: Sequence[Member]
    ) -> PopulationScores:
        """Score every member of ``members`` (the whole population, in index order) on ``examples`` — the same
        prompts on every rank — at ES step ``step``. Must leave the centre weights exactly as it found them."""

    def after_update(self, module: ReasoningModule, step: int, members: Sequence[Member], weights: Tensor) -> None:
        """Called after the ES optimizer applied step ``step``'s update with member weights ``weights`` [N] (the
        normalised rewards; member ``n`` contributes ``weights[n]·sign_n·ε(noise_id_n)``): an evaluator that keeps a
        copy of the weights elsewhere (a vLLM engine) brings it up to date. Nothing to do for the others."""
        return None


# ---------------------------------------------------------------------- shared pieces
def perturbed_parameters(model: torch.nn.Module, trainable: str | None) -> list[tuple[str, torch.nn.Parameter]]:
    """The (clean name, parameter) pairs ES perturbs and updates: all, or those whose name matches ``trainable``.
    The clean name (FSDP prefixes stripped) is part of each noise key, so it is the same under any wrapping."""
    named = [(clean_name(n), p) for n, p in model.named_parameters()]
    if trainable:
        pattern = re.compile(trainable)
        named = [(n, p) for n, p in named if pattern.search(n)]
        if not named:
            first: dict[int, str] = {}  # a tied tensor (lm_head = embed_tokens) is named once, by its first name
            tied = []
            for n, p in model.named_parameters(remove_duplicate=False):
                if id(p) in first and pattern.search(clean_name(n)):
                    tied.append(f"{clean_name(n)} is tied to {first[id(p)]} (one tensor, named once); match "
                                f"{first[id(p)]!r} instead")
                first.setdefault(id(p), clean_name(n))
            raise ValueError(f"trainable={trainable!r} matches no parameter name of the model"
                             + (f": {'; '.join(tied)}" if tied else
                                f" (names look like {clean_name(next(iter(model.named_parameters()))[0])!r})"))
    return named


def perturb(centre: Tensor, eps: Tensor, sign: float, sigma: float) -> Tensor:
    """θ + sign·σ·ε for one tensor, computed in fp32 and cast once to the parameter's dtype."""
    return (centre.float() + (sign * sigma) * eps.view_as(centre)).to(centre.dtype)


def _perturbed(theta: Tensor, eps: Tensor, sign: float, sigma: float, scaled: dict[int, Tensor], noise_id: int,
               out: Tensor) -> None:
    """Write :func:`perturb`'s θ + sign·σ·ε (``theta`` fp32, cast once to ``out``'s dtype) into ``out``, a member's slot
    of the stacked batch, bit for bit — with σ·ε computed once per noise id: for sign ±1, (±σ)·ε rounds to ±(σ·ε)
    exactly (round-to-nearest is symmetric) and θ + (−x) is θ − x, so an antithetic pair costs one multiply and two
    adds, written straight into the batch (no per-member tensor, no stacking copy)."""
    if sign not in (1.0, -1.0):
        out.copy_(perturb(theta, eps, sign, sigma))
        return
    x = scaled.pop(noise_id, None)  # the pair's first member left it: used once more, then let go
    if x is None:
        x = scaled[noise_id] = sigma * eps.view_as(theta)
    (torch.add if sign > 0 else torch.sub)(theta, x, out=out)


def es_optimizer(module: ReasoningModule) -> ESOptimizer | None:
    """The fit's ES optimizer — it holds the fp32 centre θ of bf16/fp16 weights (``master_dtype``) — or ``None``
    outside a fit (the weights are then the centre)."""
    trainer = module._trainer
    for opt in trainer.strategy.optimizers if trainer is not None else ():
        if isinstance(opt, ESOptimizer):
            return opt
    return None


def centre(opt: ESOptimizer | None, p: Tensor, copy: bool = True) -> Tensor:
    """The centre members of ``p`` are perturbed from: its fp32 master (no copy) when the optimizer keeps one, else
    ``p`` (a copy when ``copy``, for an in-place evaluation to restore from). Writing it into ``p`` restores ``p``
    bit for bit (the weight is the master rounded to nearest)."""
    if opt is not None and opt.has_master(p):
        return opt.centre(p)
    return p.detach().clone() if copy else p.detach()


def group_columns(num_prompts: int, groups: int) -> list[slice]:
    """The batch's prompts as ``groups`` equal slices of consecutive prompts (``prompt_groups``); group ``g`` of the
    population is scored on slice ``g`` only. Raises, naming the fix, when the batch does not split evenly."""
    if num_prompts % groups:
        raise ValueError(f"prompt_groups={groups} splits each batch into {groups} equal slices, but a batch has "
                         f"{num_prompts} prompts; set data.batch_size to a multiple of {groups}")
    return _equal_slices(num_prompts, groups)


def member_groups(population_size: int, groups: int) -> list[slice]:
    """The population's ``prompt_groups`` as slices of consecutive member indices (``ESSettings`` checks that they
    split evenly); group ``g`` is scored on :func:`group_columns` slice ``g``."""
    return _equal_slices(population_size, groups)


def _equal_slices(n: int, parts: int) -> list[slice]:
    size = n // parts
    return [slice(g * size, (g + 1) * size) for g in range(parts)]


def rollout_seed(seed: int, step: int) -> int:
    """The step's sampling seed, shared by every member (common random numbers) and every rank."""
    return int.from_bytes(hashlib.blake2b(f"{seed}/{step}/rollout".encode(), digest_size=4).digest(), "little") >> 1


def report_progress(module: ReasoningModule, done: int, total: int) -> None:
    """Tell callbacks that listen (``on_population_progress``, e.g. StageProgressBar) how far the population is."""
    trainer = module._trainer
    for cb in trainer.callbacks if trainer is not None else ():
        if hasattr(cb, "on_population_progress"):
            cb.on_population_progress(trainer, module, done, total)


class MemberTally:
    """Per-member sums of what this rank ran; :meth:`finish` sums them across ranks and divides.

    Sums (not means) make the reduction exact whichever way the work was split: by member (DDP: a member's sums live on
    one rank, the others add zeros) or by prompt (FSDP: every rank adds its prompts' share). float64 throughout.
    """

    def __init__(self, population: int, prompts: int, samples: int, entropy: bool) -> None:
        z = torch.zeros
        self.samples, self.entropy = samples, entropy  # entropy: measure the members' token entropy (sampled rows)
        self.sums = z(population, 6, dtype=torch.float64)  # reward, completions, length, truncated, entropy, tokens
        self.success = z(population, prompts, dtype=torch.float64)  # [N, B] accepted samples per prompt
        self.generate_s = self.score_s = 0.0

    def add(self, member: int, columns: slice, rollout: Rollout, scores: Scores, rows: slice = slice(None)) -> None:
        """Member ``member``'s completions ``rows`` of ``rollout`` (prompt-major, ``samples`` per prompt), which are
        the prompts ``columns`` of the step's batch, graded as ``scores`` (same rows)."""
        mask = rollout.completion_mask[rows].to(torch.float64)  # [R, C]
        lengths = mask.sum(-1)  # [R]
        entropy = 0.0
        if self.entropy and rollout.entropy is not None:
            entropy = float((rollout.entropy[rows].to(torch.float64) * mask).sum())
        self.sums[member] += torch.tensor([
            float(scores.rewards.to(torch.float64).sum()), len(scores), float(lengths.sum()),
            float(rollout.truncated[rows].sum()), entropy, float(lengths.sum()),
        ], dtype=torch.float64)
        self.success[member, columns] += scores.correct.to(torch.float64).view(-1, self.samples).sum(-1)

    def finish(self, module: ReasoningModule, noise_cache: dict | None = None) -> PopulationScores:
        sums, success = self.sums, self.success
        trainer = module._trainer
        if trainer is not None and trainer.world_size > 1:  # one collective; on the module's device (NCCL moves CUDA)
            flat = torch.cat([sums.reshape(-1), success.reshape(-1)]).to(module.device)
            flat = trainer.strategy.reduce(flat, reduce_op="sum").cpu()
            sums, success = flat[:sums.numel()].view_as(sums), flat[sums.numel():].view_as(success)
        reward, completions, length, truncated, entropy, tokens = sums.unbind(-1)
        return PopulationScores(
            rewards=(reward / completions).float(),
            success=(success / self.samples).float(),
            mean_length=(length / completions).float(),
            clipped_ratio=(truncated / completions).float(),
            entropy=(entropy / tokens.clamp(min=1.0)).float() if self.entropy else None,
            generate_s=self.generate_s,
            score_s=self.score_s,
            noise_cache=noise_cache or {},
        )


class PopulationStep:
    """One population evaluation's shared state — sampling settings, the step's seed, the rendered prompts (this rank's
    ``local`` share, default all) and the tally — and the generate → grade → tally of one block of members."""

    def __init__(self, module: ReasoningModule, settings: ESSettings, examples: list[dict[str, Any]], step: int,
                 local: list[dict[str, Any]] | None = None, entropy: bool = True) -> None:
        """``entropy=False``: the members' token entropy is not measured (``PopulationScores.entropy`` is None) — for
        evaluators whose members live only in a vLLM engine (perturbed inside it, or LoRA adapters), where the
        policy's forward, which measures it, holds the centre weights."""
        local = examples if local is None else local
        self.module, self.step, self.samples = module, step, settings.samples_per_member
        self.params = module.sampling_params()
        self.seed = rollout_seed(module.seed, step)
        self.prompts = module.prompts(local)  # rendered once per step
        self.repeated = [e for e in local for _ in range(self.samples)]  # one example per completion
        self.tally = MemberTally(settings.population_size, len(examples), self.samples,
                                 entropy and self.params.temperature > 0)
        # prompt groups: the batch's slice each member is scored on, by member index (one group: all of it)
        slices = group_columns(len(local), settings.prompt_groups)
        groups = member_groups(settings.population_size, settings.prompt_groups)
        self.grouped = settings.prompt_groups > 1
        self.slice_of = [c for c, g in zip(slices, groups) for _ in range(g.start, g.stop)]

    def run(self, members: Sequence[Member], columns: slice = slice(None)) -> None:
        """Score ``members`` (whose weights the caller has put in place) in one ``generate`` call, member-major rows,
        all members drawing the same sampling random numbers; ``columns``: the batch's prompts these are."""
        k = len(members)
        t0 = time.perf_counter()
        if not self.grouped:
            prompts, repeated, spans = self.prompts * k, self.repeated * k, [columns] * k
        else:  # each member's group's slice, member-major (equal slices: the blocks stay equal)
            spans = [self.slice_of[m.index] for m in members]
            n = self.samples
            prompts = [p for c in spans for p in self.prompts[c]]
            repeated = [e for c in spans for e in self.repeated[c.start * n:c.stop * n]]
        blocks = {"common_random_blocks": k} if k > 1 else {}  # a population-batched call (HF generator)
        rollout = self.module.generator.generate(prompts, self.samples, self.params, seed=self.seed,
                                                 return_logprobs=self.tally.entropy, **blocks)
        t1 = time.perf_counter()
        scores = self.module.score(rollout.texts, repeated, step=self.step)  # each completion graded once
        self.tally.generate_s += t1 - t0
        self.tally.score_s += time.perf_counter() - t1
        rows = len(repeated) // k
        for j, member in enumerate(members):
            block = slice(j * rows, (j + 1) * rows)
            self.tally.add(member.index, spans[j], rollout, _slice_scores(scores, block), rows=block)


# ---------------------------------------------------------------------- evaluators
class InPlaceEvaluator(PopulationEvaluator):
    """One member at a time, perturbed in place and restored bit for bit (a copy of θ is the one extra buffer)."""

    def evaluate(self, module, examples, step, members):
        s = self.settings
        mine = list(members)[module.trainer.global_rank::module.trainer.world_size]
        named = perturbed_parameters(module.policy.model, s.trainable)
        run = PopulationStep(module, s, examples, step)
        opt = es_optimizer(module)
        base = [centre(opt, p) for _, p in named]  # fp32 master (no copy) or a copy of the weights
        report_progress(module, 0, len(mine))
        try:
            for done, member in enumerate(mine, 1):
                for (name, p), b in zip(named, base):
                    eps = param_noise(module.seed, step, member.noise_id, name, p.numel(), device=p.device)
                    p.copy_(perturb(b, eps, member.sign, s.sigma))  # rounded once to the weight's dtype
                run.run([member])
                report_progress(module, done, len(mine))
        finally:
            for (_, p), b in zip(named, base):
                p.copy_(b)  # bit-for-bit restore of the centre weights, also when scoring raised
        return run.tally.finish(module)


class BatchedMembersEvaluator(PopulationEvaluator):
    """``members_per_batch`` members per ``generate`` call, member-major rows, each block through its own weights.

    Memory: the ``k`` perturbed copies of the perturbed tensors at once (and, when a rank's members all fit in one
    batch, their fp32 noise, which the update then reuses instead of drawing it again)."""

    def evaluate(self, module, examples, step, members):
        s = self.settings
        mine = list(members)[module.trainer.global_rank::module.trainer.world_size]
        named = perturbed_parameters(module.policy.model, s.trainable)
        run = PopulationStep(module, s, examples, step)
        k = s.members_per_batch
        keep_noise = 1 < len(mine) <= k  # the noise is held anyway: hand it to the update
        cache: dict[tuple[int, str], Tensor] = {}
        opt = es_optimizer(module)
        report_progress(module, 0, len(mine))
        for start in range(0, len(mine), k):
            chunk = mine[start:start + k]
            stacked = {}  # {name: [k, *shape]}
            for name, p in named:
                stacked[name] = out = torch.empty((len(chunk), *p.shape), dtype=p.dtype, device=p.device)
                theta = centre(opt, p, copy=False).float()
                scaled: dict[int, Tensor] = {}  # noise id -> σ·ε (fp32) until the pair's second member takes it
                for j, m in enumerate(chunk):
                    eps = cache.get((m.noise_id, name))
                    if eps is None:
                        eps = param_noise(module.seed, step, m.noise_id, name, p.numel(), device=p.device)
                        if keep_noise:
                            cache[(m.noise_id, name)] = eps
                    _perturbed(theta, eps, m.sign, s.sigma, scaled, m.noise_id, out[j])
            with PopulationForward(module.policy.model, stacked):
                run.run(chunk)
            del stacked
            report_progress(module, start + len(chunk), len(mine))
        return run.tally.finish(module, cache)


class LowRankEvaluator(PopulationEvaluator):
    """EGGROLL low-rank members (``noise_rank = r > 0``): ``members_per_batch`` members per ``generate`` call, each
    block of rows running W x + sign·(σ/√r)·A (Bᵀ x) through the shared weights
    (:class:`~es_lightning.es.lowrank.LowRankPopulationForward`); vectors get their members' full-rank copies.

    Memory: no weight copy and no write to the centre (it is never touched, so nothing needs restoring); the step's
    factors of this rank's members, O(N·r·(m+n)) fp32 per matrix (plus the vectors' noise), are kept in one cache from
    the first block to the update, which reuses them instead of drawing them again (``PopulationScores.noise_cache``).
    Under DDP rank r runs members r, r + W, … (each rank's cache holds its members; the update draws the rest).

    With fp32 masters (``master_dtype``, :mod:`es_lightning.precision`) a matrix's forward reads the live weight, which
    is the master rounded to the model's dtype, and adds the rank-r term in the activations (never rounded into a bf16
    weight); the vectors' member copies are perturbed from the master itself, θ + σε rounded once, as the other
    evaluators do.
    """

    def check(self, module):
        if module.generation_backend != "hf":
            raise ValueError(
                f"noise_rank={self.settings.noise_rank} adds each member's low-rank term inside the policy's HF forward, "
                f"which generation_backend={module.generation_backend!r} does not run; use generation_backend: hf with "
                "noise_rank > 0, or noise_rank: 0"
            )

    def evaluate(self, module, examples, step, members):
        mine = list(members)[module.trainer.global_rank::module.trainer.world_size]
        return lowrank_members(module, self.settings, PopulationStep(module, self.settings, examples, step), mine)


def lowrank_members(module: ReasoningModule, s: ESSettings, run: PopulationStep, members: Sequence[Member],
                    columns: slice = slice(None)) -> PopulationScores:
    """Score ``members`` through :class:`LowRankPopulationForward`, ``members_per_batch`` per ``generate`` call, on
    ``run``'s prompts (``columns``: which of the batch's prompts they are); the step's factors are drawn once into the
    cache the update reuses. The weights are never written."""
    named = perturbed_parameters(module.policy.model, s.trainable)
    cache: dict = {}  # (noise id, name) -> (A, B) for a matrix, flat ε for a vector: drawn once this step
    opt = es_optimizer(module)
    centres = {name: centre(opt, p, copy=False) for name, p in named}  # fp32 masters where kept (no copies)
    report_progress(module, 0, len(members))
    for start in range(0, len(members), s.members_per_batch):
        chunk = members[start:start + s.members_per_batch]
        with LowRankPopulationForward(module.policy.model, named, [(m.noise_id, m.sign) for m in chunk],
                                      seed=module.seed, step=run.step, sigma=s.sigma, rank=s.noise_rank, cache=cache,
                                      centres=centres):
            run.run(chunk, columns=columns)
        report_progress(module, start + len(chunk), len(members))
    return run.tally.finish(module, cache)


class ShardedEvaluator(PopulationEvaluator):
    """FSDP: all ranks run every member together, each on its share of the prompts, perturbing only its own shard.

    Under FSDP a forward all-gathers the parameters — a collective every rank joins — so ranks cannot run different
    members. Each rank perturbs its shard θ_local + σ ε_n[local elements] (the noise of an element is the one an
    unsharded run draws: layout-independent keys), generates on its contiguous block of the prompts
    (:func:`~es_lightning.es.sharding.prompt_share`) and restores its shard from a copy (1/W of a model-sized buffer).
    A sharded run therefore equals an unsharded one up to the float rounding of the reward sums (tested).

    Sampling at ``temperature > 0`` uses the step's rollout seed on every rank: rank 0's prompts sample exactly as in
    an unsharded run; the other ranks' prompts sit at other batch rows and draw other (equally valid) numbers.
    Limits: ``members_per_batch > 1`` falls back to one member at a time (a warning); the batch needs at least one
    prompt per rank.

    Low-rank members (``noise_rank > 0``, FSDP2 only) write no shard at all: every rank runs ``members_per_batch``
    members per ``generate`` through :class:`~es_lightning.es.lowrank.LowRankPopulationForward` on its prompt share.
    A patched layer reads its weight inside the forward, after FSDP2 has gathered it, and adds each member's rank-r
    term with factors drawn for the whole matrix (O(r·(m+n)) each, the same on every rank); the vectors' member copies
    are perturbed from the whole vector (gathered once per block). The update then adds to each rank's shard only its
    rows of Σ z E. FSDP1 is refused: outside a forward its parameters are flat shards, without a matrix's shape.
    """

    def check(self, module):
        if self.settings.prompt_groups > 1:
            raise ValueError(
                f"prompt_groups={self.settings.prompt_groups} is not supported on a sharded (FSDP) policy: its ranks "
                "split each member's prompts, not the population; use prompt_groups: 1 with FSDP, or DDP "
                "(configs/trainer/ddp.yaml) if the model fits on one device"
            )
        if self.settings.noise_rank and not any(is_dtensor(p) for p in module.policy.model.parameters()):
            raise ValueError(
                f"noise_rank={self.settings.noise_rank} is not supported under FSDP1 (FSDPStrategy), whose parameters "
                "are flat shards outside a forward, so no matrix keeps its shape; use FSDP2 (ModelParallelStrategy, "
                "configs/trainer/fsdp2.yaml) with noise_rank > 0, or noise_rank: 0 with FSDP1"
            )
        if self.settings.members_per_batch > 1 and not self.settings.noise_rank:
            rank_zero_warn(
                f"members_per_batch={self.settings.members_per_batch} stacks full copies of the weights, which a sharded "
                "(FSDP) policy does not have: members are evaluated one at a time (same rewards). Use DDP "
                "(configs/trainer/ddp.yaml) to batch members if the model fits on one device."
            )
        if module.generation_backend != "hf":
            raise ValueError(
                f"generation_backend={module.generation_backend!r} cannot generate from an FSDP-sharded policy (vLLM "
                "holds its own full copy of the weights); use generation_backend: hf with FSDP, or vLLM with DDP"
            )

    def evaluate(self, module, examples, step, members):
        s = self.settings
        trainer = module.trainer
        share = prompt_share(len(examples), trainer.global_rank, trainer.world_size)
        run = PopulationStep(module, s, examples, step, local=examples[share])
        if s.noise_rank:  # every rank runs every member, members_per_batch at a time, through the shared weights
            return lowrank_members(module, s, run, list(members), columns=share)
        views = shard_views(perturbed_parameters(module.policy.model, s.trainable), trainer.strategy.model)
        opt = es_optimizer(module)
        # this rank's shard of θ: its fp32 master's piece (no copy), else a copy of the shard — the exact restore
        base = opt.centre_views(views) if opt is not None else [(v, v.read()) for v in views]
        report_progress(module, 0, len(members))
        try:
            for done, member in enumerate(members, 1):
                for v, b in base:
                    v.write(perturb(b, v.noise(module.seed, step, member.noise_id), member.sign, s.sigma))
                if opt is not None:
                    opt.sync_mirrors(views)  # FSDP1 gathered copies of mastered parameters, from the shards
                run.run([member], columns=share)
                report_progress(module, done, len(members))
        finally:
            for v, b in base:
                v.write(b)  # bit-for-bit restore of this rank's centre shard
            if opt is not None:
                opt.sync_mirrors(views)
        return run.tally.finish(module)


def _slice_scores(scores: Scores, rows: slice) -> Scores:
    return Scores(answers=scores.answers[rows], correct=scores.correct[rows], rewards=scores.rewards[rows])


#: generation backend → the function choosing its evaluator, for backends whose engine holds its own weights (filled by
#: :mod:`es_lightning.es.vllm_evaluators` when imported — :mod:`es_lightning.es.algorithm` imports it)
BACKEND_EVALUATORS: dict[str, Callable[[ReasoningModule, ESSettings], PopulationEvaluator]] = {}


def select_evaluator(module: ReasoningModule, settings: ESSettings) -> PopulationEvaluator:
    """The evaluator for this module and these settings — the one place the choice is made."""
    if module.sharded:
        return ShardedEvaluator(settings)  # low-rank members too (FSDP2); FSDP1 refuses them in its check
    if module.generation_backend in BACKEND_EVALUATORS:  # vLLM: members pushed, perturbed engine-side, or LoRA adapters
        return BACKEND_EVALUATORS[module.generation_backend](module, settings)
    if settings.noise_rank:
        return LowRankEvaluator(settings)
    if settings.members_per_batch > 1:
        return BatchedMembersEvaluator(settings)
    return InPlaceEvaluator(settings)
