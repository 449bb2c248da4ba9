"""A Llama-3 checkpoint instead of Qwen (es_lightning/builtin/llama_like.py): no pad token, a BOS from the tokenizer and
the chat template, several EOS ids, rope scaling ``llama3``, tied embeddings."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

from es_lightning.builtin.llama_like import LLAMA3_VOCAB_SIZE, special_token_ids
from es_lightning.callbacks import HFExport
from es_lightning.modules.base import ReasoningModule
from es_lightning.policy import encode_prompts, load_policy
from es_lightning.tasks import CountdownTask


def test_the_fixture_is_llama_3_shaped(llama_like_dir):
    ids = special_token_ids()
    assert (ids["<|begin_of_text|>"], ids["<|end_of_text|>"], ids["<|start_header_id|>"], ids["<|eot_id|>"]) == (
        128000, 128001, 128006, 128009) and max(ids.values()) == LLAMA3_VOCAB_SIZE - 1
    config = json.loads((Path(llama_like_dir) / "config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["tie_word_embeddings"]
    assert AutoConfig.from_pretrained(llama_like_dir).eos_token_id == [769, 776, 777]
    gen = json.loads((Path(llama_like_dir) / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [769, 776, 777] and "pad_token_id" not in gen
    raw = AutoTokenizer.from_pretrained(llama_like_dir)
    assert raw.pad_token is None and raw.eos_token == "<|eot_id|>" and len(raw) == 1024
    policy = load_policy(llama_like_dir)
    assert isinstance(policy.model, LlamaForCausalLM)
    assert policy.model.lm_head.weight is policy.model.model.embed_tokens.weight
    assert raw("hi")["input_ids"] == [768, 104, 105]  # the tokenizer adds <|begin_of_text|>
    templated = policy.render_prompts(["hi"], use_chat_template=True)[0]
    assert templated.startswith("<|begin_of_text|><|start_header_id|>system")
    rows = encode_prompts(policy.tokenizer, [templated, "hi"])
    assert [row[mask.bool()].tolist().count(768) for row, mask in zip(rows["input_ids"], rows["attention_mask"])] == [1, 1]


def test_bf16_true_keeps_rotary_frequencies_fp32(llama_like_dir):
    """Lightning's bf16-true casts the whole module; RoPE's inv_freq must stay fp32 (bf16 frequencies shift the phase
    by 0.5 rad at position 512), so the converted policy computes exactly what the bf16 checkpoint computes."""
    plain = load_policy(llama_like_dir, dtype="bfloat16").model
    converted = HalfPrecision("bf16-true").convert_module(load_policy(llama_like_dir, dtype="bfloat16").model)
    assert plain.model.rotary_emb.inv_freq.dtype == torch.float32  # as from_pretrained(dtype=bf16) leaves it
    ids = torch.randint(0, 700, (1, 300), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = plain(ids).logits, converted(ids).logits
    assert converted.model.rotary_emb.inv_freq.dtype == torch.float32
    assert torch.equal(converted.model.rotary_emb.inv_freq, plain.model.rotary_emb.inv_freq)
    assert torch.equal(got, expected)


def test_hf_export_keeps_the_tokenizer_without_a_pad_token(llama_like_dir, tmp_path):
    """The pad token load_tokenizer borrows from the EOS (Llama 3 has none) is not written into the export: with
    ``pad_token: <|eot_id|>`` a collator that masks padding out of the labels would mask every end of turn. And the
    class is named as transformers 4 can read it (5 writes ``TokenizersBackend``)."""
    module = ReasoningModule(model=llama_like_dir, task="countdown")
    assert module.tokenizer is None and module.policy.tokenizer.pad_token == "<|eot_id|>"  # batching needs one
    HFExport(tmp_path / "export").export(module)
    config = json.loads((tmp_path / "export" / "tokenizer_config.json").read_text())
    assert "pad_token" not in config
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # as the hub's; transformers 4 reads no other
    assert AutoTokenizer.from_pretrained(tmp_path / "export").pad_token is None
    assert module.tokenizer.pad_token == "<|eot_id|>"  # the module's tokenizer still pads
    assert load_policy(str(tmp_path / "export")).tokenizer.pad_token_id == 777


def test_a_task_asking_for_the_chat_template_of_a_base_model_gets_the_no_template_prompt(tiny_model_dir):
    """A base checkpoint without a chat template (tiny_model_dir's; a base Llama's may have none) under a recipe for
    the instruct model: Countdown r1 keeps its "User: … Assistant: … <think>" scaffold instead of the bare user turn."""
    example = {"nums": [3, 25, 7], "target": 46}
    module = ReasoningModule(model=tiny_model_dir, task=CountdownTask(prompt_format="r1", use_chat_template=True))
    with pytest.warns(UserWarning, match="has none"):
        prompts = module.prompts([example])
    assert prompts == [CountdownTask(prompt_format="r1").prompt(example)] and prompts[0].endswith("<think>")
    assert module.task.use_chat_template  # the task itself is left as configured


def test_a_system_prompt_for_a_base_model_without_a_chat_template_is_refused(tiny_model_dir):
    """The no-template prompt has no place for a system turn: it was dropped without a word, and the warning's fix
    (use_chat_template: false) is refused with a system_prompt."""
    task = CountdownTask(prompt_format="r1", use_chat_template=True, system_prompt="Think step by step.")
    module = ReasoningModule(model=tiny_model_dir, task=task)
    with pytest.raises(ValueError, match="system_prompt is a turn of the chat template, but .* has no chat template"):
        module.prompts([{"nums": [3, 25, 7], "target": 46}])


def test_templated_prompts_do_not_change_with_the_day(llama_like_dir):
    """Llama 3.2's template writes strftime_now's date into the system turn; a rollout's prompt must not change at
    midnight (a resumed run, a base and a tuned model evaluated on different days)."""
    policy = load_policy(llama_like_dir)
    prompt = policy.render_prompts(["hi"], use_chat_template=True)[0]
    assert "Today Date: 26 Jul 2024\n" in prompt
    assert "Today Date: " + datetime.now().strftime("%d %b %Y") in policy.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False)  # the template itself does date its prompts

