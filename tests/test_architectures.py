"""Checkpoints of other architectures than Qwen2/Llama (GPT-2's Conv1D, Gemma's scaled embedding, MoE experts as 3-D
tensors and routers that return tuples): ES members batched full-rank or low-rank compute what each member's merged
weights compute, and a short fit runs (tiny random models with the Qwen-like tokenizer, tests/es_helpers.py)."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from es_helpers import tiny_architecture
from transformers import AutoModelForCausalLM

from es_lightning.es.evaluators import perturbed_parameters
from es_lightning.es.lowrank import LowRankPopulationForward, lowrank_factors
from es_lightning.es.noise import param_noise
from es_lightning.es.population import PopulationForward

SEED, STEP, SIGMA = 7, 3, 0.05
MEMBERS = [(0, 1.0), (0, -1.0), (1, 1.0)]  # (noise id, sign): an antithetic pair and one more


def _noise(member, name, p, rank, seed=SEED, step=STEP):
    """E (rank > 0, matrices) or ε of one member, float64, in the parameter's own layout."""
    if rank and p.dim() == 2:
        a, b = lowrank_factors(seed, step, member, name, p.shape, rank)
        return a.double() @ b.double().T / math.sqrt(rank)
    return param_noise(seed, step, member, name, p.numel()).double().view(p.shape)


def _merged_logits(model, named, member, sign, rank, ids, positions):
    """Logits of a plain copy of ``model`` holding one member's merged weights θ + sign·σ·E."""
    plain = copy.deepcopy(model)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, p in named:
            params[name].copy_((p.double() + sign * SIGMA * _noise(member, name, p, rank)).float())
        return plain(ids, position_ids=positions).logits


@pytest.mark.parametrize("model_type", ["mixtral", "qwen2_moe"])
@pytest.mark.parametrize("rank", [0, 1])
def test_moe_members_batched_equal_their_merged_weights(model_type, rank, tmp_path):
    """A router returning (logits, weights, indices) and experts that loop over the experts routed to (which vmap
    cannot batch) under population-batched members, full-rank and low-rank: each member's block of logits is its
    merged weights' (the forward raised AttributeError on the router's tuple)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_architecture(model_type, tmp_path), dtype=torch.float32).eval()
    named = perturbed_parameters(model, None)
    assert any(p.dim() == 3 for _, p in named)  # fused experts [E, out, in]
    ids = torch.randint(0, 700, (2, 9), generator=torch.Generator().manual_seed(0))
    batch, positions = ids.repeat(len(MEMBERS), 1), torch.arange(9).expand(2 * len(MEMBERS), 9)
    with torch.no_grad():
        if rank:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=rank):
                    got = model(batch, position_ids=positions).logits
            said = " ".join(str(w.message) for w in caught)
            assert "mlp.gate.weight" in said and "merged copies" in said  # the router [E, d], not an nn.Linear
            # the experts, most of the model, get full-rank noise and k copies: said, not silent
            assert "full-rank noise" in said and "model.layers.0.mlp.experts.gate_up_proj (4, " in said
        else:
            stacked = {name: torch.stack([(p.double() + s * SIGMA * _noise(i, name, p, 0)).float() for i, s in MEMBERS])
                       for name, p in named}
            with PopulationForward(model, stacked):
                got = model(batch, position_ids=positions).logits
        base = model(ids, position_ids=positions[:2]).logits
    for j, (member, sign) in enumerate(MEMBERS):
        want = _merged_logits(model, named, member, sign, rank, ids, positions[:2])
        torch.testing.assert_close(got[2 * j:2 * j + 2], want, rtol=0, atol=5e-5)
        assert (want - base).abs().max() > 0.1  # the member really differs from the centre


@pytest.mark.parametrize("rank", [0, 1])
def test_moe_es_step_batched_equals_member_by_member_without_torch_vmap_warnings(rank, tmp_path):
    """A fit step of a Mixtral (grouped-matmul experts, a router [E, d] held as k merged copies) with members batched
    earns each member's rewards and makes the update of one member at a time, bit for bit; torch's warning that vmap
    runs grouped_mm / histc per member ("Please file us an issue on GitHub") no longer reaches the user."""
    import lightning as L
    from es_helpers import CharSumTask

    from es_lightning import ESModule, ReasoningDataModule
    from es_lightning.tasks import CountdownTask

    path = tiny_architecture("mixtral", tmp_path)

    def fit(members_per_batch):
        module = ESModule(model=path, population_size=4, sigma=0.05, lr=0.01, noise_rank=rank,
                          members_per_batch=members_per_batch, max_new_tokens=4, temperature=1.0, task=CharSumTask())
        L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
                  enable_progress_bar=False, enable_model_summary=False).fit(
            module, ReasoningDataModule(task=CountdownTask(), train_size=4, val_size=2, test_size=2, batch_size=2, seed=0))
        return module

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batched = fit(4)
    said = [str(w.message) for w in caught if "batching rule" in str(w.message)]
    assert not said, said
    one = fit(1)
    assert len(set(one.last_rewards.tolist())) > 1 and torch.equal(one.last_rewards, batched.last_rewards)
    for (name, p), q in zip(one.model.named_parameters(), batched.model.parameters()):
        assert torch.equal(p, q), name


@pytest.mark.parametrize("rank", [0, 1])
def test_gpt2_members_batched_with_one_row_of_positions_equal_their_merged_weights(rank, tmp_path):
    """GPT-2 looks its positions up in a learned table (wpe, perturbed per member) and, called without position_ids,
    builds them as one row [1, T] broadcast over the batch; a caller may pass them so too. Each member's block of
    logits is its merged weights' (the batched lookup raised: 1 row, not a multiple of k members)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_architecture("gpt2", tmp_path), dtype=torch.float32).eval()
    named = perturbed_parameters(model, None)
    assert "transformer.wpe.weight" in dict(named)
    ids = torch.randint(0, 700, (2, 9), generator=torch.Generator().manual_seed(0))
    batch = ids.repeat(len(MEMBERS), 1)
    stacked = {name: torch.stack([(p.double() + s * SIGMA * _noise(i, name, p, 0)).float() for i, s in MEMBERS])
               for name, p in named}
    for positions in (None, torch.arange(9).unsqueeze(0)):  # [1, T]
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # low-rank: GPT-2's Conv1D is batched without copies; nothing to check here
            forward = (LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=rank)
                       if rank else PopulationForward(model, stacked))
            with forward:
                got = model(batch, position_ids=positions).logits
        for j, (member, sign) in enumerate(MEMBERS):
            want = _merged_logits(model, named, member, sign, rank, ids, positions)
            torch.testing.assert_close(got[2 * j:2 * j + 2], want, rtol=0, atol=5e-5)


@pytest.mark.parametrize("model_type", ["gemma2", "phi3", "gpt2"])
def test_lowrank_members_of_dense_architectures_equal_their_merged_weights(model_type, tmp_path):
    """Gemma's scaled embedding (W[ids]·√d, tied to the head), Phi-3's fused qkv / gate_up, GPT-2's Conv1D stored
    [in, out]: each low-rank member's logits are its merged weights' W + σE, E in the parameter's own layout (the
    update's), and none is held as k merged copies (Gemma's embedding table [V, d] and GPT-2's Conv1D were, warned)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_architecture(model_type, tmp_path), dtype=torch.float32).eval()
    named = perturbed_parameters(model, None)
    ids = torch.randint(0, 700, (2, 9), generator=torch.Generator().manual_seed(0))
    batch, positions = ids.repeat(len(MEMBERS), 1), torch.arange(9).expand(2 * len(MEMBERS), 9)
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=2):
            got = model(batch, position_ids=positions).logits
    copies = [str(w.message) for w in caught if "merged copies" in str(w.message)]
    assert not copies, copies
    for j, (member, sign) in enumerate(MEMBERS):
        torch.testing.assert_close(got[2 * j:2 * j + 2], _merged_logits(model, named, member, sign, 2, ids, positions[:2]),
                                   rtol=0, atol=5e-5)


def test_lowrank_step_of_an_moe_with_a_one_row_gate_updates_every_tensor_in_its_layout(tmp_path):
    """Qwen2-MoE's shared-expert gate is a [1, d] matrix: noise_rank=2 was refused (rank above its smaller side). Its
    r factors give it a full-rank perturbation; one fit step moves every tensor — the thin gate, the router [E, d],
    the experts [E, out, in] (full-rank noise) — by α/N Σ z_n E_n, each E_n in the tensor's own layout."""
    import lightning as L
    from es_helpers import CharSumTask

    from es_lightning import ESModule, ReasoningDataModule
    from es_lightning.tasks import CountdownTask

    n, sigma, lr, rank = 4, 0.05, 0.01, 2
    module = ESModule(model=tiny_architecture("qwen2_moe", tmp_path), population_size=n,
                      sigma=sigma, lr=lr, noise_rank=rank, members_per_batch=n, max_new_tokens=4, temperature=0.0,
                      reward_normalization="zscore", task=CharSumTask())
    module.configure_model()
    theta0 = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    assert theta0["model.layers.0.mlp.shared_expert_gate.weight"].shape == (1, 64)
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, limit_val_batches=0,
              enable_progress_bar=False, enable_model_summary=False).fit(
        module, ReasoningDataModule(task=CountdownTask(), train_size=8, val_size=2, test_size=2, batch_size=2, seed=0))
    rewards = module.last_rewards.double()
    z = (rewards - rewards.mean()) / rewards.std(unbiased=False)
    for name, p in module.model.named_parameters():
        e = [_noise(member, name, p, rank, seed=module.seed, step=0) for member in range(n)]
        want = theta0[name].double() + lr / n * sum(z[m] * e[m] for m in range(n))
        torch.testing.assert_close(p.double(), want, rtol=0, atol=1e-6, msg=name)
        assert not torch.equal(p, theta0[name]), name
