"""The HF generator: left padding, seeded common random numbers, stop strings, and log-probs that match a forward pass."""

import torch

from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.policy import load_policy

PROMPTS = ["c:3 5 7>22=", "a:1+2=", "s:3 1 2="]


def _forward_logprobs(model, rollout, temperature):
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    P = rollout.prompt_ids.shape[1]
    logp = torch.log_softmax(logits[:, P - 1 : -1] / temperature, -1)
    return logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1) * rollout.completion_mask


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_model_dir):
    gen = HFGenerator(load_policy(tiny_model_dir))
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    a = gen.generate(PROMPTS, 4, params, seed=7)
    b = gen.generate(PROMPTS, 4, params, seed=7)
    c = gen.generate(PROMPTS, 4, params, seed=8)
    assert a.texts == b.texts and torch.equal(a.completion_ids, b.completion_ids)
    assert a.texts != c.texts
    assert len(a.texts) == 12 and a.num_prompts == 3
    # samples of one prompt differ (the untrained model is near uniform)
    assert len(set(a.texts[:4])) > 1


def test_greedy_equals_argmax_of_forward(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    gen = HFGenerator(policy)
    r = gen.generate(["a:1+2="], 1, SamplingParams(max_new_tokens=6, temperature=0.0))
    ids = policy.tokenizer(["a:1+2="], return_tensors="pt")["input_ids"]
    for _ in range(int(r.completion_mask.sum())):
        with torch.no_grad():
            nxt = policy.model(ids).logits[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], 1)
    n = int(r.completion_mask.sum())
    assert torch.equal(ids[0, -n:], r.completion_ids[0, :n])


def test_logprobs_match_training_forward_pass(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    gen = HFGenerator(policy)
    for temperature in (1.0, 0.7):
        r = gen.generate(PROMPTS, 3, SamplingParams(max_new_tokens=10, temperature=temperature), seed=1,
                         return_logprobs=True)
        ref = _forward_logprobs(policy.model, r, temperature)
        assert torch.allclose(r.logprobs, ref, atol=1e-4), (r.logprobs - ref).abs().max()
        # entropy of the sampling distribution is positive on real tokens and zero on padding
        assert (r.entropy[r.completion_mask.bool()] > 0).all()
        assert (r.entropy[~r.completion_mask.bool()] == 0).all()


def test_common_random_numbers_across_models(tiny_model_dir):
    """Two different models given the same seed consume the same uniforms: where their distributions agree, so do the
    tokens. A model compared with itself after a tiny perturbation samples (almost) the same completions."""
    policy = load_policy(tiny_model_dir)
    gen = HFGenerator(policy)
    params = SamplingParams(max_new_tokens=12, temperature=1.0)
    base = gen.generate(PROMPTS * 4, 1, params, seed=3).texts
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(1e-6 * torch.randn_like(p))
    after = gen.generate(PROMPTS * 4, 1, params, seed=3).texts
    assert sum(a == b for a, b in zip(base, after)) >= len(base) - 1


def test_stop_strings_cut_text_and_mask(tiny_model_dir):
    gen = HFGenerator(load_policy(tiny_model_dir))
    r = gen.generate(PROMPTS * 8, 1, SamplingParams(max_new_tokens=24, temperature=1.0, stop=["+"]), seed=0)
    stopped = [t for t in r.texts if "+" in t]
    assert stopped, "an untrained char model emits '+' within 24 tokens for some prompt"
    for t in stopped:
        assert t.endswith("+") and t.count("+") == 1
    for t, m, trunc in zip(r.texts, r.completion_mask, r.truncated):
        if "+" in t:
            assert not trunc
        assert int(m.sum()) <= 24


def test_truncation_flag(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    gen = HFGenerator(policy)
    r = gen.generate(PROMPTS * 4, 2, SamplingParams(max_new_tokens=3, temperature=1.0), seed=0)
    eos = policy.tokenizer.eos_token_id
    assert r.completion_ids.shape[1] <= 3
    for ids, m, trunc in zip(r.completion_ids, r.completion_mask, r.truncated):
        hit_eos = bool((ids[: int(m.sum())] == eos).any())
        assert bool(trunc) == (not hit_eos), (ids, m, trunc)


def test_logprob_recording_allocates_nothing_per_token():
    """The sampler writes each step's log-prob and entropy into buffers allocated once: a list of per-token tensors
    kept two small allocations alive per token, which glibc placed inside that step's freed [rows, V] temporaries, so
    a CPU process grew by ~rows·V·4 bytes per token (+2.5 GB over 192 tokens at 16 rows and Qwen's vocabulary)."""
    from es_lightning.generation.hf import _Sampler

    rows, vocab, steps = 3, 50, 70  # past the buffers' default 64 columns: they grow
    sampler = _Sampler(temperature=0.7, top_p=1.0, seed=0, track=True, banned=[])
    scores = torch.randn(steps, rows, vocab, generator=torch.Generator().manual_seed(0))
    ids = torch.zeros(rows, 1, dtype=torch.long)  # one prompt token
    held = []
    for t in range(steps):
        chosen = sampler(ids, scores[t]).argmax(-1)
        ids = torch.cat([ids, chosen.unsqueeze(1)], 1)
        held.append(sum(isinstance(v, torch.Tensor) for v in vars(sampler).values())
                    + sum(len(v) for v in vars(sampler).values() if isinstance(v, list)))
    assert held[-1] == held[1], f"tensors held by the sampler grow with the completion: {held[1]} -> {held[-1]}"
    logprobs, entropy = sampler.finish(ids[:, 1:])
    logp = torch.log_softmax(scores / 0.7, -1).transpose(0, 1)  # [rows, steps, V]
    assert torch.allclose(logprobs, logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1), atol=1e-5)
    assert torch.allclose(entropy, -(logp.exp() * logp).sum(-1), atol=1e-5)


def test_completions_past_the_models_positions_are_warned_once(tiny_model_dir):
    """The fixture has max_position_embeddings = 128: a 120-token prompt with 16 new tokens may generate at positions
    the model never saw (transformers does not stop there; the vLLM backend does). Said once per generator and limit
    — a MATH run's prompts of many lengths got a line each — naming the longest prompt so far and the
    max_new_tokens that fits it; attributed to generate's caller (it was to torch's no_grad wrapper, whose source line
    `return func(*args, **kwargs)` the command printed under it)."""
    import warnings

    import pytest

    gen = HFGenerator(load_policy(tiny_model_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(["a:1+2="], 1, SamplingParams(max_new_tokens=4, temperature=0.0))  # 6 + 4 tokens: within 128
        gen.generate(["a:" + "1+" * 59], 1, SamplingParams(max_new_tokens=4, temperature=0.0))  # 120 + 4: within
    with pytest.warns(UserWarning) as record:
        gen.generate(["a:" + "1+" * 49], 1, SamplingParams(max_new_tokens=40, temperature=0.0))  # 100 + 40
    assert len(record) == 1
    assert str(record[0].message).startswith(
        "prompts of up to 120 tokens so far plus max_new_tokens=40 exceed the model's max_position_embeddings=128")
    assert "lower max_new_tokens to 8 or shorten the prompts" in str(record[0].message)
    assert record[0].filename == __file__  # generate's caller, not torch.no_grad's wrapper in torch/utils/_contextlib.py
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (59, 58, 55, 50):  # other prompt lengths past the same limit: said already
            gen.generate(["a:" + "1+" * n], 1, SamplingParams(max_new_tokens=16, temperature=0.0))


def test_position_limit_of_real_configs():
    """``max_position_embeddings`` is the limit unless the RoPE is scaled; RoPE per layer type (Gemma-3) is judged by
    its full-attention entry (sliding-window layers see positions a window apart), and a multimodal config by its
    text config."""
    from transformers import Gemma3Config, Gemma3TextConfig, LlamaConfig, Qwen2Config

    from es_lightning.generation.config import position_limit

    linear = {"rope_type": "linear", "factor": 8.0}
    cases = [
        (Qwen2Config(max_position_embeddings=4096), 4096),
        (Qwen2Config(max_position_embeddings=32768, rope_scaling={"rope_type": "yarn", "factor": 4.0}), None),
        (LlamaConfig(max_position_embeddings=131072, rope_scaling={
            "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}), None),
        (Gemma3TextConfig(max_position_embeddings=32768), 32768),  # gemma-3-1b: both entries default
        (Gemma3TextConfig(max_position_embeddings=131072, rope_parameters={  # gemma-3-4b and up
            "full_attention": dict(linear), "sliding_attention": {"rope_type": "default"}}), None),
        (Gemma3TextConfig(max_position_embeddings=8192, rope_parameters={
            "full_attention": {"rope_type": "default"}, "sliding_attention": dict(linear)}), 8192),
        (Gemma3Config(text_config={"max_position_embeddings": 32768}), 32768),
        (Gemma3Config(text_config={"max_position_embeddings": 131072, "rope_parameters": {
            "full_attention": dict(linear), "sliding_attention": {"rope_type": "default"}}}), None),
        (None, None),
    ]
    for config, expected in cases:
        assert position_limit(config) == expected, (config, expected)


def test_per_layer_type_rope_model_generates_and_warns(tmp_path):
    """A real Gemma-3 text model (RoPE keyed by layer type) with unscaled full attention: generation past its 64
    positions is warned about with that limit."""
    import pytest
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from es_lightning.builtin.tokenizer import build_char_tokenizer

    tok = build_char_tokenizer()
    config = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=64, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"], eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, bos_token_id=None,
    )
    assert set(config.rope_parameters) == {"full_attention", "sliding_attention"}
    torch.manual_seed(0)
    Gemma3ForCausalLM(config).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    gen = HFGenerator(load_policy(str(tmp_path)))
    with pytest.warns(UserWarning, match=r"prompts of up to 60 tokens so far plus max_new_tokens=8 exceed the "
                                         r"model's max_position_embeddings=64: .*lower max_new_tokens to 4"):
        r = gen.generate(["a:" + "1+" * 29], 1, SamplingParams(max_new_tokens=8, temperature=0.0))
    assert r.completion_ids.shape[0] == 1


def test_a_prompt_with_no_room_for_a_completion_is_refused_in_one_line(tiny_model_dir):
    """A prompt of max_position_embeddings tokens or more was generated anyway after a warning (a 54k-token prompt of
    a Qwen model ran to an out-of-memory traceback); it is refused before generation, naming its place in the batch,
    its token count, a piece of its text, the limit and the fixes. One token short of the limit still generates, with
    the warning about max_new_tokens."""
    import warnings

    import pytest

    gen = HFGenerator(load_policy(tiny_model_dir))
    params = SamplingParams(max_new_tokens=4, temperature=0.0)
    with pytest.raises(ValueError) as err:
        gen.generate(["a:1+2=", "a:" + "1+" * 63, "a:" + "2+" * 70], 2, params)  # 6, 128 and 142 tokens
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("prompt 2 of this batch has 142 tokens (too long too: 1 more of its 3 prompts), and the "
                              "model's max_position_embeddings is 128: no room for a completion (its text around the "
                              "middle: '...+2+2+2+"), message
    assert message.endswith("; shorten the prompts (the task's prompt format or system_prompt), or remove the rows whose "
                            "prompt has 128 tokens or more from the data"), message
    with pytest.warns(UserWarning, match=r"prompts of up to 126 tokens so far plus max_new_tokens=4 exceed .*lower "
                                         r"max_new_tokens to 2"):
        out = gen.generate(["a:" + "1+" * 62], 1, params)  # 126 tokens: room for 2
    assert out.completion_ids.shape == (1, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gen.generate(["a:1+2="], 1, params)  # the short prompts of the refused batch generate


def test_a_fits_row_check_and_the_generator_refuse_the_same_prompt_lengths(qwen_like_small_dir, tmp_path):
    """The check of a fit's rows at its start and the transformers generator's of each batch refuse from the same
    prompt length on, a prompt of limit - 1 tokens generating in both: the built-in model (128 positions, no chat
    template) and the Qwen-like fixture with its chat template (96 positions here): neither lets through what the
    other refuses (a fit passing its start check, then stopped mid-run)."""
    import json
    import shutil
    from functools import partial

    from es_helpers import no_room_boundary

    from es_lightning.modules.base import ReasoningModule

    model = tmp_path / "qwen-like-96"
    shutil.copytree(qwen_like_small_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 96}))
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    for name, limit in (("builtin:countdown-tiny", 128), (str(model), 96)):
        module = ReasoningModule(model=name, task="gsm8k", max_new_tokens=1)
        seen = no_room_boundary(module, partial(module.generator.generate, num_samples=1, params=params))
        assert {limit - 1, limit} <= set(seen), (name, seen)
        assert seen == {n: (n >= limit, n >= limit) for n in seen}, (name, seen)


def test_the_command_says_a_generation_past_the_positions_once(qwen_like_small_dir, tmp_path, caplog, recwarn):
    """`es-lightning eval` of a Qwen-like model of 64 positions with max_new_tokens 80: the generator's warning (with
    the max_new_tokens that fits) is the one line about it; transformers' "This is a friendly reminder - the current
    text generation call has exceeded the model's predefined maximum length (64)" followed it, saying it again."""
    import json
    import logging
    import shutil

    from es_lightning.cli import cli_main

    model = tmp_path / "model"
    shutil.copytree(qwen_like_small_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 64}))
    logging.Logger.warning_once.cache_clear()  # transformers says it once per process: a test before may have
    cli_main(["eval", "--checkpoints", str(model), "--tasks", "addition", "--eval.num_problems", "2",
              "--eval.num_samples", "2", "--eval.max_new_tokens", "80", "--eval.temperature", "1",
              "--out_dir", str(tmp_path / "eval"), "--plot", "false", "--progress", "false"])
    ours = [w for w in recwarn if "exceed the model's max_position_embeddings=64" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in recwarn]
    assert not [r for r in caplog.records if "friendly reminder" in r.getMessage()], caplog.text
