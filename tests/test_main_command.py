"""The main command, `es-lightning fit --config recipes/grpo_es.yaml`, end to end in a subprocess on a shortened copy of
the shipped recipe: both stages run, the table, report.json, report.png and the export are written, and the exported
directory loads in transformers and in this CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
EXE = [sys.executable, "-m", "es_lightning.cli"]


def _run(args, cwd, timeout=600):
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run(EXE + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def _shortened_recipe(tmp_path: Path) -> Path:
    """recipes/grpo_es.yaml with 4 updates (switch at 2), small evaluations and every output under tmp_path."""
    cfg = yaml.safe_load((ROOT / "recipes" / "grpo_es.yaml").read_text())
    cfg["trainer"]["max_steps"] = 4
    cfg["trainer"]["logger"]["init_args"]["save_dir"] = str(tmp_path / "logs")
    cfg["data"]["init_args"].update(batch_size=2, val_size=6, val_batch_size=6)
    cfg["model"]["init_args"]["max_new_tokens"] = 8
    for cb in cfg["trainer"]["callbacks"]:
        args = cb.setdefault("init_args", {})
        if cb["class_path"].endswith("SequentialStrategy"):
            args["switch_step"] = 2
            args["es"]["population_size"] = 4
        if cb["class_path"].endswith("PassAtKCallback"):
            args.update(num_samples=16, every_n_train_steps=2)
        if cb["class_path"].endswith("RunCheckpoint"):
            args["every_n_train_steps"] = 3  # step 3, and last.ckpt at the end (4 is not a multiple of 3)
    path = tmp_path / "grpo_es_short.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_grpo_es_recipe_end_to_end_and_export_loads_everywhere(tmp_path):
    recipe = _shortened_recipe(tmp_path)
    proc = _run(["fit", "--config", str(recipe)], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "step 2: switching to ES" in out, out[-3000:]
    for row in ("base (step 0)", "after GRPO (step 2)", "final (step 4)"):
        assert row in out, out[-3000:]

    # a console a log file can hold: progress lines (stdout is a pipe here), no bar, tips or library warnings
    assert "step 1/4 [GRPO]" in proc.stdout and "step 4/4 [ES]" in proc.stdout, proc.stdout[-3000:]
    for noise in ("Tip:", "IterableDataset", "deprecated", "Epoch 0/", "v_num", "it/s", "\r"):
        assert noise not in out, (noise, out[-3000:])

    # everything in the run's own directory: config, metrics, checkpoints, report, export
    run = tmp_path / "logs" / "grpo_es" / "version_0"
    for name in ("config.yaml", "metrics.csv", "report.json", "report.png", "export/config.json", "checkpoints/last.ckpt"):
        assert (run / name).is_file(), name
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    assert f"run directory: {run}/" in proc.stdout, proc.stdout[-2000:]

    # --ckpt_path last resumes the newest run of the recipe, into a run directory of its own
    resumed = _run(["fit", "--config", str(recipe), "--ckpt_path", "last", "--trainer.max_steps", "5"], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resuming from {run}/checkpoints/last.ckpt" in resumed.stderr, resumed.stderr[-3000:]
    second = tmp_path / "logs" / "grpo_es" / "version_1"
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5
    assert (second / "export" / "config.json").is_file() and (run / "export" / "config.json").is_file()
    assert "base (step 0)" in resumed.stdout and "final (step 5)" in resumed.stdout  # the table survives the resume
    # test (and validate) --ckpt_path last evaluate the newest run's last.ckpt (Lightning's own "last" found none here
    # and evaluated the untrained model with only a warning)
    tested = _run(["test", "--config", str(recipe), "--ckpt_path", "last", "--data.init_args.test_size", "2"], cwd=tmp_path)
    assert tested.returncode == 0, tested.stderr[-4000:]
    assert f"evaluating {second}/checkpoints/last.ckpt" in tested.stderr, tested.stderr[-3000:]

    report = json.loads((run / "report.json").read_text())
    assert [(r["label"], r["step"]) for r in report["rows"]] == [("base", 0), ("after GRPO", 2), ("final", 4)]
    assert report["switch_step"] == 2
    assert next((tmp_path / "logs").rglob("report.png")).stat().st_size > 1000
    metrics = report["rows"][-1]
    assert 0 <= metrics["val/pass@1"] <= metrics["val/pass@16"] <= 1

    export = run / "export"
    model = AutoModelForCausalLM.from_pretrained(export).eval()  # plain transformers, no es_lightning code
    tok = AutoTokenizer.from_pretrained(export)
    ids = tok(["c:3 5 7>22="], return_tensors="pt")
    with torch.no_grad():
        assert torch.isfinite(model(**ids).logits).all()
    base = AutoModelForCausalLM.from_pretrained(ROOT / "es_lightning" / "builtin" / "countdown-tiny")
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), base.parameters())), "the export is trained"

    proc = _run(["validate", "--config", str(ROOT / "recipes" / "eval.yaml"), "--model.init_args.model", str(export),
                 "--data.init_args.val_size", "6", "--trainer.logger.init_args.save_dir", str(tmp_path / "val")],
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "val/pass@1" in proc.stdout
