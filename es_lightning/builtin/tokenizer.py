"""A character-level tokenizer for the built-in model, as a standard ``PreTrainedTokenizerFast``.

One token per character keeps arithmetic honest for a 1M-parameter model (no digit-merging BPE) and lets the saved
``tokenizer.json`` load with plain ``transformers.AutoTokenizer`` — the same path a real model's tokenizer takes.
"""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

#: every character the built-in tasks use (digits, arithmetic, separators, lowercase task tags)
CHARSET = "0123456789+-*/()=>:. \nabcdefghijklmnopqrstuvwxyz"
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """Build the tokenizer: ids 0..2 are ``<pad>``, ``<eos>``, ``<unk>``, then one id per character of ``CHARSET``."""
    vocab = {PAD: 0, EOS: 1, UNK: 2}
    for ch in CHARSET:
        vocab[ch] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # split into single characters, keeping every one (spaces included)
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
    return fast
