"""Fixtures of the vLLM backend's tests (run in .venv-vllm by ``make test-vllm``; skipped where vLLM is absent).

Engines are built once per session (a few seconds each on a CPU) and shared; tests that change an engine's weights
put the centre back. ``qwen_like_dir`` is a stand-in for ``es_lightning.builtin.qwen_like`` (being added by the
real-models work): replace its body by a call to that builder when it lands.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

QWEN_VOCAB = 151_936  # Qwen2.5's embedding rows (the tokenizer uses 151,665 of them)
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 151643, 151644, 151645 as in Qwen2.5
QWEN_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
#: Qwen2.5-Instruct's generation_config.json sampling defaults: they must not reach a rollout (DESIGN.md)
QWEN_GENERATION_DEFAULTS = dict(do_sample=True, repetition_penalty=1.1, temperature=0.7, top_k=20, top_p=0.8)


def _qwen_like_tokenizer():
    """A byte-level BPE tokenizer shaped like Qwen2.5's: 151,643 ordinary tokens (the 256 byte symbols, then filler
    tokens that decode to short strings), the three specials at Qwen's ids, ``<|im_end|>`` the EOS and
    ``<|endoftext|>`` the pad (an EOS too), a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    letters = "abcdefghijklmnopqrstuvwxyz"
    i = 0
    while len(vocab) < 151_643:  # filler tokens: 'Ġ' + letters (decode as ' ab', ' abc', …)
        word, k = "", i
        while True:
            word += letters[k % 26]
            k //= 26
            if k == 0:
                break
        vocab.setdefault("Ġ" + word, len(vocab))
        i += 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=QWEN_SPECIALS)
    fast.eos_token, fast.pad_token = "<|im_end|>", "<|endoftext|>"
    fast.chat_template = QWEN_CHAT_TEMPLATE
    return fast


@pytest.fixture(scope="session")
def qwen_like_dir(tmp_path_factory) -> str:
    """A random-weight Qwen2 directory with Qwen2.5's vocabulary size, specials, chat template and sampling defaults;
    head_dim 32 (vLLM's CPU attention needs >= 32) and untied embeddings (the built-in model covers tied ones)."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tok = _qwen_like_tokenizer()
    assert tok.convert_tokens_to_ids(QWEN_SPECIALS) == [151643, 151644, 151645]
    config = Qwen2Config(
        vocab_size=QWEN_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=151643,
        eos_token_id=151645, pad_token_id=151643,
    )
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        bos_token_id=151643, eos_token_id=[151645, 151643], pad_token_id=151643, **QWEN_GENERATION_DEFAULTS
    )
    path = tmp_path_factory.mktemp("qwen-like")
    model.save_pretrained(path)
    tok.save_pretrained(path)
    with open(path / "config.json") as f:
        assert json.load(f)["vocab_size"] == QWEN_VOCAB
    return str(path)


def _policy(name: str):
    from es_lightning.policy import load_policy

    return load_policy(name, dtype="float32")


def _engine(policy, **kw):
    from es_lightning.generation.vllm import VLLMGenerator

    return VLLMGenerator(policy, max_model_len=128, cpu_kv_cache_gib=0.25, max_num_seqs=64, **kw)


@pytest.fixture(scope="session")
def builtin_pair():
    """(policy, its vLLM generator) for the built-in model (tied embeddings, char tokenizer)."""
    policy = _policy("builtin:countdown-tiny")
    gen = _engine(policy)
    yield policy, gen
    gen.close()


@pytest.fixture(scope="session")
def qwen_pair(qwen_like_dir):
    """(policy, its vLLM generator) for the Qwen-like fixture."""
    policy = _policy(qwen_like_dir)
    gen = _engine(policy)
    yield policy, gen
    gen.close()


@pytest.fixture(scope="session")
def hf_generate():
    """HFGenerator.generate with the checkpoint's sampling defaults removed for the call. transformers' ``generate``
    fills the fields a GenerationConfig leaves at their defaults from ``model.generation_config``: the Qwen-like
    fixture's repetition penalty 1.1 reached HFGenerator's greedy rollouts (found here; for the real-models fix in
    generation/hf.py, after which this is a no-op). vLLM is checked on its own by
    ``test_checkpoint_sampling_defaults_do_not_leak``."""
    from transformers import GenerationConfig

    from es_lightning.generation import HFGenerator

    def generate(policy, *args, **kwargs):
        saved = policy.model.generation_config
        policy.model.generation_config = GenerationConfig(
            bos_token_id=saved.bos_token_id, eos_token_id=saved.eos_token_id, pad_token_id=saved.pad_token_id
        )
        try:
            return HFGenerator(policy).generate(*args, **kwargs)
        finally:
            policy.model.generation_config = saved

    return generate
