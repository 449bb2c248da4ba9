"""GRPO data-parallel (DDP) and sharded (FSDP2 through ModelParallelStrategy): one step on 2 real CPU processes (gloo)
gives the weights of a 1-process step over the same batch.

The batch is fixed: 4 prompts, 2 per rank under 2 processes (the data module hands rank r every r-th batch of 2, which
together are the 1-process batch of 4), and each prompt's group is sampled on its own with a seed of its own, so the
rollouts do not depend on which rank or batch row a prompt lands on. What is compared is what the strategy changes: the
loss normalisation across ranks (``dapo``'s global token count), the gradient averaging of DDP / reduce-scatter of FSDP2,
clipping of the global norm, and the AdamW step on full vs sharded parameters. The FSDP2 run then also switches a
sharded GRPO fit to ES with ``SequentialStrategy`` and checks that the ES stage ran sharded and moved the weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch

from es_lightning import ReasoningDataModule
from es_lightning.generation import Rollout
from es_lightning.modules.grpo import GRPOModule
from es_lightning.tasks.countdown import CountdownTask

GRPO_KW = dict(group_size=4, lr=1e-2, max_new_tokens=6, loss_type="dapo", max_grad_norm=1.0)
DATA_KW = dict(task="countdown", train_size=16, val_size=4, test_size=4)


def _pad_left(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
    return torch.cat([t.new_full((t.shape[0], width - t.shape[1]), value), t], 1)


def _pad_right(t: torch.Tensor, width: int, value) -> torch.Tensor:
    return torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], 1)


def merge_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """Concatenate per-prompt rollouts: prompts left-padded, completions right-padded to common widths."""
    P = max(r.prompt_ids.shape[1] for r in parts)
    C = max(r.completion_ids.shape[1] for r in parts)
    return Rollout(
        texts=[t for r in parts for t in r.texts],
        prompt_ids=torch.cat([_pad_left(r.prompt_ids, P, pad_id) for r in parts]),
        prompt_mask=torch.cat([_pad_left(r.prompt_mask, P, 0) for r in parts]),
        completion_ids=torch.cat([_pad_right(r.completion_ids, C, pad_id) for r in parts]),
        completion_mask=torch.cat([_pad_right(r.completion_mask, C, 0) for r in parts]),
        truncated=torch.cat([r.truncated for r in parts]),
        num_samples=parts[0].num_samples,
        logprobs=torch.cat([_pad_right(r.logprobs, C, 0.0) for r in parts]),
        entropy=torch.cat([_pad_right(r.entropy, C, 0.0) for r in parts]),
    )


class PerPromptGRPO(GRPOModule):
    """GRPO whose groups are sampled prompt by prompt, seeded by the prompt: the same rollouts on any layout."""

    def sample(self, examples, num_samples=1, params=None, seed=None, return_logprobs=False):
        parts = []
        for example in examples:
            prompt = self.prompts([example])
            prompt_seed = sum(map(ord, prompt[0])) * 1000 + self.global_step
            parts.append(self.generator.generate(prompt, num_samples, params or self.sampling_params(),
                                                 seed=prompt_seed, return_logprobs=True))
        return merge_rollouts(parts, self.tokenizer.pad_token_id)

    def score(self, completions, examples, step=None):
        scores = super().score(completions, examples, step)
        scores.rewards = torch.tensor([sum(map(ord, t)) % 97 / 97 for t in completions])  # rewards that differ
        return scores


SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from lightning.pytorch.strategies import ModelParallelStrategy
    sys.path.insert(0, {tests!r})
    from test_sharding_grpo import GRPO_KW, DATA_KW, PerPromptGRPO
    from es_lightning import ReasoningDataModule

    if __name__ == "__main__":
        torch.set_num_threads(1)
        mode = sys.argv[1]
        module = PerPromptGRPO(model={model!r}, **GRPO_KW)
        trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=2,
                            strategy=ModelParallelStrategy() if mode == "fsdp2" else "ddp", logger=False,
                            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(module, ReasoningDataModule(batch_size=2, **DATA_KW))
        weights = {{n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
                   for n, p in module.model.named_parameters()}}
        switch = {{}}
        if mode == "fsdp2":  # GRPO -> ES on the sharded policy: SequentialStrategy switches at step 1
            from es_lightning import SequentialStrategy
            from test_sharding_es import LengthTask  # a reward ES members earn differently
            seq = PerPromptGRPO(model={model!r}, task=LengthTask(), **GRPO_KW)
            stages = {{}}
            class Stage(L.Callback):
                def on_train_batch_end(self, trainer, pl_module, *a):
                    stages[trainer.global_step] = pl_module.algorithm.name
            t2 = L.Trainer(max_steps=2, accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), logger=False,
                           enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                           enable_progress_bar=False, enable_model_summary=False,
                           callbacks=[Stage(), SequentialStrategy(switch_step=1, es=dict(
                               population_size=4, sigma=0.5, lr=0.05, reward_normalization="centered"))])
            t2.fit(seq, ReasoningDataModule(batch_size=2, **DATA_KW))
            switch = {{"stages": stages, "es_sharded": seq.algorithm.name == "es" and seq.sharded,
                      "update_norm": float(t2.callback_metrics["train/update_norm"])}}
        if trainer.global_rank == 0:
            json.dump({{"weights": weights, "step": trainer.global_step, "sharded": module.sharded,
                       "grad_norm": float(trainer.callback_metrics["train/grad_norm"]), "switch": switch}},
                      open({out!r} + f"/{{mode}}.json", "w"))
        from es_lightning.distributed import end_distributed_process
        end_distributed_process()  # FSDP2's units keep the gloo groups: exit past the teardown (distributed.py)
    """
)


def _single_process_step(model_dir: str) -> tuple[dict[str, torch.Tensor], float]:
    module = PerPromptGRPO(model=model_dir, **GRPO_KW)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, ReasoningDataModule(batch_size=4, **DATA_KW))
    weights = {n: p.detach().flatten().clone() for n, p in module.model.named_parameters()}
    return weights, float(trainer.callback_metrics["train/grad_norm"])


@pytest.fixture(scope="module")
def single(tiny_model_dir):
    return _single_process_step(tiny_model_dir)


def _launch(template: str, tmp_path, model: str, *args: str) -> None:
    """Write ``template`` (a 2-process script: ``{tests}``, ``{out}``, ``{model}``) into ``tmp_path`` and run it there;
    it writes its results as JSON into ``tmp_path``."""
    script = tmp_path / "two_processes.py"
    script.write_text(template.format(tests=os.path.dirname(os.path.abspath(__file__)), out=str(tmp_path), model=model))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_grpo_step_on_two_processes_equals_single_process(mode, single, tiny_model_dir, tmp_path):
    _launch(SCRIPT, tmp_path, tiny_model_dir, mode)
    result = json.loads((tmp_path / f"{mode}.json").read_text())
    assert result["step"] == 1 and result["sharded"] == (mode == "fsdp2")
    start = {n: p.detach().flatten() for n, p in GRPOModule(model=tiny_model_dir).policy.model.named_parameters()}
    single, grad_norm = single
    assert single.keys() == result["weights"].keys()
    # the global gradient (before clipping) has the 1-process norm: ranks' losses and gradients combine to the whole
    # batch's (AdamW's first step is scale-invariant, so the weights alone would not show a scale error)
    assert result["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    moved = max(float((single[n] - start[n]).abs().max()) for n in single)
    assert moved > 1e-3, "the 1-process step changed the weights"
    diff = max(float((torch.tensor(result["weights"][n]) - single[n]).abs().max()) for n in single)
    assert diff < 1e-4, diff  # lr / 100; AdamW's first step is ~±lr per element, so any wrong direction shows
    if mode == "fsdp2":  # SequentialStrategy turned the sharded GRPO fit into sharded ES, which updated the weights
        switch = result["switch"]
        assert switch["stages"] == {"1": "grpo", "2": "es"} and switch["es_sharded"]
        assert switch["update_norm"] > 0


class FlatOnRanksGRPO(GRPOModule):
    """GRPO whose rewards are one value on the ranks in ``flat_ranks`` and differ within every group elsewhere."""

    def __init__(self, *args, flat_ranks: tuple[int, ...] = (), **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.flat_ranks = tuple(flat_ranks)

    def score(self, completions, examples, step=None):
        scores = super().score(completions, examples, step)
        if self.trainer.global_rank in self.flat_ranks:
            scores.rewards = torch.full((len(completions),), 0.5)
        else:  # 0, 1, 2, 3 within each group of 4
            scores.rewards = torch.arange(len(completions), dtype=torch.float32) % GRPO_KW["group_size"]
        return scores


FLAT_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings, torch, lightning as L
    from lightning.pytorch.strategies import DDPStrategy
    sys.path.insert(0, {tests!r})
    from test_sharding_grpo import GRPO_KW, DATA_KW, FlatOnRanksGRPO
    from es_lightning import ReasoningDataModule

    class CountingDDP(DDPStrategy):  # counts the scalar collectives a training step makes through the strategy
        calls = 0
        def reduce(self, *args, **kwargs):
            CountingDDP.calls += 1
            return super().reduce(*args, **kwargs)

    class PerStep(L.Callback):
        def __init__(self):
            self.counts = []
        def on_train_batch_start(self, *args):
            CountingDDP.calls = 0
        def on_train_batch_end(self, *args):
            self.counts.append(CountingDDP.calls)

    if __name__ == "__main__":
        torch.set_num_threads(1)
        out = {{}}
        for name, flat_ranks in (("all", (0, 1)), ("one", (1,))):
            per_step = PerStep()
            trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=2, strategy=CountingDDP(), logger=False,
                                enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                                enable_progress_bar=False, enable_model_summary=False, callbacks=[per_step])
            module = FlatOnRanksGRPO(model={model!r}, flat_ranks=flat_ranks, **GRPO_KW)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.fit(module, ReasoningDataModule(batch_size=2, **DATA_KW))
            out[name] = {{"said": [str(w.message) for w in caught if "update is zero" in str(w.message)],
                         "reduces": per_step.counts,
                         "frac": float(trainer.logged_metrics["train/frac_reward_zero_std"])}}
        if trainer.global_rank == 0:
            json.dump(out, open({out!r} + "/flat.json", "w"))
    """
)


def test_grpo_flat_reward_warning_under_ddp_costs_no_collective(tiny_model_dir, tmp_path):
    """The all-groups-flat warning is about the global update: it comes once when every group on every rank scored one
    reward, and not when only one rank's groups did (the other rank's gradients make the averaged update non-zero). It
    is decided from ``train/frac_reward_zero_std`` as ``log_step`` reduced it across ranks: a step makes the same three
    scalar collectives (the kept-groups count, ``dapo``'s token count and the metrics) whether the warning is still to
    come or not; the check once made a fourth on every step until it had warned (every step of a fit whose rewards
    differ)."""
    _launch(FLAT_SCRIPT, tmp_path, tiny_model_dir)
    result = json.loads((tmp_path / "flat.json").read_text())
    said = result["all"]["said"]
    assert len(said) == 1 and said[0].startswith("GRPO step 0: the 4 completions of every group scored the same "
                                                 "reward (all 0.5)"), said
    assert result["all"]["frac"] == 1.0
    assert result["one"]["said"] == [] and result["one"]["frac"] == 0.5
    assert result["all"]["reduces"] == result["one"]["reduces"] == [3, 3, 3], result


class PlannedRewards(CountdownTask):
    """Countdown whose reward function scores each group by a plan, ``PLAN[step][rank]``: one kind a group of the rank's
    batch — ``"flat"`` (0.5 for all), ``"varied"`` (0, 1, 2, 3) or ``"nan"`` (dropped). A reward of the rank it runs on,
    as a task whose verifier fails on some ranks' problems gives."""

    PLAN = (
        (("flat", "flat"), ("nan", "nan")),  # rank 1 drops all its groups; every kept group is flat: 2/2
        (("flat", "varied"), ("nan", "nan")),  # 1 flat of the 2 kept groups
        (("nan", "flat"), ("varied", "varied")),  # uneven kept groups: 1 flat of 3 (the ranks' shares 1 and 0)
    )

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def reward(self, completions, examples):
        kinds = self.PLAN[self.calls][torch.distributed.get_rank()]
        self.calls += 1
        G = GRPO_KW["group_size"]
        values = {"flat": lambda j: 0.5, "varied": float, "nan": lambda j: float("nan")}
        return [values[kinds[i // G]](i % G) for i in range(len(completions))]


DROPPED_SCRIPT = textwrap.dedent(
    """
    import json, sys, warnings, torch, lightning as L
    sys.path.insert(0, {tests!r})
    from test_sharding_grpo import GRPO_KW, DATA_KW, PlannedRewards
    from es_lightning import ReasoningDataModule
    from es_lightning.modules.grpo import GRPOModule

    class PerStep(L.Callback):
        def __init__(self):
            self.values = []
        def on_train_batch_end(self, trainer, *args):
            self.values.append({{k: float(trainer.callback_metrics[k])
                                for k in ("train/frac_reward_zero_std", "train/accuracy")}})

    if __name__ == "__main__":
        torch.set_num_threads(1)
        per_step = PerStep()
        trainer = L.Trainer(max_steps=3, accelerator="cpu", devices=2, strategy="ddp", logger=False,
                            enable_checkpointing=False, limit_val_batches=0, num_sanity_val_steps=0,
                            enable_progress_bar=False, enable_model_summary=False, callbacks=[per_step])
        module = GRPOModule(model={model!r}, **GRPO_KW)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(module, ReasoningDataModule(batch_size=2, **{{**DATA_KW, "task": PlannedRewards()}}))
        if trainer.global_rank == 0:
            json.dump({{"steps": per_step.values,
                       "said": [str(w.message) for w in caught if "update is zero" in str(w.message)]}},
                      open({out!r} + "/dropped.json", "w"))
    """
)


def test_grpo_shares_under_ddp_are_of_every_ranks_groups(tiny_model_dir, tmp_path):
    """Under DDP ``train/frac_reward_zero_std`` is the share of flat groups among every rank's kept groups, from the
    ranks' counts in log_step's one collective: a rank whose groups were all dropped (NaN rewards) adds none — its own
    share, the mean of nothing, made the rank mean NaN, and the all-groups-flat warning could not come on such a step —
    and ranks that kept different numbers of groups weigh by them (1 flat of 3 kept is 1/3, not the mean 0.5 of the
    ranks' shares 1 and 0). ``train/accuracy`` (of the kept completions) likewise stays finite."""
    _launch(DROPPED_SCRIPT, tmp_path, tiny_model_dir)
    result = json.loads((tmp_path / "dropped.json").read_text())
    frac = [step["train/frac_reward_zero_std"] for step in result["steps"]]
    assert frac == pytest.approx([1.0, 0.5, 1 / 3], abs=1e-6)  # logged as float32, frac
    assert all(0.0 <= step["train/accuracy"] <= 1.0 for step in result["steps"]), result["steps"]
    said = result["said"]
    assert len(said) == 1 and said[0].startswith("GRPO step 0: the 4 completions of every group scored the same "
                                                 "reward (all 0.5)"), said
