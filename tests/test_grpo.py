"""GRPOModule: the loss against hand-written formulas and TRL, log-prob consistency, zero-variance groups, a real fit,
resume, DDP. Real Trainer, real tiny HF model, real data module; no mocks.

An untrained model never solves Countdown, so its rewards are all 0 and GRPO has nothing to learn from. The fit tests
give the module :class:`DigitShareCountdown`, a real task whose reward adds partial credit for digit characters — enough
reward variance for the untrained fixture to get gradients.
"""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from es_lightning import PassAtKCallback, ReasoningDataModule
from es_lightning.grpo.logprobs import completion_logprobs
from es_lightning.grpo.loss import LOSS_TYPES, group_advantages, grpo_loss
from es_lightning.modules.grpo import GRPOModule
from es_lightning.policy import load_policy
from es_lightning.tasks import CountdownTask

ROOT = Path(__file__).resolve().parents[1]


class DigitShareCountdown(CountdownTask):
    """Countdown reward plus the share of digit characters in the completion (a learning signal for a random model)."""

    def reward(self, completions, examples):
        base = super().reward(completions, examples)
        return [b + sum(c.isdigit() for c in t) / max(1, len(t)) for b, t in zip(base, completions)]


class ConstantRewardCountdown(CountdownTask):
    """Every completion scores the same: every group has zero reward variance."""

    def reward(self, completions, examples):
        return [0.5] * len(completions)


def _module(model_dir, **kw):
    args = dict(model=model_dir, task=DigitShareCountdown(), group_size=4, lr=1e-2, max_new_tokens=8, seed=0)
    args.update(kw)
    return GRPOModule(**args)


def _data(**kw):
    args = dict(task="countdown", train_size=16, val_size=4, test_size=4, batch_size=2, val_batch_size=4, seed=0)
    args.update(kw)
    return ReasoningDataModule(**args)


def _trainer(tmp_path, max_steps, callbacks=(), **kw):
    return L.Trainer(
        max_steps=max_steps, accelerator="cpu", devices=1, logger=CSVLogger(str(tmp_path), name="logs"),
        callbacks=[PassAtKCallback(num_samples=2, ks=(1,)), *callbacks], enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, log_every_n_steps=1, **kw,
    )


def _params(module):
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


# ---------------------------------------------------------------------------------------------------- config
@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(group_size=1), "group_size"),
        (dict(epsilon_low=-0.1), "epsilon"),
        (dict(epsilon_high=-0.1), "epsilon"),
        (dict(loss_type="ppo"), "loss_type"),
        (dict(scale_rewards="std"), "scale_rewards"),
        (dict(temperature=0.0), "temperature"),
        (dict(beta=-1.0), "beta"),
        (dict(num_iterations=0), "num_iterations"),
    ],
)
def test_bad_config_is_refused_with_the_fix(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOModule(model="unused", **kwargs)


# ---------------------------------------------------------------------------------------------------- the loss
def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.1, 0.0, 0.5, 0.5, 0.5, 0.5])
    G = 4
    for scale in ("group", "batch", "none"):
        adv, std = group_advantages(rewards, G, scale)
        flat = rewards.tolist()
        batch_mean = sum(flat) / len(flat)
        batch_std = math.sqrt(sum((r - batch_mean) ** 2 for r in flat) / (len(flat) - 1))
        for g in range(2):
            grp = flat[g * G:(g + 1) * G]
            mean = sum(grp) / G
            sd = math.sqrt(sum((r - mean) ** 2 for r in grp) / (G - 1))
            for j in range(G):
                want = grp[j] - mean
                want /= {"group": sd + 1e-4, "batch": batch_std + 1e-4, "none": 1.0}[scale]
                assert adv[g * G + j].item() == pytest.approx(want, abs=1e-6)
                assert std[g * G + j].item() == pytest.approx(sd, abs=1e-6)
    # the all-equal group has advantage exactly 0 whatever the scaling
    assert (group_advantages(rewards, G, "group")[0][4:] == 0).all()


def _fixed_batch(seed=0, N=6, C=5):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(N, C, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + 1.0 * (torch.rand(N, C, generator=g) - 0.5)  # ratios on both sides of the clip range
    ref = logps.detach() + 0.3 * (torch.rand(N, C, generator=g) - 0.5)
    adv = torch.randn(N, generator=g)
    lengths = [5, 3, 1, 4, 0, 2]
    mask = torch.tensor([[1.0 if t < n else 0.0 for t in range(C)] for n in lengths])
    entropy = torch.rand(N, C, generator=g) * 2
    return logps, old, ref, adv, mask, entropy


def _hand_loss(logps, old, ref, adv, mask, entropy, loss_type, eps_low, eps_high, beta, ent_coef, max_len,
               num_items, accum):
    """The per-token clipped objective and TRL's four aggregations, written with plain loops."""
    N, C = len(logps), len(logps[0])
    per_tok = [[0.0] * C for _ in range(N)]
    for i in range(N):
        for t in range(C):
            ratio = math.exp(logps[i][t] - old[i][t])
            clipped = min(max(ratio, 1 - eps_low), 1 + eps_high)
            loss = -min(ratio * adv[i], clipped * adv[i])
            if beta:
                d = ref[i][t] - logps[i][t]
                loss += beta * (math.exp(d) - d - 1) * ratio
            per_tok[i][t] = loss
    active = sum(sum(row) for row in mask)
    if loss_type == "grpo":
        total = sum(sum(per_tok[i][t] * mask[i][t] for t in range(C)) / max(1.0, sum(mask[i])) for i in range(N)) / N
    elif loss_type == "bnpo":
        total = sum(per_tok[i][t] * mask[i][t] for i in range(N) for t in range(C)) / active
    elif loss_type == "dr_grpo":
        total = sum(per_tok[i][t] * mask[i][t] for i in range(N) for t in range(C)) / (N * max_len)
    else:  # dapo
        total = sum(per_tok[i][t] * mask[i][t] for i in range(N) for t in range(C)) / num_items
    if loss_type != "dapo":
        total /= accum
    mean_entropy = sum(entropy[i][t] * mask[i][t] for i in range(N) for t in range(C)) / active
    return total - ent_coef * mean_entropy / accum


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta, entropy_coef, accum", [(0.0, 0.0, 1), (0.04, 0.01, 2)])
def test_loss_equals_hand_computation(loss_type, beta, entropy_coef, accum):
    logps, old, ref, adv, mask, entropy = _fixed_batch()
    kw = dict(loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28, beta=beta, entropy_coef=entropy_coef,
              max_completion_length=7, num_items=19.0, accumulation_steps=accum)
    loss, stats = grpo_loss(logps, old, adv, mask, ref_logps=ref, entropy=entropy, **kw)
    want = _hand_loss(logps.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(), entropy.tolist(),
                      loss_type, 0.2, 0.28, beta, entropy_coef, 7, 19.0, accum)
    assert loss.item() == pytest.approx(want, abs=1e-6)
    # ratio clipping was exercised on both sides, and the diagnostics are detached
    assert stats["clip_ratio/region_mean"] > 0
    assert not any(v.requires_grad for v in stats.values())
    loss.backward()
    assert torch.isfinite(logps.grad).all()


@pytest.fixture(scope="module")
def trl_trainer(tiny_model_dir, tmp_path_factory):
    """TRL's own GRPOTrainer on the tiny model; its ``_compute_loss`` is called with hand-made inputs."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    policy = load_policy(tiny_model_dir)
    config = GRPOConfig(
        output_dir=str(tmp_path_factory.mktemp("trl")), report_to=[], use_cpu=True, per_device_train_batch_size=8,
        num_generations=4, max_completion_length=8, save_strategy="no", bf16=False, epsilon=0.2, epsilon_high=0.28,
    )
    trainer = GRPOTrainer(
        model=policy.model, reward_funcs=lambda completions, **kw: [0.0] * len(completions), args=config,
        train_dataset=Dataset.from_list([{"prompt": "c:3 5 7>22="}] * 8), processing_class=policy.tokenizer,
    )
    trainer.model.train()
    return trainer


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("beta, entropy_coef, accum", [(0.0, 0.0, 1), (0.05, 0.02, 2)])
def test_loss_equals_trl_grpo_trainer(trl_trainer, tiny_model_dir, loss_type, beta, entropy_coef, accum):
    """TRL 1.16 ``GRPOTrainer._compute_loss`` and ours agree on the same model, tokens, advantages and π_old."""
    module = _module(tiny_model_dir, max_new_tokens=8, task="countdown")
    examples = [{"nums": [3, 5, 7], "target": 22}, {"nums": [2, 4, 6], "target": 12}]  # equal-length prompts
    rollout, _ = module.rollout(examples, 4, seed=3, return_logprobs=True)
    g = torch.Generator().manual_seed(1)
    advantages = torch.randn(8, generator=g)
    old = rollout.logprobs - 0.3 * torch.rand(rollout.logprobs.shape, generator=g)  # off-policy: clipping happens
    ref = rollout.logprobs + 0.2 * torch.randn(rollout.logprobs.shape, generator=g)
    num_items = rollout.completion_mask.sum()

    trl_trainer.loss_type, trl_trainer.beta = loss_type, beta
    trl_trainer.entropy_coef, trl_trainer._entropy_bonus_enabled = entropy_coef, entropy_coef != 0
    # TRL's default layout: one generation batch = one accumulation window of `accum` micro-batches
    trl_trainer.current_gradient_accumulation_steps = trl_trainer.args.steps_per_generation = accum
    trl_trainer._metrics["train"].clear()
    inputs = dict(
        prompt_ids=rollout.prompt_ids, prompt_mask=rollout.prompt_mask, completion_ids=rollout.completion_ids,
        completion_mask=rollout.completion_mask, advantages=advantages, old_per_token_logps=old,
        ref_per_token_logps=ref, num_items_in_batch=num_items * accum,  # TRL: tokens of the whole accumulation window
    )
    theirs = trl_trainer._compute_loss(trl_trainer.model, inputs)

    rows = slice(None)  # the module's default training forward: prompts run once, KV cache shared by the group
    logps, entropy = completion_logprobs(module.model, rollout, rows, 1.0, entropy_grad=True, share_prompt=True)
    ours, stats = grpo_loss(
        logps, old, advantages, rollout.completion_mask, loss_type=loss_type, epsilon_low=0.2, epsilon_high=0.28,
        ref_logps=ref, beta=beta, entropy=entropy, entropy_coef=entropy_coef, max_completion_length=8,
        num_items=num_items * accum, accumulation_steps=accum,
    )
    assert ours.item() == pytest.approx(theirs.item(), abs=1e-5)
    metrics = trl_trainer._metrics["train"]
    for name in ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy"):
        assert stats[name].item() == pytest.approx(metrics[name][-1], abs=1e-5), name
    if beta:
        assert stats["kl"].item() == pytest.approx(metrics["kl"][-1], abs=1e-5)


# ---------------------------------------------------------------------------------------------------- log-probs
def test_training_forward_logprobs_match_generation(tiny_model_dir):
    module = _module(tiny_model_dir, temperature=0.8, mini_batch_size=3)
    module.configure_model()
    examples = [{"nums": [3, 5, 7], "target": 22}, {"nums": [12, 15, 3], "target": 60},
                {"nums": [1, 2, 3], "target": 6}]
    rollout, _ = module.rollout(examples, 4, seed=5, return_logprobs=True)
    assert not rollout.prompt_mask.all(), "prompts of different lengths exercise left padding"
    module.model.train()
    logps, entropy = completion_logprobs(module.model, rollout, slice(None), 0.8)
    mask = rollout.completion_mask.bool()
    gap = (logps[mask] - rollout.logprobs[mask]).abs().max()
    assert gap < 1e-5, gap
    assert torch.allclose(entropy[mask], rollout.entropy[mask], atol=1e-5)
    # mini-batch slices give the same numbers
    part, _ = completion_logprobs(module.model, rollout, slice(3, 7), 0.8)
    assert torch.allclose(part * rollout.completion_mask[3:7], logps[3:7] * rollout.completion_mask[3:7], atol=1e-6)


@pytest.mark.parametrize("rows", [slice(None), slice(3, 10)])
def test_shared_prompt_forward_equals_full_forward(tiny_model_dir, rows):
    """Running each prompt once and sharing its KV cache across the group gives the same log-probs, entropies and
    parameter gradients as running every prompt + completion row in full (also for a slice cutting groups)."""
    module = _module(tiny_model_dir)
    module.configure_model()
    examples = [{"nums": [3, 5, 7], "target": 22}, {"nums": [12, 15, 3], "target": 60},
                {"nums": [1, 2, 3], "target": 6}]
    rollout, _ = module.rollout(examples, 4, seed=2, return_logprobs=True)
    mask = rollout.completion_mask[rows]
    results = []
    for share in (False, True):
        module.model.zero_grad()
        logps, entropy = completion_logprobs(module.model, rollout, rows, 1.0, share_prompt=share)
        (logps * mask).sum().backward()
        results.append((logps.detach() * mask, entropy * mask, [p.grad.clone() for p in module.model.parameters()]))
    (full_lp, full_ent, full_grads), (shared_lp, shared_ent, shared_grads) = results
    assert torch.allclose(full_lp, shared_lp, atol=1e-5)
    assert torch.allclose(full_ent, shared_ent, atol=1e-5)
    for g_full, g_shared in zip(full_grads, shared_grads):
        assert torch.allclose(g_full, g_shared, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------- training
class _GradRecorder(L.Callback):
    def __init__(self):
        self.grads = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append([p.grad.clone() for p in pl_module.model.parameters() if p.grad is not None])


def test_equal_reward_groups_contribute_no_gradient(tiny_model_dir, tmp_path):
    module = _module(tiny_model_dir, task=ConstantRewardCountdown(), mini_batch_size=4)
    recorder = _GradRecorder()
    trainer = _trainer(tmp_path, 1, callbacks=[recorder], enable_checkpointing=False)
    module.configure_model()
    before = _params(module)
    trainer.fit(module, _data())
    assert trainer.global_step == 1
    assert recorder.grads and all(torch.count_nonzero(g) == 0 for g in recorder.grads[0])
    assert trainer.logged_metrics["train/frac_reward_zero_std"].item() == 1.0
    after = _params(module)
    assert all(torch.equal(before[k], after[k]) for k in before)


def _read_metrics(log_dir) -> list[dict[str, str]]:
    import csv

    with open(Path(log_dir) / "metrics.csv") as f:
        return list(csv.DictReader(f))


EXPECTED_METRICS = [
    "train/reward_mean", "train/reward_std", "train/accuracy", "train/frac_reward_zero_std", "train/entropy",
    "train/clip_ratio/low_mean", "train/clip_ratio/high_mean", "train/clip_ratio/region_mean",
    "train/completions/mean_length", "train/completions/clipped_ratio", "train/policy_loss", "train/grad_norm",
    "train/time/generate_s", "train/time/update_s",
]


def test_fit_logs_and_resumes_exactly(tiny_model_dir, tmp_path):
    """3 real steps; resuming from the step-2 checkpoint restores step, AdamW state and sampling, and ends on the same
    weights as the uninterrupted run. Three batches per epoch, so the resume lands mid-epoch: the data module's stream
    must continue with the batch the uninterrupted run saw next."""
    data = dict(train_size=3, batch_size=1)
    module = _module(tiny_model_dir, mini_batch_size=4, warmup_steps=1)
    module.configure_model()
    start = _params(module)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    trainer = _trainer(tmp_path / "a", 3, callbacks=[ckpt])
    trainer.fit(module, _data(**data))
    assert trainer.global_step == 3
    end = _params(module)
    assert any(not torch.equal(start[k], end[k]) for k in start), "parameters moved"
    rows = [r for r in _read_metrics(trainer.logger.log_dir) if r.get("train/reward_mean")]
    assert len(rows) == 3
    for name in EXPECTED_METRICS:
        assert all(r[name] != "" for r in rows), name
    assert "train/kl" not in rows[0]  # beta == 0: no reference, no KL
    # one pass on fresh rollouts: π_old (generation) equals π_θ (training forward), so nothing is clipped
    assert all(float(r["train/clip_ratio/region_mean"]) == 0.0 for r in rows)

    state = torch.load(tmp_path / "ckpt" / "step=2.ckpt", weights_only=False)
    seen = {}

    class Probe(L.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["step"] = trainer.global_step
            seen["optim"] = copy.deepcopy(trainer.optimizers[0].state_dict())

    resumed = _module(tiny_model_dir, mini_batch_size=4, warmup_steps=1)
    trainer_b = _trainer(tmp_path / "b", 3, callbacks=[Probe()], enable_checkpointing=False)
    trainer_b.fit(resumed, _data(**data), ckpt_path=str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert seen["step"] == 2 and trainer_b.global_step == 3
    saved = state["optimizer_states"][0]["state"]
    for idx, entry in seen["optim"]["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, saved[idx][key]), (idx, key)
    final = _params(resumed)
    for k in end:
        assert torch.equal(final[k], end[k]), k  # bitwise on CPU


def test_num_iterations_makes_that_many_optimizer_steps(tiny_model_dir, tmp_path):
    module = _module(tiny_model_dir, num_iterations=2, mini_batch_size=4, loss_type="grpo", epsilon_high=0.28,
                     mask_truncated_completions=True, max_new_tokens=4)
    trainer = _trainer(tmp_path, 4, enable_checkpointing=False)
    trainer.fit(module, _data())
    assert trainer.global_step == 4 and trainer.fit_loop.epoch_loop.batch_progress.total.completed == 2


def test_a_step_whose_completions_are_all_masked_says_so(tiny_model_dir, tmp_path):
    """mask_truncated_completions with every completion at max_new_tokens: the step trains on nothing — said in a
    warning that names both fixes, not left to a zero grad norm."""
    module = _module(tiny_model_dir, mask_truncated_completions=True, max_new_tokens=1)
    module.configure_model()
    before = _params(module)
    with pytest.warns(UserWarning, match=r"every completion hit max_new_tokens=1, .* raise max_new_tokens or set "
                                         r"mask_truncated_completions: false"):
        _trainer(tmp_path, 1, enable_checkpointing=False).fit(module, _data())
    assert all(torch.equal(v, before[k]) for k, v in _params(module).items())


def test_reference_policy_is_frozen_and_not_checkpointed(tiny_model_dir, tmp_path):
    module = _module(tiny_model_dir, beta=0.1, loss_type="dr_grpo", scale_rewards="none", entropy_coef=0.01)
    module.configure_model()
    ref = module.algorithm.reference_model(module)
    ref_before = {k: v.clone() for k, v in ref.state_dict().items()}
    trainer = _trainer(tmp_path, 2, enable_checkpointing=False)
    trainer.fit(module, _data())
    assert not any(p.requires_grad for p in ref.parameters()) and not ref.training
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ref_before.items())
    assert trainer.logged_metrics["train/kl"].item() > 0  # the policy moved away from the reference
    keys = list(module.state_dict())
    assert keys and all(k.startswith("model.") for k in keys)
    assert len(keys) == len(module.model.state_dict())
    without_ref = GRPOModule(model=tiny_model_dir)
    without_ref.configure_model()
    assert without_ref.algorithm.reference_model(without_ref) is None


DDP_SCRIPT = """
import json, sys, torch, lightning as L
sys.path.insert(0, {tests!r})
from test_grpo import DigitShareCountdown
from es_lightning import PassAtKCallback, ReasoningDataModule
from es_lightning.modules.grpo import GRPOModule

def checksum(module):
    params = torch.cat([p.detach().flatten() for p in module.model.parameters()])
    return torch.stack([params.sum(), (params * params).sum()])

class Checksum(L.Callback):
    def on_train_start(self, trainer, pl_module):
        self.start = checksum(pl_module).tolist()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rewards = trainer.strategy.all_gather(pl_module.last_rewards.double())  # [ranks, B*G] of the step

    def on_train_end(self, trainer, pl_module):
        sums = trainer.strategy.all_gather(checksum(pl_module))
        if trainer.is_global_zero:
            logged = trainer.logged_metrics
            json.dump({{"sums": sums.tolist(), "start": self.start, "step": trainer.global_step,
                       "reward": float(logged["train/reward_mean"]), "reward_std": float(logged["train/reward_std"]),
                       "rewards": self.rewards.tolist()}}, open({out!r}, "w"))

if __name__ == "__main__":
    torch.set_num_threads(1)
    module = GRPOModule(model={model!r}, task=DigitShareCountdown(), group_size=4, lr=1e-2, max_new_tokens=8,
                        mini_batch_size=4, scale_rewards="batch")
    data = ReasoningDataModule(task="countdown", train_size=16, val_size=4, test_size=4, batch_size=2)
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, num_sanity_val_steps=0,
                        callbacks=[PassAtKCallback(num_samples=2, ks=(1,)), Checksum()])
    trainer.fit(module, data)
"""


def test_ddp_two_cpu_processes_stay_in_sync(tiny_model_dir, tmp_path):
    out = tmp_path / "ddp.json"
    script = tmp_path / "ddp_grpo.py"
    script.write_text(textwrap.dedent(DDP_SCRIPT).format(tests=str(ROOT / "tests"), out=str(out), model=tiny_model_dir))
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["step"] == 2
    rank0, rank1 = result["sums"]
    assert rank0 == rank1, "ranks hold identical weights after 2 DDP steps"
    assert rank0 != result["start"], "and the weights moved"
    # the logged reward mean/std are of both ranks' completions (the std was the mean of the ranks' own stds)
    rewards = torch.tensor(result["rewards"], dtype=torch.float64)  # [2, B*G]
    assert not torch.equal(rewards[0], rewards[1])
    assert result["reward"] == pytest.approx(float(rewards.mean()), abs=1e-6)
    assert result["reward_std"] == pytest.approx(float(rewards.flatten().std(unbiased=False)), abs=1e-6)


def test_recipe_parses_against_the_code(capsys):
    """Every key of recipes/grpo.yaml is one GRPOModule / ReasoningDataModule / Trainer accepts."""
    from es_lightning.cli import cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["fit", "--config", str(ROOT / "recipes" / "grpo.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    printed = capsys.readouterr().out
    assert "GRPOModule" in printed and "group_size: 8" in printed
