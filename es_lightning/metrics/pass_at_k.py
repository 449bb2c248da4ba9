"""Pass@k: the probability that at least one of k sampled completions is correct.

We use the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained on Code", §2.1, eq. 1):
draw ``n >= k`` samples per problem, count the ``c`` correct ones, and estimate

    pass@k = E_problems[ 1 - C(n - c, k) / C(n, k) ]

Computing ``1 - pass@k`` as a ratio of binomial coefficients overflows floats for realistic ``n`` (C(200, 100) ~ 1e59),
so we use the numerically stable product form from the paper's reference code (Figure 3):

    C(n - c, k) / C(n, k) = prod_{i = n - c + 1}^{n} (1 - k / i)

and pass@k = 1 exactly when ``n - c < k`` (every k-subset contains a correct sample). The naive estimator
``1 - (1 - c/n)^k`` is biased low and is deliberately not offered.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Iterable, Sequence

import torch
from torchmetrics import Metric

from es_lightning.metrics.plotting import Plottable
from es_lightning.metrics.state import ExactSums, KeepsStateOnError, sum_dtype

__all__ = ["PassAtK", "pass_at_k"]


def _as_int(value: object, name: str) -> int:
    try:
        return operator.index(value)  # accepts int, numpy ints, 0-d integer tensors; rejects floats and bools' cousins
    except TypeError:
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})") from None


def _check_k_le_n(k: int, num_samples: int, fix: str = "drop k={k} from ks") -> None:
    if k > num_samples:
        raise ValueError(
            f"pass@{k} needs at least k={k} samples per problem but got n={num_samples}: sample more completions "
            f"per problem (n >= {k}) or {fix.format(k=k)}"
        )


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k estimate for one problem (Chen et al. 2021, eq. 1, stable product form).

    Args:
        num_samples: ``n``, completions sampled for the problem.
        num_correct: ``c``, how many of them the verifier accepted (``0 <= c <= n``).
        k: the budget; must satisfy ``1 <= k <= n``.

    Returns:
        ``1 - C(n-c, k)/C(n, k)`` as a Python float in ``[0, 1]``; ``1.0`` when ``n - c < k``.
    """
    n = _as_int(num_samples, "num_samples")
    c = _as_int(num_correct, "num_correct")
    k = _as_int(k, "k")
    if k < 1:
        raise ValueError(f"k must be a positive integer, got k={k}")
    if not 0 <= c <= n:
        raise ValueError(f"num_correct must lie in [0, num_samples], got num_correct={c}, num_samples={n}")
    _check_k_le_n(k, n)
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def _pass_at_k_table(num_samples: int, ks: Sequence[int]) -> list[list[float]]:
    """``table[j][c]`` = pass@ks[j] for a problem with ``c`` of ``num_samples`` correct, for every ``c`` in 0..n.

    One pass of running products per k (O(n) each) instead of O(n) per problem: the estimate depends on a problem only
    through ``c``, so a batch of problems becomes a table lookup.
    """
    table = []
    for k in ks:
        row = [0.0] * (num_samples + 1)
        prob_all_wrong = 1.0
        for c in range(1, num_samples + 1):
            if num_samples - c < k:
                row[c] = 1.0
            else:
                prob_all_wrong *= 1.0 - k / (num_samples - c + 1)
                row[c] = 1.0 - prob_all_wrong
        table.append(row)
    return table


def _positive_int(k: object) -> int | None:
    """``k`` as an int when it is a positive integer (ints, numpy ints, 0-d integer tensors; not bools), else None."""
    try:
        value = None if isinstance(k, bool) else operator.index(k)
    except TypeError:
        return None
    return value if value is not None and value >= 1 else None


def _validate_ks(ks: Iterable[int]) -> tuple[int, ...]:
    """``ks`` as a tuple of distinct Python ints; numpy / torch integers (an array or tensor of ks) are read as theirs."""
    if hasattr(ks, "tolist"):  # a numpy array or tensor of ks, or one numpy / 0-d tensor integer
        ks = ks.tolist()
    if isinstance(ks, int):
        ks = (ks,)
    ks = tuple(ks)
    if not ks:
        raise ValueError("ks must name at least one k, e.g. ks=(1, 4, 16)")
    checked = []
    for k in ks:
        value = _positive_int(k)
        if value is None:
            raise ValueError(f"every k in ks must be a positive integer, got ks={ks}")
        checked.append(value)
    if len(set(checked)) != len(checked):
        raise ValueError(f"ks has duplicates: {ks}")
    return tuple(checked)


def _validate_correctness(correct: torch.Tensor, name: str = "correct") -> torch.Tensor:
    """Check a ``[num_problems, n]`` correctness matrix (bool, or integers that are all 0/1) and return it as bool."""
    if not isinstance(correct, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape [num_problems, n], got {type(correct).__name__}")
    if correct.ndim != 2:
        raise ValueError(
            f"{name} must be 2-D [num_problems, n] (one row per problem, one column per sample), got shape "
            f"{tuple(correct.shape)}; for a single problem use correct.unsqueeze(0)"
        )
    if correct.dtype == torch.bool:
        return correct
    if correct.is_floating_point() or correct.is_complex():
        raise TypeError(f"{name} must be bool or 0/1 integers, got dtype {correct.dtype}; use (reward == 1) or .bool()")
    if correct.numel() and not bool(((correct == 0) | (correct == 1)).all()):
        raise ValueError(f"{name} as integers must contain only 0 and 1")
    return correct.bool()


def inside_bootstrapper() -> bool:
    """Whether torchmetrics' ``BootStrapper`` is the caller (its ``update`` / ``compute`` a few frames up, past
    torchmetrics' own wrapper): it resamples only the tensor arguments of ``update`` and stacks what ``compute``
    returns, which a metric's refusal then names."""
    from torchmetrics.wrappers import BootStrapper

    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back
        if frame is None:
            return False
        if isinstance(frame.f_locals.get("self"), BootStrapper):
            return True
    return False


class _PerKSums:
    """Sum states of a metric over ks, one per k and named by it (``pass_at_4_sum``), beside a ``num_problems`` count.

    Not one ``[len(ks)]`` vector: torchmetrics' ``MetricCollection`` (``compute_groups=True``, its default) shares the
    states of metrics whose states have the same names, shapes and values after the first update, so
    ``PassAtK(ks=(1, 2))`` and ``PassAtK(ks=(1, 4))`` on a first batch of all-wrong problems (every sum 0) shared one
    vector from then on and the second reported pass@2 as its pass@4; and a ``state_dict`` of other ks loaded without
    a word into the wrong entries. Named by k, only metrics with the same ks group (they compute the same figures),
    and a ``state_dict`` of other ks is refused as missing / unexpected keys.
    """

    ks: tuple[int, ...]
    k: int | None  # the single-budget form (``k=``): compute() returns one tensor instead of a dict
    _state_stem: str  # "pass_at" / "maj_at"
    _label: str  # "pass" / "maj"

    def _init_ks(self, ks: Iterable[int] | None, k: int | None) -> None:
        """``ks=`` (several budgets, compute() a dict) or ``k=`` (one budget, compute() a tensor); the same states."""
        name = type(self).__name__
        if ks is not None and k is not None:
            raise ValueError(
                f"{name} takes ks= (several budgets; compute() returns a dict) or k= (one budget; compute() returns a "
                f"tensor), not both: got ks={ks!r}, k={k!r}; keep one, e.g. {name}(k={k}) to self.log the metric itself"
            )
        if k is None:
            self.k, self.ks = None, _validate_ks((1, 4, 16) if ks is None else ks)
            return
        value = _positive_int(k)
        if value is None:
            raise ValueError(f"{name}(k=...) takes one positive integer budget, got k={k!r}; for several use ks=(1, 4, 16)")
        self.k, self.ks = value, (value,)

    def _check_ks_le_n(self, num_samples: int) -> None:
        _check_k_le_n(max(self.ks), num_samples, "drop k={k} from ks" if self.k is None else "lower k")

    def _result(self) -> dict[str, torch.Tensor] | torch.Tensor:
        means = self._per_k_means()
        if self.k is None and inside_bootstrapper():  # else torch.stack's "expected Tensor ... but got dict"
            name = type(self).__name__
            raise ValueError(f"BootStrapper needs a metric whose compute() is one tensor, and {name}(ks={self.ks}) returns a "
                             f"dict: bootstrap {name}(k=...) instead, one BootStrapper per budget")
        return means if self.k is None else means[f"{self._label}@{self.k}"]

    def _add_per_k_states(self) -> None:
        for k in self.ks:
            self.add_state(self._k_state(k), default=torch.zeros((), dtype=sum_dtype()), dist_reduce_fx="sum")
        self.add_state("num_problems", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def _k_state(self, k: int) -> str:
        return f"{self._state_stem}_{k}_sum"

    def _add_per_k_sums(self, sums: Sequence[float] | torch.Tensor, num_problems: int) -> None:
        """Add ``sums[j]`` (the batch's sum for ``ks[j]``) to each k's state and ``num_problems`` to the count."""
        for j, k in enumerate(self.ks):
            state = getattr(self, self._k_state(k))
            state += torch.as_tensor(sums[j]).to(state)  # in place, as the states of a compute group are shared
        self.num_problems += num_problems

    def _per_k_means(self) -> dict[str, torch.Tensor]:
        # NaN when no problem was seen
        return {f"{self._label}@{k}": getattr(self, self._k_state(k)) / self.num_problems for k in self.ks}

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # torchmetrics skips a state the dict lacks (so that a module whose metrics are not persistent loads); a dict
        # with some of this metric's states but not all is another ks' (its own ones are unexpected keys)
        names = [prefix + name for name in self._defaults]
        if any(name in state_dict for name in names):
            missing_keys.extend(name for name in names if name not in state_dict)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)


class PassAtK(_PerKSums, KeepsStateOnError, ExactSums, Plottable, Metric):
    """Pass@k averaged over problems, with the unbiased estimator of Chen et al. 2021 (eq. 1).

    Each ``update`` takes the verifier's correctness matrix ``[num_problems, n]``; the per-problem estimate depends only
    on that problem's ``n`` and ``c``, so it is computed in ``update`` and the states are plain sums
    (``dist_reduce_fx="sum"``): DDP/FSDP ranks that see different problems sync exactly, and ``n`` may differ between
    calls.

    Sums are kept in float32 (float64 when that is the default dtype; fine on MPS), also in a ``bf16-true`` module:
    call ``set_dtype(torch.float64)`` for very large evaluations.

    Two forms, with the same states (and so the same sync and ``state_dict`` for the same k):

    * ``PassAtK(ks=(1, 4, 16))``: ``compute()`` returns ``{"pass@1": tensor, "pass@4": tensor, ...}``, every budget
      from one pass over the samples. Log it with ``self.log_dict(metric.compute())`` at the epoch's end;
      ``self.log("name", metric)`` is refused by Lightning (only when the epoch ends: it needs a tensor), as are
      torchmetrics' wrappers (``MetricTracker``, ``BootStrapper``, ``MinMaxMetric``) and arithmetic (``metric + 1``).
    * ``PassAtK(k=4)``: ``compute()`` returns one scalar tensor, like any torchmetrics metric, for
      ``self.log("val/pass@4", metric)`` (and a ``ModelCheckpoint`` monitoring it), those wrappers and arithmetic.
      Several budgets this way: ``MetricCollection({"pass@1": PassAtK(k=1), "pass@4": PassAtK(k=4)})`` and
      ``self.log_dict(collection)``.

    With no problems seen ``compute()`` returns NaN (for every k; torchmetrics also warns that ``compute`` ran before
    ``update``), so an empty sanity-check epoch logs NaN rather than crashing a run.

    Args:
        ks: the budgets k to report (default ``(1, 4, 16)``); positive integers, each at most the ``n`` of every update.
        k: instead of ``ks`` (keyword only), the one budget to report, as a tensor.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False
    _count_states = ("num_problems",)  # int64 whatever set_dtype makes the sums
    plot_lower_bound = 0.0
    plot_upper_bound = 1.0

    _state_stem = "pass_at"
    _label = "pass"
    num_problems: torch.Tensor

    def __init__(self, ks: Sequence[int] | None = None, *, k: int | None = None, **kwargs) -> None:
        super().__init__(**kwargs)
        self._init_ks(ks, k)
        self._add_per_k_states()  # pass_at_{k}_sum for each k, num_problems

    def update(self, correct: torch.Tensor) -> None:
        """Add problems; ``correct[i, j]``: did sample j of problem i pass (``[num_problems, n]``, bool/0-1)."""
        correct = _validate_correctness(correct)
        num_samples = correct.shape[1]
        self._check_ks_le_n(num_samples)
        num_correct = correct.sum(dim=1)  # [P]
        state = getattr(self, self._k_state(self.ks[0]))
        table = torch.tensor(_pass_at_k_table(num_samples, self.ks), dtype=state.dtype, device=state.device)  # [K, n + 1]
        estimates = table[:, num_correct.to(table.device)]  # [K, P]
        self._add_per_k_sums(estimates.sum(dim=1), correct.shape[0])

    def compute(self) -> dict[str, torch.Tensor] | torch.Tensor:
        return self._result()  # ks=: {"pass@1": ..., ...}; k=: one tensor; NaN when no problem was seen
