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
        if cb["class_path"].endswith("HFExport"):
            args["dirpath"] = str(tmp_path / "export")
    path = tmp_path / "grpo_es_short.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def test_grpo_es_recipe_end_to_end_and_export_loads_everywhere(tmp_path):
    proc = _run(["fit", "--config", str(_shortened_recipe(tmp_path))], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout + proc.stderr
    assert "step 2: switching to ES" in out, out[-3000:]
    for row in ("base (step 0)", "after GRPO (step 2)", "final (step 4)"):
        assert row in out, out[-3000:]

    report = json.loads(next((tmp_path / "logs").rglob("report.json")).read_text())
    assert [(r["label"], r["step"]) for r in report["rows"]] == [("base", 0), ("after GRPO", 2), ("final", 4)]
    assert report["switch_step"] == 2
    assert next((tmp_path / "logs").rglob("report.png")).stat().st_size > 1000
    metrics = report["rows"][-1]
    assert 0 <= metrics["val/pass@1"] <= metrics["val/pass@16"] <= 1

    export = tmp_path / "export"
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
