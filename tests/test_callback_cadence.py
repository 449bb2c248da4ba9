"""Callbacks that act every K optimizer steps act after every batch that reaches a new multiple of K, also when a GRPO
batch with ``num_iterations`` > 1 steps past it (``global_step % K == 0`` skipped those)."""

from __future__ import annotations

import lightning as L
import pytest
from test_grpo import _data, _module

from es_lightning import ParameterDrift, PassAtKCallback
from es_lightning.callbacks import HFExport


class _Drift(ParameterDrift):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.steps: list[int] = []

    def compute(self, pl_module) -> float:
        self.steps.append(pl_module.global_step)
        return super().compute(pl_module)


class _Export(HFExport):
    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.steps: list[int] = []

    def export(self, pl_module):
        self.steps.append(pl_module.global_step)


def test_every_k_steps_fires_when_a_grpo_batch_steps_past_a_multiple(tiny_model_dir, tmp_path):
    pass_at_k = PassAtKCallback(num_samples=2, ks=(1,), every_n_train_steps=2)
    drift, export = _Drift(every_n_steps=2), _Export(dirpath=tmp_path / "export", every_n_train_steps=2)
    trainer = L.Trainer(max_steps=6, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        callbacks=[pass_at_k, drift, export], enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(_module(tiny_model_dir, num_iterations=3, max_new_tokens=4), _data(train_size=4, batch_size=1))
    assert trainer.global_step == 6  # batches end at steps 3 and 6: both reached a new multiple of 2
    assert [step for step, _ in pass_at_k.history] == [3, 6]
    assert drift.steps == [3, 6]
    assert export.steps == [3, 6]  # the fit's end at step 6 does not write the step-6 export again


def test_a_max_steps_that_num_iterations_overshoots_is_said(tiny_model_dir):
    """Every batch makes all num_iterations steps: max_steps 4 at 3 per batch ends at 6, and the fit says so."""
    trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[PassAtKCallback(num_samples=2, ks=(1,))])
    with pytest.warns(UserWarning, match=r"max_steps=4 is not reachable.*ends at step 6.*e\.g\. 3 or 6"):
        trainer.fit(_module(tiny_model_dir, num_iterations=3, max_new_tokens=4), _data(train_size=4, batch_size=1))
    assert trainer.global_step == 6
