"""Lightning's own callbacks and trainer flags beside the project's modules and callbacks: what a Lightning user adds to
a fit (EarlyStopping, ModelCheckpoint on a metric, fast_dev_run, ...) does what Lightning says it does."""

from __future__ import annotations

import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from test_grpo import _data, _module

from es_lightning import PassAtKCallback


def test_monitors_see_the_training_time_pass_at_k(tiny_model_dir, tmp_path):
    """`EarlyStopping(monitor="val/pass@1")` / `ModelCheckpoint(monitor="val/pass@1")` in a fit whose Pass@K comes from
    `PassAtKCallback(every_n_train_steps=...)` with no validation loop (recipes/grpo.yaml: limit_val_batches 0): the
    figures went to the loggers alone, so EarlyStopping raised "metric `val/pass@1` which is not available" at the
    epoch's end and ModelCheckpoint saved no top-k checkpoint (a warning each step)."""
    top_k = ModelCheckpoint(dirpath=tmp_path / "top", monitor="val/pass@1", mode="max", save_top_k=2,
                            every_n_train_steps=1, filename="{step}")
    early = EarlyStopping(monitor="val/pass@1", mode="max", patience=100)
    trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path,
                        callbacks=[PassAtKCallback(num_samples=2, ks=(1,), every_n_train_steps=1), top_k, early])
    trainer.fit(_module(tiny_model_dir, group_size=2), datamodule=_data())
    assert "val/pass@1" in trainer.callback_metrics
    assert len(top_k.best_k_models) == 2 and len(list((tmp_path / "top").iterdir())) == 2, top_k.best_k_models
    assert torch.isfinite(early.best_score), early.best_score  # it compared the figures (inf: it never saw one)


def test_fast_dev_run_writes_no_report_and_no_export(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """`fast_dev_run` ("logging and checkpointing is suppressed": no logger, no log directory) wrote TrainingReport's
    report.json / report.png and HFExport's whole model into the working directory; the table is still printed."""
    from es_lightning import HFExport, TrainingReport

    monkeypatch.chdir(tmp_path)
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[PassAtKCallback(num_samples=2, ks=(1,)), TrainingReport(), HFExport()])
    trainer.fit(_module(tiny_model_dir, group_size=2), datamodule=_data())
    assert trainer.global_step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    out = capsys.readouterr().out
    assert "base (step 0)" in out and "final (step 1)" in out and "report: not written (fast_dev_run)" in out, out


def test_learning_rate_monitor_logs_weight_decay_of_the_es_optimizer(tiny_model_dir, tmp_path):
    """`LearningRateMonitor(log_weight_decay=True)` read the ES optimizer's `weight_decay` (every torch optimizer's group
    has one) and ended an ES fit — or a GRPO→ES fit at the switch — with KeyError: 'weight_decay'. A checkpoint of an
    older version (groups without it) gets it when loaded."""
    from lightning.pytorch.callbacks import LearningRateMonitor
    from lightning.pytorch.loggers import CSVLogger

    from es_lightning import ESModule

    module = ESModule(model=tiny_model_dir, population_size=4, members_per_batch=4, max_new_tokens=8)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path), enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1,
                        enable_checkpointing=False,
                        callbacks=[PassAtKCallback(num_samples=2, ks=(1,)),
                                   LearningRateMonitor(log_momentum=True, log_weight_decay=True)])
    trainer.fit(module, datamodule=_data())
    assert trainer.global_step == 2
    header = (tmp_path / "lightning_logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert "lr-ESOptimizer" in header and "lr-ESOptimizer-weight_decay" in header, header
    optimizer = trainer.optimizers[0]
    old = optimizer.state_dict()
    for group in old["param_groups"]:
        del group["weight_decay"]
    optimizer.load_state_dict(old)
    assert all(group["weight_decay"] == 0.0 for group in optimizer.param_groups)


@pytest.mark.parametrize("flags, batches", [(dict(fast_dev_run=2), 2), (dict(max_steps=2, limit_val_batches=1), 1),
                                            (dict(max_steps=2, limit_val_batches=0.5), 1)])
def test_training_time_evaluations_take_the_validation_loops_batches(flags, batches, tiny_model_dir, tmp_path,
                                                                     monkeypatch):
    """A limit on the validation loop — `limit_val_batches` (an int or a fraction), or `fast_dev_run=N` (N batches of
    each loop, a smoke test) — left the training-time evaluations (eval_at_start, TrainingReport's base and final rows)
    on every validation problem: the report compared a base on all the problems with a validation on some (and under
    fast_dev_run sampled every problem, minutes on a real model). They take the validation loop's batches."""
    from es_lightning import TrainingReport

    class Counting(PassAtKCallback):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.sizes = []

        def _update(self, pl_module, examples, batch_idx):
            self.sizes.append(len(examples))
            return super()._update(pl_module, examples, batch_idx)

    monkeypatch.chdir(tmp_path)
    counting = Counting(num_samples=2, ks=(1,), eval_at_start=True)
    trainer = L.Trainer(accelerator="cpu", enable_progress_bar=False, enable_model_summary=False, logger=False,
                        enable_checkpointing=False, num_sanity_val_steps=0, val_check_interval=2,
                        check_val_every_n_epoch=None, callbacks=[counting, TrainingReport(plot=False)], **flags)
    trainer.fit(_module(tiny_model_dir, group_size=2), datamodule=_data(val_size=6, val_batch_size=2))
    # the start, then the validation loop after step 2 (the final row reuses it): `batches` batches of 2 problems each
    assert counting.sizes == [2] * batches * 2, counting.sizes


def test_overfit_batches_trains_on_the_same_batches(tiny_model_dir, tmp_path):
    """`overfit_batches=1` (Lightning: train on the same first batch every epoch, a debugging habit) trained on a new
    batch each epoch: the prompt stream went on from the trainer's batch count."""

    class Seen(L.Callback):
        def __init__(self):
            self.batches = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.batches.append([example["nums"] for example in batch])

    seen = Seen()
    trainer = L.Trainer(max_steps=3, overfit_batches=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                        default_root_dir=tmp_path, callbacks=[PassAtKCallback(num_samples=2, ks=(1,)), seen])
    trainer.fit(_module(tiny_model_dir, group_size=2), datamodule=_data())
    assert len(seen.batches) == 3 and seen.batches[0] == seen.batches[1] == seen.batches[2], seen.batches


def test_fast_dev_run_with_several_steps_a_batch_is_not_told_to_change_max_steps(tiny_model_dir, tmp_path):
    """`fast_dev_run` with GRPO `num_iterations=2`: the module warned "trainer.max_steps=1 is not reachable ... use a
    max_steps 2 steps apart" — a max_steps the user never set (fast_dev_run runs N batches and sets it itself)."""
    import warnings

    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[PassAtKCallback(num_samples=2, ks=(1,))])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_module(tiny_model_dir, group_size=2, num_iterations=2), datamodule=_data())
    assert trainer.global_step == 2  # the one batch's two optimizer steps
    assert not [w for w in caught if "is not reachable" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_trainer_predict_is_refused_naming_what_to_use(kind, tiny_model_dir, tmp_path):
    """trainer.predict in a script: one line naming trainer.test / es-lightning eval (it was Lightning's "`Trainer.predict`
    requires `forward` method to run."), before the model loads."""
    from es_lightning import ESModule

    module = _module(tiny_model_dir) if kind == "grpo" else ESModule(model=tiny_model_dir, population_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, default_root_dir=tmp_path)
    with pytest.raises(NotImplementedError, match=r"trainer.predict: \w+Module has no prediction loop; .*trainer.test"
                                                  r".*es-lightning eval"):
        trainer.predict(module, datamodule=_data())
    assert module.model is None  # refused before loading it


@pytest.mark.parametrize(("kind", "flag", "option"), [("grpo", "gradient_clip_val", "GRPOModule(max_grad_norm="),
                                                    ("es", "accumulate_grad_batches", "GRPOModule(mini_batch_size=")])
def test_trainer_flags_manual_optimization_refuses_name_the_modules_options(kind, flag, option, tiny_model_dir, tmp_path):
    """`Trainer(gradient_clip_val=1.0)` / `Trainer(accumulate_grad_batches=2)` in a script: Lightning's refusal ended "or
    switch to automatic optimization", which these modules cannot; the line names the module option that does it."""
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    from es_lightning import ESModule

    module = _module(tiny_model_dir) if kind == "grpo" else ESModule(model=tiny_model_dir, population_size=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False,
                        default_root_dir=tmp_path, **{flag: 2})
    with pytest.raises(MisconfigurationException, match=rf"not supported for manual optimization: remove `Trainer\({flag}=2\)`"
                                                        rf" .*{re.escape(option)}.*ES takes no gradient") as refusal:
        trainer.fit(module, datamodule=_data())
    assert "switch to automatic optimization" not in str(refusal.value)
    assert module.model is None  # refused before loading it


@pytest.mark.parametrize("loop", ["training", "validation"])
def test_a_dataloader_with_the_default_collate_is_refused_naming_collate_fn(loop, tiny_model_dir, tmp_path):
    """`trainer.fit(module, train_dataloaders=DataLoader(rows, batch_size=2))`: PyTorch's default collate makes a dict
    of columns, which failed deep in prompting ("TypeError: string indices must be integers, not 'str'"; a tensor:
    "IndexError: too many indices for tensor of dimension 0"). One line names collate_fn=list; with it, it trains."""
    from torch.utils.data import DataLoader

    from es_lightning import ESModule

    rows = [{"nums": [1, 2, 3], "target": 6}, {"nums": [2, 5, 7], "target": 14}]
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[PassAtKCallback(num_samples=2, ks=(1,))])
    module = ESModule(model=tiny_model_dir, task="countdown", population_size=2, max_new_tokens=4)
    run = trainer.fit if loop == "training" else trainer.validate
    with pytest.raises(TypeError, match=rf"ESModule: a {loop} batch must be a list of example dicts .*got a dict of columns "
                                        r"\['nums', 'target'\]; give your DataLoader collate_fn=list"):
        run(module, DataLoader(rows, batch_size=2))
    run(module, DataLoader(rows, batch_size=2, collate_fn=list))


class _Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch, batch_idx):
        return self.layer(batch[0]).sum()

    def validation_step(self, batch, batch_idx):
        pass

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize(("callback", "says"), [
    ("pass_at_k", r"PassAtKCallback samples and scores with a ReasoningModule .* the module is a _Regression; .*es_lightning"
                  r"\.PassAtK\(k=\.\.\.\)"),
    ("drift", r"ParameterDrift measures the policy of a ReasoningModule .* the module is a _Regression; drop the callback")])
def test_the_projects_callbacks_on_a_lightning_module_of_ones_own_are_refused_in_one_line(callback, says, tmp_path):
    """PassAtKCallback / ParameterDrift added to a LightningModule of the user's own failed with AttributeError deep in
    the fit ("'_Regression' object has no attribute 'evaluate_batch'" / "... 'model'"); one line at setup now."""
    from torch.utils.data import DataLoader, TensorDataset

    from es_lightning import ParameterDrift

    loader = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=4)
    made = PassAtKCallback(num_samples=2, ks=(1,)) if callback == "pass_at_k" else ParameterDrift()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[made])
    with pytest.raises(TypeError, match=says):
        trainer.fit(_Regression(), loader, loader)


def test_batch_size_finder_does_not_warn_of_a_resume_with_other_data(tiny_model_dir, tmp_path, recwarn):
    """BatchSizeFinder restores the checkpoint it saved before its trials with the batch size it found: the data module
    warned "resuming with the configured data settings; the checkpoint's differ in ['batch_size'] ... resume with its
    batch_size=2", as if the user had resumed another run. The fit then trains at the size found."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    from es_lightning import ESModule

    module = ESModule(model=tiny_model_dir, population_size=2, max_new_tokens=4)
    data = _data(train_size=32, val_size=2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[BatchSizeFinder(max_trials=2, steps_per_trial=1)])
    trainer.fit(module, data)
    assert data.batch_size == 4 and trainer.global_step == 1
    assert not [w for w in recwarn if "resuming with the configured data settings" in str(w.message)]


@pytest.mark.parametrize(("mode", "mini_batch_size", "fits"), [("power", 3, False), ("power", 4, True),
                                                                ("binsearch", 4, False), ("binsearch", 2, True)])
def test_batch_size_finder_trying_a_size_grpo_cannot_split_is_refused_at_setup(tiny_model_dir, tmp_path, mode,
                                                                                mini_batch_size, fits):
    """BatchSizeFinder replaces data.batch_size with its trials (init_val 2, doubled; binsearch: any size between two
    tried): a mini_batch_size that divides the configured 3 × group_size 2 but not a tried size stopped the search with
    a traceback naming a data.batch_size the user never set. It is refused at setup, before the model loads, naming
    the finder, the sizes it tries and the fix; settings that fit every size search as before."""
    from lightning.pytorch.callbacks import BatchSizeFinder

    from es_lightning import GRPOModule

    module = GRPOModule(model=tiny_model_dir, group_size=2, mini_batch_size=mini_batch_size, max_new_tokens=2)
    data = _data(train_size=32, val_size=2, batch_size=3 if mini_batch_size == 3 else 2)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, callbacks=[BatchSizeFinder(mode=mode, max_trials=2, steps_per_trial=1)])
    if fits:
        trainer.fit(module, data)
        assert trainer.global_step == 1
        return
    tried = "data.batch_size 2, 4 (init_val 2, doubled each trial)" if mode == "power" else "any data.batch_size from 1 to 8"
    with pytest.raises(ValueError, match=rf"^BatchSizeFinder \(mode '{mode}'\) tries {re.escape(tried)}.*, and at \d: "
                                         rf"mini_batch_size={mini_batch_size} does not divide .* or leave BatchSizeFinder out"):
        trainer.fit(module, data)
    assert module.model is None  # refused before loading it
