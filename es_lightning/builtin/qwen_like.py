"""A Qwen2.5-Instruct look-alike, written offline in seconds: the test fixture for the real-model path (README "Design", "Testing").

What a user's Qwen2.5-0.5B/1.5B-Instruct directory has, and what the library must get right for it, this directory has
too — only the sizes of the hidden layers are toy:

- **Qwen2 architecture** (``model_type: qwen2``, GQA, RoPE θ = 10⁶, RMSNorm ε = 10⁻⁶, tied input/output embeddings as
  Qwen2.5-0.5B/1.5B), with ``head_dim`` ≥ 32 so that vLLM's CPU attention accepts it (default: hidden 64, 2 heads of 32,
  1 key/value head, 2 layers).
- **The real vocabulary size**, 151,936 embedding rows (the 0.5B–7B checkpoints pad Qwen's 151,665 tokens to it), so
  every ``[rows, V]`` tensor — sampler noise, logits, log-softmax — is as large as in production.
- **The real special tokens at their real ids**: ``<|endoftext|>`` 151643 (the pad token and one of the two EOS ids),
  ``<|im_start|>`` 151644, ``<|im_end|>`` 151645 (the tokenizer's EOS). With a smaller ``vocab_size`` they keep Qwen's
  layout relative to the end: 293 rows before it.
- **Qwen2.5-Instruct's chat template** (the Jinja text of the real ``tokenizer_config.json``, tools branch included) and
  its **``generation_config.json``** sampling defaults: ``do_sample`` true, ``repetition_penalty`` 1.1, ``temperature``
  0.7, ``top_k`` 20, ``top_p`` 0.8, EOS ``[151645, 151643]``, pad and BOS 151643 — the defaults that must never leak into
  rollouts (README "Design", "Sampling is the project's").
- **bf16 weights** with ``torch_dtype: bfloat16`` in ``config.json``, as the hub checkpoints are written; the directory
  loads as fp32 or bf16.

The tokenizer is Qwen's own class (``Qwen2Tokenizer``: NFC, Qwen's split regex, byte-level BPE) with a vocabulary of one
token per byte (ids 0–255, id = byte value, spelled in the byte-level alphabet) and no merges, so *any* text — the
Countdown and GSM8K prompts, ``<think>``/``<answer>`` tags, non-ASCII — encodes and decodes exactly, one token per
ASCII character. The ids between 256 and the first special token are filler entries (``<f256>`` …) that no text
encodes to; an untrained model samples them, as a random Qwen would sample arbitrary words. Because the directory says
``model_type: qwen2``, transformers 5 loads it with ``Qwen2Tokenizer`` whatever the tokenizer config names (see
:mod:`es_lightning.builtin.tokenizer`); building with that class makes every loader agree.

Build one::

    python -m es_lightning.builtin.qwen_like /tmp/qwen-like            # full vocabulary, bf16
    python -m es_lightning.builtin.qwen_like /tmp/qwen-small --vocab-size 1024
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from es_lightning.builtin.look_alike import byte_alphabet, write_look_alike

#: Qwen2.5's padded embedding size (config.json ``vocab_size`` of Qwen2.5-0.5B/1.5B/3B/7B-Instruct)
QWEN_VOCAB_SIZE = 151_936
#: rows after the first special token in Qwen2.5's embedding (151936 - 151643)
_TAIL = QWEN_VOCAB_SIZE - 151_643
ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"

#: Qwen2.5-Instruct's chat template, verbatim (its tokenizer_config.json ``chat_template``): a default system turn, tools
QWEN25_CHAT_TEMPLATE = (Path(__file__).parent / "templates" / "qwen2.5-instruct.jinja").read_text()


def special_token_ids(vocab_size: int = QWEN_VOCAB_SIZE) -> dict[str, int]:
    """Ids of ``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>`` for a fixture of ``vocab_size`` rows (Qwen's at
    151,936: 151643, 151644, 151645)."""
    first = vocab_size - _TAIL
    return {ENDOFTEXT: first, IM_START: first + 1, IM_END: first + 2}


def qwen25_generation_config(vocab_size: int = QWEN_VOCAB_SIZE) -> dict:
    """Qwen2.5-Instruct's ``generation_config.json`` (the 0.5B–7B files are identical), with this fixture's ids."""
    ids = special_token_ids(vocab_size)
    return {
        "bos_token_id": ids[ENDOFTEXT],
        "pad_token_id": ids[ENDOFTEXT],
        "do_sample": True,
        "eos_token_id": [ids[IM_END], ids[ENDOFTEXT]],
        "repetition_penalty": 1.1,
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "transformers_version": "4.37.0",
    }


def build_qwen_like_tokenizer(vocab_size: int = QWEN_VOCAB_SIZE, add_bos_token: bool = False):
    """A ``Qwen2Tokenizer``: ids 0–255 are the bytes, fillers up to the specials, specials at Qwen's ids.

    ``add_bos_token=True`` makes a variant whose tokenizer prepends ``<|endoftext|>`` as a BOS and whose chat template
    writes ``{{ bos_token }}`` first (as Llama 3's does) — for checking that a templated prompt never gets two.
    """
    from transformers import Qwen2Tokenizer

    specials = special_token_ids(vocab_size)
    first_special = min(specials.values())
    if first_special < 256:
        raise ValueError(f"vocab_size must be at least {256 + _TAIL} (256 byte tokens + Qwen's {_TAIL} tail rows), "
                         f"got {vocab_size}")
    vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
    vocab.update({f"<f{i}>": i for i in range(256, first_special)})
    vocab.update(specials)
    template = QWEN25_CHAT_TEMPLATE
    kwargs = dict(bos_token=None, unk_token=None)
    if add_bos_token:
        template = "{{- bos_token }}\n" + template
        kwargs = dict(bos_token=ENDOFTEXT, unk_token=None, add_bos_token=True)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token=IM_END, pad_token=ENDOFTEXT, model_max_length=131072,
        errors="replace", split_special_tokens=False, **kwargs,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    tokenizer.chat_template = template
    tokenizer.padding_side = "left"
    return tokenizer


def build_qwen_like(
    path: str | Path,
    vocab_size: int = QWEN_VOCAB_SIZE,
    hidden_size: int = 64,
    intermediate_size: int = 160,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    generation_defaults: bool = True,
    add_bos_token: bool = False,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> str:
    """Write a randomly initialised Qwen2.5-Instruct look-alike into ``path`` (created) and return it as a string.

    Args:
        vocab_size: embedding rows; 151,936 is Qwen2.5's (specials at 151643–151645); smaller keeps the 293-row tail.
        hidden_size, num_attention_heads: ``head_dim = hidden_size / num_attention_heads`` must be ≥ 32 (vLLM CPU).
        dtype: dtype of the saved weights (``config.json`` says the same as ``torch_dtype``, as the hub files do).
        generation_defaults: write Qwen2.5-Instruct's ``generation_config.json`` sampling defaults (``False`` writes
            only the token ids, as a base model's file does).
        add_bos_token: the BOS variant of :func:`build_qwen_like_tokenizer`.
        tie_word_embeddings: share input and output embeddings (Qwen2.5 ≤ 3B do; 7B does not).
        seed: weight initialisation seed (Qwen2's ``initializer_range`` 0.02).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if hidden_size % num_attention_heads or hidden_size // num_attention_heads < 32:
        raise ValueError(f"head_dim = hidden_size / num_attention_heads must be an integer >= 32 (vLLM's CPU "
                         f"attention), got {hidden_size} / {num_attention_heads}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_qwen_like_tokenizer(vocab_size, add_bos_token=add_bos_token)
    ids = special_token_ids(vocab_size)
    write_look_alike(
        path, Qwen2Config, Qwen2ForCausalLM, tokenizer, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, dtype=dtype, tie_word_embeddings=tie_word_embeddings, seed=seed,
        max_position_embeddings=32768, rope_theta=1_000_000.0, rms_norm_eps=1e-6, bos_token_id=ids[ENDOFTEXT],
        eos_token_id=ids[IM_END], use_sliding_window=False, attention_dropout=0.0,
    )
    generation = qwen25_generation_config(vocab_size)
    if not generation_defaults:
        generation = {k: generation[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id", "transformers_version")}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a Qwen2.5-Instruct look-alike HF directory (random weights).")
    parser.add_argument("path")
    parser.add_argument("--vocab-size", type=int, default=QWEN_VOCAB_SIZE)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--no-generation-defaults", action="store_true")
    args = parser.parse_args()
    out = build_qwen_like(args.path, vocab_size=args.vocab_size, dtype=getattr(torch, args.dtype),
                          generation_defaults=not args.no_generation_defaults)
    print(out)


if __name__ == "__main__":
    main()
