"""The `es-lightning` command end to end, in a subprocess, as a user runs it."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXE = [sys.executable, "-m", "es_lightning.cli"]


def _run(args, cwd, timeout=300):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(EXE + args, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_validate_recipe_on_builtin_model_prints_pass_at_k_table(tmp_path):
    proc = _run(
        ["validate", "--config", str(ROOT / "recipes" / "eval.yaml"), "--data.init_args.val_size", "24",
         "--trainer.logger.init_args.save_dir", str(tmp_path)],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = proc.stdout
    for name in ("val/pass@1", "val/pass@4", "val/pass@16", "val/maj@16", "val/entropy"):
        assert name in out, out[-3000:]
    rows = list(csv.DictReader(open(next(tmp_path.rglob("metrics.csv")))))
    figures = {k: float(v) for k, v in rows[-1].items() if k.startswith("val/") and v}
    # the logger holds the same figures; Pass@K is monotone in K and the built-in model solves some problems
    assert 0 < figures["val/pass@1"] <= figures["val/pass@4"] <= figures["val/pass@16"] <= 1
    assert figures["val/entropy"] > 0


def test_unknown_key_fails_with_jsonargparse_message(tmp_path):
    proc = _run(["validate", "--config", str(ROOT / "recipes" / "eval.yaml"), "--model.init_args.sigmaa", "1"],
                cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "sigmaa" in proc.stderr


def test_missing_model_path_names_the_problem(tmp_path):
    proc = _run(["validate", "--config", str(ROOT / "recipes" / "eval.yaml"), "--model.init_args.model",
                 str(tmp_path / "no-such-model"), "--data.init_args.val_size", "2"], cwd=tmp_path, timeout=120)
    assert proc.returncode != 0
    assert "does not exist" in proc.stderr and "builtin:countdown-tiny" in proc.stderr
