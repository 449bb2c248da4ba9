"""``model.generate`` configured so that :class:`SamplingParams` alone decide how a rollout samples (README "Design", "Sampling
is the project's").

How transformers 5 (checked on 5.24) merges a checkpoint's ``generation_config.json`` into a call
(``GenerationMixin._prepare_generation_config``): every field of a fresh ``GenerationConfig`` is ``None``, meaning
"unset"; the config passed to ``generate`` is deep-copied, then ``update(**model.generation_config.to_dict(),
defaults_only=True)`` fills **every field still ``None``** from the model's config (Qwen2.5-Instruct's: ``do_sample``,
``repetition_penalty`` 1.1, ``temperature`` 0.7, ``top_k`` 20, ``top_p`` 0.8, EOS ids), and only then the global
defaults (``top_k`` 50, ``max_length`` 20, …). So a field is protected only when the caller sets it to a non-``None``
value — and fields whose neutral value *is* ``None`` (``suppress_tokens``, ``bad_words_ids``, ``sequence_bias``,
``forced_eos_token_id``, ``min_p``, ``watermarking_config``, ``cache_implementation`` …) cannot be protected that way at
all: a checkpoint that sets them wins. Their logits processors run *before* the custom ones, so a repetition penalty
from the checkpoint silently changed both the sampled tokens and the log-probs our sampler records (issue 11: ratios
0.58–1.53 against the training forward).

Defeated twice, so that neither alone has to be perfect:

1. :func:`rollout_generation_config` sets every sampling/penalty field that has a neutral value to it explicitly;
2. :func:`checkpoint_defaults_off` swaps ``model.generation_config`` for a bare ``GenerationConfig()`` for the duration
   of the call, so there is nothing to merge from (the ``None``-neutral fields included).

The model's own ``generation_config`` object is put back unchanged afterwards and never modified, so
``save_pretrained`` (``HFExport``) writes the checkpoint's file back as it was, and the EOS ids are still read from it
(they say when the model has finished, not how to sample). Our stopping (EOS, stop strings) is a stopping criterion of
the generator's own (:mod:`es_lightning.generation.hf`), so the config carries no ``eos_token_id`` either.

vLLM has the same trap with another switch: its ``LLM(generation_config="auto")`` default reads
``generation_config.json`` into the default ``SamplingParams``; an engine must be built with ``generation_config="vllm"``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import GenerationConfig

#: the sampling/penalty fields of GenerationConfig that have a neutral non-None value, at that value (``top_k`` and
#: ``min_length`` are left out: transformers warns when they are set alongside greedy decoding / ``min_new_tokens``;
#: with the model's config swapped out they fall to the global defaults, which greedy decoding does not use)
NEUTRAL_FIELDS = dict(
    do_sample=False,  # our sampler turns greedy decoding into sampling (Gumbel-max), see generation/hf.py
    num_beams=1,
    num_return_sequences=1,
    temperature=1.0,
    top_p=1.0,
    typical_p=1.0,
    epsilon_cutoff=0.0,
    eta_cutoff=0.0,
    repetition_penalty=1.0,
    encoder_repetition_penalty=1.0,
    length_penalty=1.0,
    no_repeat_ngram_size=0,
    encoder_no_repeat_ngram_size=0,
    min_new_tokens=0,
    renormalize_logits=False,
    remove_invalid_values=False,
    output_scores=False,
    output_logits=False,
    use_cache=True,
)


def rollout_generation_config(max_new_tokens: int, pad_token_id: int) -> GenerationConfig:
    """The config every rollout passes to ``generate``: greedy over our sampler's scores, nothing else applied."""
    return GenerationConfig(
        max_new_tokens=max_new_tokens, pad_token_id=pad_token_id, return_dict_in_generate=True, **NEUTRAL_FIELDS
    )


@contextmanager
def checkpoint_defaults_off(model: torch.nn.Module) -> Iterator[None]:
    """Within the block ``model.generation_config`` is a bare ``GenerationConfig()`` (nothing to merge from); the
    checkpoint's object is restored afterwards, untouched."""
    if not hasattr(model, "generation_config"):
        yield
        return
    original = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = original


def checkpoint_eos_token_ids(model: torch.nn.Module, tokenizer) -> list[int]:
    """The ids that end a completion: the checkpoint's ``generation_config`` EOS (Qwen2.5-Instruct: ``<|im_end|>`` and
    ``<|endoftext|>``), else the tokenizer's EOS."""
    config = getattr(model, "generation_config", None)
    eos = getattr(config, "eos_token_id", None) if config is not None else None
    if eos is None:
        eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the model has no EOS token: neither generation_config.eos_token_id nor the tokenizer's "
                         "eos_token is set; set one in the checkpoint's generation_config.json")
    return [int(eos)] if isinstance(eos, int) else [int(e) for e in eos]


def position_limit(config) -> int | None:
    """The longest prompt + completion a model's position encoding was built for: its ``max_position_embeddings``
    when the RoPE is not scaled (YaRN, dynamic NTK … extend it: ``None``, no limit known).

    RoPE given per layer type (Gemma-3, OLMo-3: ``{"full_attention": {...}, "sliding_attention": {...}}``) is judged
    by its full-attention entry — sliding-window layers only relate positions a window apart — or, without one, by
    all its entries. A multimodal config (Gemma-3's) holds the limit in its text config."""
    if config is not None and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    limit = getattr(config, "max_position_embeddings", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return limit if isinstance(limit, int) and not isinstance(limit, bool) and not _rope_scaled(rope) else None


#: how a refusal or warning names a vLLM engine's ``max_model_len`` that ``generation_options`` did not set: vLLM took
#: the smallest length the model's config gives (``max_position_embeddings``, ``seq_length``, ``max_seq_len`` …, times
#: a linear RoPE factor) and refuses a larger one, so shorter prompts (or fewer new tokens) are the fix
DERIVED_NOTE = ("(vLLM's own for this model, from its config: generation_options sets none, and vLLM refuses a larger "
                "one)")
DERIVED_MAX_MODEL_LEN = f"the vLLM engine's max_model_len {DERIVED_NOTE}"
#: the fix of a prompt that no limit can be raised for
SHORTEN_PROMPTS = "shorten the prompts (the task's prompt format or system_prompt)"


class KVCacheTooSmall(ValueError):
    """A vLLM engine refused because its KV cache cannot hold one sequence of its ``max_model_len`` — typically the
    one vLLM derives from a long-context config (131,072 for Llama 3's rope scaling ``llama3``) where
    ``generation_options`` sets none, while a run needs only its longest prompt + ``max_new_tokens``. The message
    names both fixes; :meth:`~es_lightning.modules.base.ReasoningModule.start_generator` gives it again with that
    figure (:meth:`with_need`) where it knows the data."""

    def __init__(self, template: str, need: int | None = None) -> None:
        self.template = template  # "{need}" where the figure goes
        super().__init__(template.format(need=f" (here {need})" if need else ""))

    def with_need(self, need: int) -> KVCacheTooSmall:
        """The refusal naming ``need`` tokens (the longest prompt + ``max_new_tokens``) as the ``max_model_len`` to set."""
        return KVCacheTooSmall(self.template, need)


def prompt_limit(config, max_model_len: int | None = None) -> int | None:
    """The prompt length (tokens) from which no completion token fits: the model's positions (:func:`position_limit`),
    or a vLLM engine's ``max_model_len`` where it is lower; ``None`` where neither is known.

    The one rule of the three checks that refuse such a prompt, so that none lets through what another refuses (a fit
    that passed its start check then stopped mid-run): a fit's rows at its start and an evaluation's problems
    (:meth:`~es_lightning.modules.base.ReasoningModule.refuse_overlong_examples`, with ``generation_options``'
    ``max_model_len``), and each batch in the transformers and vLLM generators
    (:func:`~es_lightning.generation.base.refuse_overlong_prompts`; the engine's own ``max_model_len``). An engine takes
    no more than the positions (``VLLMGenerator`` caps a longer ``max_model_len``). All three count the prompt as
    rendered (chat template included) and encoded (:func:`~es_lightning.policy.prompt_token_counts`);
    ``max_new_tokens`` is no part of it: a completion cut short by the limit is each generator's warning."""
    positions = position_limit(config)
    if max_model_len is not None and (positions is None or max_model_len < positions):
        return int(max_model_len)
    return positions


def _rope_scaled(rope: Any) -> bool:
    """Whether a ``rope_parameters`` / ``rope_scaling`` value extends the positions: a flat dict whose ``rope_type``
    is not ``default``, or one keyed by layer type whose full-attention entry (else any entry) is."""
    if not isinstance(rope, dict):
        return False
    if not any(isinstance(value, dict) for value in rope.values()):  # flat: one RoPE for every layer
        return rope.get("rope_type", rope.get("type", "default")) != "default"
    entries = [rope["full_attention"]] if "full_attention" in rope else list(rope.values())
    return any(isinstance(entry, dict) and _rope_scaled(entry) for entry in entries)
