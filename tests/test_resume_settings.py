"""A resume runs the configured settings (``ReasoningModule.restore_stage`` warns which of the checkpoint's differ):
the optimizer's param groups and LR scheduler that Lightning restores from the checkpoint must not keep the old
``lr`` (GRPO, ES) or ``sigma`` (ES: the members are perturbed with the configured one)."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from test_grpo import DigitShareCountdown, _data, _trainer

from es_lightning.modules.es import ESModule
from es_lightning.modules.grpo import GRPOModule


class _Probe(L.Callback):
    def __init__(self) -> None:
        self.seen: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        group = trainer.optimizers[0].param_groups[0]
        self.seen = {"lr": group["lr"], "sigma": group.get("sigma"),
                     "base_lrs": [c.scheduler.base_lrs for c in trainer.lr_scheduler_configs]}


def _make(which, model_dir, lr, sigma, dtype="float32"):
    common = dict(model=model_dir, dtype=dtype, task=DigitShareCountdown(), max_new_tokens=4, seed=0, lr=lr)
    if which == "grpo":
        return GRPOModule(group_size=2, warmup_steps=2, **common)
    return ESModule(population_size=2, sigma=sigma, update_scale="textbook", **common)


@pytest.mark.parametrize("which", ["grpo", "es"])
@pytest.mark.parametrize("model", ["tiny", "qwen_like_bf16"])
def test_resume_with_a_changed_lr_uses_it(which, model, request, tmp_path):
    """Also on the Qwen-like fixture in bf16 (fp32 masters: MasterAdamW, the ES optimizer's masters)."""
    model_dir = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "qwen_like_small_dir")
    dtype = "float32" if model == "tiny" else "bfloat16"
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _trainer(tmp_path / "a", 1, callbacks=[ckpt]).fit(_make(which, model_dir, 1e-2, 5e-3, dtype),
                                                      _data(train_size=2, batch_size=1))
    probe = _Probe()
    with pytest.warns(UserWarning, match="configured settings"):
        _trainer(tmp_path / "b", 2, callbacks=[probe], enable_checkpointing=False).fit(
            _make(which, model_dir, 1e-3, 2e-3, dtype), _data(train_size=2, batch_size=1),
            ckpt_path=str(tmp_path / "ckpt" / "step=1.ckpt"))
    if which == "grpo":  # warm-up step 1 of 2: lr · 2/3, from the configured lr
        assert probe.seen["lr"] == pytest.approx(1e-3 * 2 / 3) and probe.seen["base_lrs"] == [[1e-3]]
    else:
        assert probe.seen["lr"] == 1e-3 and probe.seen["sigma"] == 2e-3
