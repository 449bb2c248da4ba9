"""ESModule invariants: no autograd, step counting, seeded layout-independent noise, exact restore, fp32 update,
degenerate rewards, exact resume — each on a real Trainer with a real (tiny) HF model and data module."""

from __future__ import annotations

import importlib.util
import math
import warnings

import lightning as L
import pytest
import torch
from es_helpers import CharSumTask
from lightning.pytorch.callbacks import ModelCheckpoint

from es_lightning import ESModule, ReasoningDataModule
from es_lightning.es.noise import CHUNK, param_noise
from es_lightning.es.update import normalize_rewards
from es_lightning.tasks import CountdownTask


def _trainer(tmp_path=None, max_steps=2, callbacks=(), **kw):
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=bool(tmp_path),
        limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
        default_root_dir=tmp_path, **kw,
    )


def _dm(**kw):
    kw = {"train_size": 32, "val_size": 4, "test_size": 4, "batch_size": 4, "seed": 0, **kw}
    return ReasoningDataModule(task=CountdownTask(), **kw)


def _module(model_dir, **kw):
    kw = {"population_size": 4, "sigma": 0.05, "lr": 0.05, "max_new_tokens": 6, "reward_normalization": "centered",
          **kw}
    return ESModule(model=model_dir, **kw)


def _weights(module):
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


# ---------------------------------------------------------------------------------------------------- noise
def test_noise_is_layout_independent_and_per_tensor():
    numel = 3 * CHUNK + 123  # several chunks and a ragged end
    whole = param_noise(7, 3, 1, "layer.weight", numel)
    rows, cols = 1000, numel // 1000
    numel = rows * cols
    whole = param_noise(7, 3, 1, "layer.weight", numel).view(rows, cols)
    top = param_noise(7, 3, 1, "layer.weight", numel, 0, 400 * cols).view(400, cols)  # a row-shard
    bottom = param_noise(7, 3, 1, "layer.weight", numel, 400 * cols, numel).view(600, cols)
    assert torch.equal(torch.cat([top, bottom]), whole)
    # same shape, different name / member / step / seed → different noise
    for other in (
        param_noise(7, 3, 1, "other.weight", numel), param_noise(7, 3, 2, "layer.weight", numel),
        param_noise(7, 4, 1, "layer.weight", numel), param_noise(8, 3, 1, "layer.weight", numel),
    ):
        assert not torch.equal(other.view(rows, cols), whole)
        assert abs(torch.corrcoef(torch.stack([other, whole.flatten()]))[0, 1]) < 0.01
    assert whole.dtype == torch.float32
    assert abs(float(whole.mean())) < 0.01 and abs(float(whole.std()) - 1) < 0.01


def test_reward_normalizations_against_hand_values():
    r = torch.tensor([1.0, 0.0, 0.1, 1.0])
    mean = (1 + 0 + 0.1 + 1) / 4
    std = math.sqrt(sum((x - mean) ** 2 for x in [1, 0, 0.1, 1]) / 4)
    assert torch.allclose(normalize_rewards(r, "zscore"), torch.tensor([(x - mean) / std for x in [1, 0, 0.1, 1]]))
    assert torch.allclose(normalize_rewards(r, "centered"), torch.tensor([x - mean for x in [1, 0, 0.1, 1]]))
    # ranks 0..3 with the tie of the two 1.0s sharing rank 2.5 → rank/3 − 0.5
    assert torch.allclose(normalize_rewards(r, "rank"), torch.tensor([2.5 / 3 - 0.5, -0.5, 1 / 3 - 0.5, 2.5 / 3 - 0.5]))
    assert torch.equal(normalize_rewards(torch.full((5,), 0.1), "zscore"), torch.zeros(5))
    with pytest.raises(ValueError, match="reward_normalization"):
        normalize_rewards(r, "softmax")


def test_bad_hyperparameters_fail_clearly():
    with pytest.raises(ValueError, match="sigma must be a positive"):
        ESModule(sigma=0.0)
    with pytest.raises(ValueError, match="population_size must be even"):
        ESModule(population_size=5, antithetic=True)
    with pytest.raises(ValueError, match="population_size must be >= 2"):
        ESModule(population_size=1)
    with pytest.raises(ValueError, match="reward_normalization"):
        ESModule(reward_normalization="softmax")
    with pytest.raises(ValueError, match=r"samples_per_member=3 at temperature 0 gives 3 identical .* temperature > 0"):
        ESModule(samples_per_member=3)  # greedy (ES's default) duplicates: 3x the generation, the same rewards
    ESModule(samples_per_member=3, temperature=1.0)
    if importlib.util.find_spec("vllm") is None:  # the optional backend without its package: one line, the install
        with pytest.raises(ImportError, match=r'pip install "es-lightning\[vllm\]"'):
            ESModule(generation_backend="vllm")
    with pytest.raises(ValueError, match="generation_backend must be one of"):
        ESModule(generation_backend="sglang")


def test_a_trainable_pattern_that_matches_nothing_says_why(tiny_model_dir):
    """The tiny model ties its head to the embedding: "lm_head" names no tensor of its own, and the error says which
    name to match; a pattern that matches nothing at all shows what names look like."""
    from es_lightning.es.evaluators import perturbed_parameters

    model = ESModule(model=tiny_model_dir).policy.model
    with pytest.raises(ValueError, match=r"lm_head.weight is tied to model.embed_tokens.weight .* match "
                                         r"'model.embed_tokens.weight' instead"):
        perturbed_parameters(model, "lm_head")
    with pytest.raises(ValueError, match=r"matches no parameter name of the model \(names look like 'model\."):
        perturbed_parameters(model, "no_such_layer")
    assert [n for n, _ in perturbed_parameters(model, "embed_tokens")] == ["model.embed_tokens.weight"]


# ---------------------------------------------------------------------------------------------------- the step
def test_fit_counts_steps_never_touches_autograd_and_logs(tiny_model_dir):
    module = _module(tiny_model_dir, temperature=1.0)
    trainer = _trainer(max_steps=3)
    trainer.fit(module, _dm())
    assert trainer.global_step == 3
    assert all(p.grad is None for p in module.model.parameters())
    logged = trainer.logged_metrics
    for key in ("train/reward_mean", "train/reward_std", "train/reward_max", "train/frac_reward_zero_std",
                "train/js_succ", "train/pass_pop", "train/update_norm", "train/drift", "train/accuracy",
                "train/time/generate_s", "train/time/update_s"):
        assert key in logged, key


def _eval_mode_warnings(module) -> list[str]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _trainer(max_steps=1).fit(module, _dm())
    return [str(w.message) for w in seen if "in eval mode at the start of training" in str(w.message)]


@pytest.mark.parametrize("model", ["tiny_model_dir", "qwen_like_small_dir"])
def test_python_fit_reports_only_the_users_own_eval_mode_modules(model, request, tiny_model_dir):
    """A fit from Python warned "Found N module(s) in eval mode" of the policy (``from_pretrained`` returns eval mode),
    which misled: ES's rollouts run in eval mode whatever the policy's mode (the generator sets it). The policy now
    trains in train mode, as under GRPO; every forward of a rollout still runs in eval mode (also the Qwen-like bf16
    fixture's, chat template and generation defaults); a user's own submodule left in eval mode is still reported."""
    module = _module(request.getfixturevalue(model), **({"dtype": "bfloat16"} if model == "qwen_like_small_dir" else {}))
    modes = []
    module.policy.model.register_forward_pre_hook(lambda model, args: modes.append(model.training))
    assert _eval_mode_warnings(module) == []
    assert module.model.training and modes and not any(modes)

    module = _module(tiny_model_dir)
    module.frozen_head = torch.nn.Linear(2, 2).eval()
    assert [m.split(" This")[0] for m in _eval_mode_warnings(module)] == [
        "Found 1 module(s) in eval mode at the start of training."]


def test_update_equals_independent_computation_and_centre_is_restored(tiny_model_dir):
    """One step: θ1 = θ0 + α/N Σ z_n ε_n with z computed here from the member rewards, noise from its key."""
    module = _module(tiny_model_dir, reward_normalization="zscore", sigma=0.5, lr=0.01, task=CharSumTask())
    module.configure_model()
    theta0 = _weights(module)
    trainer = _trainer(max_steps=1)
    trainer.fit(module, _dm())
    rewards = module.last_rewards.double()
    assert not bool((rewards == rewards[0]).all())
    z = (rewards - rewards.mean()) / rewards.std(unbiased=False)
    for name, p in module.model.named_parameters():
        delta = torch.zeros(p.numel(), dtype=torch.float64)
        for member in range(4):
            delta += z[member] * param_noise(module.seed, 0, member, name, p.numel()).double()
        expected = (theta0[name].double().flatten() + 0.01 / 4 * delta).view_as(p)
        assert torch.allclose(p.double(), expected, atol=1e-6), name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_zero_lr_keeps_weights_bitwise(tiny_model_dir, dtype):
    module = _module(tiny_model_dir, lr=0.0, dtype=dtype, temperature=1.0)
    module.configure_model()
    theta0 = _weights(module)
    _trainer(max_steps=3).fit(module, _dm())
    for name, p in module.model.named_parameters():
        assert p.dtype == getattr(torch, dtype)
        assert torch.equal(p, theta0[name]), name


def test_bf16_update_accumulates_in_fp32(tiny_model_dir):
    """A bf16 model gets (θ.float() + Δ_fp32).to(bf16): the same as the fp32 update rounded once."""
    kw = dict(sigma=0.5, lr=0.01, reward_normalization="zscore", task=CharSumTask())
    m16 = _module(tiny_model_dir, dtype="bfloat16", **kw)
    m16.configure_model()
    theta0 = _weights(m16)
    _trainer(max_steps=1).fit(m16, _dm())
    rewards = m16.last_rewards.double()
    assert not bool((rewards == rewards[0]).all())
    z = ((rewards - rewards.mean()) / rewards.std(unbiased=False)).float()
    for name, p in m16.model.named_parameters():
        delta = sum(z[m] * param_noise(m16.seed, 0, m, name, p.numel()) for m in range(4)).view_as(p)
        expected = (theta0[name].float() + 0.01 / 4 * delta).to(torch.bfloat16)
        assert (p.float() - expected.float()).abs().max() <= 2 ** -7 * expected.float().abs().max(), name


class _ConstantTask(CountdownTask):
    def reward(self, completions, examples):
        return [0.1] * len(completions)


def test_all_equal_rewards_give_zero_update(tiny_model_dir):
    module = _module(tiny_model_dir, task=_ConstantTask())
    module.configure_model()
    theta0 = _weights(module)
    trainer = _trainer(max_steps=2)
    trainer.fit(module, _dm())
    assert float(trainer.logged_metrics["train/frac_reward_zero_std"]) == 1.0
    assert float(trainer.logged_metrics["train/update_norm"]) == 0.0
    for name, p in module.model.named_parameters():
        assert torch.equal(p, theta0[name])


def test_exact_resume_is_bitwise(tmp_path, tiny_model_dir):
    kw = dict(temperature=1.0, task=CharSumTask())  # rewards that differ: the weights move
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    full = _module(tiny_model_dir, **kw)
    first = _trainer(tmp_path / "a", max_steps=4, callbacks=[ckpt])
    first.fit(full, _dm(batch_size=4, train_size=12))
    resumed = _module(tiny_model_dir, **kw)
    trainer = _trainer(tmp_path / "b", max_steps=4)
    trainer.fit(resumed, _dm(batch_size=4, train_size=12), ckpt_path=str(tmp_path / "a" / "step=2.ckpt"))
    assert trainer.global_step == 4
    for (name, a), (_, b) in zip(full.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    # drift is measured from the fit's first weights, which the checkpoint carried (ParameterDrift's state)
    drift = float(trainer.callback_metrics["train/drift"])
    assert drift > 0 and drift == float(first.callback_metrics["train/drift"])
