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


def test_two_pass_at_k_evaluations_train_and_resume_together(tiny_model_dir, tmp_path):
    """A sampled evaluation and a greedy one (prefix "greedy") in one fit: Lightning refused the second instance at
    `Trainer(...)` ("Found more than one stateful callback of type `PassAtKCallback`"). Now each logs under its prefix,
    the checkpoint keeps each one's history under its own key (the default prefix under the class name, as before),
    and a resumed fit restores both."""
    import torch

    from es_lightning import RunCheckpoint

    def fit(max_steps, ckpt_path=None):
        sampled = PassAtKCallback(num_samples=2, ks=(1, 2), every_n_train_steps=1)
        greedy = PassAtKCallback(num_samples=1, ks=(1,), temperature=0.0, every_n_train_steps=1, prefix="greedy")
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                            callbacks=[sampled, greedy, RunCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1)])
        trainer.fit(_module(tiny_model_dir, max_new_tokens=4), _data(train_size=8, batch_size=1), ckpt_path=ckpt_path)
        return trainer, sampled, greedy

    _, sampled, greedy = fit(2)
    assert [step for step, _ in sampled.history] == [1, 2] and [step for step, _ in greedy.history] == [1, 2]
    assert set(sampled.history[-1][1]) == {"val/pass@1", "val/pass@2", "val/maj@1", "val/maj@2", "val/entropy",
                                           "val/reward_mean"}
    assert set(greedy.history[-1][1]) == {"greedy/pass@1", "greedy/maj@1", "greedy/entropy", "greedy/reward_mean"}
    states = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=False)["callbacks"]
    assert states["PassAtKCallback"]["history"] == sampled.history
    assert states["PassAtKCallback{'prefix': 'greedy'}"]["history"] == greedy.history
    _, sampled_again, greedy_again = fit(3, ckpt_path=tmp_path / "ckpt" / "last.ckpt")
    assert sampled_again.history[:2] == sampled.history and [s for s, _ in sampled_again.history] == [1, 2, 3]
    assert greedy_again.history[:2] == greedy.history and [s for s, _ in greedy_again.history] == [1, 2, 3]
