"""The model summary at fit start gives the parameters' real memory (es_lightning/callbacks/model_summary.py): weights
at their own dtype plus the fp32 master copies the ES/GRPO optimizers keep, where Lightning's counted every parameter at
the trainer precision's size. Real fits (one step) of the built-in model (fp32: no masters) and of the Qwen-like fixture
in bf16 (ES and GRPO), the figures checked against sums over the parameters computed here."""

from __future__ import annotations

import logging
import re

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary

from es_lightning import ESModule, GRPOModule, ReasoningDataModule
from es_lightning.callbacks.model_summary import ModelSummary, RichModelSummary


def _fit(module, root, callbacks=()):
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, limit_val_batches=0,
                        num_sanity_val_steps=0, enable_checkpointing=False, enable_progress_bar=False,
                        default_root_dir=root, callbacks=list(callbacks))
    trainer.fit(module, ReasoningDataModule(task="countdown", train_size=4, val_size=2, test_size=2, batch_size=2, seed=0))
    return trainer


def _line(caplog) -> str:
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Parameter memory (MB):")]
    assert len(lines) == 1, caplog.text
    return lines[0]


def test_builtin_fp32_counts_its_weights_and_no_masters(tmp_path, caplog, capsys):
    module = ESModule(population_size=2, max_new_tokens=4)  # the built-in model, fp32: its own master
    with caplog.at_level(logging.INFO):
        trainer = _fit(module, tmp_path)
    assert [type(cb) for cb in trainer.callbacks if isinstance(cb, LightningModelSummary)] == [RichModelSummary]
    weights = sum(p.numel() * 4 for p in module.parameters())
    assert {p.dtype.itemsize for p in module.parameters()} == {4}
    assert _line(caplog) == (f"Parameter memory (MB): {weights / 1e6:,.3f} weights (float32), no master copies "
                             "(the optimizers update the weights in their own dtype)")
    assert f"Total estimated model params size (MB): {weights / 1e6:,.3f}" in capsys.readouterr().out


@pytest.mark.parametrize("algorithm", ["es", "grpo"])
def test_bf16_qwen_like_counts_bf16_weights_plus_fp32_masters(qwen_like_small_dir, tmp_path, caplog, algorithm):
    if algorithm == "es":
        module = ESModule(model=qwen_like_small_dir, task="countdown", dtype="bfloat16", population_size=2,
                          max_new_tokens=4)
    else:
        module = GRPOModule(model=qwen_like_small_dir, task="countdown", dtype="bfloat16", group_size=2, max_new_tokens=4)
    given = LightningModelSummary(max_depth=2)  # the user's own Lightning summary: swapped, its depth kept
    with caplog.at_level(logging.INFO):
        trainer = _fit(module, tmp_path, [given])
    summaries = [cb for cb in trainer.callbacks if isinstance(cb, LightningModelSummary)]
    assert [type(cb) for cb in summaries] == [ModelSummary] and summaries[0]._max_depth == 2

    params = list(module.parameters())  # tied embeddings once
    assert {p.dtype.itemsize for p in params} == {2}
    weights = sum(p.numel() * 2 for p in params)
    masters = sum(p.numel() * 4 for p in params)  # both optimizers update every weight through an fp32 master
    assert weights == 2 * sum(p.numel() for p in module.model.parameters())
    assert _line(caplog) == (f"Parameter memory (MB): {weights / 1e6:,.3f} weights (bfloat16) + {masters / 1e6:,.3f} "
                             f"float32 master copies = {(weights + masters) / 1e6:,.3f}")
    table = [r.getMessage() for r in caplog.records if "Total estimated model params size (MB)" in r.getMessage()]
    assert len(table) == 1
    assert re.search(rf"^{re.escape(f'{(weights + masters) / 1e6:,.3f}')} +Total estimated model params size", table[0], re.M)
    assert "model.lm_head" in table[0]  # max_depth 2 kept: the table names the model's children
