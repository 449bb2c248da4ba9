"""The built-in model: it loads through the real loading path, it answers Countdown, and the recipe that made it trains
and exports a directory that loads back bit for bit."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2ForCausalLM

from es_lightning.builtin import CHARSET, build_char_tokenizer
from es_lightning.builtin.pretrain import IGNORE_INDEX, PretrainDataModule, SFTModule
from es_lightning.callbacks.export import HFExport
from es_lightning.data import in_heldout_pool, procedural_split
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.policy import load_policy, save_model
from es_lightning.tasks import CountdownTask

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are tiny: intra-op threads only add synchronisation, which a busy shared CPU turns into
    seconds per step (measured: 20 SFT steps take 17 s with 2 threads under load, 0.8 s with one)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_module(**overrides) -> SFTModule:
    kwargs = dict(
        hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64, lr=3e-3, warmup_steps=2
    )
    return SFTModule(**{**kwargs, **overrides})


def test_builtin_model_loads_through_load_policy():
    policy = load_policy("builtin:countdown-tiny")
    assert isinstance(policy.model, Qwen2ForCausalLM)
    assert policy.model.config.model_type == "qwen2"
    assert policy.model.config.vocab_size == len(policy.tokenizer) == len(build_char_tokenizer())
    assert policy.tokenizer.eos_token_id == policy.model.generation_config.eos_token_id == 1
    assert policy.tokenizer.pad_token_id == 0
    # the loaded tokenizer (transformers picks Qwen2Tokenizer for a qwen2 config) must give the char tokenizer's ids:
    # <pad> <eos> <unk>, then one id per character of CHARSET in order (a dropped space would shift them)
    expected_ids = list(range(3, 3 + len(CHARSET)))
    assert policy.tokenizer(CHARSET)["input_ids"] == build_char_tokenizer()(CHARSET)["input_ids"] == expected_ids
    prompt = "c:3 5 7>22="
    ids = policy.tokenizer(prompt)["input_ids"]
    assert len(ids) == len(prompt)  # one token per character (spaces included), no special tokens added
    assert policy.tokenizer.decode(ids + [policy.tokenizer.eos_token_id], skip_special_tokens=True) == prompt
    assert sum(p.numel() for p in policy.model.parameters()) < 2_000_000


def test_builtin_model_answers_heldout_countdown_greedily():
    policy = load_policy("builtin:countdown-tiny")
    task = CountdownTask(prompt_format="compact")
    problems = procedural_split(task, "test", 16, seed=123)
    rollout = HFGenerator(policy).generate(
        [task.prompt(p) for p in problems], num_samples=1, params=SamplingParams(max_new_tokens=24, temperature=0.0)
    )
    extractable = sum(task.extract_answer(t) is not None for t in rollout.texts)
    assert extractable >= len(problems) // 2, rollout.texts
    assert not rollout.truncated.any(), "the model should end its answers with EOS"


def test_pretrain_data_uses_train_pool_and_masks_the_prompt():
    dm = PretrainDataModule(tasks={"countdown": 0.5, "addition": 0.25, "sort": 0.25}, num_examples=64, val_size=4,
                            batch_size=16)
    dm.setup()
    assert {task.name for task, _ in dm.train_items} == {"countdown", "addition", "sort"}
    assert all(not in_heldout_pool(task.prompt(ex)) for task, ex in dm.train_items)
    assert all(in_heldout_pool(task.prompt(ex)) for items in dm.val_items.values() for task, ex in items)
    batch = next(iter(dm.train_dataloader()))
    tok = dm.collate.tokenizer
    for ids, labels, mask in zip(batch["input_ids"], batch["labels"], batch["attention_mask"]):
        text = tok.decode(ids[mask.bool()], skip_special_tokens=True)
        completion = tok.decode(labels[labels != IGNORE_INDEX], skip_special_tokens=True)
        assert text.endswith("=" + completion)  # loss on the completion only …
        assert labels[labels != IGNORE_INDEX][-1] == tok.eos_token_id  # … which ends with EOS


def test_countdown_targets_are_redrawn_among_solutions():
    dm = PretrainDataModule(tasks=["countdown"], num_examples=400, val_size=0, batch_size=8)
    dm.setup()
    index = next(i for i, (_, ex) in enumerate(dm.train_items) if ex["num_solutions"] >= 3)
    dataset = dm.train_dataloader().dataset
    served = {dataset[index][2] for _ in range(40)}
    assert len(served) >= 2 and served <= set(dm.train_items[index][1]["solutions"])


class _LossRecorder(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny SFT run with a real Trainer, exported by HFExport."""
    out = tmp_path_factory.mktemp("export") / "tiny"
    torch.manual_seed(0)
    module = tiny_module()
    dm = PretrainDataModule(tasks={"countdown": 0.5, "addition": 0.5}, num_examples=512, val_size=0, batch_size=32)
    recorder = _LossRecorder()
    trainer = L.Trainer(
        max_steps=20,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[recorder, HFExport(out)],
    )
    trainer.fit(module, dm)
    return module, out, recorder.losses


def test_sft_loss_drops(trained):
    _, _, losses = trained
    assert len(losses) == 20
    assert sum(losses[-3:]) / 3 < 0.8 * sum(losses[:3]) / 3, losses


def test_hf_export_loads_back_with_identical_logits(trained):
    module, out, _ = trained
    assert not list(out.parent.glob(".tiny.*")), "no temporary directories left behind"
    texts = ["c:3 5 7>22=3*5+7", "s:42 7 19=7 19 42"]
    policy = load_policy(str(out))
    batch = policy.tokenizer(texts, return_tensors="pt", padding=True)
    assert torch.equal(batch["input_ids"], module.tokenizer(texts, return_tensors="pt", padding=True)["input_ids"])
    module.eval()
    with torch.no_grad():
        expected = module(batch["input_ids"], batch["attention_mask"])
        hf = AutoModelForCausalLM.from_pretrained(out).eval()
        assert torch.equal(hf(**batch).logits, expected)
        assert torch.equal(policy.model(**batch).logits, expected)


def test_hf_export_replaces_atomically_and_keeps_the_model_card(tmp_path):
    target = tmp_path / "model"
    first, second = tiny_module(seed=1), tiny_module(seed=2)
    HFExport(target).export(first)
    (target / "README.md").write_text("card")
    HFExport(target).export(second)
    assert (target / "README.md").read_text() == "card"
    reloaded = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(reloaded.model.embed_tokens.weight, second.model.model.embed_tokens.weight)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    second.model.save_pretrained = broken  # a crash mid-export must leave the previous export untouched
    with pytest.raises(OSError, match="disk full"):
        HFExport(target).export(second)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    assert torch.equal(AutoModelForCausalLM.from_pretrained(target).model.embed_tokens.weight,
                       reloaded.model.embed_tokens.weight)


def test_hf_export_keep_files_takes_one_name_as_a_string(tmp_path):
    """``keep_files="NOTES.md"`` is that one file; it was iterated character by character (files "N", "O", …) and the
    notes were lost at the next export."""
    target = tmp_path / "export"
    for seed in (1, 2):
        trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            callbacks=[HFExport(target, keep_files="NOTES.md")])
        trainer.fit(tiny_module(seed=seed), PretrainDataModule(tasks={"countdown": 1.0}, num_examples=16, val_size=0,
                                                                batch_size=8))
        if seed == 1:
            (target / "NOTES.md").write_text("notes")
    assert (target / "NOTES.md").read_text() == "notes"


@pytest.mark.parametrize("name", ["/home/me/card.md", "../card.md", "docs/card.md", ".."])
def test_hf_export_keep_files_refuses_a_path(tmp_path, name):
    """``keep_files`` names files of the previous export; a path was joined to the export directory: an absolute one
    or one with ``..`` (a model card kept elsewhere) was then copied onto itself — ``SameFileError`` at the end of the
    fit, after all the training — and one into a folder never found. Refused at construction, in one line."""
    with pytest.raises(ValueError, match=r"^HFExport: keep_files names files of the previous export to carry over into "
                                         rf"the next, by their plain names \(README.md\), got '{re.escape(name)}'; copy"):
        HFExport(tmp_path / "export", keep_files=["README.md", name])


def test_recover_exports_puts_back_the_newest_complete_previous_export(tmp_path):
    """Several ``.export.old-*`` (random suffixes: their names say nothing of their order) and no ``export``: the newest
    complete one comes back — a half-deleted newer one, or an older whole one, sorted first and was restored. None
    complete: refused in one line naming them and the fix, nothing touched."""
    from es_lightning.callbacks.export import recover_exports

    target = tmp_path / "export"
    modules = {}
    for suffix, seed in (("aaaa", 1), ("zzzz", 2), ("0000", 3)):  # written in this order: 0000 is the newest
        modules[suffix] = tiny_module(seed=seed)
        HFExport(target).export(modules[suffix])
        target.rename(tmp_path / f".export.old-{suffix}")
    (tmp_path / ".export.old-0000" / "model.safetensors").unlink()  # its removal was cut short
    recover_exports(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    restored = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(restored.model.embed_tokens.weight, modules["zzzz"].model.model.embed_tokens.weight)

    target.rename(tmp_path / ".export.old-b")
    (tmp_path / ".export.old-b" / "model.safetensors").unlink()
    (tmp_path / ".export.old-a").mkdir()
    with pytest.raises(ValueError, match=r"export' is missing and the previous exports a kill left beside it "
                                         r"\(\.export\.old-a, \.export\.old-b\) are all incomplete; move the one") as err:
        recover_exports(tmp_path)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export.old-a", ".export.old-b"]


class Killed(BaseException):
    """The process died here."""


def export_killed(monkeypatch, target: Path, module: SFTModule, at: str) -> None:
    """``HFExport(target).export(module)`` killed at ``at`` — "tokenizer" (while it is written), "weights" (halfway
    through model.safetensors), "dtype" (the weights whole, before save_model adds torch_dtype to config.json), "chmod"
    (before the export is made readable), "swap" (between the swap's two renames):
    the directory a kill there leaves, nothing after it run (the export's clean-up neither)."""
    from es_lightning.callbacks import export

    def kill(*args, **kwargs):
        for mod, name in ((os, "replace"), (os, "chmod"), (shutil, "rmtree")):
            patch.setattr(mod, name, kill)
        raise Killed

    def cut_weights(model, path, state_dict=None):
        save_model(model, path, state_dict)
        weights = Path(path) / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        kill()

    replace, write_text = os.replace, Path.write_text
    with monkeypatch.context() as patch:
        if at == "tokenizer":
            patch.setattr(export, "save_tokenizer", kill)
        elif at == "weights":
            patch.setattr(export, "save_model", cut_weights)
        elif at == "dtype":
            patch.setattr(Path, "write_text", lambda path, *args, **kwargs: kill() if path.name == "config.json" else
                          write_text(path, *args, **kwargs))
        elif at == "chmod":
            patch.setattr(os, "chmod", kill)
        else:  # the second rename: the new export (the tmp) to the target
            patch.setattr(os, "replace", lambda src, dst: kill() if ".tmp-" in Path(src).name else replace(src, dst))
        with pytest.raises(Killed):
            HFExport(target).export(module)


def test_recover_exports_puts_in_place_a_finished_export_a_kill_left(tmp_path, monkeypatch):
    """A kill between the swap's two renames (the previous export moved to ``.export.old-*``, the new one finished in
    ``.export.tmp-*``) got the older export put back and the finished newer one deleted: the newer one is put in place.
    A first export killed after it was written (before its rename) is put in place, readable; one killed while the
    tokenizer or the weights were written is removed — as is one killed with its weights whole before ``torch_dtype``
    was added to its config.json (transformers 4 read it as fp32), which was put in place — and an unfinished one
    beside a previous export."""
    from es_lightning.callbacks.export import _is_whole_weights, recover_exports

    def embeddings():
        return AutoModelForCausalLM.from_pretrained(target).model.embed_tokens.weight

    target = tmp_path / "export"
    first, second, third = tiny_module(seed=1), tiny_module(seed=2), tiny_module(seed=3)
    for at in ("tokenizer", "weights", "dtype"):
        export_killed(monkeypatch, target, first, at)
        assert [p.name.startswith(".export.tmp-") for p in tmp_path.iterdir()] == [True]
        if at == "dtype":  # the weights whole, config.json with transformers 5's dtype alone
            left = next(tmp_path.iterdir())
            config = json.loads((left / "config.json").read_text())
            assert _is_whole_weights(left / "model.safetensors") and "dtype" in config and "torch_dtype" not in config
        recover_exports(tmp_path)
        assert list(tmp_path.iterdir()) == []
    export_killed(monkeypatch, target, first, "chmod")
    recover_exports(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert target.stat().st_mode & 0o777 == 0o755 and {p.stat().st_mode & 0o777 for p in target.iterdir()} == {0o644}
    assert torch.equal(embeddings(), first.model.model.embed_tokens.weight)
    assert load_policy(str(target)).tokenizer("c:3 5").input_ids == first.tokenizer("c:3 5").input_ids

    (target / "README.md").write_text("card")
    export_killed(monkeypatch, target, second, "weights")  # unfinished beside the previous export: removed
    export_killed(monkeypatch, target, third, "swap")
    left = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    assert left == [".export.old", ".export.tmp", ".export.tmp"]  # the first moved aside, the second and third
    recover_exports(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert torch.equal(embeddings(), third.model.model.embed_tokens.weight)
    assert (target / "README.md").read_text() == "card"

    export_killed(monkeypatch, target, second, "weights")  # the previous export there: it stays
    recover_exports(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
    assert torch.equal(embeddings(), third.model.model.embed_tokens.weight)


def test_recover_exports_of_a_dirpath_whose_name_has_glob_characters(tmp_path, monkeypatch):
    """``dirpath: runs/export[1]``: the leftovers of a kill (``.export[1].tmp-*``) were looked for with the name as a
    glob pattern, which ``[1]`` does not match: a finished first export was never put in place (nor any leftover
    removed, gigabytes at 1.5B), and ``.export1.tmp-*``, which it matches, was deleted. The name is matched as it
    is."""
    from es_lightning.callbacks.export import recover_exports

    target, module = tmp_path / "export[1]", tiny_module(seed=1)
    export_killed(monkeypatch, target, module, "chmod")
    (tmp_path / ".export1.tmp-x").mkdir()  # what the pattern matched: not this export's
    recover_exports(tmp_path, target.name)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".export1.tmp-x", "export[1]"]
    restored = AutoModelForCausalLM.from_pretrained(target)
    assert torch.equal(restored.model.embed_tokens.weight, module.model.model.embed_tokens.weight)


def test_recover_exports_of_a_symlinked_dirpath(tmp_path, monkeypatch):
    """``dirpath`` a symlink (``runs/export`` → a scratch disk's ``big/model``): an export writes beside the link's
    target, where a kill between the swap's renames leaves ``.model.old-*`` and the finished ``.model.tmp-*``; recovery
    looked beside the link, found nothing, and left the link dangling (the newer export never put in place) and both
    model copies on the disk for good. It is recovered where the link points."""
    from es_lightning.callbacks.export import recover_exports

    (tmp_path / "runs").mkdir()
    (tmp_path / "big").mkdir()
    link = tmp_path / "runs" / "export"
    link.symlink_to(tmp_path / "big" / "model")
    first, second = tiny_module(seed=1), tiny_module(seed=2)
    HFExport(link).export(first)
    export_killed(monkeypatch, link, second, "swap")
    assert not link.exists() and len(list((tmp_path / "big").iterdir())) == 2
    recover_exports(link.parent, link.name)  # as HFExport's setup calls it
    assert sorted(p.name for p in (tmp_path / "big").iterdir()) == ["model"] and link.is_symlink()
    restored = AutoModelForCausalLM.from_pretrained(link)
    assert torch.equal(restored.model.embed_tokens.weight, second.model.model.embed_tokens.weight)


def test_hf_export_refuses_a_directory_it_would_wipe(tmp_path):
    """An export replaces its whole directory: pointed at a folder of other files (a home directory, a data folder, a
    downloaded hub model with its .cache/), it deleted them all. A fit is refused at setup, before any step, and an
    export() outside a fit before writing — in one line naming what is there and the fix; the files stay."""
    mine = tmp_path / "mywork"
    (mine / "data").mkdir(parents=True)
    (mine / "notes.txt").write_text("keep me")
    (mine / "data" / "train.jsonl").write_text("{}\n")
    before = sorted(p.relative_to(mine) for p in mine.rglob("*"))
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        callbacks=[HFExport(mine)])
    dm = PretrainDataModule(tasks={"countdown": 1.0}, num_examples=32, val_size=0, batch_size=8)
    module = tiny_module()
    with pytest.raises(ValueError, match=r"is not a Hugging Face export: it holds data/, notes\.txt, .* choose a new or "
                                         r"empty directory as dirpath") as err:
        trainer.fit(module, dm)
    assert "\n" not in str(err.value) and trainer.global_step == 0
    with pytest.raises(ValueError, match="is not a Hugging Face export"):
        HFExport(mine).export(module)
    file = tmp_path / "model.bin"
    file.write_text("x")
    with pytest.raises(ValueError, match="is a file, and an export is a directory"):
        HFExport(file).export(module)
    assert sorted(p.relative_to(mine) for p in mine.rglob("*")) == before and (mine / "notes.txt").read_text() == "keep me"
    assert file.read_text() == "x"
    (tmp_path / "empty").mkdir()
    HFExport(tmp_path / "empty").export(module)  # an empty directory, or a previous export, is written
    HFExport(tmp_path / "empty").export(module)
    assert (tmp_path / "empty" / "config.json").is_file()


def test_pretrain_recipe_parses():
    from es_lightning.cli import ESLightningCLI

    cli = ESLightningCLI(
        args=["--config", str(ROOT / "recipes/builtin/pretrain.yaml"), "--trainer.logger", "false"], run=False
    )
    assert isinstance(cli.model, SFTModule) and isinstance(cli.datamodule, PretrainDataModule)
    assert any(isinstance(c, HFExport) for c in cli.trainer.callbacks)
    assert cli.model.num_parameters < 2_000_000


def test_recover_exports_of_a_bf16_qwen_like_export(qwen_like_dir, tmp_path, monkeypatch):
    """The recovery on what a user's Qwen2.5 run exports: bf16 weights at the real vocabulary size (transformers 5 writes
    ``dtype`` alone to config.json, save_model adds ``torch_dtype`` after the weights), a chat template, a pad token
    that is one of the model's EOS ids. A ``.export.tmp-*`` killed with its weights whole before ``torch_dtype`` was
    added (transformers 4 and older vLLM read it as fp32), newer than the previous export moved aside to
    ``.export.old-*``, is removed and the previous export put back; a finished bf16 ``.export.tmp-*`` (a kill between
    the swap's renames) is put in place. Each loads in bf16 with the tokenizer as exported."""
    from transformers import AutoTokenizer

    from es_lightning import ESModule
    from es_lightning.builtin.qwen_like import QWEN25_CHAT_TEMPLATE, QWEN_VOCAB_SIZE
    from es_lightning.callbacks.export import _is_whole_weights, recover_exports

    def policy(seed):
        module = ESModule(model=qwen_like_dir, task=CountdownTask(use_chat_template=True), dtype="bfloat16")
        module.configure_model()
        with torch.no_grad():  # weights of its own: which export came back is told by them
            module.model.model.norm.weight.add_(seed)
        return module

    def check_restored(module):
        assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
        config = json.loads((target / "config.json").read_text())
        assert config["dtype"] == config["torch_dtype"] == "bfloat16" and config["vocab_size"] == QWEN_VOCAB_SIZE
        model = AutoModelForCausalLM.from_pretrained(target)  # transformers 5 reads the file's dtype
        assert model.dtype == torch.bfloat16 and model.lm_head.weight is model.model.embed_tokens.weight
        for (name, a), (_, b) in zip(model.named_parameters(), module.model.named_parameters()):
            assert torch.equal(a, b), name
        tokenizer = AutoTokenizer.from_pretrained(target)
        assert tokenizer.chat_template == QWEN25_CHAT_TEMPLATE
        assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
        assert tokenizer.pad_token_id in model.generation_config.eos_token_id
        loaded = load_policy(str(target), dtype="auto")
        assert loaded.model.dtype == torch.bfloat16
        assert loaded.render_prompts(["3 + 4"], use_chat_template=True) == \
            module.policy.render_prompts(["3 + 4"], use_chat_template=True)

    target = tmp_path / "export"
    first, second, third = policy(0), policy(1), policy(2)
    HFExport(target).export(first)
    os.replace(target, tmp_path / ".export.old-k3x9")  # the previous export moved aside, as by _swap_in's first rename
    export_killed(monkeypatch, target, second, "dtype")
    left = next(p for p in tmp_path.iterdir() if p.name.startswith(".export.tmp-"))
    config = json.loads((left / "config.json").read_text())
    assert config["dtype"] == "bfloat16" and "torch_dtype" not in config and _is_whole_weights(left / "model.safetensors")
    assert (left / "config.json").stat().st_mtime_ns >= (tmp_path / ".export.old-k3x9" / "config.json").stat().st_mtime_ns
    recover_exports(tmp_path)
    check_restored(first)

    export_killed(monkeypatch, target, third, "swap")  # the first moved aside, the third finished in .export.tmp-*
    assert sorted(p.name.split("-")[0] for p in tmp_path.iterdir()) == [".export.old", ".export.tmp"]
    recover_exports(tmp_path)
    check_restored(third)
    assert target.stat().st_mode & 0o777 == 0o755 and {p.stat().st_mode & 0o777 for p in target.iterdir()} == {0o644}
