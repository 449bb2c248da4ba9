"""The Qwen-like fixture is what it claims: Qwen2.5-Instruct's vocabulary size, special ids, chat template, generation
defaults and dtype, and a tokenizer every loader reads back identically that encodes the tasks' prompts exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast, Qwen2ForCausalLM

from es_lightning.builtin.qwen_like import (
    QWEN25_CHAT_TEMPLATE,
    QWEN_VOCAB_SIZE,
    build_qwen_like,
    build_qwen_like_tokenizer,
    special_token_ids,
)
from es_lightning.policy import encode_prompts, load_policy
from es_lightning.tasks import CountdownTask, GSM8KTask

QWEN_SYSTEM = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
GSM8K_QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                  "How many clips did Natalia sell altogether in April and May? (It's $1,234.50 - 10% off!)")


def task_prompts() -> list[str]:
    example = {"nums": [3, 25, 7], "target": 46}
    return [
        CountdownTask().prompt(example),
        CountdownTask(prompt_format="r1", use_chat_template=True).prompt(example),
        CountdownTask(prompt_format="r1").prompt(example),
        GSM8KTask().prompt({"question": GSM8K_QUESTION, "answer": "72"}),
        "<think>\n3 * 7 = 21; 25 + 21 = 46\n</think>\n<answer>25 + 3 * 7</answer> #### 46\n\t~`|{}[]\\^_@!?;'\"",
    ]


def test_real_vocabulary_size_special_ids_and_dims(qwen_like_dir):
    config = AutoConfig.from_pretrained(qwen_like_dir)
    assert config.model_type == "qwen2" and config.vocab_size == QWEN_VOCAB_SIZE == 151_936
    assert config.hidden_size // config.num_attention_heads >= 32  # vLLM's CPU attention
    assert config.num_key_value_heads < config.num_attention_heads  # grouped-query attention, as Qwen2.5
    assert config.tie_word_embeddings and config.bos_token_id == 151643 and config.eos_token_id == 151645
    raw = json.loads((Path(qwen_like_dir) / "config.json").read_text())
    assert raw["torch_dtype"] == "bfloat16"  # the key the hub's Qwen files use
    tok = AutoTokenizer.from_pretrained(qwen_like_dir)
    assert type(tok).__name__ == "Qwen2Tokenizer"
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [151643, 151644, 151645]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    assert len(tok) == 151646 < config.vocab_size  # embedding rows past the tokenizer, as in Qwen2.5
    assert special_token_ids(1024) == {"<|endoftext|>": 731, "<|im_start|>": 732, "<|im_end|>": 733}


def test_generation_config_is_qwen25_instructs(qwen_like_dir):
    gen = json.loads((Path(qwen_like_dir) / "generation_config.json").read_text())
    assert gen["do_sample"] is True
    assert (gen["repetition_penalty"], gen["temperature"], gen["top_k"], gen["top_p"]) == (1.1, 0.7, 20, 0.8)
    assert gen["eos_token_id"] == [151645, 151643] and gen["pad_token_id"] == gen["bos_token_id"] == 151643
    assert gen["pad_token_id"] in gen["eos_token_id"]  # the pad token is also an EOS


def test_loads_as_bf16_fp32_and_auto(qwen_like_small_dir):
    assert load_policy(qwen_like_small_dir, dtype="auto").model.dtype == torch.bfloat16  # from torch_dtype
    fp32 = load_policy(qwen_like_small_dir, dtype="float32").model
    bf16 = load_policy(qwen_like_small_dir, dtype="bfloat16").model
    assert fp32.dtype == torch.float32 and isinstance(fp32, Qwen2ForCausalLM)
    assert fp32.lm_head.weight is fp32.model.embed_tokens.weight  # tied, as Qwen2.5-0.5B/1.5B
    for (name, a), (_, b) in zip(fp32.named_parameters(), bf16.named_parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name  # bf16 on disk: fp32 loading is exact


def test_every_loader_reads_the_same_tokenizer_and_prompts_round_trip(qwen_like_dir):
    """AutoTokenizer (which transformers 5 forces to Qwen2Tokenizer for qwen2 directories), the generic fast tokenizer
    reading tokenizer.json as written, and the in-memory builder give the same ids; text comes back exactly."""
    auto = AutoTokenizer.from_pretrained(qwen_like_dir)
    generic = PreTrainedTokenizerFast(tokenizer_file=str(Path(qwen_like_dir) / "tokenizer.json"))
    built = build_qwen_like_tokenizer()
    for prompt in task_prompts() + ["non-ASCII: é € 数"]:
        ids = auto(prompt)["input_ids"]
        assert ids == generic(prompt)["input_ids"] == built(prompt)["input_ids"], prompt
        assert auto.decode(ids) == prompt
        if prompt.isascii():
            assert ids == list(prompt.encode())  # one token per character, id = byte value
    assert len(auto("é€")["input_ids"]) == 5  # UTF-8 bytes: 2 + 3


def test_chat_template_renders_qwen25s_format(qwen_like_dir):
    tok = AutoTokenizer.from_pretrained(qwen_like_dir)
    assert tok.chat_template.strip() == QWEN25_CHAT_TEMPLATE.strip()
    prompt = task_prompts()[1]
    rendered = load_policy(qwen_like_dir).render_prompts([prompt], use_chat_template=True)[0]
    assert rendered == f"{QWEN_SYSTEM}<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
    ids = encode_prompts(tok, [rendered])["input_ids"][0].tolist()
    assert ids[0] == 151644 and ids.count(151644) == 3 and ids.count(151645) == 2  # special tokens stay whole
    assert ids[-len("assistant\n") - 1 :] == [151644, *b"assistant\n"]
    with_system = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1"}],
                                          tokenize=False, add_generation_prompt=False)
    assert with_system == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1+1<|im_end|>\n"


def test_bos_variant_gets_one_bos_with_or_without_a_template(tmp_path):
    """A tokenizer that adds a BOS (add_bos_token) and a template that writes one: the plain prompt gets the
    tokenizer's BOS, the templated prompt keeps the template's — never two."""
    path = build_qwen_like(tmp_path / "bos", vocab_size=1024, add_bos_token=True)
    policy = load_policy(path)
    bos = policy.tokenizer.bos_token_id
    assert bos == 731 and policy.tokenizer("12")["input_ids"] == [bos, *b"12"]
    plain, templated = "c:3 5>8=", policy.render_prompts(["c:3 5>8="], use_chat_template=True)[0]
    assert templated.startswith("<|endoftext|><|im_start|>system")
    assert policy.tokenizer(templated)["input_ids"][:2] == [bos, bos]  # what plain tokenization would feed the model
    enc = encode_prompts(policy.tokenizer, [plain, templated])
    for row, mask in zip(enc["input_ids"], enc["attention_mask"]):
        ids = row[mask.bool()].tolist()
        assert ids[0] == bos and ids.count(bos) == 1, ids
    assert enc["attention_mask"][0, 0] == 0  # left padding


@pytest.mark.parametrize("model", ["qwen-like", "qwen-like-bos", "builtin"])
def test_repeated_prompts_encode_as_each_prompt_alone_left_padded(model, qwen_like_dir, tmp_path):
    """A population-batched ES step passes its B prompts once per member: encode_prompts tokenizes each distinct prompt
    once. Checked against each prompt encoded on its own, left-padded by hand to the batch's longest."""
    if model == "builtin":
        policy = load_policy("builtin:countdown-tiny")
        texts = [CountdownTask().prompt({"nums": [3, 25, 7], "target": t}) for t in (46, 1, 123)]
    else:
        path = qwen_like_dir if model == "qwen-like" else build_qwen_like(tmp_path / "bos", vocab_size=1024,
                                                                           add_bos_token=True)
        policy = load_policy(path)
        texts = policy.render_prompts(task_prompts()[:3], use_chat_template=True) + task_prompts()[3:]
    prompts = [texts[i] for i in (2, 0, 1, 0, 2, 2, 1, 0)] + texts * 2  # repeats, in no order
    enc = encode_prompts(policy.tokenizer, prompts)
    alone = [encode_prompts(policy.tokenizer, [p])["input_ids"][0].tolist() for p in prompts]
    width = max(map(len, alone))
    pad = policy.tokenizer.pad_token_id
    assert enc["input_ids"].tolist() == [[pad] * (width - len(ids)) + ids for ids in alone]
    assert enc["attention_mask"].tolist() == [[0] * (width - len(ids)) + [1] * len(ids) for ids in alone]
    assert len(set(map(len, alone))) > 1  # the padding is exercised


@pytest.mark.parametrize("vocab_size, hidden, heads", [(200, 64, 2), (1024, 64, 4)])
def test_bad_sizes_are_refused(tmp_path, vocab_size, hidden, heads):
    with pytest.raises(ValueError, match="vocab_size|head_dim"):
        build_qwen_like(tmp_path / "x", vocab_size=vocab_size, hidden_size=hidden, num_attention_heads=heads)


def test_a_task_system_prompt_replaces_the_templates_default_and_is_recorded(qwen_like_small_dir):
    """``system_prompt`` (a Task setting): the system turn before every prompt instead of Qwen's "You are Qwen..."
    default; recorded with the task, so an evaluation of the checkpoint prompts with it; refused without the template."""
    from es_lightning.modules.base import ReasoningModule
    from es_lightning.tasks import get_task
    from es_lightning.tasks.base import task_record

    example = {"question": "What is 2 + 3?", "answer": "5"}
    module = ReasoningModule(model=qwen_like_small_dir, task=GSM8KTask(use_chat_template=True))
    default = module.prompts([example])[0]
    assert default.startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    task = GSM8KTask(use_chat_template=True, system_prompt="Reason step by step.")
    (prompt,) = ReasoningModule(model=qwen_like_small_dir, task=task).prompts([example])
    assert prompt == ("<|im_start|>system\nReason step by step.<|im_end|>\n" + default.split("<|im_end|>\n", 1)[1])
    record = task_record(task)
    assert record["init_args"]["system_prompt"] == "Reason step by step."
    assert get_task(record["class_path"], **record["init_args"]).system_prompt == "Reason step by step."
    with pytest.raises(ValueError, match="system_prompt is a turn of the chat template: set use_chat_template: true"):
        GSM8KTask(system_prompt="Reason step by step.")


#: a chat template that, as Gemma 2's does, refuses a system turn with the template's own raise_exception
NO_SYSTEM_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_refuses_a_system_turn_is_one_line_naming_system_prompt(qwen_like_small_dir, tmp_path):
    """A model whose chat template takes no system turn (Gemma 2) with a task's system_prompt: one ValueError naming
    the template's reason and system_prompt (was jinja2's TemplateError from the first rollout, 20 frames deep)."""
    import shutil

    from es_lightning.modules.base import ReasoningModule

    model = tmp_path / "no-system"
    shutil.copytree(qwen_like_small_dir, model)
    (model / "chat_template.jinja").write_text(NO_SYSTEM_TEMPLATE)
    example = {"question": "What is 2 + 3?", "answer": "5"}
    plain = ReasoningModule(model=str(model), task=GSM8KTask(use_chat_template=True)).prompts([example])[0]
    assert plain.startswith("<|im_start|>user\n")  # the template in use: no system turn of its own
    module = ReasoningModule(model=str(model), task=GSM8KTask(use_chat_template=True, system_prompt="Be brief."))
    with pytest.raises(ValueError, match=r"^the tokenizer's chat template refused the prompt \(a system turn, then one "
                                         r"user turn\): System role not supported; .*remove the task's system_prompt"):
        module.prompts([example])


def test_hf_export_refuses_the_directory_the_model_was_loaded_from(qwen_like_small_dir, tmp_path):
    """dirpath = the model's own directory (a save_pretrained directory looks like a previous export): the export
    would have replaced the base model with the tuned weights. Refused in one line; the directory is untouched."""
    import shutil

    from es_lightning.callbacks import HFExport
    from es_lightning.modules.base import ReasoningModule

    model = tmp_path / "base-model"
    shutil.copytree(qwen_like_small_dir, model)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    module = ReasoningModule(model=str(model), task=GSM8KTask(use_chat_template=True))
    module.configure_model()  # what a fit does first (the weights load lazily)
    with pytest.raises(ValueError, match=r"is the directory the model was loaded from .* the base model would be lost; "
                                         r"choose another directory as dirpath"):
        HFExport(model).export(module)
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before
    HFExport(tmp_path / "elsewhere").export(module)
    assert (tmp_path / "elsewhere" / "config.json").is_file()
