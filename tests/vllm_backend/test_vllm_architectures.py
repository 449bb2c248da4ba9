"""Architectures beyond Qwen2/Llama on the vLLM engine (tiny random models of tests/es_helpers.py, fp32): GPT-2's
Conv1D weights stored [in, out] (vLLM transposes them as it loads) and Gemma-2's scaled embedding and (1 + w) norms
take pushed and engine-side members as HF computes them; a mixture-of-experts model, whose pushed expert weights vLLM
does not compute with, is refused when the engine is built."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm")

from es_helpers import tiny_architecture  # noqa: E402

from es_lightning.es.noise import param_noise  # noqa: E402
from es_lightning.generation import HFGenerator, SamplingParams  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
PROMPTS = ["What is 2+3?", "hi there"]
SEED, STEP, SIGMA = 5, 3, 0.5


@pytest.fixture(scope="module", params=["gpt2", "gemma2"])
def arch_pair(request, tmp_path_factory, keep_alive):
    from conftest import _engine, _policy

    policy = _policy(tiny_architecture(request.param, tmp_path_factory.mktemp(request.param)))
    gen = _engine(policy)
    keep_alive.append(gen)
    return policy, gen


def test_members_of_other_layouts_equal_hf(arch_pair):
    """A member θ + σε perturbed inside the engine from its seed (noise keyed by HF names, in HF's layout) and the same
    member pushed from the perturbed policy leave the engine's parameters bitwise equal and generate HF's greedy tokens
    on the perturbed policy (log-probs within 1e-4); es_restore gives the centre back bit for bit."""
    policy, gen = arch_pair
    saved = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    try:
        hf_centre = HFGenerator(policy).generate(PROMPTS, 1, GREEDY, return_logprobs=True)
        gen.es_set_centre(policy.model.named_parameters())
        centre = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
        with torch.no_grad():
            for n, p in policy.model.named_parameters():
                eps = param_noise(SEED, STEP, 2, n, p.numel())
                p.copy_((saved[n].float() + SIGMA * eps.view_as(p)).to(p.dtype))
        hf = HFGenerator(policy).generate(PROMPTS, 1, GREEDY, return_logprobs=True)
        gen.es_perturb(SEED, STEP, 2, 1.0, SIGMA)
        engine_side = gen.generate(PROMPTS, 1, GREEDY, return_logprobs=True)
        member = {n: p.detach().clone() for n, p in gen.engine_model.named_parameters()}
        gen.push_weights()
        pushed = gen.generate(PROMPTS, 1, GREEDY, return_logprobs=True)
        assert all(torch.equal(member[n], p) for n, p in gen.engine_model.named_parameters())
        for out in (engine_side, pushed):
            assert torch.equal(out.completion_ids, hf.completion_ids)
            assert (out.logprobs - hf.logprobs).abs().max() < 1e-4
        assert (hf.logprobs - hf_centre.logprobs).abs().max() > 0.1  # the member really differs from the centre
        gen.es_set_centre((n, saved[n]) for n in saved)
        gen.es_perturb(SEED, STEP, 2, 1.0, SIGMA)
        gen.es_restore()
        assert all(torch.equal(centre[n], p) for n, p in gen.engine_model.named_parameters())
    finally:
        with torch.no_grad():
            for n, p in policy.model.named_parameters():
                p.copy_(saved[n])
        gen.push_weights()


def test_a_mixture_of_experts_model_is_refused_at_construction(tmp_path, keep_alive):
    """Qwen2-MoE: the experts pushed into vLLM's fused-expert layer are not what it computes with (greedy tokens
    differed from HF's at the centre, log-probs by 0.09, silently): one line naming generation_backend: hf."""
    from conftest import _engine, _policy

    policy = _policy(tiny_architecture("qwen2_moe", tmp_path))
    with pytest.raises(ValueError) as err:
        keep_alive.append(_engine(policy))
    message = str(err.value)
    assert "mixture-of-experts" in message and "generation_backend: hf" in message and "\n" not in message
    assert "Qwen2MoeConfig's experts" in message  # refused from the config, before the engine was built
