"""Maj@k (self-consistency): is the most common final answer among k samples a correct one?

Majority voting over sampled reasoning paths is the self-consistency decoding of Wang et al. 2023 ("Self-Consistency
Improves Chain of Thought Reasoning in Language Models"); maj@k is how reasoning papers report it (Lewkowycz et al.
2022, Minerva). Pass@k asks whether *some* sample is right (an oracle picks); maj@k asks whether the policy's
*consensus* is right, which needs no verifier at inference time. A policy that sharpens onto one answer keeps maj@k
while losing pass@k, so the two together tell coverage from confidence.

Votes are on answers, not on texts: each sample's vote is its task's
:meth:`~es_lightning.tasks.Task.vote_key` (Countdown: the value reached and the numbers used; GSM8K: the final number;
MATH: math-verify's reading of the boxed answer), built by :class:`~es_lightning.callbacks.PassAtKCallback`. This metric
only counts; it takes any hashable votes.

Conventions (document-level choices; change them and results are not comparable):

* **First k samples.** maj@k of a problem votes over its first k samples (columns ``0..k-1``), the standard report
  (lm-evaluation-harness ``take_first_k`` + ``majority_vote`` filters, Minerva); samples are i.i.d., so this is an
  unbiased (if noisier) estimate of the expected maj@k over random k-subsets, without averaging over all of them.
* **Unparseable answers abstain.** ``None`` (the task's ``extract_answer`` failed, or its ``vote_key`` abstained)
  never wins a vote; if all k samples are ``None`` the problem counts as wrong.
* **Ties go to the answer seen first** among the k samples (deterministic, matches ``collections.Counter.most_common``,
  which keeps insertion order among equal counts).
* **The vote is right** when the verifier accepted the first sample that gave the winning vote (a task's vote keys
  group only answers its verifier judges alike, so which one we read does not matter).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Sequence

import torch
from torchmetrics import Metric

from es_lightning.metrics.pass_at_k import _PerKSums, _validate_correctness, inside_bootstrapper
from es_lightning.metrics.plotting import Plottable
from es_lightning.metrics.state import ExactSums, KeepsStateOnError

__all__ = ["MajorityAtK", "majority_vote_correct"]


def majority_vote_correct(answers: Sequence[Hashable | None], correct: Sequence[bool], k: int) -> bool:
    """Whether the majority answer among the first ``k`` samples is correct (conventions in the module docstring).

    Args:
        answers: the vote of each sample (``Task.vote_key``; ``None`` = abstains), length ``n >= k``.
        correct: the verifier's verdict for each sample, same length.
        k: how many leading samples vote.
    """
    votes = Counter(answer for answer in answers[:k] if answer is not None)
    if not votes:
        return False
    winner, _ = votes.most_common(1)[0]  # ties: first inserted = first seen
    return bool(correct[list(answers).index(winner)])


def _by_value(votes: Sequence[Hashable | None]) -> Sequence[Hashable | None]:
    """The votes with tensors read as their values: a tensor hashes (and so is counted by ``Counter``) by identity, so
    ``answers`` of tensors (a row of an answer-id tensor, a list of 0-d tensors) never agreed with one another."""
    if isinstance(votes, torch.Tensor):
        return votes.tolist()
    if any(isinstance(vote, torch.Tensor) for vote in votes):
        return [vote.item() if isinstance(vote, torch.Tensor) else vote for vote in votes]
    return votes


class MajorityAtK(_PerKSums, KeepsStateOnError, ExactSums, Plottable, Metric):
    """Maj@k averaged over problems (self-consistency, Wang et al. 2023), with sum states that sync across processes.

    ``update(answers, correct)``: ``answers`` is a list with one entry per problem, each a list of the ``n`` votes
    (``Task.votes``: hashable keys, ``None`` abstains; tensors are read as their values, so a ``[num_problems, n]``
    tensor of answer ids works too) of that problem's samples, in sampling order; ``correct`` is the
    ``[num_problems, n]`` bool (or 0/1 int) correctness matrix of the same samples. maj@1 equals pass@1 on the first
    sample.

    As :class:`~es_lightning.metrics.PassAtK`, two forms with the same states: ``MajorityAtK(ks=(1, 4, 16))``'s
    ``compute()`` returns ``{"maj@1": tensor, "maj@4": ...}`` (log it with ``self.log_dict(metric.compute())``;
    Lightning's ``self.log("name", metric)``, torchmetrics' wrappers and arithmetic need a tensor), and
    ``MajorityAtK(k=4)``'s returns one scalar tensor, for ``self.log("val/maj@4", metric)``, ``MetricTracker``,
    ``MinMaxMetric`` and arithmetic. ``BootStrapper`` resamples the tensor arguments only (lists of answers would not
    follow the resampled rows of ``correct``): pass it ``MajorityAtK.answer_ids(answers)``, the answers as a
    ``[num_problems, n]`` tensor of ids (``None`` as -1: in a tensor, a negative id abstains). Lists by keyword
    (``update(answers=..., correct=...)``) are refused here in one line naming that fix; lists *positionally*
    (``bootstrap.update(answers, correct)``, also with ``correct=`` by keyword) fail inside torchmetrics before this
    metric runs — ``BootStrapper.update`` takes the first positional argument as the number of rows to resample and
    calls ``torch.ones(answers)`` (``TypeError: ones(): argument 'size' ... must be tuple of ints, but found element of
    type list``; ``torch.Size() takes an iterable of 'int'`` with its default ``sampling_strategy="poisson"``), and
    nothing of this metric's can intercept that short of patching torchmetrics: the fix is the same ``answer_ids``
    tensor. NaN when no problem was seen (torchmetrics warns).

    Args:
        ks: the vote sizes k to report (default ``(1, 4, 16)``); positive integers, each at most the ``n`` of every
            update.
        k: instead of ``ks`` (keyword only), the one vote size to report, as a tensor.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    _count_states = ("num_problems",)  # int64 whatever set_dtype makes the sums
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    _state_stem = "maj_at"
    _label = "maj"
    num_problems: torch.Tensor

    def __init__(self, ks: Sequence[int] | None = None, *, k: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._init_ks(ks, k)
        self._add_per_k_states()  # maj_at_{k}_sum for each k, num_problems

    def update(self, answers: Sequence[Sequence[Hashable | None]] | torch.Tensor, correct: torch.Tensor) -> None:
        correct = _validate_correctness(correct)
        if isinstance(answers, torch.Tensor):  # [num_problems, n] answer ids: vote on their values (tensors hash by id)
            answers = [[None if vote < 0 else vote for vote in row] if isinstance(row, list) else row
                       for row in answers.tolist()]  # a negative id abstains (answer_ids' None)
        elif inside_bootstrapper():  # the lists stay as given while correct's rows are resampled: votes of other problems
            raise ValueError("BootStrapper resamples tensor arguments only, and answers is not one: pass "
                             "MajorityAtK.answer_ids(answers) (a [num_problems, n] tensor of answer ids) as answers")
        num_problems, num_samples = correct.shape
        if isinstance(answers, (str, bytes)) or len(answers) != num_problems:
            raise ValueError(
                f"answers must hold one list of answers per problem: correct has {num_problems} rows but answers has "
                f"{len(answers) if not isinstance(answers, (str, bytes)) else 'a string, not a list'}"
            )
        self._check_ks_le_n(num_samples)
        verdicts = correct.cpu().tolist()
        hits = [0] * len(self.ks)
        for problem, (problem_answers, problem_correct) in enumerate(zip(answers, verdicts)):
            if (isinstance(problem_answers, (str, bytes)) or not hasattr(problem_answers, "__len__")
                    or len(problem_answers) != num_samples):
                raise ValueError(
                    f"answers[{problem}] must list one answer per sample (n={num_samples}, the width of correct), "
                    f"got {problem_answers!r:.80}"
                )
            problem_answers = _by_value(problem_answers)
            for j, k in enumerate(self.ks):
                hits[j] += majority_vote_correct(problem_answers, problem_correct, k)
        self._add_per_k_sums(hits, num_problems)

    @staticmethod
    def answer_ids(answers: Sequence[Sequence[Hashable | None]]) -> torch.Tensor:
        """``answers`` (one list of votes per problem, as ``update`` takes them) as a ``[num_problems, n]`` int64
        tensor: within each problem equal votes get one id (0, 1, … in order of first appearance) and ``None`` -1,
        which ``update`` reads as an abstention, so the votes are the same; the form torchmetrics' ``BootStrapper``
        resamples (with ``correct``, row by row)."""
        rows = []
        for problem_answers in answers:
            ids: dict[Hashable, int] = {}
            rows.append([-1 if vote is None else ids.setdefault(vote, len(ids)) for vote in _by_value(problem_answers)])
        if len({len(row) for row in rows}) > 1:
            raise ValueError(f"answers must list the same number n of votes for every problem, got {sorted({len(r) for r in rows})}")
        return torch.tensor(rows, dtype=torch.long) if rows else torch.zeros((0, 0), dtype=torch.long)

    def compute(self) -> dict[str, torch.Tensor] | torch.Tensor:
        return self._result()  # ks=: {"maj@1": ..., ...}; k=: one tensor; NaN when no problem was seen
