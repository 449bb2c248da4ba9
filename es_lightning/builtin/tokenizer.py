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


def _plain_char_tokenizer() -> PreTrainedTokenizerFast:
    """Ids 0..2 are ``<pad>``, ``<eos>``, ``<unk>``, then one id per character of ``CHARSET``."""
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


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """The built-in char tokenizer (ids of :func:`_plain_char_tokenizer`), stored in byte-level form so that *every*
    loader reads it back identically.

    Why: transformers 5 forces ``Qwen2Tokenizer`` on any directory whose config says ``model_type: qwen2``
    (``MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`` in ``tokenization_auto.py``), whatever ``tokenizer_class`` the
    tokenizer config names. ``Qwen2Tokenizer`` keeps only the vocabulary of ``tokenizer.json`` and installs its own
    byte-level pre-tokenizer, under which a space is ``"Ġ"`` and a newline ``"Ċ"``: with a plain ``" "`` entry every
    space of a prompt silently disappears. Spelling the vocabulary in the byte-level alphabet (BPE without merges,
    one token per character) makes ``AutoTokenizer``, ``Qwen2Tokenizer``, ``PreTrainedTokenizerFast`` and vLLM agree.
    A character outside ``CHARSET`` becomes ``<unk>`` here and is dropped by ``Qwen2Tokenizer``.
    """
    base = _plain_char_tokenizer()
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    specials = {PAD, EOS, UNK}

    def spell(token: str) -> str:
        return token if token in specials else "".join(piece for piece, _ in byte_level.pre_tokenize_str(token))

    vocab = {spell(token): i for token, i in base.get_vocab().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated"), byte_level]
    )
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD, eos_token=EOS, unk_token=UNK, padding_side="left"
    )
