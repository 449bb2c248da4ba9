"""Chunked, selective log-probs (es_lightning/grpo/logprobs.py): the numbers and gradients of a float64 brute force,
tied and untied heads, shared-prompt forward, gradient checkpointing — and no ``[rows, C, V]`` tensor at V = 151,936."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from es_lightning.builtin.qwen_like import build_qwen_like
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.grpo.logprobs import completion_logprobs, enable_gradient_checkpointing, selective_logprobs
from es_lightning.policy import load_policy

PROMPTS = ["c:3 5 7>22=", "Natalia sold 48 clips. How many?", "a:1+2="]


def _brute_force(model64, rollout, rows, temperature):
    """float64, every position's full logits from one plain forward, log_softmax by definition: ``[n, C]`` each."""
    ids = torch.cat([rollout.prompt_ids[rows], rollout.completion_ids[rows]], 1)
    mask = torch.cat([rollout.prompt_mask[rows], rollout.completion_mask[rows]], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model64(input_ids=ids, attention_mask=mask, position_ids=pos).logits  # [n, P+C, V] float64
    P, C = rollout.prompt_ids.shape[1], rollout.completion_ids.shape[1]
    z = logits[:, P - 1 : P + C - 1] / temperature
    logp_all = z - z.exp().sum(-1, keepdim=True).log()  # [n, C, V]
    logp = logp_all.gather(-1, rollout.completion_ids[rows].unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    cmask = rollout.completion_mask[rows]
    return logp * cmask, entropy * cmask


def _loss(logp, entropy, mask, seed=0):
    """A scalar touching every token with its own weight (like a GRPO loss with advantages and an entropy bonus)."""
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(mask.shape, generator=g, dtype=torch.float64), torch.randn(mask.shape, generator=g,
                                                                                   dtype=torch.float64)
    return ((logp.double() * a + entropy.double() * b) * mask).sum()


def test_selective_logprobs_equal_float64_brute_force_with_gradients():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = (0.5 * torch.randn(50, 16)).requires_grad_()
    bias = (0.1 * torch.randn(50)).requires_grad_()
    targets = torch.randint(0, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0
    mask[2, :2] = 0
    for chunk in (1, 4, 100):
        logp, ent = selective_logprobs(hidden, weight, bias, targets, 0.7, mask, chunk_size=chunk, entropy_grad=True)
        grads = torch.autograd.grad(_loss(logp, ent, mask), (hidden, weight, bias))
        h64, w64, b64 = (t.detach().double().requires_grad_() for t in (hidden, weight, bias))
        z = (h64 @ w64.T + b64) / 0.7
        logp_all = z - z.exp().sum(-1, keepdim=True).log()
        ref_logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1) * mask
        ref_ent = -(logp_all.exp() * logp_all).sum(-1) * mask
        ref_grads = torch.autograd.grad(_loss(ref_logp, ref_ent, mask), (h64, w64, b64))
        assert torch.allclose(logp.double(), ref_logp, atol=1e-5) and torch.allclose(ent.double(), ref_ent, atol=1e-5)
        assert (logp[mask == 0] == 0).all() and (ent[mask == 0] == 0).all()
        for g, r in zip(grads, ref_grads):
            assert torch.allclose(g.double(), r, atol=1e-5, rtol=1e-4), (chunk, (g.double() - r).abs().max())
        assert (grads[0][mask == 0] == 0).all()  # masked positions get no gradient


@pytest.fixture(scope="module")
def untied_small_dir(tmp_path_factory) -> str:
    return build_qwen_like(tmp_path_factory.mktemp("untied"), vocab_size=1024, tie_word_embeddings=False)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("share_prompt, rows, chunk", [(False, slice(None), 3), (True, slice(None), 512),
                                                       (True, slice(3, 10), 5), (False, slice(2, 7), 512)])
def test_completion_logprobs_and_gradients_equal_float64_forward(qwen_like_small_dir, untied_small_dir, tied,
                                                                  share_prompt, rows, chunk):
    """On the Qwen-like model (fp32): log-probs, entropies and every parameter's gradient of a loss over them equal
    a float64 copy's plain full-logits forward — tied (Qwen2.5 ≤ 3B) and untied (7B) heads, groups cut by the slice."""
    policy = load_policy(qwen_like_small_dir if tied else untied_small_dir, dtype="float32")
    model = policy.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    rollout = HFGenerator(policy).generate(PROMPTS, 4, SamplingParams(max_new_tokens=10), seed=3, return_logprobs=True)
    mask = rollout.completion_mask[rows]
    model.train()
    logp, ent = completion_logprobs(model, rollout, rows, 0.7, entropy_grad=True, share_prompt=share_prompt,
                                    chunk_size=chunk)
    model.zero_grad()
    _loss(logp, ent, mask).backward()
    model64 = copy.deepcopy(model).double()
    model64.zero_grad()
    ref_logp, ref_ent = _brute_force(model64, rollout, rows, 0.7)
    _loss(ref_logp, ref_ent, mask).backward()
    assert (logp.double() - ref_logp).abs().max() < 1e-5
    assert (ent.double() - ref_ent).abs().max() < 1e-5
    for (name, p), p64 in zip(model.named_parameters(), model64.parameters()):  # fp32 rounding of sums over tokens
        diff = p.grad.double() - p64.grad
        err = diff.norm() / p64.grad.norm()
        assert err < 1e-5 and diff.abs().max() < 1e-5 * p64.grad.abs().max().clamp(min=1), (name, err)


def test_reference_forward_without_grad_and_without_entropy(qwen_like_small_dir):
    policy = load_policy(qwen_like_small_dir)
    rollout = HFGenerator(policy).generate(PROMPTS, 2, SamplingParams(max_new_tokens=6), seed=0, return_logprobs=True)
    with torch.no_grad():
        logp, ent = completion_logprobs(policy.model, rollout, slice(None), 1.0, entropy=False, share_prompt=True)
    assert ent is None and not logp.requires_grad
    assert (logp - rollout.logprobs).abs().max() < 1e-5  # the generator's own record, at T = 1
    assert policy.model.lm_head.__dict__.get("forward") is None  # the head's own forward is back


class _LargestTensor(TorchDispatchMode):
    """The largest number of elements of any tensor an op produces, excluding those the size of a parameter (weights,
    their transposes and gradients)."""

    def __init__(self, parameter_sizes):
        super().__init__()
        self.skip = set(parameter_sizes)
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.numel() not in self.skip:
                self.largest = max(self.largest, t.numel())
        return out


def test_no_rows_by_length_by_vocabulary_tensor_at_qwen_size(qwen_like_dir):
    """V = 151,936: the forward and backward never make a tensor of rows·C·V elements (the plain path's logits); the
    largest is one chunk of chunk_size·V."""
    policy = load_policy(qwen_like_dir, dtype="float32")
    rollout = HFGenerator(policy).generate(PROMPTS[:2], 4, SamplingParams(max_new_tokens=16), seed=1)
    rows, C = rollout.completion_ids.shape
    V = policy.model.config.vocab_size
    policy.model.train()
    watch = _LargestTensor(p.numel() for p in policy.model.parameters())
    with watch:
        logp, ent = completion_logprobs(policy.model, rollout, slice(None), 1.0, entropy_grad=True, chunk_size=16)
        (logp.sum() + ent.sum()).backward()
    assert rows * C >= 8 * 16 and rows * C != policy.model.config.hidden_size, "more tokens than a chunk"
    assert 16 * V <= watch.largest <= 16 * V * 1.01, (watch.largest, rows * C * V)


def test_gradient_checkpointing_recomputes_blocks_and_keeps_gradients(qwen_like_small_dir):
    policy = load_policy(qwen_like_small_dir)
    model = policy.model
    rollout = HFGenerator(policy).generate(PROMPTS, 2, SamplingParams(max_new_tokens=8), seed=2, return_logprobs=True)
    calls = []
    model.model.layers[0].mlp.register_forward_pre_hook(lambda *a: calls.append(1))  # (the replay stops early)
    grads = []
    for checkpointing in (False, True):
        if checkpointing:
            enable_gradient_checkpointing(model)
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        model.train()
        model.zero_grad()
        calls.clear()
        logp, ent = completion_logprobs(model, rollout, slice(None), 1.0, entropy_grad=True)
        _loss(logp, ent, rollout.completion_mask).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
        assert len(calls) == (2 if checkpointing else 1)  # the block's forward is replayed in the backward
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="share_prompt_prefix"):
        completion_logprobs(model, rollout, slice(None), 1.0, share_prompt=True)
    with torch.no_grad():  # no backward, no conflict: the reference model may share prompts
        completion_logprobs(model, rollout, slice(None), 1.0, share_prompt=True)


def test_models_with_logits_transformed_after_the_head_use_their_full_logits(qwen_like_small_dir):
    """A config naming a post-head transform (Gemma-2's soft-capping, Cohere's logit scale) makes the head's selective
    projection step aside: the model's own logits go through the same chunked log-softmax (Qwen2 ignores the
    attribute, so the numbers must still be the float64 forward's)."""
    policy = load_policy(qwen_like_small_dir)
    model = policy.model
    rollout = HFGenerator(policy).generate(PROMPTS, 2, SamplingParams(max_new_tokens=6), seed=4)
    model.config.final_logit_softcapping = 30.0
    seen = []
    model.lm_head.register_forward_hook(lambda m, i, o: seen.append(o.shape[-1]))
    logp, ent = completion_logprobs(model, rollout, slice(None), 0.7, share_prompt=True, chunk_size=4)
    assert seen and all(v == model.config.vocab_size for v in seen)  # the real head ran: full logits
    ref_logp, ref_ent = _brute_force(copy.deepcopy(model).double(), rollout, slice(None), 0.7)
    assert (logp.double() - ref_logp).abs().max() < 1e-5 and (ent.double() - ref_ent).abs().max() < 1e-5
