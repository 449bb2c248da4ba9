"""Scoring completions: the task's ``grade`` once per completion, with the rewards checked before any update sees them.

Every training rollout and every evaluation is scored through :func:`score_completions` (the module calls it from
:meth:`~es_lightning.modules.base.ReasoningModule.score`), so a reward function is trusted in one place only.

**The bad-reward policy** (issue 15: bad rewards never reach the weights):

* ``grade()`` raises, returns the wrong number of rewards / answers / verdicts, a reward that is not a number, or a
  correctness verdict (``is_correct`` / ``check_answer``) that is no bool nor 0/1 (a score of 0.3 is not "correct"):
  the fit **stops** with a :class:`RewardError` naming the task, the step and the fix. These are bugs in a reward
  function; skipping them would hide the bug and train on whatever is left.
* A reward that is NaN or ±inf (a reward that divides by a length that can be 0, say): the unit the reward belongs to is
  **dropped from the update** with a warning — ES drops the population *member* (its reward is the mean over its
  completions), GRPO drops the prompt's whole *group* (zero advantage, masked out of the loss; a group baseline with a
  hole in it is not a baseline). The rest of the step trains as usual.
* A step in which **every** member / group is dropped stops the fit with a :class:`RewardError`: a reward function that
  returns no finite value for a whole step is broken, not unlucky.
"""

from __future__ import annotations

import inspect
import os
import sys
import traceback
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from es_lightning.tasks import Task
from es_lightning.tasks.base import VerdictError, as_verdict

__all__ = ["RewardError", "Scores", "check_reward_signature", "check_some_kept", "score_completions"]


class RewardError(RuntimeError):
    """A task's reward function broke the scoring contract (see :mod:`es_lightning.scoring` for the policy)."""


@dataclass
class Scores:
    """The verdicts on ``R`` completions, row for row."""

    answers: list[str | None]  # [R] extracted answers (None = unparseable); what Maj@K votes on
    correct: Tensor  # [R] bool: the verifier accepts the completion
    rewards: Tensor  # [R] float32; a non-finite value marks a reward the update must not use

    @property
    def finite(self) -> Tensor:  # [R] bool
        return torch.isfinite(self.rewards)

    def __len__(self) -> int:
        return len(self.answers)


def score_completions(
    task: Task, completions: Sequence[str], examples: Sequence[dict[str, Any]], step: int | None = None
) -> Scores:
    """``task.grade(completions, examples)`` — each completion parsed and verified once — checked against the contract.

    Raises :class:`RewardError` when ``grade`` raises or returns lists of the wrong length or non-numeric rewards.
    Non-finite rewards are returned as they are (the caller drops their member / group, see the module docstring).
    """
    where = f"{type(task).__name__}" + (f" at step {step}" if step is not None else "")
    check_reward_signature(task, where)
    try:
        answers, correct, rewards = task.grade(completions, examples)
    except VerdictError as err:  # is_correct / check_answer returned no bool: a bug of the task, not a raising reward
        raise RewardError(f"{where}: {err}") from None
    except Exception as err:
        raise RewardError(
            f"{where}: scoring {len(completions)} completions raised {type(err).__name__}: {err}{_raised_at(err)}. A "
            "reward function must not raise: score a malformed completion 0 (see Task.reward)"
        ) from err
    n = len(completions)
    if not isinstance(rewards, Iterable) or isinstance(rewards, (str, bytes, Mapping, AbstractSet)):
        # a dict or a set has no completion order (list() of a dict is its keys: they would train as rewards)
        raise RewardError(f"{where}: the reward function returned {_shown(rewards)}, not a list of rewards; return one "
                          "float per completion, in order")
    rewards = list(rewards)  # a tensor or an array of rewards is read as its elements
    for what, values in (("answers", answers), ("correctness verdicts", correct), ("rewards", rewards)):
        if len(values) != n:
            raise RewardError(f"{where}: grade() returned {len(values)} {what} for {n} completions; return one per "
                              "completion, in order")
    try:
        values = [_number(r) for r in rewards]
    except (TypeError, ValueError) as err:
        bad = next(r for r in rewards if not _is_number(r))
        raise RewardError(f"{where}: reward {_shown(bad)} is not a number; return one float per completion (0.0 "
                          "for a completion that earns nothing)") from err
    try:
        verdicts = [as_verdict(c, "grade()") for c in correct]
    except VerdictError as err:
        raise RewardError(f"{where}: {err}") from None
    return Scores(
        answers=list(answers),
        correct=torch.tensor(verdicts, dtype=torch.bool),
        rewards=torch.tensor(values, dtype=torch.float32),
    )


def _raised_at(err: BaseException) -> str:
    """`` (in reward, my_tasks.py:12)``: the innermost frame of the task's own code that raised — outside this package
    and the installed libraries (a library frame deep inside sympy says less), else the innermost frame. The command
    shows one line, without the traceback."""
    frames = traceback.extract_tb(err.__traceback__)
    if not frames:
        return ""
    package = os.path.dirname(os.path.abspath(__file__)) + os.sep
    libraries = tuple({os.path.abspath(p) + os.sep for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)})
    own = [f for f in frames if not os.path.abspath(f.filename).startswith((package, *libraries))]
    frame = (own or frames)[-1]
    return f" (in {frame.name}, {os.path.basename(frame.filename)}:{frame.lineno})"


def check_reward_signature(task: Task, where: str | None = None) -> None:
    """An overridden ``reward`` must take ``(completions, examples)`` (checked at every scoring, and by the module's
    ``setup`` before the model loads and the first rollouts are generated). One written the TRL way —
    ``reward(prompts, completions, **kwargs)`` — would be handed the completions as ``prompts`` and the examples as
    ``completions`` and score the wrong thing silently, and ``reward(completions, **kwargs)`` would raise a TypeError
    reported as a raising reward; both are named here with the signature to write."""
    _check_methods_of_its_class(task, where)
    reward = getattr(type(task), "reward", None)
    if reward is None or reward is Task.reward:
        return
    try:
        signature = inspect.signature(task.reward)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return
    positional = [p.name for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    try:
        signature.bind(["completion"], [{}])
        fits = not positional or positional[0] != "prompts"
    except TypeError:
        fits = False
    if not fits:
        raise RewardError(
            f"{where or type(task).__name__}: {type(task).__name__}.reward{signature} cannot be called as reward(completions, examples); a "
            "task's reward is reward(self, completions, examples) -> list[float]: the completion texts and one example "
            "(the row's fields as a dict) per completion, one float per completion in order (TRL's reward_funcs "
            "signature (prompts, completions, **kwargs) is not this one: read a row's columns from its example)"
        )


#: a task's public methods (``reward``, ``is_correct``, ``check_answer``, ``prompt``, ...)
_TASK_METHODS = frozenset(name for name in dir(Task) if not name.startswith("_") and callable(getattr(Task, name)))


def _check_methods_of_its_class(task: Task, where: str | None) -> None:
    """Refuse a task method set on the instance (``task.reward = fn``, ``task.is_correct = fn``): scoring obeys a
    subclass's override only (an instance's ``reward`` / ``is_correct`` was ignored, its ``check_answer`` obeyed), and
    a checkpoint records its task by class and options (:func:`~es_lightning.tasks.base.task_record`), so an
    evaluation of the run would grade without the function, and a spawned worker could not pickle a lambda. One way
    to customise a task — a subclass, as everywhere in this package (README "Pointing at a real model and dataset")."""
    cls = type(task).__name__
    for name, value in vars(task).items():
        if name in _TASK_METHODS and callable(value):
            given = getattr(value, "__name__", type(value).__name__)
            raise RewardError(
                f"{where or cls}: {name} was set on the {cls} instance ({given}); a task's methods are its "
                f"class's — a checkpoint records the task by class and options, so it would be lost (and scoring "
                f"obeys a subclass's override only): subclass instead, class MyTask({cls}) with def {name}(self, ...) "
                "in it, and pass task=MyTask() (README \"Pointing at a real model and dataset\")")


def check_some_kept(kept: int, total: int, unit: str, step: int) -> None:
    """Stop when every ``unit`` (member / group) of a step was dropped for a non-finite reward."""
    if total > 0 and kept == 0:
        raise RewardError(
            f"step {step}: every {unit} ({total}) has a NaN/inf reward, so nothing is left to train on; the task's "
            "reward function returns non-finite values — make it return a finite float for every completion"
        )


def _number(value: Any) -> float:
    """``float(value)``, but a string is no number: ``float("12")`` would train on an answer text returned by mistake."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{value!r} is text")
    return float(value)


def _is_number(value: Any) -> bool:
    try:
        _number(value)
    except (TypeError, ValueError):
        return False
    return True


def _shown(value: Any) -> str:
    """``value``'s repr, cut at 60 characters (a whole list of rewards would fill the line)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
