"""Population-batched ES (``members_per_batch > 1``): k members in one batched forward give exactly what k separate
perturbed models give — logits, sampled texts (common random numbers), rewards and the update."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from es_lightning import ESModule, ReasoningDataModule
from es_lightning.es.population import PopulationForward
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.policy import load_policy
from es_lightning.tasks import CountdownTask


def _member_weights(model, k, scale=0.02, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: p.detach().unsqueeze(0) + scale * torch.randn(k, *p.shape, generator=g) for n, p in model.named_parameters()}


def _load_into(model, values):
    for n, p in model.named_parameters():
        p.data.copy_(values[n])


def test_batched_forward_equals_each_member_alone(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    model = policy.model.eval()
    centre = {n: p.detach().clone() for n, p in model.named_parameters()}
    k = 3
    stacked = _member_weights(model, k)
    ids = torch.randint(0, model.config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = []
        for j in range(k):  # independent computation: load member j's weights into the plain model
            _load_into(model, {n: v[j] for n, v in stacked.items()})
            alone.append(model(ids).logits)
        _load_into(model, centre)
        with PopulationForward(model, stacked):
            batched = model(ids.repeat(k, 1)).logits  # member-major rows
        after = model(ids).logits
    torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1])  # the members really differ
    # the centre weights were never touched and the patch is gone on exit
    assert all(torch.equal(p, centre[n]) for n, p in model.named_parameters())
    torch.testing.assert_close(after, model(ids).logits)
    assert "forward" not in model.model.embed_tokens.__dict__


def test_only_listed_parameters_differ_and_bad_shapes_fail(tiny_model_dir):
    model = load_policy(tiny_model_dir).model.eval()
    name = "model.layers.0.mlp.up_proj.weight"
    p = dict(model.named_parameters())[name]
    stacked = {name: torch.stack([p.detach(), p.detach() + 0.1])}
    ids = torch.arange(6).view(1, 6)
    with torch.no_grad():
        with PopulationForward(model, stacked):
            two = model(ids.repeat(2, 1)).logits
        plain = model(ids).logits
    torch.testing.assert_close(two[0], plain[0], rtol=0, atol=1e-5)  # member 0 holds the centre weights
    assert not torch.allclose(two[1], plain[0])
    with pytest.raises(ValueError, match="shape"):
        PopulationForward(model, {name: torch.zeros(2, 3)})
    with pytest.raises(KeyError, match="not a parameter"):
        PopulationForward(model, {"nope.weight": torch.zeros(2, 3)})
    with torch.no_grad(), PopulationForward(model, stacked), pytest.raises(ValueError, match="multiple of 2"):
        model(ids.repeat(3, 1))


def test_common_random_blocks_sample_what_each_block_alone_samples(tiny_model_dir):
    gen = HFGenerator(load_policy(tiny_model_dir))
    prompts = ["c:3 5 7>22=", "c:1 2>3=", "c:10 4 6 2>8="]
    params = SamplingParams(max_new_tokens=8, temperature=1.0)
    alone = gen.generate(prompts, 2, params, seed=11)
    together = gen.generate(prompts * 3, 2, params, seed=11, common_random_blocks=3)
    assert together.texts == alone.texts * 3
    assert torch.equal(together.completion_ids, alone.completion_ids.repeat(3, 1))
    plain = gen.generate(prompts * 3, 2, params, seed=11)  # without blocks the copies draw different numbers
    assert plain.texts != alone.texts * 3
    with pytest.raises(ValueError, match="common_random_blocks"):
        gen.generate(prompts, 1, params, seed=1, common_random_blocks=2)


@pytest.mark.parametrize("temperature,antithetic", [(0.0, False), (1.0, True)])
def test_batched_es_step_equals_member_by_member(temperature, antithetic):
    """The built-in model earns different rewards per member, so equal updates mean equal rewards member by member."""

    def fit(members_per_batch):
        module = ESModule(
            model="builtin:countdown-tiny", population_size=6, sigma=3e-2, lr=1e-2, max_new_tokens=12,
            temperature=temperature, samples_per_member=2 if temperature else 1, antithetic=antithetic,
            members_per_batch=members_per_batch,
        )
        dm = ReasoningDataModule(task=CountdownTask(), train_size=32, val_size=4, test_size=4, batch_size=8, seed=0)
        L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                  enable_progress_bar=False, enable_model_summary=False).fit(module, dm)
        return module

    one, batched = fit(1), fit(4)  # 6 members in batches of 4 and 2
    assert len(set(one.last_rewards.tolist())) > 1
    assert torch.equal(one.last_rewards, batched.last_rewards)
    for (name, p), q in zip(one.model.named_parameters(), batched.model.parameters()):
        assert torch.equal(p, q), name


def test_members_per_batch_is_validated():
    with pytest.raises(ValueError, match="members_per_batch"):
        ESModule(members_per_batch=0)


class _OnePlusNorm(torch.nn.Module):
    """Gemma-style norm, (1 + w) ⊙ x/rms(x): not of the form w ⊙ g(x); it broadcasts a per-block weight, though."""

    def __init__(self, d):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _OnePlusLayerNorm(_OnePlusNorm):
    """(1 + w) through ``F.layer_norm``, which takes a weight of shape [d] only: neither fast form, the generic path."""

    def forward(self, x):
        return torch.nn.functional.layer_norm(x, self.weight.shape, 1 + self.weight)


def test_norm_fast_path_is_checked_not_assumed(tiny_model_dir, qwen_like_small_dir):
    # Qwen2RMSNorm is w ⊙ g(x) on the last dim and broadcasts its weight: the built-in model (fp32) and the Qwen-like
    # fixture in bf16 (its input cast to fp32 inside the norm and back) both take the broadcast path, bitwise per block
    for path, dtype in ((tiny_model_dir, "float32"), (qwen_like_small_dir, "bfloat16")):
        model = load_policy(path, dtype=dtype).model.eval()
        name = "model.norm.weight"
        weight = dict(model.named_parameters())[name].detach()
        stacked = {name: torch.stack([weight * 0.5, weight * 2.0])}
        norm = model.model.norm
        h = torch.randn(2, 5, 3, weight.shape[-1], generator=torch.Generator().manual_seed(2)).to(weight.dtype)
        with torch.no_grad():
            alone = [torch.func.functional_call(norm, {"weight": stacked[name][j]}, (h[j],)) for j in range(2)]
            with PopulationForward(model, stacked):
                assert norm.forward.__func__.__name__ == "broadcast_forward"
                batched = norm(h.reshape(10, 3, -1))
        assert batched.dtype == weight.dtype and torch.equal(batched, torch.cat(alone)), dtype  # bitwise per block

    # LayerNorm without bias is w ⊙ g(x) too, but F.layer_norm refuses a [k, 1, 1, d] weight: the scale form
    ln = torch.nn.LayerNorm(4, bias=False)
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    w = torch.stack([torch.linspace(0.5, 1.5, 4), torch.linspace(-1.0, 2.0, 4)])
    with torch.no_grad():
        alone = [torch.func.functional_call(ln, {"weight": w[j]}, (x,)) for j in range(2)]
        with PopulationForward(ln, {"weight": w}):
            assert ln.forward.__func__.__name__ == "scale"
            batched = ln(x.repeat(2, 1, 1))
    assert torch.equal(batched, torch.cat(alone))

    for norm, path in ((_OnePlusNorm, "broadcast_forward"), (_OnePlusLayerNorm, "generic")):
        net = torch.nn.Sequential(torch.nn.Linear(4, 4), norm(4))
        w = torch.stack([torch.full((4,), 0.5), torch.full((4,), -0.25)])
        x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            alone = []
            for j in range(2):
                net[1].weight.copy_(w[j])
                alone.append(net(x))
            net[1].weight.zero_()
            with PopulationForward(net, {"1.weight": w}):
                assert net[1].forward.__func__.__name__ == path
                batched = net(x.repeat(2, 1, 1))
        torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-6)


@pytest.mark.parametrize("fixture, dtype", [("tiny_model_dir", "float32"), ("qwen_like_small_dir", "bfloat16")])
def test_norm_path_is_probed_once_per_module(fixture, dtype, request, monkeypatch):
    """The probe that picks a norm's batched form runs the first time a module is batched, not at every block of every
    step; a block of another member count (1 against 2) is probed anew. The built-in model in fp32 and the Qwen-like
    fixture in bf16."""
    from es_lightning.es import population

    calls = []
    probe = population._probe_norm
    monkeypatch.setattr(population, "_probe_norm", lambda module, *a: calls.append(module) or probe(module, *a))
    model = load_policy(request.getfixturevalue(fixture), dtype=dtype).model.eval()
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen2RMSNorm"]
    stacked = {n: torch.stack([p.detach() * 0.5, p.detach() * 2.0]) for n, p in model.named_parameters()
               if n.endswith("norm.weight")}
    ids = torch.tensor([[3, 4, 5]] * 4)
    with torch.no_grad():
        for _ in range(3):  # three steps' blocks
            with PopulationForward(model, stacked):
                model(ids)
        assert sorted(map(id, calls)) == sorted(map(id, norms))  # each norm once
        with PopulationForward(model, {n: w[:1] for n, w in stacked.items()}):  # one member: probed again
            model(ids[:2])
    assert len(calls) == 2 * len(norms)


def test_a_population_forward_survives_train_and_eval_of_a_loaded_policy(qwen_like_small_dir):
    """transformers 5.25 (which installs `kernels`) kernelizes a loaded model by default and re-kernelizes it at every
    train()/eval(), resetting each RMSNorm instance's forward: the members' batched norms were dropped in the middle of
    an ES step (and the context's exit failed). load_policy loads the plain PyTorch layers (use_kernels=False)."""
    policy = load_policy(qwen_like_small_dir, dtype="float32")
    model = policy.model
    norm = dict(model.named_parameters())["model.norm.weight"]
    stacked = {"model.norm.weight": torch.stack([norm.detach(), 2 * norm.detach()])}
    ids = torch.tensor([[1, 2, 3], [1, 2, 3]])
    with torch.no_grad(), PopulationForward(model, stacked):
        before = model(input_ids=ids).logits
        model.train()
        model.eval()
        assert "forward" in model.model.norm.__dict__
        after = model(input_ids=ids).logits
    assert torch.equal(before, after) and not torch.equal(before[0], before[1])  # member 2's norm still applied
    assert "forward" not in model.model.norm.__dict__
