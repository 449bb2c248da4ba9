"""``ESModule(noise_rank=r)`` end to end (EGGROLL low-rank members, es_lightning/es/lowrank.py) on a real Trainer.

Checked against independent computations: the member rewards of a step equal those of each member's explicitly merged
weights W + σ·A Bᵀ/√r loaded into a plain copy of the model; the update equals Σ z_n E_n formed member by member in
float64; the whole population in one batched generate equals the members one at a time, bitwise; a resumed fit equals
the uninterrupted one, bitwise. (DDP: tests/test_es_ddp.py; the forward and the update rule alone: tests/test_lowrank.py.)

Where batched and member-by-member are bitwise, and why: a member's rows go through the same kernels with the same
operands whichever other blocks share the batch (the base matmul is row-independent; the rank-r term is one ``bmm``
slice per block; the factors are the same pure function of their key), and the update does not depend on the batching
at all. That holds on CPU (this file, fp32 and bf16, rank 2 and 4) except at rank 1 in fp32, where MKL's bmm
of a one-row Bᵀ rounds a batch of one member differently from a batch of k in the last bit (tests/test_lowrank.py::
test_rank1_batched_members_equal_each_member_alone_to_rounding). It is *not* guaranteed where a kernel's reduction order depends on
the number of rows: cuBLAS/cuDNN choose kernels (split-K, tile sizes) by shape, so on a GPU the base matmul of k·R rows
may round differently from R rows in the last bit, and a greedy near-tie can then pick another token. The low-rank
member is never bitwise equal to its merged weights either (x Wᵀ + (x B)(s Aᵀ) rounds twice, x (W + σE)ᵀ once after
rounding the merged weight): equal to 1e-5 in fp32 (tests/test_lowrank.py), which is why the merged-weights comparison
below uses greedy tokens (and so rewards), not bits.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from es_helpers import CharSumTask, RecordBatches
from lightning.pytorch.callbacks import ModelCheckpoint

from es_lightning import ESModule, ReasoningDataModule
from es_lightning.es.algorithm import ESSettings
from es_lightning.es.evaluators import LowRankEvaluator, ShardedEvaluator
from es_lightning.es.lowrank import lowrank_factors
from es_lightning.es.noise import param_noise
from es_lightning.generation import HFGenerator
from es_lightning.policy import load_policy
from es_lightning.tasks import CountdownTask


def _trainer(max_steps, root=None, callbacks=()):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=bool(root),
                     default_root_dir=root, limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks))


def _dm(**kw):
    return ReasoningDataModule(task=CountdownTask(), **{"train_size": 32, "val_size": 4, "test_size": 4, "batch_size": 4,
                                                         "seed": 0, **kw})


def _weights(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


# ---------------------------------------------------------------------------------------------------- settings
def test_noise_rank_is_validated_with_the_fix(tiny_model_dir):
    with pytest.raises(ValueError, match=r"noise_rank must be an integer >= 0.*got -1"):
        ESModule(model=tiny_model_dir, noise_rank=-1)
    module = ESModule(model=tiny_model_dir, noise_rank=33)  # no matrix of the tiny model has both sides above 32
    with pytest.raises(ValueError, match=r"noise_rank=33 exceeds the smaller side of every perturbed matrix \(the "
                                         r"largest is .* \(\d+, 32\)\).*use noise_rank <= 32"):
        module.configure_model()  # once the model is loaded: before any step
    ESModule(model=tiny_model_dir, noise_rank=17).configure_model()  # k_proj [16, 32] thinner than r: its full rank
    # trainable restricts the matrices the bound is taken over: k_proj's smaller side is 16
    with pytest.raises(ValueError, match=r"noise_rank=17 exceeds .*k_proj.weight \(16, 32\).*use noise_rank <= 16"):
        ESModule(model=tiny_model_dir, noise_rank=17, trainable=r"k_proj").configure_model()
    assert ESSettings().noise_rank == 0  # full rank by default (Ba et al.)


def test_paths_that_cannot_run_low_rank_members_refuse_it(tiny_model_dir):
    module = ESModule(model=tiny_model_dir, population_size=4)
    # under the sharded evaluator, parameters that are not DTensors are FSDP1's flat shards: refused, naming FSDP2
    # (FSDP2 runs low-rank members: tests/test_sharding_lowrank.py)
    with pytest.raises(ValueError, match=r"noise_rank=2 is not supported under FSDP1.*ModelParallelStrategy.*fsdp2\.yaml"):
        ShardedEvaluator(ESSettings(population_size=4, noise_rank=2)).check(module)
    ShardedEvaluator(ESSettings(population_size=4)).check(module)  # full rank under FSDP1 is fine
    LowRankEvaluator(ESSettings(population_size=4, noise_rank=2)).check(module)
    module.generation_backend = "vllm"  # the HF forward is where the low-rank term is added
    with pytest.raises(ValueError, match="use generation_backend: hf with noise_rank > 0"):
        LowRankEvaluator(ESSettings(population_size=4, noise_rank=2)).check(module)


# ---------------------------------------------------------------------------------------------------- the step
def test_step_equals_merged_members_and_the_explicit_update(tiny_model_dir):
    """One step with noise_rank=2: each member's reward is what its merged weights W + σE earn when loaded into a
    plain copy of the model (greedy), and θ1 − θ0 = α/N Σ z_n E_n with z computed here and every E_n formed here."""
    sigma, lr, rank, n = 0.5, 0.01, 2, 4
    module = ESModule(model=tiny_model_dir, population_size=n, sigma=sigma, lr=lr, noise_rank=rank, members_per_batch=n,
                      max_new_tokens=6, temperature=0.0, reward_normalization="zscore", task=CharSumTask())
    module.configure_model()
    theta0 = _weights(module)
    batches = RecordBatches()
    _trainer(1, callbacks=[batches]).fit(module, _dm())
    assert isinstance(module.algorithm.evaluator, LowRankEvaluator)
    (batch,) = batches.batches
    rewards = module.last_rewards.double()
    assert len(set(rewards.tolist())) > 1

    def e(member, name, shape):  # E_n for a matrix (float64 product of the keyed factors), ε_n for a vector
        if len(shape) == 2:
            a, b = lowrank_factors(module.seed, 0, member, name, shape, rank)
            return a.double() @ b.double().T / math.sqrt(rank)
        return param_noise(module.seed, 0, member, name, math.prod(shape)).double().view(shape)

    plain = load_policy(tiny_model_dir)  # an independent copy of the model, generating on its own
    task, prompts = CharSumTask(), module.prompts(batch)
    for member in range(n):
        with torch.no_grad():
            for name, p in plain.model.named_parameters():
                p.copy_((theta0[name].double() + sigma * e(member, name, tuple(p.shape))).float())
        texts = HFGenerator(plain).generate(prompts, 1, module.sampling_params(), seed=0).texts
        assert rewards[member] == pytest.approx(sum(task.reward(texts, batch)) / len(texts), abs=1e-6), member

    z = (rewards - rewards.mean()) / rewards.std(unbiased=False)
    for name, p in module.model.named_parameters():
        want = theta0[name].double() + lr / n * sum(z[m] * e(m, name, tuple(p.shape)) for m in range(n))
        torch.testing.assert_close(p.double(), want, rtol=0, atol=1e-6, msg=name)
        assert not torch.equal(p, theta0[name]), name  # every tensor moved
    assert all(p.grad is None for p in module.model.parameters())


@pytest.mark.parametrize("temperature,antithetic", [(0.0, False), (1.0, True)])
def test_whole_population_in_one_batch_equals_member_by_member(temperature, antithetic):
    """The built-in model, 2 steps: 6 low-rank members in batches of 6, of 4 and 2, and one at a time give the same
    rewards and weights bitwise (see the module docstring for why, and where that stops holding)."""

    def fit(members_per_batch):
        module = ESModule(model="builtin:countdown-tiny", population_size=6, sigma=3e-2, lr=1e-2, max_new_tokens=12,
                          temperature=temperature, samples_per_member=2 if temperature else 1, antithetic=antithetic,
                          noise_rank=2, members_per_batch=members_per_batch)
        _trainer(2).fit(module, _dm(batch_size=8))
        return module

    one, whole, split = fit(1), fit(6), fit(4)
    assert len(set(one.last_rewards.tolist())) > 1
    for other in (whole, split):
        assert torch.equal(one.last_rewards, other.last_rewards)
        for (name, p), q in zip(one.model.named_parameters(), other.model.parameters()):
            assert torch.equal(p, q), name


def test_resume_is_bitwise(tmp_path, tiny_model_dir):
    kw = dict(population_size=4, sigma=0.05, lr=0.05, max_new_tokens=6, temperature=1.0, noise_rank=2,
              members_per_batch=4, reward_normalization="centered", task=CharSumTask())
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full = ESModule(model=tiny_model_dir, **kw)
    _trainer(4, tmp_path / "a", [ckpt]).fit(full, _dm(train_size=12))
    resumed = ESModule(model=tiny_model_dir, **kw)
    trainer = _trainer(4, tmp_path / "b")
    trainer.fit(resumed, _dm(train_size=12), ckpt_path=str(tmp_path / "a" / "step=2.ckpt"))
    assert trainer.global_step == 4
    start = _weights(ESModule(model=tiny_model_dir, **kw).policy)
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    assert any(not torch.equal(a, start[n]) for n, a in full.model.named_parameters())  # the fit moved the weights


@pytest.mark.parametrize("rank", [1, 4])  # 1: the recipes' rank; q/k/v and gate/up share their input term
def test_qwen_like_bf16_whole_population_equals_member_by_member(qwen_like_small_dir, rank):
    """The Qwen-like fixture in bf16 (tied embeddings: the same factors perturb the lookup and the lm_head, chat
    template, pad = EOS), sampled: one batch of 4 low-rank members equals the members one at a time, bitwise."""

    def fit(members_per_batch):
        module = ESModule(model=qwen_like_small_dir, dtype="bfloat16", population_size=4, sigma=2e-2, lr=1e-2,
                          max_new_tokens=4, temperature=1.0, noise_rank=rank, members_per_batch=members_per_batch,
                          reward_normalization="centered", task=CharSumTask())
        _trainer(1).fit(module, _dm(batch_size=2))
        return module

    one, whole = fit(1), fit(4)
    assert next(whole.model.parameters()).dtype == torch.bfloat16
    assert len(set(one.last_rewards.tolist())) > 1
    assert torch.equal(one.last_rewards, whole.last_rewards)
    start = _weights(load_policy(qwen_like_small_dir, dtype="bfloat16"))
    for (name, p), q in zip(one.model.named_parameters(), whole.model.parameters()):
        assert torch.equal(p, q), name
    # a real update (the bf16 norm weights at 1.0 keep theirs only with an fp32 master: es_lightning/precision.py)
    assert not torch.equal(one.model.model.embed_tokens.weight, start["model.embed_tokens.weight"])


def test_bf16_weights_update_their_fp32_master_by_the_explicit_sum(tiny_model_dir):
    """bf16 weights with an fp32 master (``master_dtype`` float32, the default): two low-rank steps; after each the
    master moved by exactly α/N Σ z_n E_n (formed here, float64) and the weight is the master rounded once. The second
    step's members are perturbed around a master that is no longer the bf16 weight."""
    sigma, lr, rank, n = 0.5, 0.01, 2, 4
    module = ESModule(model=tiny_model_dir, dtype="bfloat16", population_size=n, sigma=sigma, lr=lr, noise_rank=rank,
                      members_per_batch=n, max_new_tokens=6, temperature=0.0, reward_normalization="zscore",
                      task=CharSumTask())
    masters: list[dict[str, torch.Tensor]] = []
    rewards: list[torch.Tensor] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            opt = pl_module.optimizers().optimizer
            masters.append({name: opt.centre(p).detach().clone() for name, p in pl_module.model.named_parameters()})
            rewards.append(pl_module.last_rewards.clone())

    module.configure_model()
    start = {name: p.detach().float().clone() for name, p in module.model.named_parameters()}
    _trainer(2, callbacks=[Record()]).fit(module, _dm())
    previous = start
    for step, (master, r) in enumerate(zip(masters, rewards)):
        r = r.double()
        assert len(set(r.tolist())) > 1
        z = (r - r.mean()) / r.std(unbiased=False)
        for name, p in module.model.named_parameters():
            shape = tuple(p.shape)
            if len(shape) == 2:
                e = [lowrank_factors(module.seed, step, m, name, shape, rank) for m in range(n)]
                e = [a.double() @ b.double().T / math.sqrt(rank) for a, b in e]
            else:
                e = [param_noise(module.seed, step, m, name, p.numel()).double().view(shape) for m in range(n)]
            want = previous[name].double() + lr / n * sum(z[m] * e[m] for m in range(n))
            assert master[name].dtype == torch.float32
            torch.testing.assert_close(master[name].double(), want, rtol=0, atol=1e-6, msg=f"step {step} {name}")
        previous = master
    for name, p in module.model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(p, masters[-1][name].to(torch.bfloat16)), name
    norm = "model.norm.weight"  # an update far below a bf16 ulp at 1.0 (7.8e-3): kept by the master, not the weight
    assert not torch.equal(masters[-1][norm], masters[-1][norm].to(torch.bfloat16).float())
