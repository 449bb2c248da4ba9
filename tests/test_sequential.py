"""SequentialStrategy: GRPO → ES (and ES → GRPO) inside one fit, on a real Trainer with the tiny HF model.

The module's class never changes: the switch gives it another algorithm object (``module.algorithm.name``)."""

from __future__ import annotations

from contextlib import nullcontext
from pathlib import Path

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
        self.kinds[trainer.global_step] = pl_module.algorithm.name


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
    assert record.kinds == {1: "grpo", 2: "grpo", 3: "es", 4: "es"}
    assert type(module) is GRPOModule  # the object and its class are what the user built
    assert module.algorithm.name == "es" and module.algorithm.settings.population_size == 4
    assert module.sampling.temperature == 1.0
    assert len(trainer.optimizers) == 1 and type(trainer.optimizers[0]).__name__ == "ESOptimizer"
    assert trainer.lr_scheduler_configs == []
    assert all(p.grad is None for p in module.model.parameters())  # GRPO's gradients are gone with its optimizer
    assert float(trainer.logged_metrics["train/stage"]) == 1.0


def test_the_second_stage_rows_of_metrics_csv_hold_only_its_own_metrics(tmp_path, tiny_model_dir):
    """Lightning keeps a step metric's last value for the epoch: without forgetting the first stage's keys at the switch,
    GRPO's grad_norm and policy_loss were written into every ES row (and ES's pass_pop into GRPO's the other way round)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    for module, seq, first_only in (
        (_grpo(tiny_model_dir), SequentialStrategy(switch_step=2, es=ES), ("train/grad_norm", "train/policy_loss")),
        (ESModule(model=tiny_model_dir, max_new_tokens=6, **ES), SequentialStrategy(switch_step=1, grpo=dict(group_size=2)),
         ("train/pass_pop", "train/update_norm")),
    ):
        logger = CSVLogger(tmp_path, name=module.algorithm.name)
        trainer = L.Trainer(max_steps=3, accelerator="cpu", logger=logger, log_every_n_steps=1, limit_val_batches=0,
                            enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                            callbacks=[seq])
        trainer.fit(module, _dm())
        rows = [r for r in csv.DictReader(open(Path(logger.log_dir) / "metrics.csv")) if r.get("train/reward_mean")]
        assert len(rows) == 3
        for row in rows:
            first = float(row["train/stage"]) == float(seq.target != "es")  # train/stage is 1.0 in ES
            for key in first_only:
                assert bool(row[key]) == first, (key, row["step"], row[key])


def test_resume_before_and_after_the_switch(tmp_path, tiny_model_dir):
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full = _grpo(tiny_model_dir)
    _trainer(tmp_path / "a", 4, [SequentialStrategy(switch_step=2, es=ES), ckpt]).fit(full, _dm())
    expected = _params(full)
    # the active stage is part of the module's own checkpoint
    stage = torch.load(tmp_path / "ck" / "step=3.ckpt", weights_only=False)["es_lightning_stage"]
    assert stage["algorithm"] == "es" and stage["settings"]["population_size"] == 4
    assert stage["sampling"]["temperature"] == 1.0
    assert torch.load(tmp_path / "ck" / "step=1.ckpt", weights_only=False)["es_lightning_stage"]["algorithm"] == "grpo"
    # before the switch, after it, and after it without the callback (the module's checkpoint alone says ES)
    for resume_step, callback in ((1, True), (3, True), (3, False)):
        record = _Record()
        module = _grpo(tiny_model_dir)
        seq = [SequentialStrategy(switch_step=2, es=ES)] if callback else []
        trainer = _trainer(tmp_path / f"r{resume_step}{callback}", 4, [*seq, record])
        said = pytest.warns(UserWarning, match="continues es .* not the configured grpo") if not callback else nullcontext()
        with said:  # without the callback nothing in this fit switches to ES: the checkpoint's stage runs, and it says so
            trainer.fit(module, _dm(), ckpt_path=str(tmp_path / "ck" / f"step={resume_step}.ckpt"))
        assert trainer.global_step == 4 and module.algorithm.name == "es"
        assert type(trainer.optimizers[0]).__name__ == "ESOptimizer"
        assert all(kind == ("grpo" if step <= 2 else "es") for step, kind in record.kinds.items())
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
    assert record.kinds == {1: "es", 2: "grpo", 3: "grpo"}
    assert type(trainer.optimizers[0]).__name__ == "MasterAdamW"  # plain AdamW on fp32 weights
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


@pytest.mark.parametrize("stage, match", [
    (dict(es={"sigma": -0.01}), "sigma must be a positive"),
    (dict(es={"population_size": 5, "antithetic": True}), "must be even"),
    (dict(es={"temperature": -1.0}), "temperature must be >= 0"),
    (dict(grpo={"group_size": 1}), "group_size must be >= 2"),
    (dict(grpo={"temperature": 0.0}), "GRPO samples its groups"),
    (dict(grpo={"loss_type": "ppo"}), "loss_type must be one of"),
    (dict(es={"samples_per_member": 2}), "2 identical greedy completions"),  # ES's default temperature is 0
    (dict(algorithm="ppo", settings={}), "unknown algorithm 'ppo'"),
])
def test_second_stage_values_are_validated_when_constructed(stage, match):
    with pytest.raises(ValueError, match=match):
        SequentialStrategy(switch_step=1, **stage)


def test_switch_step_that_num_iterations_would_overshoot_is_refused(tmp_path, tiny_model_dir):
    module = GRPOModule(model=tiny_model_dir, group_size=2, num_iterations=2, max_new_tokens=4)
    trainer = _trainer(tmp_path, 4, [SequentialStrategy(switch_step=3, es=ES)])
    with pytest.raises(ValueError, match=r"switch_step=3 is not reachable.*use a multiple of 2"):
        trainer.fit(module, _dm())
    assert trainer.global_step == 0  # refused before any step


def test_an_es_stage_whose_prompt_groups_cannot_split_the_batch_is_refused_up_front(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, 4, [SequentialStrategy(switch_step=2, es={**ES, "population_size": 6, "prompt_groups": 3})])
    with pytest.raises(ValueError, match=r"prompt_groups=3 .* a batch has 4 prompts; set data.batch_size to a multiple"):
        trainer.fit(_grpo(tiny_model_dir), _dm())
    assert trainer.global_step == 0  # refused before the GRPO stage ran


def test_an_es_stage_the_loaded_model_cannot_run_is_refused_before_the_first_stage_trains(tmp_path, tiny_model_dir):
    """A noise rank beyond the model's matrices is known once the model is loaded: it was refused at the switch, after
    the GRPO stage had trained (on vLLM: LoRA members over parameters LoRA cannot perturb, tests/vllm_backend)."""
    trainer = _trainer(tmp_path, 4, [SequentialStrategy(switch_step=2, es={**ES, "noise_rank": 100_000})])
    with pytest.raises(ValueError, match=r"noise_rank=100000"):
        trainer.fit(_grpo(tiny_model_dir), _dm())
    assert trainer.global_step == 0  # refused before the GRPO stage ran


def test_a_switch_the_fit_never_reaches_is_said(tmp_path, tiny_model_dir):
    trainer = _trainer(tmp_path, 1, [SequentialStrategy(switch_step=1, es=ES)])
    with pytest.warns(UserWarning, match=r"switch_step=1 is not below trainer.max_steps=1, so this fit never reaches ES"):
        trainer.fit(_grpo(tiny_model_dir), _dm())


def test_a_switch_a_fast_dev_run_never_reaches_names_fast_dev_run(tmp_path, tiny_model_dir):
    """Under `fast_dev_run` the max_steps is Lightning's: the line said "raise max_steps", which the user never set."""
    trainer = L.Trainer(fast_dev_run=True, accelerator="cpu", enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, callbacks=[SequentialStrategy(switch_step=1, es=ES)])
    with pytest.warns(UserWarning, match=r"never reaches ES; fast_dev_run runs 1 batch\(es\): give --trainer.fast_dev_run "
                                         r"2 or lower switch_step"):
        trainer.fit(_grpo(tiny_model_dir), _dm())


def test_a_module_already_in_the_second_stage_is_refused(tmp_path, tiny_model_dir):
    module = ESModule(model=tiny_model_dir, max_new_tokens=4, **ES)
    with pytest.raises(TypeError, match="already runs ES"):
        _trainer(tmp_path, 2, [SequentialStrategy(switch_step=1, es=ES)]).fit(module, _dm())


def test_load_from_checkpoint_after_the_switch_says_nothing_of_a_fit(tmp_path, tiny_model_dir):
    """`GRPOModule.load_from_checkpoint(<a GRPO → ES run's last.ckpt>)` in a script warned "the checkpoint was written
    in the es stage, so this fit continues es ... not the configured grpo; to train grpo, start from the checkpoint's
    weights instead (--model.init_args.model <run>/export ...)": no fit runs, and the checkpoint is this run's own. The
    module comes back in the checkpoint's stage, with its settings, without a word."""
    import warnings

    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="last")
    _trainer(tmp_path, 2, [ckpt, SequentialStrategy(switch_step=1, es=ES)]).fit(_grpo(tiny_model_dir), _dm())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = GRPOModule.load_from_checkpoint(tmp_path / "last.ckpt", map_location="cpu")
    said = [str(w.message) for w in caught if "stage" in str(w.message)]
    assert not said, said
    assert loaded.algorithm.name == "es" and loaded.algorithm.settings.population_size == ES["population_size"]


def test_another_algorithms_checkpoint_continues_its_stage_and_says_so(tmp_path, tiny_model_dir):
    """A GRPO checkpoint resumed by an ES module with no SequentialStrategy that switches to GRPO (most likely another
    recipe's checkpoint): the fit continues the checkpoint's stage, as a switched run resumes, and a warning says
    that the configured algorithm does not run and how to start it from those weights instead."""
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=1)
    _trainer(tmp_path, 1, [ckpt]).fit(_grpo(tiny_model_dir), _dm())
    module = ESModule(model=tiny_model_dir, **ES)
    with pytest.warns(UserWarning, match=r"written in the grpo stage, so this fit continues grpo .* not the configured "
                                         r"es; to train es, start from the checkpoint's weights"):
        _trainer(tmp_path, 2, []).fit(module, _dm(), ckpt_path=str(tmp_path / "step=1.ckpt"))
    assert module.algorithm.name == "grpo"
