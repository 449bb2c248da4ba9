"""The README's "compose it yourself" example (section "GRPO, and GRPO then ES") runs as written, shrunk to a few
steps and small sizes by replacing numbers only: if the README's code changes, this test reads the new code."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SHRINK = [  # (as in the README, shrunk)
    ("max_steps=80", "max_steps=4"),
    ("switch_step=40", "switch_step=2"),
    ('"population_size": 32', '"population_size": 4'),
    ('"members_per_batch": 32', '"members_per_batch": 4'),
    ("num_samples=32", "num_samples=4"),
    ("ks=[1, 4, 16]", "ks=[1, 4]"),
    ("every_n_train_steps=20", "every_n_train_steps=2"),
    ("group_size=8", "group_size=2"),
    ('ReasoningDataModule("countdown")',
     'ReasoningDataModule("countdown", train_size=64, val_size=4, test_size=4, batch_size=2)'),
]


def _example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## GRPO, and GRPO then ES"):]
    return re.search(r"Compose it yourself:\s*```python\n(.*?)```", section, re.S).group(1)


def test_readme_compose_it_yourself_example_runs(tmp_path, monkeypatch):
    code = _example()
    for old, new in SHRINK:
        assert old in code, f"the README example no longer contains {old!r}: update SHRINK"
        code = code.replace(old, new)
    monkeypatch.chdir(tmp_path)  # the example writes its logs and report under the working directory
    torch.manual_seed(0)
    namespace: dict = {}
    exec(compile(code, "README.md example", "exec"), namespace)
    trainer = namespace["trainer"]
    module = trainer.lightning_module
    assert trainer.global_step == 4 and module.algorithm.name == "es"
    assert type(module).__name__ == "GRPOModule"  # the switch changed the algorithm, not the class
    report = json.loads(next(tmp_path.rglob("report.json")).read_text())
    assert [(r["label"], r["step"]) for r in report["rows"]] == [("base", 0), ("after GRPO", 2), ("final", 4)]
    assert "train/drift" in trainer.logged_metrics and float(trainer.logged_metrics["train/drift"]) > 0
