"""A Llama-3.2-Instruct look-alike, written offline in seconds: the fixture for users whose checkpoint is Llama 3, not
Qwen (its tokenizer has no pad token and adds a BOS; its generation_config lists three EOS ids).

What a Llama-3.2-1B(-Instruct) directory has that matters to the library, this directory has too:

- **Llama architecture** (``model_type: llama``, GQA, RoPE θ = 5·10⁵ with ``rope_scaling`` of type ``llama3``, tied
  input/output embeddings as the 1B/3B checkpoints; ``tie_word_embeddings=False`` as 8B).
- **Llama 3's special-token layout**: the last 256 rows are special tokens — ``<|begin_of_text|>`` (first), then
  ``<|end_of_text|>``, four reserved ones, ``<|start_header_id|>``, ``<|end_header_id|>``, ``<|eom_id|>``, ``<|eot_id|>``
  and reserved ones to the end (128000, 128001, 128006–128009 at the real size, 128,256). The tokenizer is as long as
  the embedding (no padding rows, unlike Qwen).
- **A tokenizer like the hub's** (``PreTrainedTokenizerFast`` from ``tokenizer.json``): it prepends
  ``<|begin_of_text|>`` (its post-processor), its EOS is ``<|eot_id|>`` (``instruct=False``: ``<|end_of_text|>``, as the
  base model), and it has **no pad token**. One token per byte (ids 0–255) and no merges, so any text encodes exactly.
- **A Llama-3-Instruct chat template** that writes ``{{ bos_token }}`` itself and a system turn with today's date
  (``strftime_now``, as Llama 3.1–3.3's do) (``instruct=False``: no template, as a base checkpoint may have none).
- **Llama 3.2's ``generation_config.json``**: ``bos_token_id`` 128000, ``eos_token_id`` [128001, 128008, 128009]
  (base: 128001), ``do_sample`` true, ``temperature`` 0.6, ``top_p`` 0.9; **bf16** weights.

Build one::

    python -m es_lightning.builtin.llama_like /tmp/llama-like --vocab-size 2048
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from es_lightning.builtin.look_alike import byte_alphabet, rewrite_json, write_look_alike

#: Llama 3's vocabulary (tokenizer and embedding): 128,000 BPE tokens and 256 special tokens
LLAMA3_VOCAB_SIZE = 128_256
_SPECIALS = 256
BEGIN, END, START_HEADER, END_HEADER, EOM, EOT = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>")

#: Llama-3-Instruct's chat template (Llama-3.2's without the tools branch; today's date in the system turn)
LLAMA3_CHAT_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' %}\n"
    "    {%- set system_message = messages[0]['content']|trim %}\n"
    "    {%- set messages = messages[1:] %}\n"
    "{%- else %}\n"
    "    {%- set system_message = \"\" %}\n"
    "{%- endif %}\n"
    "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n"
    "{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n"
    "{%- if not date_string is defined %}\n"
    "    {%- if strftime_now is defined %}\n"
    "        {%- set date_string = strftime_now(\"%d %b %Y\") %}\n"
    "    {%- else %}\n"
    "        {%- set date_string = \"26 Jul 2024\" %}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n"
    "{{- system_message }}\n"
    "{{- \"<|eot_id|>\" }}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)


def special_token_ids(vocab_size: int = LLAMA3_VOCAB_SIZE) -> dict[str, int]:
    """Ids of Llama 3's special tokens for a fixture of ``vocab_size`` rows (the real ones at 128,256)."""
    first = vocab_size - _SPECIALS
    names = [BEGIN, END] + [f"<|reserved_special_token_{i}|>" for i in range(4)] + [START_HEADER, END_HEADER, EOM, EOT]
    names += [f"<|reserved_special_token_{i}|>" for i in range(4, _SPECIALS - 6)]
    return {name: first + i for i, name in enumerate(names)}


def llama3_generation_config(vocab_size: int = LLAMA3_VOCAB_SIZE, instruct: bool = True) -> dict:
    """Llama-3.2-1B(-Instruct)'s ``generation_config.json`` with this fixture's ids."""
    ids = special_token_ids(vocab_size)
    return {
        "bos_token_id": ids[BEGIN],
        "do_sample": True,
        "eos_token_id": [ids[END], ids[EOM], ids[EOT]] if instruct else ids[END],
        "temperature": 0.6,
        "top_p": 0.9,
        "transformers_version": "4.45.0.dev0",
    }


def build_llama_like_tokenizer(vocab_size: int = LLAMA3_VOCAB_SIZE, instruct: bool = True):
    """A fast tokenizer with Llama 3's special tokens and BOS post-processor, one token per byte, no pad token."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = special_token_ids(vocab_size)
    first_special = min(specials.values())
    if first_special < 256:
        raise ValueError(f"vocab_size must be at least {256 + _SPECIALS}, got {vocab_size}")
    vocab = {ch: b for b, ch in enumerate(byte_alphabet())}
    vocab.update({f"<f{i}>": i for i in range(256, first_special)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BEGIN}:0 $A:0", pair=f"{BEGIN}:0 $A:0 {BEGIN}:1 $B:1", special_tokens=[(BEGIN, specials[BEGIN])])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BEGIN, eos_token=EOT if instruct else END, model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )
    if instruct:
        tokenizer.chat_template = LLAMA3_CHAT_TEMPLATE
    return tokenizer


def build_llama_like(
    path: str | Path,
    vocab_size: int = LLAMA3_VOCAB_SIZE,
    hidden_size: int = 64,
    intermediate_size: int = 160,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 1,
    dtype: torch.dtype = torch.bfloat16,
    instruct: bool = True,
    tie_word_embeddings: bool = True,
    seed: int = 0,
) -> str:
    """Write a randomly initialised Llama-3.2(-Instruct) look-alike into ``path`` (created) and return it as a string.

    Args:
        vocab_size: embedding rows = tokenizer length; the last 256 are the special tokens.
        instruct: the Instruct checkpoint's tokenizer (EOS ``<|eot_id|>``, chat template) and three EOS ids; ``False``
            the base model's (EOS ``<|end_of_text|>``, no template, one EOS id).
        tie_word_embeddings: share input and output embeddings (Llama 3.2 1B/3B do; 3.1 8B does not).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_llama_like_tokenizer(vocab_size, instruct=instruct)
    ids = special_token_ids(vocab_size)
    generation = llama3_generation_config(vocab_size, instruct=instruct)
    write_look_alike(
        path, LlamaConfig, LlamaForCausalLM, tokenizer, vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, dtype=dtype, tie_word_embeddings=tie_word_embeddings, seed=seed,
        hub_config=_hub_config, head_dim=hidden_size // num_attention_heads, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        bos_token_id=ids[BEGIN], eos_token_id=generation["eos_token_id"], attention_bias=False, mlp_bias=False,
        hidden_act="silu",
    )
    rewrite_json(path / "tokenizer_config.json", lambda c: {**c, "tokenizer_class": "PreTrainedTokenizerFast"})
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return str(path)


def _hub_config(config: dict) -> dict:
    """``config.json`` as the hub's Llama 3 files spell it (transformers 5 writes ``rope_parameters``; they have
    ``rope_theta`` and ``rope_scaling``; :func:`write_look_alike` appends ``torch_dtype``)."""
    config = {k: v for k, v in config.items() if k != "pad_token_id"}
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    return config


def main() -> None:
    parser = argparse.ArgumentParser(description="Write a Llama-3.2-Instruct look-alike HF directory (random weights).")
    parser.add_argument("path")
    parser.add_argument("--vocab-size", type=int, default=LLAMA3_VOCAB_SIZE)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--base", action="store_true", help="the base model's tokenizer and generation config")
    parser.add_argument("--untied", action="store_true", help="separate output embedding (as Llama 3.1 8B)")
    args = parser.parse_args()
    print(build_llama_like(args.path, vocab_size=args.vocab_size, dtype=getattr(torch, args.dtype),
                           instruct=not args.base, tie_word_embeddings=not args.untied))


if __name__ == "__main__":
    main()
