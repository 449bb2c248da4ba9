"""Metrics checked against independent computations: brute-force subset enumeration, exact binomials, a KL-based
Jensen–Shannon divergence, hand-worked votes and entropies, and a real 2-process gloo sync."""

from __future__ import annotations

import copy
import itertools
import math
import random
import re
import time
import warnings
from datetime import timedelta
from fractions import Fraction

import lightning
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics import MetricCollection

from es_lightning.metrics import (
    MajorityAtK,
    PassAtK,
    PopulationDiversity,
    TokenEntropy,
    js_succ,
    pass_at_k,
    population_pass,
    token_entropy,
)

# ---------------------------------------------------------------------------------------------------------- pass@k


def brute_force_pass_at_k(row: list[bool], k: int) -> float:
    """Fraction of all k-subsets of the n samples holding at least one correct sample (what the estimator estimates)."""
    subsets = list(itertools.combinations(range(len(row)), k))
    return sum(any(row[j] for j in subset) for subset in subsets) / len(subsets)


def random_correctness(generator: torch.Generator, num_problems: int, num_samples: int) -> torch.Tensor:
    # per-problem success probability, including all-wrong and all-right problems
    rates = torch.rand(num_problems, 1, generator=generator)
    rates[0], rates[-1] = 0.0, 1.0
    return torch.rand(num_problems, num_samples, generator=generator) < rates  # [P, n]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_pass_at_k_matches_enumeration_of_all_k_subsets(seed):
    generator = torch.Generator().manual_seed(seed)
    for num_samples in range(1, 11):
        correct = random_correctness(generator, 6, num_samples)
        ks = tuple(range(1, num_samples + 1))
        metric = PassAtK(ks=ks)
        metric.update(correct)
        result = metric.compute()
        for k in ks:
            expected = [brute_force_pass_at_k(row, k) for row in correct.tolist()]
            for row, value in zip(correct.tolist(), expected):
                assert pass_at_k(num_samples, sum(row), k) == pytest.approx(value, abs=1e-12)
            assert result[f"pass@{k}"].item() == pytest.approx(sum(expected) / len(expected), abs=1e-6)


def test_pass_at_k_matches_exact_binomial_form():
    for n in range(1, 31):
        for c in range(n + 1):
            for k in range(1, n + 1):
                exact = 1 - Fraction(math.comb(n - c, k), math.comb(n, k))
                assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_values():
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 10, 3) == 1.0
    assert pass_at_k(10, 8, 3) == 1.0  # n - c = 2 < k: every 3-subset holds a correct sample
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 = c / n
    assert pass_at_k(torch.tensor(4), torch.tensor(2), 2) == pytest.approx(1 - 1 / 6)  # 0-d int tensors accepted


@pytest.mark.parametrize("num_samples", [200, 2000])
def test_pass_at_k_is_stable_for_large_n(num_samples):
    if num_samples == 2000:
        with pytest.raises(OverflowError):  # the textbook ratio in floats is not an option at this n
            float(math.comb(num_samples, num_samples // 2))
    for c in [0, 1, 3, 17, 100, 190, num_samples - 1]:
        for k in [1, 10, 50, 100, num_samples // 2]:
            value = pass_at_k(num_samples, c, k)
            exact = 1 - Fraction(math.comb(num_samples - c, k), math.comb(num_samples, k))
            assert math.isfinite(value) and 0.0 <= value <= 1.0
            assert value == pytest.approx(float(exact), abs=1e-12), (c, k)
    # and through the metric (float32 states)
    generator = torch.Generator().manual_seed(7)
    correct = random_correctness(generator, 5, num_samples)
    metric = PassAtK(ks=(1, 16, 100))
    metric.update(correct)
    for k, value in metric.compute().items():
        k = int(k.removeprefix("pass@"))
        expected = (
            sum(
                float(1 - Fraction(math.comb(num_samples - c, k), math.comb(num_samples, k)))
                for c in correct.sum(1).tolist()
            )
            / 5
        )
        assert value.item() == pytest.approx(expected, abs=1e-6)


def test_pass_at_k_accumulates_across_updates_with_different_n():
    generator = torch.Generator().manual_seed(11)
    chunks = [random_correctness(generator, 4, 8) for _ in range(3)]
    one_update, many_updates = PassAtK(ks=(1, 2, 8)), PassAtK(ks=(1, 2, 8))
    one_update.update(torch.cat(chunks))
    for chunk in chunks:
        many_updates.update(chunk)
    for key, value in one_update.compute().items():
        torch.testing.assert_close(many_updates.compute()[key], value)

    # n may change between calls: the result is the mean of per-problem estimates
    mixed = PassAtK(ks=(1, 2))
    wide, narrow = random_correctness(generator, 3, 9), random_correctness(generator, 5, 2)
    mixed.update(wide)
    mixed.update(narrow)
    for k in (1, 2):
        per_problem = [brute_force_pass_at_k(row, k) for row in wide.tolist() + narrow.tolist()]
        assert mixed.compute()[f"pass@{k}"].item() == pytest.approx(sum(per_problem) / 8, abs=1e-6)


def test_pass_at_k_accepts_0_1_integers():
    correct = torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0]])
    from_ints, from_bools = PassAtK(ks=(1, 2)), PassAtK(ks=(1, 2))
    from_ints.update(correct)
    from_bools.update(correct.bool())
    assert from_ints.compute() == from_bools.compute()
    assert from_ints.compute()["pass@1"].item() == pytest.approx(0.25)
    assert from_ints.compute()["pass@2"].item() == pytest.approx((1 - 1 / 6) / 2)


def test_pass_at_k_rejects_k_above_n_with_the_fix():
    metric = PassAtK(ks=(1, 16))
    with pytest.raises(ValueError, match=r"k=16.*n=8.*sample more.*drop k=16"):
        metric.update(torch.ones(3, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="k=5.*n=4"):
        pass_at_k(4, 1, 5)


@pytest.mark.parametrize(
    "correct, error",
    [
        (torch.ones(8, dtype=torch.bool), ValueError),  # 1-D
        (torch.ones(2, 3, 4, dtype=torch.bool), ValueError),  # 3-D
        (torch.full((2, 4), 0.5), TypeError),  # float rewards, not verdicts
        (torch.tensor([[0, 1, 2, 1]]), ValueError),  # ints other than 0/1
        ([[True, False]], TypeError),  # not a tensor
    ],
)
def test_pass_at_k_rejects_bad_correctness_matrix(correct, error):
    with pytest.raises(error, match="correct"):
        PassAtK(ks=(1,)).update(correct)


@pytest.mark.parametrize("ks", [(), (0,), (1, -4), (1.0,), ("4",), (True,), (4, 4)])
def test_pass_at_k_rejects_bad_ks(ks):
    with pytest.raises(ValueError, match="ks"):
        PassAtK(ks=ks)


def test_ks_may_be_numpy_or_torch_integers():
    """``ks=np.array([1, 4])`` or ``torch.tensor([1, 4])`` (or a list of numpy ints) was refused as "every k in ks must
    be a positive integer" although every k was one; they are read as Python ints (keys ``pass@1``, ``maj@4``)."""
    import numpy as np

    correct = torch.tensor([[True, False, False, False], [False, False, False, False]])
    expected = {"pass@1": 0.125, "pass@4": 0.5}
    for ks in (np.array([1, 4]), torch.tensor([1, 4]), [np.int64(1), np.int64(4)], [torch.tensor(1), 4]):
        metric = PassAtK(ks=ks)
        assert metric.ks == (1, 4) and all(type(k) is int for k in metric.ks)
        metric.update(correct)
        assert {key: value.item() for key, value in metric.compute().items()} == expected
        assert MajorityAtK(ks=ks).ks == (1, 4)
    assert PassAtK(ks=np.int64(4)).ks == (4,)
    with pytest.raises(ValueError, match="positive integer"):
        PassAtK(ks=np.array([1.0, 4.0]))


def test_pass_at_k_rejects_bad_scalar_arguments():
    with pytest.raises(ValueError, match="num_correct"):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError, match="k must be a positive"):
        pass_at_k(4, 1, 0)
    with pytest.raises(TypeError, match="num_samples"):
        pass_at_k(4.0, 1, 1)


def test_empty_compute_is_nan_for_every_metric():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torchmetrics warns that compute ran before update
        assert all(torch.isnan(v) for v in PassAtK(ks=(1, 4)).compute().values())
        assert all(torch.isnan(v) for v in MajorityAtK(ks=(1,)).compute().values())
        assert torch.isnan(TokenEntropy().compute())
        assert all(torch.isnan(v) for v in PopulationDiversity().compute().values())


def test_pass_at_k_reset_starts_over():
    metric = PassAtK(ks=(1,))
    metric.update(torch.ones(2, 3, dtype=torch.bool))
    metric.reset()
    metric.update(torch.zeros(1, 3, dtype=torch.bool))
    assert metric.compute()["pass@1"].item() == 0.0


# ---------------------------------------------------------------------------------------------------------- maj@k


def reference_majority_correct(answers, correct, k):
    """Independent maj@k: rank answers by (-count, first index); abstain on None; wrong when nobody votes."""
    first = answers[:k]
    candidates = {a for a in first if a is not None}
    if not candidates:
        return 0.0
    winner = min(candidates, key=lambda a: (-first.count(a), first.index(a)))
    return float(correct[first.index(winner)])


def maj(answers, correct, ks):
    metric = MajorityAtK(ks=ks)
    metric.update(answers, torch.tensor(correct))
    return {key: value.item() for key, value in metric.compute().items()}


def test_majority_hand_cases():
    # majority "4" is right; first sample right too
    assert maj([["4", "5", "4"]], [[True, False, True]], ks=(1, 3)) == {"maj@1": 1.0, "maj@3": 1.0}
    # first sample right but the majority "5" is wrong
    assert maj([["4", "5", "5"]], [[True, False, False]], ks=(1, 2, 3)) == {"maj@1": 1.0, "maj@2": 1.0, "maj@3": 0.0}
    # tie 1-1: the answer seen first wins
    assert maj([["5", "4"]], [[False, True]], ks=(2,)) == {"maj@2": 0.0}
    assert maj([["4", "5"]], [[True, False]], ks=(2,)) == {"maj@2": 1.0}
    # unparseable answers abstain; all-None counts as wrong
    assert maj([[None, None, "7"]], [[False, False, True]], ks=(1, 2, 3)) == {"maj@1": 0.0, "maj@2": 0.0, "maj@3": 1.0}
    assert maj([[None, None, None, "3", "4", "4"]], [[False] * 3 + [False, True, True]], ks=(6,)) == {"maj@6": 1.0}
    # averaged over problems
    assert maj([["1", "1"], ["2", "3"]], [[True, True], [False, True]], ks=(2,)) == {"maj@2": 0.5}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_majority_matches_independent_vote_on_random_answers(seed):
    rng = random.Random(seed)
    num_samples, ks = 9, (1, 2, 5, 9)
    answers, correct = [], []
    for _ in range(40):
        truth = str(rng.randint(0, 3))
        row = [rng.choice(["0", "1", "2", "3", None]) for _ in range(num_samples)]
        answers.append(row)
        correct.append([answer == truth for answer in row])
    got = maj(answers, correct, ks)
    for k in ks:
        expected = sum(reference_majority_correct(a, c, k) for a, c in zip(answers, correct)) / len(answers)
        assert got[f"maj@{k}"] == pytest.approx(expected, abs=1e-6)
    # maj@1 is pass@1 on the first sample
    assert got["maj@1"] == pytest.approx(sum(row[0] for row in correct) / len(correct))


def test_majority_votes_on_the_values_of_tensor_answers():
    """Answers given as a tensor of answer ids (or rows / elements that are tensors) were counted by identity — a
    tensor hashes by id — so no two samples ever agreed and the first sample always won the vote. They are read as
    their values, as the same answers in lists."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 3, (12, 5), generator=generator)
    correct = ids == 1
    expected = maj(ids.tolist(), correct.tolist(), (1, 3, 5))
    assert expected != maj([row[:1] * 5 for row in ids.tolist()], correct.tolist(), (1, 3, 5))  # first-sample wins
    for answers in (ids, list(ids), [list(row) for row in ids]):
        metric = MajorityAtK(ks=(1, 3, 5))
        metric.update(answers, correct)
        assert {key: value.item() for key, value in metric.compute().items()} == expected
    with pytest.raises(ValueError, match=r"answers\[0\] must list one answer per sample"):
        MajorityAtK(ks=(1,)).update(torch.tensor([1, 2]), torch.ones(2, 1, dtype=torch.bool))


def test_majority_rejects_mismatched_inputs():
    metric = MajorityAtK(ks=(1, 2))
    with pytest.raises(ValueError, match="one list of answers per problem"):
        metric.update([["1", "2"]], torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"answers\[0\].*n=2"):
        metric.update([["1", "2", "3"]], torch.ones(1, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="k=2.*n=1"):
        metric.update([["1"]], torch.ones(1, 1, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------------------- entropy


def reference_entropy(logits: torch.Tensor) -> torch.Tensor:
    """H = log Z - E_p[z] with max-shifted logits, in float64 (a different route from -sum p log p)."""
    z = logits.double() - logits.double().amax(dim=-1, keepdim=True)
    partition = z.exp().sum(-1)
    probs = z.exp() / partition.unsqueeze(-1)
    return partition.log() - (probs * z).sum(-1)


def test_token_entropy_hand_values():
    vocab_size = 7
    uniform = torch.full((2, 3, vocab_size), 4.2)  # [B, L, V]
    torch.testing.assert_close(token_entropy(uniform), torch.full((2, 3), math.log(vocab_size)))

    one_hot = torch.full((1, 2, vocab_size), float("-inf"))
    one_hot[..., 3] = 0.0  # all mass on one token; -inf elsewhere must not give NaN
    assert torch.equal(token_entropy(one_hot), torch.zeros(1, 2))

    two_way = torch.tensor([[[0.0, 0.0, float("-inf")]]])  # fair coin over two tokens
    torch.testing.assert_close(token_entropy(two_way), torch.tensor([[math.log(2)]]))


def test_token_entropy_matches_reference_and_is_chunk_invariant():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0)) * 4  # [B, L, V]
    expected = reference_entropy(logits).float()
    torch.testing.assert_close(token_entropy(logits), expected)
    torch.testing.assert_close(token_entropy(logits, chunk_size=1), expected)
    bf16 = token_entropy(logits.bfloat16())
    assert bf16.dtype == torch.float32 and bf16.shape == (3, 5)
    torch.testing.assert_close(bf16, reference_entropy(logits.bfloat16()).float(), atol=1e-4, rtol=1e-4)


def test_token_entropy_mask_zeroes_positions():
    logits = torch.randn(2, 4, 5, generator=torch.Generator().manual_seed(1))
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]])
    out = token_entropy(logits, mask)
    assert torch.equal(out[0, 2:], torch.zeros(2))
    torch.testing.assert_close(out[1], token_entropy(logits)[1])


def test_token_entropy_metric_is_token_weighted_and_ignores_masked_tokens():
    entropy = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])  # [B, L]; 100 = padding, must not count
    mask = torch.tensor([[True, True, False], [True, False, False]])
    metric = TokenEntropy()
    metric.update(entropy, mask)
    assert metric.compute().item() == pytest.approx((1 + 2 + 3) / 3)  # token-weighted, not (1.5 + 3) / 2
    metric.update(torch.tensor(10.0), 2)  # pre-reduced: sum 10 over 2 tokens
    assert metric.compute().item() == pytest.approx((6 + 10) / 5)
    metric.update(torch.tensor([[4.0]]))  # no mask: every token counts
    assert metric.compute().item() == pytest.approx((6 + 10 + 4) / 6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_token_entropy_metric_sums_half_precision_entropies_in_its_own_dtype(dtype):
    """Per-token entropies in fp16 / bf16 (a half-precision policy's) were summed in their own dtype: 32k tokens of ~2
    nats overflowed fp16 (inf) and bf16 rounded the sum to 3 digits. They are summed in the metric's dtype."""
    entropies = (torch.rand(64, 512, generator=torch.Generator().manual_seed(6)) * 4).to(dtype)  # [B, L]
    mask = torch.ones(64, 512, dtype=torch.bool)
    mask[:, -5:] = False
    for args, kept in (((entropies,), entropies), ((entropies, mask), entropies[mask])):
        metric = TokenEntropy()
        metric.update(*args)
        assert metric.compute().item() == pytest.approx(kept.double().mean().item(), rel=1e-5)


def test_token_entropy_refuses_token_counts_as_a_mask():
    """``update(per_sequence_sums [B], token_counts [B])`` — the reduced form of the docstring, one sum per sequence —
    read the counts as a 0/1 mask: every sequence's sum weighed as one token (18.3 nats for 2.1). An integer mask with
    values other than 0/1 is refused, naming the scalar form."""
    sums, counts = torch.tensor([20.0, 30.0, 5.0]), torch.tensor([10, 12, 4])
    with pytest.raises(ValueError, match=r"values up to 12.*update\(entropy_sums.sum\(\), token_counts.sum\(\)\)"):
        TokenEntropy().update(sums, counts)
    with pytest.raises(ValueError, match="0/1 integers"):
        token_entropy(torch.zeros(1, 3, 4), torch.tensor([[1, 2, 0]]))
    metric = TokenEntropy()
    metric.update(sums.sum(), counts.sum())
    metric.update(torch.tensor([[1.0, 3.0]]), torch.tensor([[1, 0]]))  # 0/1 integers are a mask
    assert metric.compute().item() == pytest.approx(56 / 27)


def test_token_entropy_takes_the_reduced_form_by_keyword():
    """The docstring's `update(entropy_sum, num_tokens)` refused those keywords (TypeError), and a `MetricCollection`,
    which passes each metric the keywords its `update` names, dropped them and raised a missing argument."""
    sums, counts = torch.tensor([20.0, 30.0, 5.0]), torch.tensor([10, 12, 4])
    metric = TokenEntropy()
    metric.update(entropy_sum=sums.sum(), num_tokens=counts.sum())
    metric.update(per_token_entropy=torch.tensor([[1.0, 3.0]]), mask=torch.tensor([[True, False]]))
    assert metric.compute().item() == pytest.approx(56 / 27)
    collection = MetricCollection([TokenEntropy()])
    collection.update(entropy_sum=sums.sum(), num_tokens=counts.sum())
    assert collection(entropy_sum=torch.tensor(1.0), num_tokens=2)["TokenEntropy"].item() == pytest.approx(0.5)
    assert collection.compute()["TokenEntropy"].item() == pytest.approx(56 / 28)
    with pytest.raises(ValueError, match="not a mix"):
        TokenEntropy().update(torch.ones(2, 2), num_tokens=4)
    with pytest.raises(ValueError, match="not a mix"):
        TokenEntropy().update(entropy_sum=1.0)
    with pytest.raises(ValueError, match="entropy_sum must be a scalar"):
        TokenEntropy().update(entropy_sum=torch.ones(2, 2), num_tokens=4)
    with pytest.raises(ValueError, match="update needs per_token_entropy"):
        TokenEntropy().update()


def test_token_entropy_metric_errors():
    metric = TokenEntropy()
    with pytest.raises(ValueError, match="mask shape"):
        metric.update(torch.ones(2, 3), torch.ones(2, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match="num_tokens"):
        metric.update(torch.tensor(1.0))
    with pytest.raises(TypeError, match="mask must be bool"):
        metric.update(torch.ones(2, 3), torch.ones(2, 3))


# ---------------------------------------------------------------------------------------------------------- diversity


def bernoulli_kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """KL(B(p) || B(q)) in nats, with 0 log 0 = 0 written out by hand."""

    def term(a, b):
        return torch.where(a > 0, a * (a.log() - b.log()), torch.zeros_like(a))

    return term(p, q) + term(1 - p, 1 - q)


def js_via_kl_to_mixture(success: torch.Tensor) -> torch.Tensor:
    """Equal-weight JS divergence of the members' Bernoullis as mean_i KL(B(p_i) || B(p_bar)), averaged over prompts."""
    success = success.double()  # [N, P]
    mixture = success.mean(0, keepdim=True).expand_as(success)  # [N, P]
    return bernoulli_kl(success, mixture).mean(0).mean()


def test_js_succ_identical_members_is_zero():
    for rate in [0.0, 0.3, 0.5, 1.0]:
        assert js_succ(torch.full((6, 4), rate)).item() == pytest.approx(0.0, abs=1e-7)


def test_js_succ_split_population_is_ln2():
    success = torch.tensor([[1.0], [1.0], [0.0], [0.0]])  # half always solve, half never
    assert js_succ(success).item() == pytest.approx(math.log(2), abs=1e-6)
    assert js_succ(torch.tensor([True, False])).item() == pytest.approx(math.log(2), abs=1e-6)  # 1-D = one prompt


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_js_succ_matches_kl_to_mixture(seed):
    generator = torch.Generator().manual_seed(seed)
    success = torch.randint(0, 9, (8, 12), generator=generator) / 8  # rates from 8 samples: exact 0s and 1s appear
    assert (success == 0).any() and (success == 1).any()
    assert js_succ(success).item() == pytest.approx(js_via_kl_to_mixture(success).item(), abs=1e-6)
    per_prompt = js_succ(success, per_prompt=True)
    assert per_prompt.shape == (12,) and bool((per_prompt >= 0).all()) and bool((per_prompt <= math.log(2)).all())


def test_population_pass():
    assert population_pass(torch.tensor([[0.5], [0.5]])).item() == pytest.approx(0.75)
    # one sample per member: the population passes a prompt iff some member solved it
    solved = torch.rand(5, 20, generator=torch.Generator().manual_seed(3)) < 0.2  # [N, P]
    assert population_pass(solved).item() == pytest.approx(solved.any(0).float().mean().item())
    assert population_pass(torch.zeros(3, 2)).item() == 0.0


def test_diversity_rejects_bad_success():
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        js_succ(torch.tensor([[0.5, 1.5]]))
    with pytest.raises(ValueError, match="num_members, num_prompts"):
        population_pass(torch.zeros(2, 2, 2))


def test_population_diversity_metric_averages_over_all_prompts():
    generator = torch.Generator().manual_seed(5)
    step_one, step_two = torch.rand(4, 3, generator=generator), torch.rand(6, 5, generator=generator)
    metric = PopulationDiversity()
    metric.update(step_one)
    metric.update(step_two)  # population size may change between steps
    result = metric.compute()
    expected_js = torch.cat([js_succ(step_one, per_prompt=True), js_succ(step_two, per_prompt=True)]).mean()
    expected_pass = torch.cat([population_pass(step_one, True), population_pass(step_two, True)]).mean()
    torch.testing.assert_close(result["js_succ"], expected_js)
    torch.testing.assert_close(result["population_pass"], expected_pass)


# ---------------------------------------------------------------------------------------------------------- DDP sync


def _sync_worker(rank, world_size, init_file, parts, out_dir):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size, timeout=timedelta(seconds=90)
    )
    try:
        part = parts[rank]
        pass_metric, maj_metric = PassAtK(ks=(1, 2, 4)), MajorityAtK(ks=(1, 3))
        entropy_metric, diversity_metric = TokenEntropy(), PopulationDiversity()
        for correct in part["correct"]:
            pass_metric.update(correct)
        maj_metric.update(part["answers"], part["maj_correct"])
        entropy_metric.update(part["entropy"], part["mask"])
        diversity_metric.update(part["success"])
        # copies that refused a batch in forward before computing: they must sync as the others do
        refused = [copy.deepcopy(metric) for metric in (pass_metric, maj_metric, entropy_metric, diversity_metric)]
        for metric, bad_batch in zip(refused, [(torch.ones(1, 2),), ([[1]], torch.ones(1, 1)), (torch.ones(2), torch.ones(3)),
                                               (torch.full((2, 2), 2.0),)]):
            with pytest.raises((ValueError, TypeError)):
                metric(*bad_batch)
        results = {
            **pass_metric.compute(),
            **maj_metric.compute(),
            "entropy": entropy_metric.compute(),
            **diversity_metric.compute(),
        }
        torch.save(results, f"{out_dir}/rank{rank}.pt")
        refused_results = {**refused[0].compute(), **refused[1].compute(), "entropy": refused[2].compute(), **refused[3].compute()}
        torch.save(refused_results, f"{out_dir}/rank{rank}-refused.pt")
    finally:
        dist.destroy_process_group()


def test_metrics_sync_across_two_processes(tmp_path):
    generator = torch.Generator().manual_seed(0)
    rng = random.Random(0)

    def make_part(num_problems, num_samples, num_sequences, num_prompts):
        answers = [[rng.choice(["1", "2", None]) for _ in range(3)] for _ in range(num_problems)]
        return {
            # two updates with different n, and unequal problem counts between ranks
            "correct": [random_correctness(generator, num_problems, num_samples), random_correctness(generator, 2, 4)],
            "answers": answers,
            "maj_correct": torch.tensor([[a == "1" for a in row] for row in answers]),
            "entropy": torch.rand(num_sequences, 6, generator=generator),
            "mask": torch.rand(num_sequences, 6, generator=generator) < 0.7,
            "success": torch.rand(4, num_prompts, generator=generator),
        }

    parts = [make_part(3, 5, 2, 3), make_part(5, 7, 3, 6)]

    pass_metric, maj_metric = PassAtK(ks=(1, 2, 4)), MajorityAtK(ks=(1, 3))
    entropy_metric, diversity_metric = TokenEntropy(), PopulationDiversity()
    for part in parts:
        for correct in part["correct"]:
            pass_metric.update(correct)
        maj_metric.update(part["answers"], part["maj_correct"])
        entropy_metric.update(part["entropy"], part["mask"])
        diversity_metric.update(part["success"])
    single = {
        **pass_metric.compute(),
        **maj_metric.compute(),
        "entropy": entropy_metric.compute(),
        **diversity_metric.compute(),
    }

    context = mp.spawn(_sync_worker, args=(2, str(tmp_path / "rendezvous"), parts, str(tmp_path)), nprocs=2, join=False)
    deadline = time.monotonic() + 120
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("distributed workers did not finish within 120 s")

    for rank, name in itertools.product(range(2), ("", "-refused")):
        synced = torch.load(tmp_path / f"rank{rank}{name}.pt")
        assert synced.keys() == single.keys()
        for key, value in single.items():
            torch.testing.assert_close(synced[key], value, msg=f"rank {rank}{name}, {key}")
    # the parts really differ, so a missing sync would have been caught
    local = PassAtK(ks=(1, 2, 4))
    for correct in parts[0]["correct"]:
        local.update(correct)
    assert any(not torch.allclose(local.compute()[k], single[k]) for k in local.compute())


def test_a_refused_forward_keeps_what_was_accumulated():
    """torchmetrics' `forward` resets the metric to run `update` on the batch alone; when `update` refused the batch
    (k > n, a 1-D matrix, a bad mask or success rate) everything accumulated before was lost (compute gave NaN) and
    `compute` no longer synced across processes. The refusal now leaves the metric as it was, and it goes on."""
    generator = torch.Generator().manual_seed(0)
    first, second = random_correctness(generator, 5, 6), random_correctness(generator, 3, 4)
    metric = PassAtK(ks=(1, 4))
    metric.update(first)
    for refused in (first[:, :3], first[0], first.float()):  # k=4 > n=3; not [P, n]; not bool
        with pytest.raises((ValueError, TypeError)):
            metric(refused)
    batch = metric(second)
    for k in (1, 4):
        expected = [brute_force_pass_at_k(row, k) for row in first.tolist() + second.tolist()]
        assert metric.compute()[f"pass@{k}"].item() == pytest.approx(sum(expected) / len(expected), abs=1e-6)
        batch_expected = [brute_force_pass_at_k(row, k) for row in second.tolist()]
        assert batch[f"pass@{k}"].item() == pytest.approx(sum(batch_expected) / len(batch_expected), abs=1e-6)

    majority = MajorityAtK(ks=(1, 3))
    majority.update([["4", "5", "5"], [None, "2", "2"]], torch.tensor([[True, False, False], [False, True, True]]))
    with pytest.raises(ValueError, match="needs at least k=3"):
        majority([["4", "4"]], torch.tensor([[True, True]]))
    assert {key: value.item() for key, value in majority.compute().items()} == {"maj@1": 0.5, "maj@3": 0.5}

    entropy = TokenEntropy()
    entropy.update(torch.tensor([[1.0, 2.0, 6.0]]), torch.tensor([[True, True, False]]))
    with pytest.raises(ValueError, match="mask shape"):
        entropy(torch.ones(2, 3), torch.ones(2, 2, dtype=torch.bool))
    assert entropy.compute().item() == pytest.approx(1.5)

    diversity = PopulationDiversity()
    success = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # prompt 0: split population (ln 2), prompt 1: all agree (0)
    diversity.update(success)
    with pytest.raises(ValueError, match=r"in \[0, 1\]"):
        diversity(torch.full((2, 2), 2.0))
    assert diversity.compute()["js_succ"].item() == pytest.approx(math.log(2) / 2)
    assert diversity.compute()["population_pass"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "torch.HalfTensor", torch.int64])
def test_set_dtype_refuses_dtypes_that_cannot_hold_the_sums(dtype):
    """torchmetrics' `set_dtype(torch.float16)` made every state float16, counts too: 3000 problems, one a batch, were
    counted 2048 (2048 + 1 rounds to 2048). Half precision cannot hold the sums either, so it is refused."""
    for metric in (PassAtK(ks=(1,)), MajorityAtK(ks=(1,)), TokenEntropy(), PopulationDiversity()):
        with pytest.raises(ValueError, match=r"set_dtype\(torch\.float64\)"):
            metric.set_dtype(dtype)
        assert all(getattr(metric, name).dtype in (torch.float32, torch.long) for name in metric._defaults)


def test_set_dtype_float64_keeps_counts_exact_integers():
    generator = torch.Generator().manual_seed(0)
    metric = PassAtK(ks=(1, 3)).set_dtype(torch.float64)
    assert metric.num_problems.dtype == torch.long and metric.pass_at_3_sum.dtype == torch.float64
    rows = []
    for _ in range(300):  # 3000 problems
        correct = random_correctness(generator, 10, 4)
        metric.update(correct)
        rows += correct.tolist()
    assert metric.num_problems.dtype == torch.long and int(metric.num_problems) == 3000
    for k in (1, 3):
        exact = sum(Fraction(1) - Fraction(math.comb(4 - sum(row), k), math.comb(4, k)) for row in rows) / len(rows)
        assert metric.compute()[f"pass@{k}"].item() == pytest.approx(float(exact), abs=1e-12)
    for other in (TokenEntropy(), PopulationDiversity(), MajorityAtK(ks=(1,))):
        other.set_dtype(torch.float64)
        counts = [name for name in other._defaults if name.startswith("num_")]
        assert counts and all(getattr(other, name).dtype == torch.long for name in counts)


def test_metrics_of_a_bf16_true_lightning_module_sum_in_float32():
    """Lightning's `bf16-true` makes bfloat16 the default dtype in `configure_model` and calls `.to(torch.bfloat16)` on
    the module, metrics included (torchmetrics guards `.half()`, not `.to(dtype)`): the sums became bfloat16, which
    stops counting at 256, and pass@1 of 1200 problems, half right, came out 0.21. Sums now stay float32."""
    generator = torch.Generator().manual_seed(0)
    batches = [random_correctness(generator, 300, 4) for _ in range(4)]
    entropies = torch.rand(4, 300, 8, generator=generator) * 3  # [steps, B, L]

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.pass_in_init = PassAtK(ks=(1, 2))

        def configure_model(self):  # under bf16-true: bfloat16 is the default dtype here
            self.layer = torch.nn.Linear(1, 1)
            self.pass_in_configure_model, self.entropy = PassAtK(ks=(1, 2)), TokenEntropy()

        def training_step(self, batch, batch_idx):
            for metric in (self.pass_in_init, self.pass_in_configure_model):
                metric.update(batches[batch_idx])
            self.entropy.update(entropies[batch_idx])
            return self.layer(batch).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    module = Module()
    trainer = lightning.Trainer(max_epochs=1, precision="bf16-true", accelerator="cpu", logger=False,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, torch.utils.data.DataLoader(torch.ones(4, 1), batch_size=1))
    assert module.layer.weight.dtype == torch.bfloat16  # the module is bf16; its metrics' sums are not
    rows = torch.cat(batches).tolist()
    for metric in (module.pass_in_init, module.pass_in_configure_model):
        result = metric.compute()
        for k in (1, 2):
            exact = sum(Fraction(1) - Fraction(math.comb(4 - sum(row), k), math.comb(4, k)) for row in rows) / len(rows)
            assert result[f"pass@{k}"].dtype == torch.float32
            assert result[f"pass@{k}"].item() == pytest.approx(float(exact), abs=1e-5)
    assert module.entropy.compute().item() == pytest.approx(entropies.double().mean().item(), abs=1e-5)


def test_every_metric_plots_as_torchmetrics_metrics_do():
    """`metric.plot()` (torchmetrics' API: a result, or a list of results over time, into a matplotlib axis) raised an
    empty NotImplementedError for every metric of the project. Each now draws a point per figure for one result and a
    line per figure for a list; the drawn values are the computed ones."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from es_lightning.metrics import MajorityAtK, PassAtK, PopulationDiversity, TokenEntropy

    correct = torch.tensor([[1, 0, 0, 1], [0, 0, 0, 0]], dtype=torch.bool)
    cases = [
        (PassAtK([1, 4]), (correct,), (torch.ones(1, 4, dtype=torch.bool),)),
        (MajorityAtK([1, 4]), ([["1", "2", "2", "1"], ["3", "3", "3", "4"]], correct), ([["5"] * 4], torch.ones(1, 4, dtype=torch.bool))),
        (TokenEntropy(), (torch.tensor([[0.5, 1.0, 2.0]]), torch.tensor([[1, 1, 0]])), (torch.tensor([[3.0]]),)),
        (PopulationDiversity(), (torch.tensor([[1, 0], [0, 0], [1, 1]]),), (torch.tensor([[1, 1], [1, 1]]),)),
    ]
    for metric, first, second in cases:
        metric.update(*first)
        one = metric.compute()
        metric.update(*second)
        two = metric.compute()
        values = one if isinstance(one, dict) else {type(metric).__name__: one}
        fig, ax = metric.plot(one)
        drawn = {line.get_label(): line.get_ydata().tolist() for line in ax.get_lines()}
        assert drawn.keys() == values.keys() or len(values) == 1, (metric, drawn)
        assert sorted(y for ys in drawn.values() for y in ys) == pytest.approx(sorted(float(v) for v in values.values()))
        plt.close(fig)
        fig, axis = plt.subplots()
        assert metric.plot([one, two], ax=axis)[1] is axis  # drawn into the given axis (torchmetrics returns no figure)
        series = sorted(line.get_ydata().tolist() for line in axis.get_lines())
        later = two if isinstance(two, dict) else {type(metric).__name__: two}
        expected = sorted([float(values[k]), float(later[k])] for k in values)
        assert len(series) == len(expected) and all(a == pytest.approx(b) for a, b in zip(series, expected)), series
        plt.close(fig)
        metric.reset()
        assert metric.plot()[1] is not None  # nothing seen: NaN figures, still a picture


# ---------------------------------------------------------------------------------------------------------- torchmetrics habits


def test_metrics_of_other_ks_keep_their_own_states_in_a_metric_collection():
    """MetricCollection groups metrics whose states match after the first update (compute_groups, its default):
    PassAtK(ks=(1, 2)) and PassAtK(ks=(1, 4)) kept one [2] vector of sums, identical after a first batch of all-wrong
    problems, and from then on the second reported pass@2 as its pass@4 (MajorityAtK alike). States are now one per k,
    named by it; and a state_dict of other ks is refused instead of filling the wrong entries."""
    from torchmetrics import MetricCollection

    generator = torch.Generator().manual_seed(3)
    all_wrong, later = torch.zeros(4, 8, dtype=torch.bool), random_correctness(generator, 6, 8)
    rng = random.Random(3)
    answers = [[rng.choice(["1", "2", "3", None]) for _ in range(8)] for _ in range(10)]
    votes_correct = torch.tensor([[a == "1" for a in row] for row in answers])
    votes_correct[:4] = False
    for compute_groups in (True, False):
        passes = MetricCollection({"small": PassAtK(ks=(1, 2)), "large": PassAtK(ks=(1, 4))}, compute_groups=compute_groups)
        votes = MetricCollection({"small": MajorityAtK(ks=(1, 2)), "large": MajorityAtK(ks=(1, 3))},
                                 compute_groups=compute_groups)
        passes.update(all_wrong)
        passes.update(later)
        votes.update(answers[:4], votes_correct[:4])
        votes.update(answers[4:], votes_correct[4:])
        result = {**passes.compute(), **votes.compute()}
        for name, k in (("small", 1), ("small", 2), ("large", 1), ("large", 4)):
            expected = sum(brute_force_pass_at_k(row, k) for row in torch.cat([all_wrong, later]).tolist()) / 10
            assert result[f"{name}_pass@{k}"].item() == pytest.approx(expected, abs=1e-6), (compute_groups, name, k)
        for name, k in (("small", 1), ("small", 2), ("large", 1), ("large", 3)):
            expected = sum(reference_majority_correct(a, c, k) for a, c in zip(answers, votes_correct.tolist())) / 10
            assert result[f"{name}_maj@{k}"].item() == pytest.approx(expected, abs=1e-6), (compute_groups, name, k)

    saved = PassAtK(ks=(1, 2, 4))
    saved.persistent(True)
    saved.update(later)
    for ks in ((1, 4), (1, 2, 4, 8)):
        other = PassAtK(ks=ks)
        with pytest.raises(RuntimeError, match="pass_at_"):
            other.load_state_dict(saved.state_dict())
    same = PassAtK(ks=(1, 2, 4))
    same.load_state_dict(saved.state_dict())
    assert same.compute() == saved.compute()


def exact_pass_at_k(rows: list[list[bool]], k: int) -> float:
    """Mean over problems of 1 - C(n - c, k) / C(n, k), in exact fractions (math.comb), for rows of n samples."""
    return float(sum(Fraction(1) - Fraction(math.comb(len(row) - sum(row), k), math.comb(len(row), k)) for row in rows) / len(rows))


def test_single_budget_form_works_with_torchmetrics_wrappers_and_arithmetic():
    """compute() of PassAtK / MajorityAtK was a dict, so MetricTracker.best_metric() raised `max() received an invalid
    combination of arguments - got (dict, int)`, and MinMaxMetric, BootStrapper and `metric + 1` failed alike.
    PassAtK(k=...) / MajorityAtK(k=...) return one tensor, which they take as any scalar metric's."""
    from torchmetrics.wrappers import BootStrapper, MetricTracker, MinMaxMetric

    generator = torch.Generator().manual_seed(5)
    epochs = [random_correctness(generator, 7, 6) for _ in range(3)]
    rng = random.Random(5)
    answers = [[[rng.choice(["1", "2", None]) for _ in range(6)] for _ in range(7)] for _ in epochs]
    pass_tracker, maj_tracker = MetricTracker(PassAtK(k=3), maximize=True), MetricTracker(MajorityAtK(k=5), maximize=True)
    expected_pass, expected_maj = [], []
    for correct, votes in zip(epochs, answers):
        pass_tracker.increment()
        maj_tracker.increment()
        pass_tracker.update(correct[:4])
        pass_tracker.update(correct[4:])
        maj_tracker.update(votes, correct)
        expected_pass.append(exact_pass_at_k(correct.tolist(), 3))
        expected_maj.append(sum(reference_majority_correct(a, c, 5) for a, c in zip(votes, correct.tolist())) / 7)
    assert pass_tracker.compute_all().tolist() == pytest.approx(expected_pass, abs=1e-6)
    assert maj_tracker.compute_all().tolist() == pytest.approx(expected_maj, abs=1e-6)
    best, step = pass_tracker.best_metric(return_step=True)
    assert best == pytest.approx(max(expected_pass), abs=1e-6) and step == expected_pass.index(max(expected_pass))
    assert maj_tracker.best_metric() == pytest.approx(max(expected_maj), abs=1e-6)

    rows = torch.cat(epochs)
    min_max, shifted = MinMaxMetric(PassAtK(k=2)), PassAtK(k=2) + 1
    bootstrap = BootStrapper(PassAtK(k=2), num_bootstraps=4, sampling_strategy="multinomial")
    for metric in (min_max, shifted, bootstrap):
        metric.update(rows)
    assert min_max.compute()["raw"].item() == pytest.approx(exact_pass_at_k(rows.tolist(), 2), abs=1e-6)
    assert shifted.compute().item() == pytest.approx(1 + exact_pass_at_k(rows.tolist(), 2), abs=1e-6)
    assert 0.0 <= bootstrap.compute()["mean"].item() <= 1.0


def test_single_budget_form_logs_with_self_log_in_a_lightning_module():
    """`self.log("val/pass@4", PassAtK(ks=...))` failed only when the epoch ended ("The .compute() return of the metric
    logged as ... must be a tensor"). PassAtK(k=...) / MajorityAtK(k=...) log as metric objects; the logged epoch values
    are the exact ones."""
    generator = torch.Generator().manual_seed(7)
    batches = [random_correctness(generator, 5, 4) for _ in range(3)]
    rng = random.Random(7)
    votes = [[[rng.choice(["1", "2", None]) for _ in range(4)] for _ in range(5)] for _ in batches]

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(1, 1)
            self.pass_at_2, self.maj_at_3 = PassAtK(k=2), MajorityAtK(k=3)

        def training_step(self, batch, batch_idx):
            return self.layer(batch).sum()

        def validation_step(self, batch, batch_idx):
            self.pass_at_2.update(batches[batch_idx])
            self.maj_at_3.update(votes[batch_idx], batches[batch_idx])
            self.log("val/pass@2", self.pass_at_2)
            self.log("val/maj@3", self.maj_at_3)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.0)

    trainer = lightning.Trainer(max_epochs=1, accelerator="cpu", logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    loader = torch.utils.data.DataLoader(torch.ones(3, 1), batch_size=1)
    trainer.validate(Module(), loader, verbose=False)
    rows = torch.cat(batches).tolist()
    all_votes = [problem for batch in votes for problem in batch]
    expected_maj = sum(reference_majority_correct(a, c, 3) for a, c in zip(all_votes, rows)) / len(rows)
    assert trainer.callback_metrics["val/pass@2"].item() == pytest.approx(exact_pass_at_k(rows, 2), abs=1e-6)
    assert trainer.callback_metrics["val/maj@3"].item() == pytest.approx(expected_maj, abs=1e-6)


def test_single_budget_form_keeps_the_states_of_ks_and_refuses_both():
    """k= is ks=(k,) with a tensor result: the same states (a state_dict moves between the forms), and the k > n
    refusal names k; giving both ks= and k=, or a k that is not one positive integer, is one line naming the forms."""
    correct = random_correctness(torch.Generator().manual_seed(2), 6, 5)
    several, single = PassAtK(ks=(4,)), PassAtK(k=4)
    several.persistent(True)
    several.update(correct)
    single.load_state_dict(several.state_dict())
    assert single.compute().item() == several.compute()["pass@4"].item() == pytest.approx(exact_pass_at_k(correct.tolist(), 4))
    assert PassAtK().ks == (1, 4, 16) and PassAtK([1, 2]).ks == (1, 2)  # the ks form is as it was
    for metric_class in (PassAtK, MajorityAtK):
        with pytest.raises(ValueError, match=r"ks= .* or k= .*not both.*keep one"):
            metric_class(ks=(1, 4), k=4)
        for bad in (0, -1, True, 2.0, (1, 2)):
            with pytest.raises(ValueError, match=r"k=\.\.\.\) takes one positive integer"):
                metric_class(k=bad)
    with pytest.raises(ValueError, match="n >= 8.*or lower k$"):
        PassAtK(k=8).update(correct)


def test_bootstrapper_resamples_majority_votes_given_as_answer_ids_and_refuses_what_it_cannot_resample():
    """torchmetrics' BootStrapper resamples update's tensor arguments only: MajorityAtK's answers as lists of strings
    stayed as given while correct's rows were resampled (votes of other problems, silently, as keywords) and
    PassAtK(ks=...)'s dict failed in torch.stack. MajorityAtK.answer_ids gives the tensor it resamples (None as -1,
    an abstention); the bootstrap mean and std equal those computed by hand on the same resampled rows; the rest is
    refused in one line naming the fix."""
    from torchmetrics.wrappers import BootStrapper

    generator = torch.Generator().manual_seed(11)
    correct = random_correctness(generator, 9, 6)
    rng = random.Random(11)
    answers = [[rng.choice(["12", "7", "x", None]) for _ in range(6)] for _ in range(9)]
    ids = MajorityAtK.answer_ids(answers)
    assert ids.shape == (9, 6) and ((ids == -1) == torch.tensor([[a is None for a in row] for row in answers])).all()
    plain = MajorityAtK(k=5)
    plain.update(ids, correct)
    expected = sum(reference_majority_correct(a, c, 5) for a, c in zip(answers, correct.tolist())) / 9
    assert plain.compute().item() == pytest.approx(expected, abs=1e-6)  # the same votes

    num_bootstraps = 8
    torch.manual_seed(3)
    bootstrap = BootStrapper(MajorityAtK(k=5), num_bootstraps=num_bootstraps, sampling_strategy="multinomial")
    bootstrap.update(ids, correct)
    got = bootstrap.compute()
    torch.manual_seed(3)  # the same draws, in the same order: one resample of the 9 problems per copy
    scores = []
    for _ in range(num_bootstraps):
        rows = torch.multinomial(torch.ones(9), num_samples=9, replacement=True).tolist()
        scores.append(sum(reference_majority_correct(answers[i], correct[i].tolist(), 5) for i in rows) / 9)
    mean = sum(scores) / num_bootstraps
    std = math.sqrt(sum((s - mean) ** 2 for s in scores) / (num_bootstraps - 1))
    assert got["mean"].item() == pytest.approx(mean, abs=1e-6) and got["std"].item() == pytest.approx(std, abs=1e-6)

    lists = BootStrapper(MajorityAtK(k=5), num_bootstraps=2, sampling_strategy="multinomial")
    with pytest.raises(ValueError, match=r"^BootStrapper resamples tensor arguments only.*MajorityAtK\.answer_ids\(answers\)"):
        lists.update(correct=correct, answers=answers)
    several = BootStrapper(PassAtK(ks=(1, 2)), num_bootstraps=2, sampling_strategy="multinomial")
    several.update(correct)
    with pytest.raises(ValueError, match=r"returns a dict: bootstrap PassAtK\(k=\.\.\.\) instead, one BootStrapper per budget$"):
        several.compute()


@pytest.mark.parametrize("sampling_strategy", ["poisson", "multinomial"])
def test_bootstrapper_fails_on_majority_answers_as_lists_given_positionally_before_the_metric_runs(sampling_strategy):
    """Answers as lists given *positionally* to torchmetrics' BootStrapper never reach MajorityAtK.update (whose
    keyword-form refusal names MajorityAtK.answer_ids): BootStrapper.update takes the first positional argument as the
    number of rows to resample and calls torch.ones / torch.Size on the list. Nothing of ours runs before that, so the
    failure is documented (MajorityAtK's docstring, the README's metrics section) with its message and the fix. If a
    torchmetrics release changes this, this test says so: the docs then need updating."""
    import traceback
    from pathlib import Path

    from torchmetrics.wrappers import BootStrapper

    import es_lightning.metrics.majority as majority

    correct = torch.tensor([[True, False], [True, True], [False, True]])
    answers = [["12", "7"], ["12", "12"], ["x", None]]
    expected = {"multinomial": "found element of type list", "poisson": "torch.Size() takes an iterable of 'int'"}
    for call in ({"args": (answers, correct), "kwargs": {}}, {"args": (answers,), "kwargs": {"correct": correct}}):
        bootstrap = BootStrapper(MajorityAtK(k=2), num_bootstraps=2, sampling_strategy=sampling_strategy)
        with pytest.raises(TypeError, match=re.escape(expected[sampling_strategy])) as info:
            bootstrap.update(*call["args"], **call["kwargs"])
        frames = {Path(frame.filename).resolve() for frame in traceback.extract_tb(info.value.__traceback__)}
        assert Path(majority.__file__).resolve() not in frames  # torchmetrics failed before MajorityAtK.update ran
    docs = {"MajorityAtK's docstring": " ".join(MajorityAtK.__doc__.split()),
            "README": " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())}
    for where, text in docs.items():
        for phrase in ("found element of type list", "torch.Size() takes an iterable of 'int'", "answer_ids"):
            assert phrase in text, f"{where} does not document {phrase!r}"
