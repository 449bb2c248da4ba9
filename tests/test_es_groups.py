"""``ESModule(prompt_groups=G)``: the population in G groups of consecutive members, group g scored only on slice g of
the step's prompts and normalised within itself — on a real Trainer, the tiny model and the Qwen-like fixture.

Checked against independent computations: which prompts each member saw (a reward that is the prompt's own target
number, so a member's reward is the mean target of its slice, computed here from the batch), and one full step by hand
(each member's weights θ + σε written here, its slice generated and graded, z-scored within its group, the update
formed here in float64). (DDP: tests/test_es_ddp.py.)
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from es_helpers import CharSumTask, RecordBatches

from es_lightning import ESModule, ReasoningDataModule
from es_lightning.es.algorithm import ESSettings
from es_lightning.es.evaluators import ShardedEvaluator
from es_lightning.es.noise import param_noise
from es_lightning.tasks import CountdownTask


class _TargetTask(CountdownTask):
    """Each completion earns its prompt's target / 1000, whatever it says: a member's reward names the prompts it saw."""

    def reward(self, completions, examples):
        return [e["target"] / 1000 for e in examples]


def _trainer(max_steps, callbacks=()):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks))


def _dm(batch_size=4, use_chat_template=False):
    return ReasoningDataModule(task=CountdownTask(use_chat_template=use_chat_template), train_size=32, val_size=4,
                               test_size=4, batch_size=batch_size, seed=0)


@pytest.mark.parametrize("model, layout", [
    ("tiny", {}),  # member by member, in place
    ("tiny", {"members_per_batch": 3}),  # full-rank copies, 3 members per generate (blocks straddle the groups)
    ("tiny", {"noise_rank": 1, "members_per_batch": 6}),  # low-rank, the whole population in one generate
    ("qwen_like", {"noise_rank": 1, "members_per_batch": 6, "dtype": "bfloat16"}),  # real vocabulary, chat template, bf16
])
def test_each_group_is_scored_on_its_slice_only(request, model, layout):
    """N = 6 in G = 3 groups, B = 6 prompts: members 2g and 2g+1 earn the mean target of prompts 2g, 2g+1 and nothing
    else; within a group the rewards are equal, so every group has zero spread and the update is zero."""
    model_dir = request.getfixturevalue("tiny_model_dir" if model == "tiny" else "qwen_like_dir")
    seen = RecordBatches()
    module = ESModule(model=model_dir, population_size=6, prompt_groups=3, sigma=0.05, lr=0.05, max_new_tokens=2,
                      task=_TargetTask(use_chat_template=model == "qwen_like"), **layout)
    module.configure_model()
    start = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    trainer = _trainer(1, [seen])
    trainer.fit(module, _dm(batch_size=6, use_chat_template=model == "qwen_like"))  # the module's task's settings
    (batch,) = seen.batches
    if model == "qwen_like":  # the prompts the members saw went through Qwen's chat template
        assert module.prompts(batch[:1])[0].startswith("<|im_start|>")
    expected = [sum(e["target"] for e in batch[2 * (m // 2):2 * (m // 2) + 2]) / 2 / 1000 for m in range(6)]
    assert len(set(expected)) > 1  # the slices differ, so a member on the wrong slice would show
    assert torch.allclose(module.last_rewards.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-6)
    assert float(trainer.logged_metrics["train/frac_reward_zero_std"]) == 1.0
    for name, p in module.model.named_parameters():
        assert torch.equal(p, start[name]), name


def test_one_step_equals_the_step_computed_by_hand(tiny_model_dir):
    """N = 4, G = 2, B = 4, greedy, z-score: member n's reward is what θ0 + σε_n earns on its group's two prompts
    (weights written, generated and graded here); z is z-scored within each group; θ1 = θ0 + α/N Σ z_n ε_n."""
    sigma, lr, n = 0.5, 0.01, 4
    seen = RecordBatches()
    module = ESModule(model=tiny_model_dir, population_size=n, prompt_groups=2, sigma=sigma, lr=lr, max_new_tokens=6,
                      reward_normalization="zscore", task=CharSumTask())
    module.configure_model()
    theta0 = {k: p.detach().clone() for k, p in module.model.named_parameters()}
    _trainer(1, [seen]).fit(module, _dm())
    (batch,) = seen.batches

    probe = ESModule(model=tiny_model_dir, max_new_tokens=6, task=CharSumTask())
    probe.configure_model()
    rewards = []
    for m in range(n):
        with torch.no_grad():
            for name, p in probe.model.named_parameters():
                eps = param_noise(module.seed, 0, m, name, p.numel()).view_as(p)
                p.copy_(theta0[name] + sigma * eps)
        mine = batch[2 * (m // 2):2 * (m // 2) + 2]
        texts = probe.generator.generate(probe.prompts(mine), 1, probe.sampling_params()).texts
        rewards.append(sum(sum(map(ord, t)) % 97 / 97 for t in texts) / 2)
    rewards = torch.tensor(rewards, dtype=torch.float64)
    assert torch.allclose(module.last_rewards.double(), rewards, atol=1e-6)

    z = torch.empty(n, dtype=torch.float64)
    for group in (slice(0, 2), slice(2, 4)):
        r = rewards[group]
        assert r[0] != r[1]  # both groups carry signal
        z[group] = (r - r.mean()) / r.std(unbiased=False)  # two members: ±1
    for name, p in module.model.named_parameters():
        delta = sum(z[m] * param_noise(module.seed, 0, m, name, p.numel()).double() for m in range(n))
        expected = theta0[name].double() + lr / n * delta.view_as(p)
        assert torch.allclose(p.double(), expected, atol=1e-6), name


def test_group_metrics_cover_only_what_each_group_saw():
    """accuracy, member accuracy, js_succ and pass_pop come from the observed [N/G, B/G] blocks, never from the zeros
    of prompts a member did not see."""
    from es_lightning.es.algorithm import ESAlgorithm, _block_mean
    from es_lightning.metrics import js_succ, population_pass

    algo = ESAlgorithm(ESSettings(population_size=4, prompt_groups=2))
    success = torch.tensor([[1.0, 0.0, 0.0, 0.0],  # members 0, 1 saw prompts 0, 1; members 2, 3 prompts 2, 3
                            [1.0, 1.0, 0.0, 0.0],
                            [0.0, 0.0, 0.0, 1.0],
                            [0.0, 0.0, 0.0, 0.0]])
    blocks = algo.success_blocks(success)
    assert [b.tolist() for b in blocks] == [[[1.0, 0.0], [1.0, 1.0]], [[0.0, 1.0], [0.0, 0.0]]]
    assert torch.cat([b.mean(-1) for b in blocks]).tolist() == [0.5, 1.0, 0.5, 0.0]
    # pass_pop by hand: prompts 0..3 are solved by some member of their group: 1, 1, 0, 1
    assert _block_mean(population_pass, blocks) == pytest.approx(0.75)
    # js_succ by hand: per prompt h(mean p) - mean h(p); with 0/1 successes h(p) = 0, so h(mean): ln2 where 1 of 2
    ln2 = torch.log(torch.tensor(2.0)).item()
    assert _block_mean(js_succ, blocks) == pytest.approx((0 + ln2 + 0 + ln2) / 4)


def test_bad_prompt_groups_fail_with_the_fix(tiny_model_dir):
    with pytest.raises(ValueError, match=r"prompt_groups must be an integer >= 1.*got 0"):
        ESModule(prompt_groups=0)
    with pytest.raises(ValueError, match=r"prompt_groups=3 needs population_size to be a multiple.*use population_size: 6"):
        ESModule(population_size=4, prompt_groups=3)
    with pytest.raises(ValueError, match=r"at least 2 members per group.*use population_size: 8"):
        ESModule(population_size=4, prompt_groups=4)
    with pytest.raises(ValueError, match=r"antithetic pairs must stay in one group.*use population_size: 8"):
        ESModule(population_size=6, prompt_groups=2, antithetic=True)
    module = ESModule(model=tiny_model_dir, population_size=4, prompt_groups=2, max_new_tokens=2)
    trainer = _trainer(1)
    with pytest.raises(ValueError, match=r"prompt_groups=2 splits each batch into 2 equal slices, but a batch has 3 "
                                         r"prompts; set data.batch_size to a multiple of 2"):
        trainer.fit(module, _dm(batch_size=3))
    assert trainer.global_step == 0 and module.model is None  # at setup, before the model loads
    with pytest.raises(ValueError, match=r"prompt_groups=2 is not supported on a sharded \(FSDP\).*prompt_groups: 1"):
        ShardedEvaluator(ESSettings(population_size=4, prompt_groups=2)).check(module)
    assert ESSettings().prompt_groups == 1  # every member sees every prompt by default (Ba et al.)
