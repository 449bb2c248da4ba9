"""TrainingReport in a real two-stage fit: base / after GRPO / final rows, report.json and report.png written."""

from __future__ import annotations

import json

import lightning as L
import pytest

from es_lightning import PassAtKCallback, ReasoningDataModule, SequentialStrategy, TrainingReport
from es_lightning.callbacks.report import format_table
from es_lightning.modules.grpo import GRPOModule


def test_report_rows_files_and_table(tmp_path, tiny_model_dir):
    report = TrainingReport(dirpath=str(tmp_path / "out"))
    evaluator = PassAtKCallback(num_samples=2, ks=[1, 2], num_problems=4, batch_size=4)
    trainer = L.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False,
        callbacks=[SequentialStrategy(switch_step=1, es=dict(population_size=2, sigma=0.05, lr=0.05)), evaluator, report],
    )
    module = GRPOModule(model=tiny_model_dir, group_size=2, lr=1e-3, max_new_tokens=4)
    trainer.fit(module, ReasoningDataModule(task="countdown", train_size=16, val_size=4, test_size=4, batch_size=2))
    assert [(label, step) for label, step, _ in report.rows] == [("base", 0), ("after GRPO", 1), ("final", 2)]
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    assert data["switch_step"] == 1 and [r["label"] for r in data["rows"]] == ["base", "after GRPO", "final"]
    assert {"val/pass@1", "val/pass@2", "val/entropy"} <= set(data["rows"][0])
    png = (tmp_path / "out" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000
    # every evaluation is computed once per step: the history has no duplicate steps
    steps = [s for s, _ in evaluator.history]
    assert len(steps) == len(set(steps))


def test_format_table_lines_up_hand_rows():
    rows = [("base", 0, {"val/pass@1": 0.25, "val/entropy": 0.5}), ("final", 10, {"val/pass@1": 0.5, "val/entropy": 0.25})]
    lines = format_table(rows).splitlines()
    assert "base (step 0)" in lines[0] and "final (step 10)" in lines[0]
    assert lines[2].split() == ["pass@1", "0.250", "0.500"]
    assert lines[3].split() == ["entropy", "0.500", "0.250"]


def test_a_training_time_evaluation_draws_what_the_validation_loop_draws():
    """The report's base row (eval_at_start, the callback's own batches of 64) and its later rows (the validation
    loop's batches of val_batch_size) sampled the same weights with different random numbers: an ES fit with lr 0
    showed Pass@16 0.880 → 0.850. Every evaluation of a fit now batches as the validation loop does."""
    from es_lightning import ESModule

    callback = PassAtKCallback(num_samples=4, ks=[1, 4], batch_size=64)
    data = ReasoningDataModule(task="countdown", train_size=8, val_size=12, test_size=2, batch_size=2, val_batch_size=5)
    module = ESModule(population_size=2, max_new_tokens=16)  # the built-in model: it solves some
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[callback])
    trainer.validate(module, data)
    validated = callback.history[-1][1]
    assert 0 < validated["val/pass@1"] < validated["val/pass@4"]  # sampled: the draws matter
    with pytest.warns(UserWarning, match=r"PassAtKCallback\(batch_size=64\) applies outside a fit: .*val_batch_size=5"):
        assert callback.evaluate(trainer, module) == validated
