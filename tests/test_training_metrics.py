"""ES and GRPO log the same training metrics under the same keys, from one place, and both train under Lightning's
bf16 precisions on the CPU.

The logged values are checked against the rollouts themselves: a spy around the real generator keeps every rollout of
the step, and the test recomputes mean length, clipped ratio, token entropy and accuracy from them by hand."""

from __future__ import annotations

import csv
import re
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from es_lightning import ESModule, GRPOModule, ReasoningDataModule
from es_lightning.metrics.training import device_time
from es_lightning.tasks import CountdownTask

SHARED = [
    "train/reward_mean", "train/reward_std", "train/frac_reward_zero_std", "train/accuracy",
    "train/completions/mean_length", "train/completions/clipped_ratio", "train/entropy", "train/lr", "train/drift",
    "train/time/generate_s", "train/time/score_s", "train/time/update_s",
]
OWN = {
    "es": ["train/js_succ", "train/pass_pop", "train/update_norm"],
    "grpo": ["train/clip_ratio/low_mean", "train/clip_ratio/high_mean", "train/clip_ratio/region_mean", "train/kl",
             "train/grad_norm"],
}


class _CharSum(CountdownTask):
    """A reward that differs between completions (the untrained fixture never solves Countdown)."""

    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


class _Spy:
    """The module's real generator, keeping what it returns."""

    def __init__(self, generator):
        self.generator, self.rollouts = generator, []

    def __getattr__(self, name):  # everything else of the Generator interface (e.g. weights_changed)
        return getattr(self.generator, name)

    def generate(self, *args, **kwargs):
        rollout = self.generator.generate(*args, **kwargs)
        self.rollouts.append(rollout)
        return rollout


def _module(kind, model_dir, task=None, **kw):
    task = task or _CharSum()
    if kind == "es":
        return ESModule(model=model_dir, task=task, population_size=4, sigma=0.05, lr=0.01, max_new_tokens=6,
                        temperature=1.0, **kw)
    return GRPOModule(model=model_dir, task=task, group_size=2, lr=1e-3, beta=0.05, max_new_tokens=6, **kw)


def _dm(task="countdown"):
    return ReasoningDataModule(task=task, train_size=16, val_size=4, test_size=4, batch_size=2, seed=0)


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_both_algorithms_log_the_shared_keys_computed_from_their_rollouts(kind, tiny_model_dir, tmp_path, monkeypatch):
    module = _module(kind, tiny_model_dir)
    spy = _Spy(module.generator)
    module._generator = spy
    clocks = []  # GRPO's step clock waits for the device after the update (test_device_time_waits_for_cuda_work)
    import es_lightning.grpo.algorithm as grpo_algorithm

    def clock(device):
        clocks.append((torch.device(device), module.trainer.global_step))
        return device_time(device)

    monkeypatch.setattr(grpo_algorithm, "device_time", clock, raising=False)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=CSVLogger(tmp_path), enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1)
    trainer.fit(module, _dm())
    rows = list(csv.DictReader(open(Path(trainer.logger.log_dir) / "metrics.csv")))
    row = next(r for r in rows if r.get("train/reward_mean"))
    if kind == "grpo":  # read before the rollout and after the optimizer step, on the module's device
        assert clocks == [(module.device, 0), (module.device, 1)]
    for key in SHARED + OWN[kind]:
        assert row.get(key, "") != "", key
    assert {k for k in row if k.startswith("train/")} >= set(SHARED)

    # by hand, from every rollout of the step (ES: one per member; GRPO: one)
    mask = torch.cat([r.completion_mask for r in spy.rollouts]).double()  # [R, C]
    entropy = torch.cat([r.entropy for r in spy.rollouts]).double()
    truncated = torch.cat([r.truncated for r in spy.rollouts]).double()
    texts = [t for r in spy.rollouts for t in r.texts]
    assert len(texts) == (4 * 2 if kind == "es" else 2 * 2)
    assert float(row["train/completions/mean_length"]) == pytest.approx(float(mask.sum(-1).mean()), rel=1e-6)
    assert float(row["train/completions/clipped_ratio"]) == pytest.approx(float(truncated.mean()), abs=1e-7)
    assert float(row["train/entropy"]) == pytest.approx(float((entropy * mask).sum() / mask.sum()), rel=1e-5)
    assert float(row["train/accuracy"]) == 0.0  # an untrained model solves no Countdown problem
    lr = float(row["train/lr"])
    assert lr == pytest.approx(0.01 if kind == "es" else 1e-3)
    rewards = torch.tensor([sum(map(ord, t)) % 97 / 97 for t in texts], dtype=torch.float64)
    if kind == "es":  # member rewards: the mean of each member's 2 completions
        rewards = rewards.view(4, 2).mean(-1)
    assert float(row["train/reward_mean"]) == pytest.approx(float(rewards.mean()), rel=1e-6)
    assert float(row["train/reward_std"]) == pytest.approx(float(rewards.std(unbiased=False)), rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_one_step_under_bf16_precision(kind, precision, tiny_model_dir):
    """Lightning sets the default dtype to bf16 inside training_step under bf16-true: every tensor the step makes must
    say its dtype (an ES step once crashed on `Index put requires the source and destination dtypes match`)."""
    module = _module(kind, tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(max_steps=1, accelerator="cpu", precision=precision, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, _dm())
    assert trainer.global_step == 1
    params = dict(module.model.named_parameters())
    expected = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(p.dtype == expected and torch.isfinite(p).all() for p in params.values())
    assert any(not torch.equal(p.float(), before[n]) for n, p in params.items()), "the step moved the weights"
    for key in SHARED:
        value = trainer.logged_metrics[key]
        assert value.dtype == torch.float32 and torch.isfinite(value), key


def test_device_time_waits_for_cuda_work(monkeypatch):
    """CUDA kernels run asynchronously: a step clock read right after the last call of a phase (GRPO's update: its last
    backward and AdamW step) stopped before the GPU had done it, and that time went to the next phase's
    ``train/time/generate_s``. ``device_time`` synchronises a CUDA device first; a CPU has nothing queued."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    before = device_time("cpu")
    assert calls == []
    after = device_time(torch.device("cuda", 1))
    assert calls == [torch.device("cuda", 1)] and after >= before


class _Constant(CountdownTask):
    """Every completion scores 0.5: no member or completion can be told apart."""

    def reward(self, completions, examples):
        return [0.5] * len(completions)


@pytest.mark.parametrize(("kind", "model", "task", "scored"), [
    ("es", "builtin", _Constant(), "all scored 0.5"),  # the built-in model, a reward all-equal
    ("es", "qwen_like", CountdownTask(use_chat_template=True), "all scored 0"),  # an untrained model never solves it
    ("grpo", "builtin", _Constant(), r"scored the same reward \(all 0.5\)"),
    ("grpo", "qwen_like", CountdownTask(use_chat_template=True), r"scored the same reward \(all 0\)"),
])
def test_a_step_whose_rewards_are_all_equal_warns_once_that_its_update_is_zero(kind, model, task, scored,
                                                                                 qwen_like_small_dir):
    """Every member (ES) or every group's completions (GRPO) scoring one reward makes a zero update: a fit of such
    steps learned nothing without a word (only frac_reward_zero_std = 1.0 said so). One warning, after the first such
    step, names it and the fixes; the weights are indeed unchanged (checked by hand), and a fit whose rewards differ
    says nothing."""
    path = "builtin:countdown-tiny" if model == "builtin" else qwen_like_small_dir
    module = _module(kind, path, task)
    module.configure_model()
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = L.Trainer(max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False)
    with pytest.warns(UserWarning) as caught:  # the data module's task is the module's (a chat template for Qwen)
        trainer.fit(module, _dm(task if model == "qwen_like" else "countdown"))
    said = [str(w.message) for w in caught if "update is zero" in str(w.message)]
    name, who = ("ES", "4 population members") if kind == "es" else ("GRPO", "2 completions of every group")
    assert len(said) == 1, said  # once, not once a step
    assert re.match(rf"{name} step 0: the {who} {scored}", said[0]), said[0]
    assert kind == "es" or "(only the beta=0.05 term moves the weights)" in said[0]
    assert "frac_reward_zero_std is 1.0" in said[0] and "format_reward" in said[0]
    assert ("larger sigma" if kind == "es" else "larger group_size") in said[0]
    assert float(trainer.logged_metrics["train/frac_reward_zero_std"]) == 1.0
    assert float(trainer.logged_metrics["train/reward_std"]) == 0.0
    assert trainer.global_step == 2 and all(torch.equal(p, before[n]) for n, p in module.model.named_parameters())

    module = _module(kind, "builtin:countdown-tiny")  # rewards that differ: not a word
    trainer = L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, limit_val_batches=0,
                        enable_progress_bar=False, enable_model_summary=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, _dm())
    assert not [w for w in caught if "update is zero" in str(w.message)]
