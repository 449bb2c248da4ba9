"""What the look-alike fixtures (:mod:`es_lightning.builtin.qwen_like`, :mod:`es_lightning.builtin.llama_like`) share:
the byte-level token alphabet, the toy layer sizes, the seeded random initialisation, and writing the directory as the
hub's files are written (weights in ``dtype``, ``config.json`` saying so as ``torch_dtype``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch


def write_look_alike(
    path: Path,
    config_class: type,
    model_class: type,
    tokenizer,
    *,
    vocab_size: int,
    hidden_size: int,
    intermediate_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    dtype: torch.dtype,
    tie_word_embeddings: bool,
    seed: int,
    hub_config: Callable[[dict], dict] = lambda config: config,
    **architecture,
) -> None:
    """Write a randomly initialised ``model_class`` and ``tokenizer`` into the existing directory ``path``.

    The arguments between ``vocab_size`` and ``seed`` are those of the fixture builders (their docstrings);
    ``architecture`` is the rest of the ``config_class`` arguments (RoPE, norms, special-token ids), with Hugging Face's
    ``initializer_range`` 0.02 unless given. ``hub_config`` edits the ``config.json`` transformers writes (without its
    ``dtype``) into the hub's spelling; ``torch_dtype`` is appended last.
    """
    config = config_class(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, tie_word_embeddings=tie_word_embeddings,
        **{"initializer_range": 0.02, **architecture},
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_class(config)
    model.to(dtype).save_pretrained(path)
    tokenizer.save_pretrained(path)
    rewrite_json(path / "config.json", lambda c: {**hub_config({k: v for k, v in c.items() if k != "dtype"}),
                                                  "torch_dtype": str(dtype).removeprefix("torch.")})


def rewrite_json(file: Path, edit: Callable[[dict], dict]) -> None:
    """Replace the JSON object in ``file`` by ``edit`` of it (indent 2, final newline, as transformers writes)."""
    file.write_text(json.dumps(edit(json.loads(file.read_text())), indent=2) + "\n")


def byte_alphabet() -> list[str]:
    """The byte-level BPE spelling of each byte 0..255 (GPT-2's convention, used by Qwen): printable Latin-1 bytes are
    their own character, the others are shifted to U+0100 onwards (a space is ``Ġ``, a newline ``Ċ``)."""
    keep = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    shift, out = 0, []
    for b in range(256):
        if b in keep:
            out.append(chr(b))
        else:
            out.append(chr(256 + shift))
            shift += 1
    return out
