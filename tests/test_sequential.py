"""SequentialStrategy: GRPO → ES (and ES → GRPO) inside one fit, on a real Trainer with the tiny HF model."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from es_lightning import ESModule, ReasoningDataModule, SequentialStrategy
from es_lightning.modules.grpo import GRPOModule

ES = dict(population_size=4, sigma=0.05, lr=0.05, reward_normalization="centered", temperature=1.0)


class _Record(L.Callback):
    def __init__(self):
        self.kinds = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.kinds[trainer.global_step] = type(pl_module).__name__


def _dm():
    return ReasoningDataModule(task="countdown", train_size=40, val_size=4, test_size=4, batch_size=4, seed=0)


def _grpo(model_dir):
    return GRPOModule(model=model_dir, group_size=2, lr=1e-3, max_new_tokens=6, seed=0)


def _trainer(root, max_steps, callbacks):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, limit_val_batches=0,
                     enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks), callbacks=callbacks)


def _params(module):
    return [p.detach().clone() for p in module.model.parameters()]


def test_switch_happens_at_exactly_switch_step(tmp_path, tiny_model_dir):
    record = _Record()
    module = _grpo(tiny_model_dir)
    trainer = _trainer(tmp_path, 4, [SequentialStrategy(switch_step=2, es=ES), record])
    trainer.fit(module, _dm())
    assert trainer.global_step == 4
    assert record.kinds == {1: "GRPOModule", 2: "GRPOModule", 3: "ESModule", 4: "ESModule"}
    assert isinstance(module, ESModule) and module.population_size == 4 and module.sampling.temperature == 1.0
    assert len(trainer.optimizers) == 1 and type(trainer.optimizers[0]).__name__ == "ESOptimizer"
    assert trainer.lr_scheduler_configs == []
    assert all(p.grad is None for p in module.model.parameters())  # GRPO's gradients are gone with its optimizer
    assert float(trainer.logged_metrics["train/stage"]) == 1.0


def test_resume_before_and_after_the_switch(tmp_path, tiny_model_dir):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full = _grpo(tiny_model_dir)
    _trainer(tmp_path / "a", 4, [SequentialStrategy(switch_step=2, es=ES), ckpt]).fit(full, _dm())
    expected = _params(full)
    for resume_step in (1, 3):  # before the switch, and after it
        record = _Record()
        module = _grpo(tiny_model_dir)
        trainer = _trainer(tmp_path / f"r{resume_step}", 4, [SequentialStrategy(switch_step=2, es=ES), record])
        trainer.fit(module, _dm(), ckpt_path=str(tmp_path / "ck" / f"step={resume_step}.ckpt"))
        assert trainer.global_step == 4 and isinstance(module, ESModule)
        assert all(kind == ("GRPOModule" if step <= 2 else "ESModule") for step, kind in record.kinds.items())
        for a, b in zip(expected, _params(module)):
            assert torch.equal(a, b)


def test_switch_at_step_zero_equals_pure_es(tmp_path, tiny_model_dir):
    switched = _grpo(tiny_model_dir)
    _trainer(tmp_path / "a", 3, [SequentialStrategy(switch_step=0, es=ES)]).fit(switched, _dm())
    pure = ESModule(model=tiny_model_dir, max_new_tokens=6, seed=0, **ES)
    _trainer(tmp_path / "b", 3, []).fit(pure, _dm())
    for a, b in zip(_params(pure), _params(switched)):
        assert torch.equal(a, b)


def test_reverse_order_es_then_grpo(tmp_path, tiny_model_dir):
    record = _Record()
    module = ESModule(model=tiny_model_dir, max_new_tokens=6, **ES)
    trainer = _trainer(tmp_path, 3, [SequentialStrategy(switch_step=1, grpo=dict(group_size=2, lr=1e-3)), record])
    trainer.fit(module, _dm())
    assert record.kinds == {1: "ESModule", 2: "GRPOModule", 3: "GRPOModule"}
    assert type(trainer.optimizers[0]).__name__ == "AdamW"
    assert float(trainer.logged_metrics["train/stage"]) == 0.0


def test_bad_arguments():
    with pytest.raises(ValueError, match="exactly one second stage"):
        SequentialStrategy(switch_step=1)
    with pytest.raises(ValueError, match="exactly one second stage"):
        SequentialStrategy(switch_step=1, es={}, grpo={})
    with pytest.raises(ValueError, match="switch_step"):
        SequentialStrategy(switch_step=-1, es={})


def test_unknown_stage_setting_is_refused_up_front():
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['sigmaa'\]"):
        SequentialStrategy(switch_step=1, es={"sigmaa": 0.1})
