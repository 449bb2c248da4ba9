"""Maj@K votes on the answer, not on one expression: each task's ``vote_key``, the metric's count, the callback's wiring."""

from __future__ import annotations

import builtins
from collections import Counter
from fractions import Fraction

import pytest
import torch

from es_lightning.analysis.evaluate import evaluation_module, heldout_problems
from es_lightning.callbacks import PassAtKCallback
from es_lightning.metrics import MajorityAtK
from es_lightning.policy import load_policy
from es_lightning.tasks import AdditionTask, CountdownTask, GSM8KTask, MathTask, SortTask
from es_lightning.tasks.expressions import solve

EXAMPLE = {"nums": [1, 2, 3], "target": 6}


def _maj(task, texts, example, k):
    """maj@k of one problem's completions through grade → votes → MajorityAtK, as the callback does it."""
    answers, correct, _ = task.grade(texts, [example] * len(texts))
    metric = MajorityAtK(ks=(k,))
    metric.update([task.votes(answers, example)], torch.tensor([correct]))
    return float(metric.compute()[f"maj@{k}"])


def test_countdown_different_correct_expressions_vote_together():
    task = CountdownTask()
    # three different solutions of 1 2 3 → 6 (distinct normal forms), two different wrong expressions reaching 5
    assert solve([1, 2, 3], 6) == ["1*2*3", "1+2+3", "2*3/1"]
    keys = {text: task.vote_key(task.extract_answer(text), EXAMPLE) for text in ("1+2+3", "3*2*1", "2*3/1", "2*3-1", "3+2*1")}
    assert len({task.extract_answer(t) for t in keys}) == 5  # five different answer strings ...
    assert keys["1+2+3"] == keys["3*2*1"] == keys["2*3/1"] == (Fraction(6), (1, 2, 3))  # ... three votes for 6
    assert keys["2*3-1"] == keys["3+2*1"] == (Fraction(5), (1, 2, 3))  # ... two for 5
    # the same value from other numbers is another answer (and a wrong one)
    assert task.vote_key("4+2", EXAMPLE) == (Fraction(6), (2, 4)) != keys["1+2+3"]

    # hand count, wrong answer first: by answer strings every sample is a one-vote tie that the first (wrong) one wins;
    # by vote keys the two correct expressions hold 2 votes against 1
    texts = ["2*3-1", "1+2+3", "1*2*3"]
    answers, correct, _ = task.grade(texts, [EXAMPLE] * 3)
    assert correct == [False, True, True]
    assert set(Counter(answers).values()) == {1} and Counter(answers).most_common(1)[0][0] == answers[0]
    votes = task.votes(answers, EXAMPLE)
    assert Counter(votes) == {(Fraction(5), (1, 2, 3)): 1, (Fraction(6), (1, 2, 3)): 2}
    assert _maj(task, texts, EXAMPLE, 3) == 1.0
    # and a wrong value reached by two different expressions beats a single correct one (hand count 2 : 1)
    assert _maj(task, ["1+2+3", "2*3-1", "3+2*1"], EXAMPLE, 3) == 0.0
    # unparseable completions abstain; a non-expression r1 answer votes as its text
    assert task.votes([None, "1+2+3"], EXAMPLE) == [None, (Fraction(6), (1, 2, 3))]
    r1 = CountdownTask(prompt_format="r1")
    assert r1.vote_key("six", EXAMPLE) == "six" and r1.vote_key("1/0+6", EXAMPLE) == "1/0+6"


def test_vote_keys_never_eval_model_text(monkeypatch, tmp_path):
    def refuse(*args, **kwargs):
        raise AssertionError("a verifier called eval/exec on model text")

    monkeypatch.setattr(builtins, "eval", refuse)
    monkeypatch.setattr(builtins, "exec", refuse)
    marker = tmp_path / "pwned"
    hostile = f"__import__('pathlib').Path({str(marker)!r}).touch()"
    for task in (CountdownTask(), CountdownTask(prompt_format="r1"), GSM8KTask(), AdditionTask(), SortTask()):
        answers, _, _ = task.grade([hostile, f"<think>x</think>\n<answer>{hostile}</answer>", "1+2+3"], [EXAMPLE] * 3)
        task.votes(answers, EXAMPLE)
        for text in (hostile, "1+2+3", "(" * 10000 + "1" + ")" * 10000, "9" * 5000 + "**9" * 100):
            task.votes([text], EXAMPLE)  # straight to vote_key, bypassing extraction
    assert not marker.exists()


def test_gsm8k_votes_on_the_number():
    task = GSM8KTask()
    example = task.preprocess({"question": "q", "answer": "#### 1000"})
    texts = ["... #### 1,000", "#### 999", "#### $1000.00"]
    answers, correct, _ = task.grade(texts, [example] * 3)
    assert correct == [True, False, True]
    assert task.votes(["1,000"], example) == task.votes(["1000"], example) == [Fraction(1000)]
    assert task.vote_key("1,000", example) == task.vote_key("1000", example) != task.vote_key("999", example)
    assert task.vote_key("not a number", example) == "not a number"
    # 2 votes for 1000 against 1 for 999, whatever order
    assert _maj(task, texts, example, 3) == 1.0
    assert _maj(task, ["#### 999", "#### 1,000", "#### 1000"], example, 3) == 1.0


def test_math_votes_follow_math_verify():
    math_verify = pytest.importorskip("math_verify")
    task = MathTask()
    example = {"problem": "p", "answer": "\\frac12"}
    halves = ["\\frac12", "\\frac{1}{2}", "\\dfrac{1}{2}", "0.5", "0.50"]
    assert len({task.vote_key(a, example) for a in halves}) == 1
    assert len({task.vote_key(a, example) for a in ("x+1", "1+x", " x + 1 ")}) == 1
    assert task.vote_key("\\{2,1\\}", example) == task.vote_key("\\{1,2\\}", example)
    assert task.vote_key("\\frac13", example) != task.vote_key("0.333", example) != task.vote_key("\\frac12", example)
    # equal keys only where math-verify says equal
    answers = [*halves, "x+1", "1+x", "\\frac13", "0.333", "3", "3.0", "\\{1,2\\}", "\\{2,1\\}"]
    for a in answers:
        for b in answers:
            if task.vote_key(a, example) == task.vote_key(b, example):
                assert math_verify.verify(math_verify.parse("\\boxed{" + a + "}"), math_verify.parse("\\boxed{" + b + "}"))
    # the hand count: 0.5 and \frac{1}{2} are one answer with 2 votes against 1 for 1/3
    texts = ["\\boxed{\\frac13}", "\\boxed{0.5}", "\\boxed{\\frac{1}{2}}"]
    assert _maj(task, texts, example, 3) == 1.0


def test_simple_tasks_vote_on_the_answer_and_a_failing_key_votes_as_text():
    assert AdditionTask().votes(["65", None, "65"], {"x": 57, "y": 8}) == ["65", None, "65"]
    assert SortTask().vote_key("7 7 19 42", {"nums": [42, 7, 19, 7]}) == "7 7 19 42"

    class Broken(AdditionTask):
        def vote_key(self, answer, example):
            raise RuntimeError("bug")

    assert Broken().votes(["65", None], {"x": 57, "y": 8}) == ["65", None]


def test_pass_at_k_callback_votes_with_the_task_vote_key():
    """The callback's maj@k uses ``task.votes``: a task whose every answer gets one key makes maj@n the verdict of the
    first sample with an answer, a rule checked here by hand on the same samples."""

    class OneVote(CountdownTask):
        def vote_key(self, answer, example):
            return "same"

    task = OneVote()
    problems = heldout_problems(task, 6, 11)
    module = evaluation_module(load_policy("builtin:countdown-tiny"), task, max_new_tokens=10)
    callback = PassAtKCallback(num_samples=8, ks=(8,), temperature=1.0, max_new_tokens=10, seed=3, batch_size=3)
    batches = []
    metrics = callback.evaluate_examples(module, problems, on_batch=lambda examples, result: batches.append(result))
    expected = []
    for result in batches:
        for answers, correct in zip(result.answers, result.correct.tolist()):
            first = next((i for i, a in enumerate(answers) if a is not None), None)
            expected.append(first is not None and correct[first])
    assert any(a is not None for r in batches for row in r.answers for a in row)
    assert metrics["val/maj@8"] == pytest.approx(sum(expected) / len(expected))
