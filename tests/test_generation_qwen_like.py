"""Rollouts on the Qwen-like fixture (real vocabulary size, pad ∈ EOS, Qwen2.5-Instruct's generation defaults):
sampling is ours alone, log-probs equal the training forward's, and completions end where they really ended."""

from __future__ import annotations

import json
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from es_lightning import PassAtKCallback
from es_lightning.callbacks import HFExport
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.modules.base import ReasoningModule
from es_lightning.policy import encode_prompts, load_policy
from es_lightning.tasks import CountdownTask

EXAMPLES = [{"nums": [3, 25, 7], "target": 46}, {"nums": [12, 4], "target": 3}, {"nums": [1, 2, 3, 4], "target": 24}]


def _prompts(policy) -> list[str]:
    task = CountdownTask(prompt_format="r1", use_chat_template=True)
    return policy.render_prompts([task.prompt(e) for e in EXAMPLES], use_chat_template=True)


def _forward(model, rollout, temperature):
    """Log-prob and entropy of every completion token from one plain forward over prompt + completion (fp32)."""
    ids = torch.cat([rollout.prompt_ids, rollout.completion_ids], 1)
    mask = torch.cat([rollout.prompt_mask, rollout.completion_mask], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    C = rollout.completion_ids.shape[1]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=C + 1).logits.float()
    logp = torch.log_softmax(logits[:, :-1] / temperature, -1)  # [N, C, V]
    chosen = logp.gather(-1, rollout.completion_ids.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp.exp() * logp).sum(-1)
    return chosen * rollout.completion_mask, entropy * rollout.completion_mask


def _copy_with_generation_config(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    file = dst / "generation_config.json"
    file.write_text(json.dumps(edit(json.loads(file.read_text())), indent=2))
    return str(dst)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_equal_the_training_forward_despite_qwen_defaults(qwen_like_dir, temperature):
    """Qwen's repetition_penalty 1.1 / top_k 20 / top_p 0.8 / T 0.7 sit in generation_config.json; the recorded
    log-probs are still the policy's own at the rollout's temperature (fp32, V = 151,936)."""
    policy = load_policy(qwen_like_dir, dtype="float32")
    assert policy.model.generation_config.repetition_penalty == 1.1
    rollout = HFGenerator(policy).generate(_prompts(policy), 2, SamplingParams(max_new_tokens=12, temperature=temperature),
                                           seed=1, return_logprobs=True)
    assert not rollout.prompt_mask.all(), "prompts of different lengths exercise left padding"
    logp, entropy = _forward(policy.model, rollout, temperature)
    assert (rollout.logprobs - logp).abs().max() < 1e-5
    assert (rollout.entropy - entropy).abs().max() < 1e-4  # ~12 nats summed over 151,936 terms in fp32
    assert rollout.completion_ids.max() >= 256, "an untrained Qwen-like model samples from the whole vocabulary"


def test_checkpoint_generation_defaults_never_apply(qwen_like_small_dir, tmp_path):
    """The same weights with Qwen's defaults, with none, and with every None-neutral field set hostile: identical
    tokens, log-probs and Pass@K, greedy and sampled — while plain ``generate`` does feel the defaults."""
    hostile = dict(suppress_tokens=[65, 66], begin_suppress_tokens=[67], bad_words_ids=[[68]], no_repeat_ngram_size=1,
                   min_new_tokens=20, forced_eos_token_id=733, renormalize_logits=True)
    dirs = {
        "qwen": qwen_like_small_dir,
        "bare": _copy_with_generation_config(qwen_like_small_dir, tmp_path / "bare", lambda g: {
            k: g[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}),
        "hostile": _copy_with_generation_config(qwen_like_small_dir, tmp_path / "hostile", lambda g: {**g, **hostile}),
    }
    task = CountdownTask(prompt_format="r1", use_chat_template=True)
    results = {}
    for name, path in dirs.items():
        module = ReasoningModule(model=path, task=task)
        before = module.policy.model.generation_config.to_dict()
        runs = [module.evaluate_batch(EXAMPLES, 4, SamplingParams(max_new_tokens=16, temperature=t), seed=5).rollout
                for t in (0.0, 1.0, 0.7)]
        evaluation = PassAtKCallback(num_samples=4, ks=(1, 4), temperature=0.7, max_new_tokens=16).evaluate_examples(
            module, EXAMPLES)
        assert module.policy.model.generation_config.to_dict() == before  # the checkpoint's config is left as it was
        results[name] = (runs, evaluation)
    ref_runs, ref_eval = results["bare"]
    for name in ("qwen", "hostile"):
        runs, evaluation = results[name]
        assert evaluation == ref_eval, name
        for run, ref in zip(runs, ref_runs):
            assert torch.equal(run.completion_ids, ref.completion_ids), name
            assert torch.equal(run.completion_mask, ref.completion_mask) and run.texts == ref.texts, name
            assert torch.equal(run.logprobs, ref.logprobs), name

    # the check can fail: transformers' own greedy decoding does apply what the hostile checkpoint asks for
    greedy = ref_runs[0]
    C = greedy.completion_ids.shape[1]
    ours = greedy.completion_ids.masked_fill(greedy.completion_mask == 0, 731)
    plain = {}
    for name in ("bare", "hostile"):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # transformers warns about the hostile min_new_tokens
            plain[name] = load_policy(dirs[name]).model.generate(
                input_ids=greedy.prompt_ids, attention_mask=greedy.prompt_mask, do_sample=False, max_new_tokens=16,
                pad_token_id=731)[:, -C:]
    assert torch.equal(plain["bare"], ours)  # without defaults, transformers' greedy decoding is ours
    assert not torch.equal(plain["hostile"], ours)  # with them, it is not


def test_hf_export_writes_the_checkpoints_generation_config_back(qwen_like_small_dir, tmp_path):
    module = ReasoningModule(model=qwen_like_small_dir, task="countdown")
    module.evaluate_batch(EXAMPLES[:1], 2, SamplingParams(max_new_tokens=4), seed=0)  # a rollout first
    HFExport(tmp_path / "export").export(module)
    original = json.loads((Path(qwen_like_small_dir) / "generation_config.json").read_text())
    exported = json.loads((tmp_path / "export" / "generation_config.json").read_text())
    drop = {"transformers_version"}
    assert {k: v for k, v in exported.items() if k not in drop} == {k: v for k, v in original.items() if k not in drop}


def _stop_index(tokenizer, ids: list[int], stop: str) -> int | None:
    """First position whose token completes ``stop`` in the decoded text (an independent re-reading of the tokens)."""
    for t in range(len(ids)):
        if stop in tokenizer.decode(ids[: t + 1], skip_special_tokens=True):
            return t
    return None


def test_rows_ended_by_a_stop_string_count_no_forced_pad(qwen_like_small_dir):
    """pad <|endoftext|> ∈ EOS: after a stop string ``generate`` writes pads that look like a sampled EOS. Mask,
    lengths, log-probs, entropy and ``truncated`` must end at the stop token."""
    policy = load_policy(qwen_like_small_dir)
    pad, eos = policy.tokenizer.pad_token_id, {731, 733}
    assert pad in eos
    stop = "<f7"  # completed by any filler token <f7...>: a random model hits it within a few tokens
    rollout = HFGenerator(policy).generate(["c:3 5 7>22="] * 12, 2, SamplingParams(max_new_tokens=20, stop=[stop]),
                                           seed=0, return_logprobs=True)
    stopped = 0
    for ids, mask, trunc, logp, ent in zip(rollout.completion_ids, rollout.completion_mask, rollout.truncated,
                                           rollout.logprobs, rollout.entropy):
        n = int(mask.sum())
        assert mask[:n].all() and not mask[n:].any()
        at = _stop_index(policy.tokenizer, ids.tolist(), stop)
        if at is not None and not (set(ids[:at].tolist()) & eos):
            stopped += 1
            assert n == at + 1 and not trunc  # the stop token is the last one counted
            assert (ids[n:] == pad).all() and (logp[n:] == 0).all() and (ent[n:] == 0).all()
            assert (logp[:n] < 0).all() and (ent[:n] > 0).all()
    assert stopped >= 5, stopped


def test_rows_ended_by_eos_include_it_and_truncation_is_exact(qwen_like_small_dir):
    policy = load_policy(qwen_like_small_dir)
    eos = torch.tensor([731, 733])
    rollout = HFGenerator(policy).generate(["c:3 5 7>22="] * 64, 2, SamplingParams(max_new_tokens=32), seed=0)
    ended_by_eos = 0
    for ids, mask, trunc in zip(rollout.completion_ids, rollout.completion_mask, rollout.truncated):
        n = int(mask.sum())
        hits = torch.isin(ids[:n], eos).nonzero().flatten().tolist()
        if hits:
            ended_by_eos += 1
            assert hits == [n - 1] and not trunc  # the sampled EOS is the last counted token, and the only one
        else:
            assert trunc and n == 32
    assert ended_by_eos >= 3, ended_by_eos  # ~2/1024 per token over 4096 tokens


def test_templated_prompts_reach_the_model_with_one_bos(tmp_path):
    from es_lightning.builtin.qwen_like import build_qwen_like

    policy = load_policy(build_qwen_like(tmp_path / "bos", vocab_size=1024, add_bos_token=True))
    prompts = [*_prompts(policy), "c:3 5 7>22="]
    rollout = HFGenerator(policy).generate(prompts, 1, SamplingParams(max_new_tokens=2), seed=0)
    bos = policy.tokenizer.bos_token_id
    for ids, mask in zip(rollout.prompt_ids, rollout.prompt_mask):
        real = ids[mask.bool()].tolist()
        assert real[0] == bos and real.count(bos) == 1
    assert torch.equal(rollout.prompt_ids, encode_prompts(policy.tokenizer, prompts)["input_ids"])


def _gsm8k_with_a_long_problem(directory: Path, repeats: int = 9000) -> Path:
    """train.jsonl / test.jsonl in openai/gsm8k's columns, each with one problem of ~36k tokens: past the Qwen-like
    fixture's 32,768 positions (a 54k-token prompt of a Qwen model ran to an out-of-memory traceback)."""
    directory.mkdir()
    short = {"question": "Natalia sold 48 clips in April and half as many in May. How many in all?",
             "answer": "48 + 24 = 72\n#### 72"}
    long = {"question": "Add these up: " + "1 + " * repeats + "1. What is the sum?", "answer": f"#### {repeats + 1}"}
    for split in ("train", "test"):
        (directory / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in (short, long)))
    return directory


def test_a_prompt_past_the_positions_stops_a_fit_in_one_line(qwen_like_small_dir, tmp_path):
    """A GRPO fit whose batch holds a prompt longer than the model's max_position_embeddings: one warning, then
    generation of it (an out-of-memory traceback at Qwen's sizes). Now the fit refuses it at its start, before anything
    is generated, naming how many rows, the first one's row in the data, its token count (chat template included), the
    limit and the fixes; so does an ES fit, and ``trainer.test`` / ``validate`` before their first batch."""
    import lightning as L

    from es_lightning import ESModule, GRPOModule, ReasoningDataModule

    source = _gsm8k_with_a_long_problem(tmp_path / "gsm8k")
    for module in (GRPOModule(model=qwen_like_small_dir, task="gsm8k", group_size=2, max_new_tokens=4),
                   ESModule(model=qwen_like_small_dir, task="gsm8k", population_size=2, max_new_tokens=4)):
        data = ReasoningDataModule(task="gsm8k", source=str(source), train_size=None, val_size=0, test_size=0,
                                   batch_size=2)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            num_sanity_val_steps=0)
        with pytest.raises(ValueError, match=r"^1 of the 2 train prompts has 32768 tokens or more, and the model's "
                                             r"max_position_embeddings is 32768: no room for a completion; the first is "
                                             r"row 1 \(counting from 0\) of the 'train' split of data.source '.*gsm8k' "
                                             r"\(3\d{4} tokens as prompted\); shorten the prompts .*, or remove those "
                                             r"rows from the data$"):
            trainer.fit(module, data)
    data = ReasoningDataModule(task="gsm8k", source=str(source), train_size=None, val_size=0, test_size=None)
    with pytest.raises(ValueError, match=r"^1 of the 2 test prompts has 32768 tokens or more, .* the first is row 1 "
                                         r"\(counting from 0\) of the 'test' split of data.source '.*gsm8k' \(3\d{4} "
                                         r"tokens as prompted\);"):  # it said "prompt 1 of this batch", at that batch
        L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False).test(module, data)


def test_eval_of_a_prompt_past_the_positions_is_one_line(qwen_like_small_dir, tmp_path, capsys):
    """``es-lightning eval`` of a data set with a problem past the model's positions: one line naming its row in the
    file (it named "prompt 1 of this batch"), before anything is generated, exit 2."""
    from es_lightning.cli import cli_main

    source = _gsm8k_with_a_long_problem(tmp_path / "gsm8k")
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--checkpoints", qwen_like_small_dir, "--tasks", "gsm8k", "--eval.source", str(source),
                  "--eval.num_problems", "2", "--eval.num_samples", "1", "--eval.max_new_tokens", "4",
                  "--out_dir", str(tmp_path / "eval"), "--progress", "false", "--plot", "false"])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert re.fullmatch(r"es-lightning eval: error: 1 of the 2 problems has 32768 tokens or more, and the model's "
                        r"max_position_embeddings is 32768: no room for a completion; the first is row 1 \(counting from "
                        rf"0\) of the 'test' split of --eval.source '{re.escape(str(source))}' \(3\d{{4}} tokens as "
                        r"prompted\); shorten the prompts \(the task's prompt format or system_prompt\), or remove those "
                        r"rows from the data", err), err
