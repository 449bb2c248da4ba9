"""Weights into the engine: a GRPO-style push after an optimizer step, ES members pushed in place or perturbed inside the
engine from seeds, exact restore, and the engine-side ES update against ESOptimizer."""

from __future__ import annotations

import contextlib

import pytest
import torch

pytest.importorskip("vllm")

from es_lightning.es.noise import param_noise  # noqa: E402
from es_lightning.es.update import ESOptimizer  # noqa: E402
from es_lightning.generation import SamplingParams  # noqa: E402

PAIRS = {"builtin": "builtin_pair", "qwen_like": "qwen_pair", "llama_like": "llama_pair"}
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
SEED, STEP = 5, 3


def _prompts(name, policy):
    if name == "builtin":
        return ["12 34 56 = ", "3 5 7 =", "1 2 3 ="]
    return policy.render_prompts(["What is 2+3?", "hi"], use_chat_template=True)


def _engine_params(gen) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}


def _member(centre: torch.Tensor, name: str, noise_id: int, sign: float, sigma: float) -> torch.Tensor:
    """ESModule's in-place member: θ + sign·σ·ε computed in fp32 and cast once (es_lightning/modules/es.py)."""
    eps = param_noise(SEED, STEP, noise_id, name, centre.numel(), device=centre.device)
    return (centre.float() + (sign * sigma) * eps.view_as(centre)).to(centre.dtype)


@contextlib.contextmanager
def _centre_kept(policy, gen):
    """Put the policy and the engine back to the fixture's weights afterwards."""
    saved = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    try:
        yield saved
    finally:
        with torch.no_grad():
            for n, p in policy.model.named_parameters():
                p.copy_(saved[n])
        gen.push_weights()


@pytest.mark.parametrize("name", ["builtin", "qwen_like"])
def test_push_after_an_optimizer_step(name, request, hf_generate):
    """GRPO: after an AdamW step on the HF policy, a push makes the engine generate what HF generates on the new
    weights (and log-probs equal the forward's); without the push the engine still holds the old weights."""
    policy, gen = request.getfixturevalue(PAIRS[name])
    prompts = _prompts(name, policy)
    with _centre_kept(policy, gen):
        before = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
        opt = torch.optim.AdamW(policy.model.parameters(), lr=3e-2)
        ids = torch.cat([before.prompt_ids, before.completion_ids], 1)
        loss = policy.model(input_ids=ids, labels=ids).loss  # raise the likelihood of one rollout: a real step
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        policy.model.zero_grad(set_to_none=True)
        stale = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
        assert torch.equal(stale.logprobs, before.logprobs)  # the engine did not see the step yet
        gen.push_weights()
        after = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
        hf = hf_generate(policy, prompts, 1, GREEDY, return_logprobs=True)
        assert torch.equal(after.completion_ids, hf.completion_ids)
        assert (after.logprobs - hf.logprobs).abs().max() < 1e-5
        assert (after.logprobs - before.logprobs).abs().max() > 1e-3


@pytest.mark.parametrize("name", ["builtin", "qwen_like", "llama_like"])
def test_members_pushed_in_place_and_engine_side_are_the_same_and_restore_is_exact(name, request, hf_generate):
    """ES: a member perturbed in the policy and pushed, and the same member perturbed inside the engine from its seed,
    leave the engine's parameters bitwise equal and generate what HF generates on the perturbed policy; es_restore
    brings the centre back bit for bit (parameters and log-probs)."""
    policy, gen = request.getfixturevalue(PAIRS[name])
    prompts, sigma = _prompts(name, policy), (0.05 if name == "builtin" else 0.5)
    with _centre_kept(policy, gen) as centre:
        gen.es_set_centre(policy.model.named_parameters())
        centre_params = _engine_params(gen)
        centre_out = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
        for noise_id, sign in ((2, 1.0), (2, -1.0), (7, 1.0)):
            with torch.no_grad():  # in place, as ESModule's one-member-at-a-time evaluator
                for n, p in policy.model.named_parameters():
                    p.copy_(_member(centre[n], n, noise_id, sign, sigma))
            hf = hf_generate(policy, prompts, 1, GREEDY)
            gen.push_weights()
            pushed = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
            pushed_params = _engine_params(gen)
            gen.es_restore()
            gen.es_perturb(SEED, STEP, noise_id, sign, sigma)
            engine_side = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
            assert all(torch.equal(pushed_params[k], p) for k, p in gen.engine_model.named_parameters())
            assert torch.equal(engine_side.completion_ids, pushed.completion_ids)
            assert torch.equal(engine_side.logprobs, pushed.logprobs)
            assert torch.equal(pushed.completion_ids, hf.completion_ids)
            assert not torch.equal(pushed.logprobs, centre_out.logprobs)
            gen.es_restore()
            assert all(torch.equal(centre_params[k], p) for k, p in gen.engine_model.named_parameters())
            restored = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
            assert torch.equal(restored.logprobs, centre_out.logprobs)
            assert torch.equal(restored.completion_ids, centre_out.completion_ids)


def test_engine_side_update_equals_es_optimizer(builtin_pair):
    """θ ← θ + (α/N) Σ w ε applied inside the engine from (seed, step, noise ids, weights, lr) equals ESOptimizer's
    update of the policy bit for bit: the fp32 master, the engine's parameters (vs a push of the updated policy), the
    update norm."""
    policy, gen = builtin_pair
    noise_ids, weights = torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, -0.5, 0.0, 0.7])
    with _centre_kept(policy, gen):
        gen.es_set_centre(policy.model.named_parameters())
        opt = ESOptimizer(list(policy.model.named_parameters()), lr=0.05, sigma=0.02)
        opt.set_update(SEED, STEP, noise_ids, weights)
        opt.step()
        norm = gen.es_update(SEED, STEP, noise_ids.tolist(), weights.tolist(), lr=0.05, sigma=0.02)
        assert norm == pytest.approx(opt.last_update_norm, rel=1e-6) and norm > 0
        master = gen.engine_worker._es_master
        for n, p in policy.model.named_parameters():
            assert torch.equal(master[n], p.detach()), n
        updated = _engine_params(gen)
        gen.push_weights()  # the updated policy, pushed: the same engine parameters
        assert all(torch.equal(updated[k], p) for k, p in gen.engine_model.named_parameters())
        gen.es_perturb(SEED, STEP + 1, 0, 1.0, 0.02)
        gen.es_restore()  # the centre is now the updated θ
        assert all(torch.equal(updated[k], p) for k, p in gen.engine_model.named_parameters())


def test_engine_side_es_refuses_before_a_centre(builtin_pair):
    _, gen = builtin_pair
    worker = gen.engine_worker
    saved = getattr(worker, "_es_master", None)
    worker._es_master = None
    try:
        with pytest.raises(RuntimeError, match="es_set_centre"):
            gen.es_perturb(SEED, STEP, 0, 1.0, 0.01)
    finally:
        worker._es_master = saved


def test_bf16_engine_keeps_an_fp32_master(keep_alive):
    """A bf16 engine fed an fp32 policy: four engine-side updates, each below half a bf16 ulp for most weights, equal
    ESOptimizer's four fp32 updates bit for bit, and the engine's weights are that master rounded once — whereas adding
    each update to the bf16 weights (Qiu et al.'s public code) loses them."""
    import copy

    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    policy = load_policy("builtin:countdown-tiny", dtype="float32")
    gen = VLLMGenerator(policy, dtype="bfloat16", max_model_len=128, cpu_kv_cache_gib=0.0625, max_num_seqs=16)
    keep_alive.append(gen)  # not closed: see keep_alive
    gen.es_set_centre(policy.model.named_parameters())
    reference = copy.deepcopy(policy.model)
    opt = ESOptimizer(list(reference.named_parameters()), lr=2e-4, sigma=1e-3)
    ids, weights = torch.tensor([0, 1, 2, 3]), torch.tensor([1.0, -0.4, 0.3, -0.9])
    name = "model.norm.weight"  # not fused: the engine's tensor is the HF tensor
    naive = policy.model.get_parameter(name).detach().to(torch.bfloat16)
    for step in range(4):
        before = reference.get_parameter(name).detach().clone()
        opt.set_update(SEED, step, ids, weights)
        opt.step()
        naive = (naive.float() + (reference.get_parameter(name).detach() - before)).to(torch.bfloat16)
        gen.es_update(SEED, step, ids.tolist(), weights.tolist(), lr=2e-4, sigma=1e-3)
    master = gen.engine_worker._es_master
    assert all(torch.equal(master[n], p.detach()) for n, p in reference.named_parameters())
    engine = dict(gen.engine_model.named_parameters())[name]
    assert engine.dtype == torch.bfloat16
    assert torch.equal(engine, reference.get_parameter(name).detach().to(torch.bfloat16))
    assert int((engine != naive).sum()) > 0  # updates the bf16 path rounded away
    out = gen.generate(["12 34 56 = "], 1, SamplingParams(max_new_tokens=6, temperature=0.0))
    assert out.completion_lengths.item() > 0


def test_prefix_caching_never_serves_another_members_prefix(keep_alive, qwen_like_dir):
    """``enable_prefix_caching: true`` (any vllm.LLM option may be given): an engine-side member's prompts were
    served from the centre's cached key/values (prompts longer than a cache block, 128 tokens on a CPU) — its
    log-probs differed by up to 1.4 from the member's own. The cache is now reset after every change of weights."""
    from es_lightning.generation.vllm import VLLMGenerator
    from es_lightning.policy import load_policy

    policy = load_policy(qwen_like_dir, dtype="float32")
    gen = VLLMGenerator(policy, max_model_len=512, cpu_kv_cache_gib=0.0625, max_num_seqs=8, enable_prefix_caching=True)
    keep_alive.append(gen)
    prompts = policy.render_prompts([f"Question {i}: " + "tell me a long story about apples " * 6 for i in range(2)],
                                    use_chat_template=True)
    assert len(policy.tokenizer(prompts[0])["input_ids"]) > 2 * 128
    gen.es_set_centre(policy.model.named_parameters())
    gen.generate(prompts, 1, GREEDY, return_logprobs=True)  # the centre's prefixes, cached
    for noise_id in (1, 2):
        gen.es_perturb(SEED, STEP, noise_id, 1.0, 0.5)
        member = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
        gen.llm.reset_prefix_cache()
        fresh = gen.generate(prompts, 1, GREEDY, return_logprobs=True)
        assert torch.equal(member.completion_ids, fresh.completion_ids)
        assert torch.equal(member.logprobs, fresh.logprobs)
        gen.es_restore()


def test_an_engine_whose_first_push_fails_is_closed_and_the_error_is_the_push_s(closed_engines):
    """A policy holding a parameter the engine's architecture lacks (a value head, as TRL's value-head models add)
    fails the first push, inside ``VLLMGenerator(...)``, after the engine is built: no caller holds the generator to
    close it, so the constructor closes it before the error propagates (the engine's memory and worker were held
    until the process ended). The error is one line naming every such parameter and the fixes, not vLLM's raw
    ``There is no module or parameter named 'v_head'`` (its module only, the first one, under many frames)."""
    from conftest import _engine, _policy

    policy = _policy("builtin:countdown-tiny")
    policy.model.v_head = torch.nn.Linear(policy.model.config.hidden_size, 1)
    with pytest.raises(ValueError) as refused:
        _engine(policy)
    assert str(refused.value) == (
        "the policy's parameters v_head.weight, v_head.bias have no counterpart in vLLM's Qwen2ForCausalLM (the engine "
        "built from the model's config), so the policy's weights cannot be pushed into the engine: remove them from the "
        "policy's model (keep a value head or other added layers in a module of their own, outside policy.model) or use "
        "generation_backend: hf")
    assert closed_engines == [(128, True)]
