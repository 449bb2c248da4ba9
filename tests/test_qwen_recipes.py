"""Every real-model recipe runs (issue 11, item 8), through ``es-lightning fit`` in a subprocess as a user runs it:
``recipes/qwen2.5-1.5b-instruct/gsm8k/{es,grpo,grpo_es}.yaml`` for 2 steps with only the model pointed at the Qwen-like
fixture (the real vocabulary size, bf16, Qwen's chat template and generation defaults) and sizes shrunk — GSM8K from a
local jsonl in the hub's format, the switch of grpo_es at step 1, the recipe's own evaluation and HFExport, whose
directory loads in plain transformers.

And ``es-lightning analyze compare --budget time`` on these recipes — the equal-wall-clock comparison a GPU user runs
to judge ES against GRPO on their model — in this process, with the same fixture and local GSM8K.

And HFExport under FSDP2 (``configs/trainer/fsdp2_cpu.yaml``, 2 processes): the export holds the full weights, equal to
the consolidated distributed checkpoint of the same run (``torch.distributed.checkpoint``'s own gather), not a shard.
"""

from __future__ import annotations

import csv
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from es_helpers import teardown_bomb
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
QWEN = ROOT / "recipes" / "qwen2.5-1.5b-instruct" / "gsm8k"
EXE = [sys.executable, "-m", "es_lightning.cli"]


def _run(args, cwd, timeout=900, pythonpath=()):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([*pythonpath, str(ROOT)])}
    return subprocess.run(EXE + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _gsm8k(directory: Path) -> Path:
    """train.jsonl / test.jsonl in openai/gsm8k's columns: ``question``, ``answer`` ending in ``#### <n>``."""
    directory.mkdir()
    rng = random.Random(0)
    for split, n in (("train", 16), ("test", 8)):
        with open(directory / f"{split}.jsonl", "w") as f:
            for _ in range(n):
                a, b = rng.randint(2, 60), rng.randint(2, 60)
                f.write(json.dumps({
                    "question": f"Natalia sold clips to {a} friends in April and to {b} in May. How many in all?",
                    "answer": f"She sold {a} + {b} = <<{a}+{b}={a + b}>>{a + b} clips.\n#### {a + b}",
                }) + "\n")
    return directory


def _shrunk_callbacks(recipe: Path, tmp_path: Path) -> Path:
    """The recipe's own callbacks with their sizes shrunk and the export under tmp_path (a list is replaced whole by a
    later config, so the list is restated)."""
    callbacks = yaml.safe_load(recipe.read_text())["trainer"]["callbacks"]
    for cb in callbacks:
        args = cb.setdefault("init_args", {}) or {}
        cb["init_args"] = args
        kind = cb["class_path"].rsplit(".", 1)[-1]
        if kind == "PassAtKCallback":
            args.update(num_samples=2, ks=[1, 2], max_new_tokens=8, batch_size=2, every_n_train_steps=2)
        elif kind == "SequentialStrategy":
            args["switch_step"] = 1
            args["es"]["population_size"] = 2
        elif kind == "HFExport":
            args["dirpath"] = str(tmp_path / "export")
    path = tmp_path / "shrink.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"callbacks": callbacks}}))
    return path


def _metrics(logs: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(open(next(logs.rglob("metrics.csv")))))


@pytest.mark.parametrize("name", ["es", "es_lowrank", "grpo", "grpo_es"])
def test_qwen_recipe_runs_two_steps_on_the_qwen_like_fixture(name, qwen_like_dir, tmp_path):
    recipe = QWEN / f"{name}.yaml"
    sizes = (["--model.init_args.population_size", "2"] if name.startswith("es") else
             ["--model.init_args.group_size", "2", "--model.init_args.mini_batch_size", "2"])
    proc = _run(["fit", "--config", str(recipe), "--config", str(_shrunk_callbacks(recipe, tmp_path)),
                 "--model.init_args.model", qwen_like_dir, "--model.init_args.max_new_tokens", "8", *sizes,
                 "--data.init_args.source", str(_gsm8k(tmp_path / "gsm8k")), "--data.init_args.val_size", "2",
                 "--data.init_args.test_size", "2", "--data.init_args.batch_size", "2",
                 "--data.init_args.val_batch_size", "2", "--trainer.max_steps", "2",
                 "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    rows = _metrics(tmp_path / "logs")
    train = [r for r in rows if r.get("train/reward_mean")]
    assert len(train) == 2 and all(float(r["train/reward_mean"]) == 0.0 for r in train)  # an untrained model
    assert any(r.get("val/pass@1") for r in rows)  # the recipe's Pass@K evaluation ran (eval_at_start)
    if name == "grpo_es":
        assert [float(r["train/stage"]) for r in train] == [0.0, 1.0]  # GRPO at step 0, ES at step 1
        assert "switching to ES" in proc.stdout + proc.stderr

    export = tmp_path / "export"
    tokenizer = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == 151_936
    assert model.dtype == torch.bfloat16 and tokenizer.pad_token == "<|endoftext|>"
    assert "<|im_start|>" in tokenizer.apply_chat_template([{"role": "user", "content": "1+1?"}], tokenize=False)
    # every reward was 0 (frac_reward_zero_std = 1), so no update moved the weights: the export is the fixture, whole
    assert all(float(r["train/frac_reward_zero_std"]) == 1.0 for r in train)
    original = AutoModelForCausalLM.from_pretrained(qwen_like_dir).state_dict()
    exported = model.state_dict()
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)


def test_hf_export_under_fsdp2_writes_the_full_weights(tmp_path):
    """2 processes, ES on the built-in model, parameters sharded: the exported safetensors are the whole model —
    equal to the run's sharded checkpoint consolidated by torch.distributed.checkpoint — and the step moved them.
    Both processes end past the interpreter's teardown (es_lightning/distributed.py): armed to abort there
    (es_helpers.teardown_bomb), they still exit 0 — FSDP2's units keep their gloo groups alive until then."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from es_lightning.policy import load_policy

    overrides = tmp_path / "export.yaml"
    overrides.write_text(yaml.safe_dump({"trainer": {
        "max_steps": 1, "logger": False, "enable_checkpointing": True,
        "callbacks": [
            {"class_path": "es_lightning.HFExport", "init_args": {"dirpath": str(tmp_path / "export")}},
            # rank-0-only writers must not call collectives (trainer.log_dir is one): the report's end-of-fit write
            {"class_path": "es_lightning.PassAtKCallback", "init_args": {"num_samples": 2, "ks": [1], "num_problems": 4}},
            {"class_path": "es_lightning.TrainingReport", "init_args": {"dirpath": str(tmp_path / "report"), "plot": False}},
            {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
             "init_args": {"dirpath": str(tmp_path / "ckpt"), "filename": "last", "every_n_train_steps": 1}},
        ],
    }}))
    # the fragment after the recipe: recipes/es.yaml names devices: 1 itself
    proc = _run(["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--config",
                 str(ROOT / "configs" / "trainer" / "fsdp2_cpu.yaml"), "--config", str(overrides),
                 "--model.init_args.population_size", "4", "--model.init_args.members_per_batch", "1",
                 "--data.init_args.batch_size", "4", "--data.init_args.train_size", "16"], cwd=tmp_path,
                pythonpath=[teardown_bomb(tmp_path / "bomb")])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]  # where it stopped, if it did
    assert "MEMBER: 2/2" in proc.stdout + proc.stderr  # two processes
    assert proc.stderr.count("teardown bomb armed") == 2  # both ranks were armed
    assert "report: " in proc.stdout  # the command's last output, printed before it ends the process
    assert (tmp_path / "report" / "report.json").is_file()
    assert sorted(p.name for p in (tmp_path / "ckpt" / "last.ckpt").glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    dcp_to_torch_save(tmp_path / "ckpt" / "last.ckpt", tmp_path / "full.pt")
    gathered = torch.load(tmp_path / "full.pt", weights_only=False)["state_dict"]  # {"model.<hf name>": tensor}

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    start = load_policy("builtin:countdown-tiny").model.state_dict()
    assert exported.keys() == start.keys()
    for name, tensor in exported.items():
        assert tensor.shape == start[name].shape and torch.equal(tensor, gathered["model." + name]), name
    assert all(not torch.equal(exported[n], start[n]) for n in start)  # ES moved every tensor


def test_compare_at_equal_time_runs_the_qwen_recipes(qwen_like_dir, tmp_path):
    """``analyze compare --budget time --methods [GRPO, ES, ES low-rank] --recipes_dir
    recipes/qwen2.5-1.5b-instruct/gsm8k`` with the model and data pointed at the fixture and local GSM8K (the overrides
    every fit shares): GRPO makes its update, ES and ES low-rank — the recipes' own 32 members, bf16 weights with fp32
    masters — train for as long, and the base model (in the recipes' bf16, as the fits load it) and the results are
    evaluated on the same test problems through Qwen's chat template."""
    from dataclasses import replace

    from es_lightning.analysis.compare import compare_methods
    from es_lightning.analysis.settings import COMPARE_EVAL

    gsm8k = str(_gsm8k(tmp_path / "gsm8k"))
    report = compare_methods(
        seeds=[0], steps=1, methods=["GRPO", "ES", "ES low-rank"], budget="time", recipes_dir=QWEN,
        out_dir=tmp_path / "compare",
        settings=replace(COMPARE_EVAL, num_problems=2, num_samples=16, max_new_tokens=8, source=gsm8k),
        overrides=["--model.init_args.model", qwen_like_dir, "--model.init_args.max_new_tokens", "8",
                   "--data.init_args.source", gsm8k, "--data.init_args.batch_size", "2"],
    )
    rows = report.results[0]
    assert rows["GRPO"]["updates"] == 1
    for es in ("ES", "ES low-rank"):
        assert rows[es]["updates"] >= 1
        assert rows[es]["train_s"] >= rows["GRPO"]["train_s"] - 0.05  # trained until GRPO's time was reached
    assert report.settings["task"] == "gsm8k"
    assert report.settings["base_dtype"] == "bfloat16"  # the base row evaluated as the fits load the model (was fp32)
    assert all(0 <= r["pass@1"] <= r["pass@16"] <= 1 for r in [report.base, *rows.values()])
    assert {c for c, *_ in report.claims()} >= {"ES: Pass@1 gain >= 0.5 x GRPO's at equal time"}
