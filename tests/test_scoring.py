"""Bad rewards never reach the weights (issue 15.4): the policy of es_lightning/scoring.py, on real fits.

A reward function that raises or miscounts stops the fit with a RewardError; a NaN/inf reward drops its ES member or
GRPO group (checked against an update computed here from the finite members only, and against unchanged weights);
a step with nothing finite left stops the fit."""

from __future__ import annotations

import lightning as L
import pytest
import torch

from es_lightning import ESModule, GRPOModule, ReasoningDataModule, RewardError
from es_lightning.es.noise import param_noise
from es_lightning.scoring import score_completions
from es_lightning.tasks import CountdownTask


def _trainer(max_steps=1):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                     limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False)


def _dm(batch_size=4):
    return ReasoningDataModule(task="countdown", train_size=32, val_size=4, test_size=4, batch_size=batch_size, seed=0)


class _Raises(CountdownTask):
    def reward(self, completions, examples):
        raise ZeroDivisionError("division by zero")


class _Short(CountdownTask):
    def reward(self, completions, examples):
        return [0.0] * (len(completions) - 1)


class _NotANumber(CountdownTask):
    def grade(self, completions, examples):
        answers, correct, _ = super().grade(completions, examples)
        return answers, correct, ["high"] * len(completions)


class _AllNaN(CountdownTask):
    def reward(self, completions, examples):
        return [float("nan")] * len(completions)


class _NaNMembers(CountdownTask):
    """Scores like _CharSum, but the 2nd and 5th grading call of each ES step (members 1 and 4 when the population is
    scored member by member on one process) are NaN / +inf."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def reward(self, completions, examples):
        self.calls += 1
        bad = {2: float("nan"), 5: float("inf")}.get((self.calls - 1) % 6 + 1)
        if bad is not None:
            return [bad] * len(completions)
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


class _NaNGroup(CountdownTask):
    """0.5 for every completion (zero-variance groups: no gradient), NaN for the completions of one prompt."""

    def __init__(self, bad_target):
        super().__init__()
        self.bad_target = bad_target

    def reward(self, completions, examples):
        return [float("nan") if e["target"] == self.bad_target else 0.5 for e in examples]


def test_score_completions_checks_the_contract():
    examples = [{"nums": [1, 2], "target": 3}] * 2
    ok = score_completions(CountdownTask(), ["1+2", "junk"], examples, step=7)
    assert ok.correct.tolist() == [True, False] and ok.rewards.tolist() == [1.0, 0.0] and ok.answers[0] == "1+2"
    with pytest.raises(RewardError, match=r"_Raises at step 7: scoring 2 completions raised ZeroDivisionError"):
        score_completions(_Raises(), ["1+2", "x"], examples, step=7)
    with pytest.raises(RewardError, match="returned 1 rewards for 2 completions"):
        score_completions(_Short(), ["1+2", "x"], examples)
    with pytest.raises(RewardError, match="is not a number"):
        score_completions(_NotANumber(), ["1+2", "x"], examples)
    nan = score_completions(_AllNaN(), ["1+2", "x"], examples)  # kept as it is: the algorithm drops its unit
    assert nan.finite.tolist() == [False, False]


def test_a_reward_that_is_no_number_is_named_as_such_not_as_a_raise():
    """A custom ``reward()`` returning ``None`` for a completion (or one float for the batch) was reported as "scoring
    raised TypeError ... a reward function must not raise" (grade() converted it): the message now names the value."""
    examples = [{"nums": [1, 2], "target": 3}] * 2

    class NoneForJunk(CountdownTask):
        def reward(self, completions, examples):
            return [1.0 if c == "1+2" else None for c in completions]

    class OneFloat(CountdownTask):
        def reward(self, completions, examples):
            return 0.5

    class TensorRewards(CountdownTask):
        def reward(self, completions, examples):
            return torch.tensor([0.25] * len(completions))

    with pytest.raises(RewardError, match=r"NoneForJunk: reward None is not a number; return one float per completion"):
        score_completions(NoneForJunk(), ["1+2", "x"], examples)
    with pytest.raises(RewardError, match=r"returned 0.5, not a list of rewards"):
        score_completions(OneFloat(), ["1+2", "x"], examples)
    assert score_completions(TensorRewards(), ["1+2", "x"], examples).rewards.tolist() == [0.25, 0.25]


@pytest.mark.parametrize("module_cls", [ESModule, GRPOModule])
def test_a_raising_reward_stops_the_fit_with_the_fix(tiny_model_dir, module_cls):
    kw = dict(population_size=2) if module_cls is ESModule else dict(group_size=2)
    module = module_cls(model=tiny_model_dir, task=_Raises(), max_new_tokens=4, **kw)
    before = [p.detach().clone() for p in module.policy.model.parameters()]
    with pytest.raises(RewardError, match="must not raise"):
        _trainer().fit(module, _dm())
    assert all(torch.equal(a, b) for a, b in zip(before, module.model.parameters()))  # centre weights restored


@pytest.mark.parametrize("module_cls", [ESModule, GRPOModule])
def test_a_step_with_no_finite_reward_stops_the_fit(tiny_model_dir, module_cls):
    kw = dict(population_size=2) if module_cls is ESModule else dict(group_size=2)
    module = module_cls(model=tiny_model_dir, task=_AllNaN(), max_new_tokens=4, **kw)
    with pytest.raises(RewardError, match=r"step 0: every (population member|group) \(\d+\) has a NaN/inf reward"):
        _trainer().fit(module, _dm())


def test_es_drops_the_members_with_non_finite_rewards(tiny_model_dir):
    """θ1 = θ0 + α/N Σ_{finite n} z_n ε_n with z the z-score over the finite members only, computed here."""
    module = ESModule(model=tiny_model_dir, task=_NaNMembers(), population_size=6, sigma=0.5, lr=0.01,
                      max_new_tokens=6, temperature=1.0)
    theta0 = {n: p.detach().clone() for n, p in module.policy.model.named_parameters()}
    with pytest.warns(UserWarning, match="2 of 6 member rewards are NaN/inf"):
        _trainer().fit(module, _dm())
    rewards = module.last_rewards.double()
    assert torch.isnan(rewards[1]) and torch.isinf(rewards[4])
    kept = [0, 2, 3, 5]
    r = rewards[kept]
    assert not bool((r == r[0]).all())
    z = (r - r.mean()) / r.std(unbiased=False)
    for name, p in module.model.named_parameters():
        delta = sum(z[i] * param_noise(module.seed, 0, m, name, p.numel()).double() for i, m in enumerate(kept))
        expected = (theta0[name].double().flatten() + 0.01 / 6 * delta).view_as(p)
        assert torch.isfinite(p).all() and torch.allclose(p.double(), expected, atol=1e-6), name


def test_grpo_drops_the_group_with_a_non_finite_reward(tiny_model_dir):
    """The other groups have zero variance, so the only possible gradient is the NaN group's: the weights must come out
    of a real AdamW step bitwise unchanged (they would be NaN if the group reached the loss)."""
    dm = _dm(batch_size=2)
    dm.setup("fit")
    first_batch = next(iter(dm.train_dataloader()))
    module = GRPOModule(model=tiny_model_dir, task=_NaNGroup(first_batch[0]["target"]), group_size=2, lr=0.1,
                        max_new_tokens=4)
    before = {n: p.detach().clone() for n, p in module.policy.model.named_parameters()}
    trainer = _trainer()
    with pytest.warns(UserWarning, match="1 of 2 groups have a NaN/inf reward"):
        trainer.fit(module, dm)
    assert trainer.global_step == 1
    for name, p in module.model.named_parameters():
        assert torch.equal(p, before[name]), name
    assert float(trainer.logged_metrics["train/reward_mean"]) == 0.5  # the dropped group is not in the statistics


def test_a_reward_given_as_text_or_without_an_order_is_refused():
    """Rewards as strings (an answer list returned by mistake: ``float("12")`` is 12.0) and a dict or a set of rewards
    (``list()`` of a dict is its keys: completion indices trained as rewards) were taken silently; each stops now."""
    examples = [{"nums": [1, 2], "target": 3}] * 2

    class AnswersAsRewards(CountdownTask):
        def reward(self, completions, examples):
            return [str(len(c)) for c in completions]

    class RewardsByIndex(CountdownTask):
        def reward(self, completions, examples):
            return {i: 1.0 for i in range(len(completions))}

    class RewardSet(CountdownTask):
        def reward(self, completions, examples):
            return {1.0}

    with pytest.raises(RewardError, match=r"AnswersAsRewards: reward '3' is not a number"):
        score_completions(AnswersAsRewards(), ["1+2", "x"], examples)
    with pytest.raises(RewardError, match=r"RewardsByIndex: the reward function returned \{0: 1.0, 1: 1.0\}, not a list"):
        score_completions(RewardsByIndex(), ["1+2", "x"], examples)
    with pytest.raises(RewardError, match=r"RewardSet: the reward function returned \{1.0\}, not a list"):
        score_completions(RewardSet(), ["1+2", "x"], examples)


def test_a_correctness_verdict_that_is_no_bool_is_refused_and_0_or_1_is_read_exactly():
    """``is_correct`` / ``check_answer`` / a ``grade()`` override returning a score (0.3, a numpy float, a tensor) was
    read with bool(): 0.3 counted as correct — Pass@K and correct_reward paid for it — and a forgotten return (None)
    as wrong, silently. A bool or a number equal to 0 or 1 is a verdict; anything else stops with the fix."""
    import numpy as np

    examples = [{"nums": [1, 2], "target": 3}] * 2

    def task(method, value):
        def verdict(self, *args):
            return value(*args) if callable(value) else value
        return type(f"Scored{method.title().replace('_', '')}", (CountdownTask,), {method: verdict})()

    for value in (0.7, np.float32(0.3), torch.tensor(0.3), None, "yes", [1.0]):
        with pytest.raises(RewardError, match=r"ScoredIsCorrect at step 3: is_correct returned .*, not a correctness "
                                              r"verdict: return True when the completion is correct"):
            score_completions(task("is_correct", value), ["1+2", "x"], examples, step=3)
        with pytest.raises(RewardError, match=r"ScoredCheckAnswer: check_answer returned .*, not a correctness verdict"):
            score_completions(task("check_answer", value), ["1+2", "x"], examples)

    class GradedVerdicts(CountdownTask):
        def grade(self, completions, examples):
            answers, _, rewards = super().grade(completions, examples)
            return answers, [0.3] * len(completions), rewards

    with pytest.raises(RewardError, match=r"GradedVerdicts: grade\(\) returned 0.3 \(float\), not a correctness verdict"):
        score_completions(GradedVerdicts(), ["1+2", "x"], examples)
    for ok, wrong in ((1.0, 0.0), (np.float64(1), np.int64(0)), (torch.tensor(1.0), torch.tensor(False)), (np.bool_(1), 0)):
        scores = score_completions(task("is_correct", lambda c, e, ok=ok, wrong=wrong: ok if c == "1+2" else wrong),
                                   ["1+2", "x"], examples)
        assert scores.correct.tolist() == [True, False] and scores.rewards.tolist() == [1.0, 0.0]


def test_a_reward_written_with_trls_signature_is_named_with_the_signature_to_write():
    """TRL habits: ``reward(self, prompts, completions, **kwargs)`` was handed (completions, examples) and scored the
    examples as completions silently; ``reward(self, completions, **kwargs)`` raised a TypeError reported as "a reward
    function must not raise". Both name the signature to write; one that fits it is taken as it is."""
    examples = [{"nums": [1, 2], "target": 3}] * 2

    class TRLStyle(CountdownTask):
        def reward(self, prompts, completions, **kwargs):
            return [float(len(c)) for c in completions]

    class CompletionsOnly(CountdownTask):
        def reward(self, completions, **kwargs):
            return [1.0] * len(completions)

    class Fits(CountdownTask):
        def reward(self, completions, examples, **kwargs):
            return [float(len(c)) for c in completions]

    fix = r"cannot be called as reward\(completions, examples\); a task's reward is reward\(self, completions, examples\)"
    with pytest.raises(RewardError, match=r"TRLStyle at step 3: TRLStyle.reward\(prompts, completions, \*\*kwargs\) " + fix):
        score_completions(TRLStyle(), ["1+2", "x"], examples, step=3)
    with pytest.raises(RewardError, match=r"CompletionsOnly.reward\(completions, \*\*kwargs\) " + fix):
        score_completions(CompletionsOnly(), ["1+2", "x"], examples)
    assert score_completions(Fits(), ["1+2", "x"], examples).rewards.tolist() == [3.0, 1.0]


def test_a_raising_reward_is_located_in_the_tasks_own_code():
    """The command shows the RewardError in one line, without the traceback: it names the function and line of the
    task's own code that raised, not a frame of the library it called (here: the standard library's ``json``)."""
    import json

    examples = [{"nums": [1, 2], "target": 3}] * 2

    class ParsesJSON(CountdownTask):
        def reward(self, completions, examples):
            return [float(json.loads(c)) for c in completions]

    # Python 3.11 runs a list comprehension in a frame of its own (<listcomp>); 3.12 inlines it into reward
    with pytest.raises(RewardError, match=r"raised JSONDecodeError: .*\(in (reward|<listcomp>), test_scoring.py:\d+\)\."):
        score_completions(ParsesJSON(), ["1+2", "x"], examples, step=2)
    with pytest.raises(RewardError, match=r"raised ZeroDivisionError: division by zero \(in reward, test_scoring.py:\d+\)"):
        score_completions(_Raises(), ["1+2", "x"], examples)


def test_trls_reward_funcs_habits_are_answered_with_the_task_reward_to_write():
    """A TRL user's first tries — ``reward_funcs=[f]``, a bare function as the task — were refused without the way to
    give a reward here (an unknown keyword's list of accepted ones; "get_task expects ... got function")."""
    from es_lightning.tasks import get_task

    def my_reward(prompts, completions, **kwargs):
        return [1.0] * len(completions)

    fix = r"subclass a task \(e.g. CountdownTask\) and override reward\(self, completions, examples\) -> list\[float\]"
    with pytest.raises(TypeError, match=r"GRPOModule: reward_funcs is TRL's GRPOTrainer argument, not ours; .*" + fix):
        GRPOModule(reward_funcs=[my_reward])
    with pytest.raises(TypeError, match=r"ESModule: reward_funcs and reward_weights are TRL's GRPOTrainer arguments"):
        ESModule(reward_funcs=[my_reward], reward_weights=[1.0])
    with pytest.raises(TypeError, match=r"GRPOModule: task must be .*\(function\); .*" + fix):
        GRPOModule(task=my_reward)
    with pytest.raises(TypeError, match=r"got function my_reward; .*" + fix):
        ReasoningDataModule(task=my_reward)
    with pytest.raises(TypeError, match=r"got function my_reward; .*" + fix):
        get_task(my_reward)


@pytest.mark.parametrize("module_cls", [ESModule, GRPOModule])
def test_a_reward_with_trls_signature_is_refused_before_the_first_rollout(tiny_model_dir, module_cls):
    """The signature was only checked when the first completions were scored — after a validation pass or a step's
    rollouts (minutes on a real model). Here ``prompt`` raises, so any rollout would surface as that error."""

    class TRLStyle(CountdownTask):
        def reward(self, prompts, completions, **kwargs):
            return [1.0] * len(completions)

        def prompt(self, example):
            raise AssertionError("a rollout started")

    dm = ReasoningDataModule(task=TRLStyle(), train_size=8, val_size=4, test_size=4, batch_size=4)
    module = module_cls(model=tiny_model_dir, max_new_tokens=2, **({"group_size": 2} if module_cls is GRPOModule else
                                                                   {"population_size": 2}))
    with pytest.raises(RewardError, match=r"^TRLStyle: TRLStyle.reward\(prompts, completions, \*\*kwargs\) cannot be"):
        L.Trainer(max_steps=1, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False).fit(module, dm)


@pytest.mark.parametrize("method", ["reward", "is_correct", "check_answer"])
def test_a_task_method_set_on_the_instance_is_refused_with_the_subclass_to_write(tiny_model_dir, method):
    """``task.reward = fn`` / ``task.is_correct = fn`` were ignored (scoring obeyed a subclass's override only) while
    ``task.check_answer = fn`` was obeyed, and a checkpoint records the task by class and options, so an evaluation of
    the run graded without it. Each is refused — before the model loads in a fit — naming the subclass to write."""
    examples = [{"nums": [1, 2], "target": 3}] * 2

    def always(*args):
        return [1.0] * len(args[0]) if method == "reward" else True

    task = CountdownTask()
    setattr(task, method, always)
    line = rf"{method} was set on the CountdownTask instance \(always\); .* class MyTask\(CountdownTask\) with def {method}"
    with pytest.raises(RewardError, match=rf"^CountdownTask at step 1: {line}"):
        score_completions(task, ["1+2", "x"], examples, step=1)
    dm = ReasoningDataModule(task=task, train_size=8, val_size=4, test_size=4, batch_size=4)
    module = ESModule(model=tiny_model_dir, max_new_tokens=2, population_size=2)
    with pytest.raises(RewardError, match=rf"^CountdownTask: {line}"):
        _trainer().fit(module, dm)
