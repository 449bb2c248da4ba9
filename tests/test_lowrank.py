"""Low-rank (EGGROLL) ES noise: the batched population forward equals explicitly merged weights W + σE, the update
equals the explicit Σ wᵢ Eᵢ, the factors are keyed, layout-independent and have the right statistics, and no k·m·n
tensor is ever built."""

from __future__ import annotations

import math
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from es_lightning.es.lowrank import (
    LowRankPopulationForward,
    check_noise_rank,
    lowrank_delta,
    lowrank_factors,
    lowrank_view_delta,
)
from es_lightning.es.noise import param_noise
from es_lightning.es.population import PopulationForward
from es_lightning.es.sharding import ShardView
from es_lightning.es.update import ESOptimizer
from es_lightning.generation import HFGenerator, SamplingParams
from es_lightning.policy import load_policy

SEED, STEP, SIGMA, RANK = 3, 7, 0.05, 2
#: an antithetic pair (noise id 0, ±) and two more members
MEMBERS = [(0, 1.0), (0, -1.0), (5, 1.0), (2, -1.0)]


def _merged(centre, seed, step, sigma, rank, noise_id, sign):
    """Explicit W + sign·σ·A Bᵀ/√r (matrices, float64 product) and θ + sign·σ·ε (vectors), fp32."""
    out = {}
    for name, c in centre.items():
        if c.dim() == 2:
            a, b = lowrank_factors(seed, step, noise_id, name, c.shape, rank)
            e = a.double() @ b.double().T / math.sqrt(rank)
        else:
            e = param_noise(seed, step, noise_id, name, c.numel()).double().view_as(c)
        out[name] = (c.double() + sign * sigma * e).to(c.dtype)
    return out


def _load(model, values):
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(values[n])


def _each_member_merged(model, centre, run, sigma=SIGMA, rank=RANK, members=MEMBERS):
    """``run(model)`` once per member with that member's explicitly merged weights loaded into the plain model (the
    independent computation the batched forward is checked against); the centre is loaded back afterwards."""
    out = []
    for noise_id, sign in members:
        _load(model, _merged(centre, SEED, STEP, sigma, rank, noise_id, sign))
        out.append(run(model))
    _load(model, centre)
    return out


@pytest.fixture
def tiny(tiny_model_dir):
    policy = load_policy(tiny_model_dir)
    policy.model.eval()
    return policy


# ---------------------------------------------------------------------------------------------------- factors
def test_factors_are_keyed_and_layout_independent():
    m, n, r = 700, 300, 4
    a, b = lowrank_factors(SEED, STEP, 1, "layer.weight", (m, n), r)
    assert a.shape == (m, r) and b.shape == (n, r) and a.dtype == b.dtype == torch.float32
    a2, b2 = lowrank_factors(SEED, STEP, 1, "layer.weight", (m, n), r)
    assert torch.equal(a, a2) and torch.equal(b, b2)  # a pure function of its key
    top, b_top = lowrank_factors(SEED, STEP, 1, "layer.weight", (m, n), r, rows=(0, 123))  # a row-shard of W
    rest, _ = lowrank_factors(SEED, STEP, 1, "layer.weight", (m, n), r, rows=(123, m))
    assert torch.equal(torch.cat([top, rest]), a) and torch.equal(b_top, b)
    big_m = 300_000  # A = 1.2M elements: several independently seeded chunks, a shard boundary inside one
    big, _ = lowrank_factors(SEED, STEP, 1, "emb.weight", (big_m, 8), r)
    piece, _ = lowrank_factors(SEED, STEP, 1, "emb.weight", (big_m, 8), r, rows=(65_000, 200_001))
    assert torch.equal(piece, big[65_000:200_001])
    # the full-rank noise of the same parameter, another name / member / step / seed: all different
    assert not torch.equal(a.flatten(), param_noise(SEED, STEP, 1, "layer.weight", m * r))
    for other in (
        lowrank_factors(SEED, STEP, 1, "other.weight", (m, n), r), lowrank_factors(SEED, STEP, 2, "layer.weight", (m, n), r),
        lowrank_factors(SEED, STEP + 1, 1, "layer.weight", (m, n), r), lowrank_factors(SEED + 1, STEP, 1, "layer.weight", (m, n), r),
    ):
        assert not torch.equal(other[0], a) and not torch.equal(other[1], b)
    with pytest.raises(ValueError, match="rows"):
        lowrank_factors(SEED, STEP, 1, "layer.weight", (m, n), r, rows=(10, m + 1))


def _e(noise_id, name, shape, rank):
    a, b = lowrank_factors(SEED, STEP, noise_id, name, shape, rank)
    return (a.double() @ b.double().T / math.sqrt(rank)).flatten()


def test_noise_statistics():
    """E = A Bᵀ/√r: entries of mean 0 and variance 1, uncorrelated across names and members.

    Tolerances from the exact moments: the entries are uncorrelated, so the mean of M = m·n entries has std 1/√M; the
    squares are not — entries of one row share A's row: Cov(E_ij², E_il²) = 2/r — so the mean square over one matrix
    has variance ≈ (2/r)(1/m + 1/n) + 8/(rM). Five standard deviations each.
    """
    m, n, r, members = 384, 256, 4, 6
    es = [_e(i, "layer.weight", (m, n), r) for i in range(members)]
    big = torch.cat(es)
    count = big.numel()
    assert abs(float(big.mean())) < 5 / math.sqrt(count)
    sq_std = math.sqrt(((2 / r) * (1 / m + 1 / n) + 8 / (r * m * n)) / members)
    assert abs(float(big.square().mean()) - 1) < 5 * sq_std
    # independence: across members and across names (same shape), the correlation is that of unrelated data
    for other in (es[1], _e(0, "other.weight", (m, n), r)):
        corr = float(torch.corrcoef(torch.stack([es[0], other]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(m * n)
    # the perturbation a member really gets through the batched forward: W = 0, identity inputs read it out as σE
    k, d = 4, 192
    lin = torch.nn.Linear(d, d, bias=False)
    torch.nn.init.zeros_(lin.weight)
    with torch.no_grad(), LowRankPopulationForward(lin, [("w", lin.weight)], [(i, 1.0) for i in range(k)], seed=SEED,
                                                   step=STEP, sigma=SIGMA, rank=r):
        seen = lin(torch.eye(d).repeat(k, 1))  # row j of block i: (σ E_i)ᵀ row j, i.e. σ E_i[:, j]
    var = float(seen.double().square().mean())
    sq_std = math.sqrt(((2 / r) * (2 / d) + 8 / (r * d * d)) / k)
    assert abs(var / SIGMA**2 - 1) < 5 * sq_std
    for i in range(k):  # and it is exactly σ·A_i B_iᵀ/√r of the keyed factors
        torch.testing.assert_close(seen[i * d:(i + 1) * d].T.double(), SIGMA * _e(i, "w", (d, d), r).view(d, d),
                                   rtol=1e-5, atol=1e-7)


def test_antithetic_members_get_exactly_opposite_perturbations():
    d = 16
    lin = torch.nn.Linear(d, d, bias=False)
    torch.nn.init.zeros_(lin.weight)  # the output is the low-rank term alone
    with torch.no_grad(), LowRankPopulationForward(lin, [("w", lin.weight)], [(3, 1.0), (3, -1.0)], seed=SEED,
                                                   step=STEP, sigma=SIGMA, rank=RANK):
        y = lin(torch.randn(5, d, generator=torch.Generator().manual_seed(0)).repeat(2, 1))  # both members, same rows
    assert torch.equal(y[:5], -y[5:]) and bool(y.abs().max() > 0)


# ---------------------------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("rank", [1, RANK])  # r = 1 in fp32 adds its term as a broadcast multiply-add
def test_lowrank_forward_equals_merged_weights(tiny, rank):
    model = tiny.model
    named = list(model.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    k = len(MEMBERS)
    with torch.no_grad():
        alone = _each_member_merged(model, centre, lambda m: m(ids).logits, rank=rank)
        with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=rank):
            batched = model(ids.repeat(k, 1)).logits  # member-major rows
        after = model(ids).logits
    torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-5)
    assert not torch.allclose(alone[0], alone[1], atol=1e-3) and not torch.allclose(alone[0], alone[2], atol=1e-3)
    assert all(torch.equal(p, centre[n]) for n, p in model.named_parameters())  # centre never written
    assert not any("forward" in m.__dict__ for m in model.modules())  # every patch removed
    torch.testing.assert_close(after, model(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("rank", [1, RANK])
def test_lowrank_forward_under_bf16_autocast_matches_merged_weights(tiny, rank):
    """bf16-mixed (fp32 weights, bf16 autocast: Lightning runs ES members so) once crashed here — autocast made the
    input term bf16 while the factors stayed fp32. Now each member's logits are its merged weights' under autocast to
    bf16 rounding (measured max 0.03 on logits ~3 apart between members; fp32 is 1e-5 above), and the fp32 low-rank
    forward's. Each merged member runs in its own autocast region: autocast caches the bf16 copy of a weight for the
    whole region, so one region would give every member the first one's weights."""
    model = tiny.model
    named = list(model.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    ids = torch.randint(0, model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))

    def bf16(m):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(ids).logits.float()

    with torch.no_grad():
        alone = torch.cat(_each_member_merged(model, centre, bf16, rank=rank))
        with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=rank):
            fp32 = model(ids.repeat(len(MEMBERS), 1)).logits
            with torch.autocast("cpu", dtype=torch.bfloat16):
                batched = model(ids.repeat(len(MEMBERS), 1)).logits
    assert batched.dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in model.parameters())
    gap, gap32 = (batched.float() - alone).abs().max(), (batched.float() - fp32).abs().max()
    apart = (alone[:3] - alone[6:9]).abs().max()  # member 0 against member 2
    assert gap <= 0.08 and gap32 <= 0.08 and apart > 10 * max(gap, gap32), (gap, gap32, apart)


def test_lowrank_greedy_generate_equals_merged_weights(tiny):
    model = tiny.model
    named = list(model.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    gen = HFGenerator(tiny)
    prompts = ["c:3 5 7>22=", "c:1 2>3=", "c:10 4 6 2>8="]
    params = SamplingParams(max_new_tokens=10, temperature=0.0)
    alone = _each_member_merged(model, centre, lambda m: gen.generate(prompts, 1, params, seed=0), sigma=SIGMA * 4)
    with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA * 4, rank=RANK):
        together = gen.generate(prompts * len(MEMBERS), 1, params, seed=0, common_random_blocks=len(MEMBERS))
    assert together.texts == [t for r in alone for t in r.texts]
    assert torch.equal(together.completion_ids, torch.cat([r.completion_ids for r in alone]))
    assert len({tuple(r.texts) for r in alone}) > 1  # the members really generate differently


@pytest.mark.parametrize("rank", [RANK])
def test_batched_members_equal_each_member_alone_bitwise(tiny, rank):
    """Each block's arithmetic does not depend on the other blocks (same kernels, row-independent), so k batched
    members give exactly what each member gives alone through the same context manager (k = 1). Not at r = 1 in fp32
    on a CPU: there MKL's bmm for one batch of a one-row Bᵀ times a transposed view rounds differently from k batches
    (measured; a contiguous copy of xᵀ would restore it at the cost of one more pass over the input), so a member alone
    differs from it batched in the last bit — test_rank1_batched_members_equal_each_member_alone_to_rounding."""
    model = tiny.model
    named = list(model.named_parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=rank):
            batched = model(ids.repeat(len(MEMBERS), 1)).logits
        alone = []
        for member in MEMBERS:
            with LowRankPopulationForward(model, named, [member], seed=SEED, step=STEP, sigma=SIGMA, rank=rank):
                alone.append(model(ids).logits)
    assert torch.equal(batched, torch.cat(alone))


def test_rank1_batched_members_equal_each_member_alone_to_rounding(tiny):
    model = tiny.model
    named = list(model.named_parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=1):
            batched = model(ids.repeat(len(MEMBERS), 1)).logits
        alone = []
        for member in MEMBERS:
            with LowRankPopulationForward(model, named, [member], seed=SEED, step=STEP, sigma=SIGMA, rank=1):
                alone.append(model(ids).logits)
    torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-6)


class _Block(torch.nn.Module):
    """attn: q/k/v read one input, o another, ``spare`` shares their width but is never called; mlp: gate/up read one."""

    def __init__(self, d=24):
        super().__init__()
        self.attn, self.mlp = torch.nn.Module(), torch.nn.Module()
        for name in ("q", "k", "v", "o", "spare"):
            setattr(self.attn, name, torch.nn.Linear(d, d, bias=name == "k"))
        for name in ("gate", "up"):
            setattr(self.mlp, name, torch.nn.Linear(d, d, bias=False))

    def forward(self, x):
        a = self.attn
        h = a.o(a.q(x) * torch.sigmoid(a.k(x)) + a.v(x))
        return h + self.mlp.gate(h) * self.mlp.up(h)


def _block_rounds(make, rounds, watch=None):
    """``rounds`` batched calls of a toy block (``make()``, seeded) through the low-rank context, each checked against
    every member's merged weights; ``watch(mp)`` may patch torch for the calls. Returns the block and, after the last
    round, each shared group's held input."""
    torch.manual_seed(0)
    block = make()
    named = list(block.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    x = torch.randn(3, 5, 24)
    with torch.no_grad():
        alone = _each_member_merged(block, centre, lambda m: m(x))
        ctx = LowRankPopulationForward(block, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=RANK)
        with ctx, pytest.MonkeyPatch.context() as mp:
            if watch is not None:
                watch(mp)
            outs = [block(x.repeat(len(MEMBERS), 1, 1)) for _ in range(rounds)]
            held = [share._x for share in ctx._shares]
    for out in outs:
        torch.testing.assert_close(out, torch.cat(alone), rtol=0, atol=1e-5)
    return block, held


def test_siblings_reading_one_input_share_one_term_and_learn_who_does():
    """Sibling linears called with one input get their (x B)ᵀ from one bmm; a sibling called with another input (o)
    or never called (spare) leaves the group; every output still equals the merged weights', and no input is held
    once a round is over."""
    bmms = []
    real_bmm = torch.bmm

    def counting_bmm(*args, **kwargs):
        bmms.append(args[0].shape)
        return real_bmm(*args, **kwargs)

    block, held = _block_rounds(_Block, 3, watch=lambda mp: mp.setattr(torch, "bmm", counting_bmm))
    # round 1 learns (q computes for q, k, v, o, spare; o and spare leave); rounds 2-3: one bmm for q/k/v (3·r rows),
    # one for o alone, one for gate/up (2·r rows)
    assert [tuple(s)[1] for s in bmms] == [5 * RANK, RANK, 2 * RANK] + [3 * RANK, RANK, 2 * RANK] * 2
    assert held == [None, None]  # attn's and mlp's groups; neither holds its last input
    assert not any("forward" in m.__dict__ for m in block.modules())


class _Interleaved(torch.nn.Module):
    """q and k read x, but o (the same width) is called with another input between them."""

    def __init__(self, d=24):
        super().__init__()
        for name in ("q", "o", "k"):
            setattr(self, name, torch.nn.Linear(d, d, bias=False))

    def forward(self, x):
        q = self.q(x)
        o = self.o(torch.tanh(q))
        return self.k(x) + o


def test_a_sibling_leaving_mid_round_keeps_the_rounds_terms():
    """q starts a round for q, o and k; o, called with another input, leaves mid-round; k still gets its term of the
    round (it crashed here once), and later rounds share q's and k's only — every output the merged weights'."""
    _block_rounds(_Interleaved, 2)


def test_shared_terms_work_under_inference_mode(tiny):
    """Inference-mode tensors keep no version counter: shared terms fall back to the input's identity alone."""
    model = tiny.model
    named = list(model.named_parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(3)).repeat(4, 1)
    with torch.no_grad(), LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=1):
        expected = model(ids).logits
    with torch.inference_mode(), LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA,
                                                          rank=1):
        got = model(ids).logits
    assert torch.equal(got, expected)


def test_bf16_base_weights(tiny_model_dir):
    """bf16 base: the rank-r term is computed in bf16 and added to the bf16 output. Against the fp32 W + σE it is as
    accurate as bf16 inference of the member's own merged weights (rounded to bf16) — the full-rank batched path."""
    p32 = load_policy(tiny_model_dir).model.eval()
    p16 = load_policy(tiny_model_dir, dtype="bfloat16").model.eval()
    named16 = list(p16.named_parameters())
    assert named16[0][1].dtype == torch.bfloat16
    centre16 = {n: p.detach().clone() for n, p in named16}
    ids = torch.randint(0, p32.config.vocab_size, (3, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        truth, merged16 = [], []
        for noise_id, sign in MEMBERS:  # fp32 merged weights from the fp32 copy of the bf16 centre
            merged = _merged({n: c.float() for n, c in centre16.items()}, SEED, STEP, SIGMA, RANK, noise_id, sign)
            _load(p32, merged)
            truth.append(p32(ids).logits)
            _load(p16, merged)  # the same member as merged bf16 weights
            merged16.append(p16(ids).logits.float())
        _load(p16, centre16)
        truth, merged16 = torch.cat(truth), torch.cat(merged16)
        with LowRankPopulationForward(p16, named16, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=RANK):
            got = p16(ids.repeat(len(MEMBERS), 1)).logits
    assert got.dtype == torch.bfloat16
    err, merged_err = float((got.float() - truth).abs().max()), float((merged16 - truth).abs().max())
    assert err <= 1.5 * merged_err, (err, merged_err)
    spread = float((truth[:3] - truth[3:6]).abs().max())  # members differ by far more than the rounding
    assert spread > 10 * err
    assert all(torch.equal(p, centre16[n]) for n, p in p16.named_parameters())


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of live tensor storages produced by aten ops (CPU has no allocator statistics): ``peak`` is
    the most held at once; ``shapes`` every op output's shape."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, list[int]] = {}  # storage pointer -> [bytes, live tensors on it]
        self.current = self.peak = 0
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        self.shapes.append(tuple(t.shape))
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0:
            return
        if key in self.live:
            self.live[key][1] += 1
        else:
            self.live[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(t, self._release, key)

    def _release(self, key: int) -> None:
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                self.current -= entry[0]
                del self.live[key]


def test_memory_holds_factors_not_weight_copies(tiny):
    """Setting up and running k low-rank members holds O(k·r·(m+n)) more than a plain forward of the same k·R rows,
    and no op ever produces a [k, m, n] tensor; the full-rank batched forward (k perturbed copies) is the control
    that shows the meter sees copies."""
    model = tiny.model
    named = list(model.named_parameters())
    k, rows = 8, 2
    ids = torch.randint(0, model.config.vocab_size, (rows, 6), generator=torch.Generator().manual_seed(4)).repeat(k, 1)
    matrices = [tuple(p.shape) for _, p in named if p.dim() == 2]
    factor_bytes = sum(4 * k * RANK * (m + n) for m, n in matrices)
    copy_bytes = sum(4 * k * m * n for m, n in matrices)
    members = [(i, 1.0) for i in range(k)]
    with torch.no_grad():
        with _LiveBytes() as plain:
            model(ids)
        with _LiveBytes() as low:
            with LowRankPopulationForward(model, named, members, seed=SEED, step=STEP, sigma=SIGMA, rank=RANK):
                model(ids)
        with _LiveBytes() as full:
            stacked = {n: p.detach().unsqueeze(0) + SIGMA * torch.randn(k, *p.shape) for n, p in named}
            with PopulationForward(model, stacked):
                model(ids)
            del stacked
    assert low.peak <= plain.peak + 4 * factor_bytes, (low.peak, plain.peak, factor_bytes)
    assert full.peak >= plain.peak + 0.9 * copy_bytes  # the meter does see k weight copies
    assert copy_bytes > 8 * factor_bytes
    assert not any(s in low.shapes for m, n in matrices for s in ((k, m, n), (k, n, m), (k * m, n)))
    assert any((k, m, n) in full.shapes for m, n in matrices)


def test_other_modules_with_matrices_fall_back_to_merged_copies():
    class Bilinear(torch.nn.Module):  # a matrix outside nn.Linear / nn.Embedding
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(6, 6, generator=torch.Generator().manual_seed(0)))
            self.scale = torch.nn.Parameter(torch.ones(6))

        def forward(self, x):
            return (x @ self.weight) * self.scale

    net = torch.nn.Sequential(torch.nn.Linear(6, 6), Bilinear()).eval()
    named = list(net.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        alone = _each_member_merged(net, centre, lambda m: m(x))
        with pytest.warns(UserWarning, match=r"1\.weight \(Bilinear\)"):
            with LowRankPopulationForward(net, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=RANK):
                batched = net(x.repeat(len(MEMBERS), 1))
    torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-5)


def test_rows_must_split_into_members(tiny):
    model = tiny.model
    with torch.no_grad(), LowRankPopulationForward(model, list(model.named_parameters()), MEMBERS, seed=SEED,
                                                   step=STEP, sigma=SIGMA, rank=RANK):
        with pytest.raises(ValueError, match="multiple of 4"):
            model(torch.zeros(6, 3, dtype=torch.long))


# ---------------------------------------------------------------------------------------------------- update
def _explicit_sum(name, shape, ids, weights, rank):
    """Σ w_i E_i in float64 with every E_i formed explicitly, member by member."""
    total = torch.zeros(shape, dtype=torch.float64)
    for i, w in zip(ids, weights):
        total += w * _e(i, name, shape, rank).view(shape)
    return total


def test_lowrank_delta_equals_explicit_sum():
    m, n, r = 40, 24, 3
    ids, weights = [0, 0, 1, 2, 5, 7], [0.7, -1.1, 0.3, -0.2, 1.9, 0.0]  # an antithetic pair (0, 0) and a zero weight
    want = _explicit_sum("w", (m, n), ids, weights, r)
    got = lowrank_delta(SEED, STEP, "w", (m, n), ids, weights, r)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert torch.linalg.matrix_rank(want).item() == 4 * r  # 4 ids with a nonzero weight: rank 4r, not r
    rows = lowrank_delta(SEED, STEP, "w", (m, n), ids, weights, r, rows=(11, 30))  # a row-shard draws its rows only
    torch.testing.assert_close(rows, got[11:30], rtol=0, atol=1e-6)
    chunked = lowrank_delta(SEED, STEP, "w", (m, n), ids, weights, r, max_elements=1)  # one member per matmul
    torch.testing.assert_close(chunked, got, rtol=1e-6, atol=1e-6)
    assert torch.equal(lowrank_delta(SEED, STEP, "w", (m, n), [3, 3], [0.5, -0.5], r), torch.zeros(m, n))


def test_view_delta_covers_shards_and_flat_segments():
    m, n, r = 12, 10, 2
    active = [(0, 0.5), (4, -1.5), (9, 2.0)]
    full = lowrank_delta(SEED, STEP, "w", (m, n), [i for i, _ in active], [w for _, w in active], r).reshape(-1)

    def view(start, end, index=None):
        local = torch.zeros(end - start if index is None else len(index))
        return ShardView("w", local, m * n, start, end, index=index, shape=(m, n))

    for start, end in ((30, 70), (0, m * n), (37, 83), (119, 120)):  # a row-shard, whole, FSDP1-like segments
        torch.testing.assert_close(lowrank_view_delta(view(start, end), SEED, STEP, active, r), full[start:end],
                                   rtol=0, atol=1e-6)
    cols = torch.tensor([row * n + c for row in range(2, 5) for c in range(3, 7)])  # a column-shard of rows 2..4
    got = lowrank_view_delta(view(int(cols.min()), int(cols.max()) + 1, cols - cols.min()), SEED, STEP, active, r)
    torch.testing.assert_close(got, full[cols], rtol=0, atol=1e-6)


def test_optimizer_with_noise_rank_applies_the_explicit_update(tiny):
    """ESOptimizer(noise_rank=r): θ += (α/N) Σ w_n ε_n with ε = A Bᵀ/√r for matrices, full-rank for vectors (float64
    reference), the same whether the forward's cache is reused or not."""
    model = tiny.model
    named = list(model.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    ids = torch.tensor([i for i, _ in MEMBERS])
    weights = torch.tensor([0.9, -0.4, 1.3, -2.0]) * torch.tensor([s for _, s in MEMBERS])
    lr = 0.3
    cache = {}
    with torch.no_grad(), LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=RANK,
                                                   cache=cache):
        model(torch.zeros(len(MEMBERS), 2, dtype=torch.long))
    assert isinstance(cache[(5, "model.embed_tokens.weight")], tuple)
    assert isinstance(cache[(5, "model.norm.weight")], torch.Tensor)
    results = []
    for use_cache in (True, False):
        _load(model, centre)
        opt = ESOptimizer(named, lr=lr, sigma=SIGMA, noise_rank=RANK)
        opt.set_update(SEED, STEP, ids, weights, noise_cache=dict(cache) if use_cache else None)
        opt.step()
        results.append({n: p.detach().clone() for n, p in named})
    coef = lr / len(MEMBERS)
    for name, c in centre.items():
        if c.dim() == 2:
            want = _explicit_sum(name, tuple(c.shape), ids.tolist(), weights.tolist(), RANK)
        else:
            want = sum(float(w) * param_noise(SEED, STEP, int(i), name, c.numel()).double() for i, w in zip(ids, weights))
            want = want.view_as(c)
        torch.testing.assert_close((results[0][name].double() - c.double()), coef * want, rtol=1e-4, atol=1e-6)
        assert torch.equal(results[0][name], results[1][name]), name
    _load(model, centre)


# ---------------------------------------------------------------------------------------------------- bad input
def test_noise_rank_is_validated(tiny):
    named = list(tiny.model.named_parameters())  # smaller sides 16 (k_proj [16, 32]) and 32 (the others)
    check_noise_rank(0, named)
    check_noise_rank(16, named)
    with pytest.raises(ValueError, match=r"noise_rank must be an integer >= 0.*got -1"):
        check_noise_rank(-1, named)
    with pytest.raises(ValueError, match=r"noise_rank must be an integer"):
        check_noise_rank(True, named)
    check_noise_rank(17, named)  # k_proj [16, 32] is thinner: its r factors give it a full-rank perturbation
    with pytest.raises(ValueError, match=r"noise_rank=33 exceeds the smaller side of every perturbed matrix .*"
                                         r"use noise_rank <= 32"):
        check_noise_rank(33, named)
    with pytest.raises(ValueError, match="rank 0 is full-rank"):
        LowRankPopulationForward(tiny.model, named, MEMBERS, seed=0, step=0, sigma=0.1, rank=0)


def test_a_failure_while_patching_leaves_the_model_unpatched(tiny):
    model = tiny.model
    bad_cache = {(0, "model.norm.weight"): torch.zeros(3)}  # the last module patched gets a malformed cached noise
    with pytest.raises(RuntimeError):
        with LowRankPopulationForward(model, list(model.named_parameters()), [(0, 1.0)], seed=SEED, step=STEP,
                                      sigma=SIGMA, rank=RANK, cache=bad_cache):
            pass
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_copied_tensors_are_perturbed_from_the_given_centres(tiny):
    """``centres`` (an fp32 master of a bf16 weight, say) is what vectors' member copies are perturbed from; a Linear
    matrix still reads its live weight. Independent computation: the merged weights with that vector's centre."""
    model = tiny.model
    named = list(model.named_parameters())
    centre = {n: p.detach().clone() for n, p in named}
    name = "model.norm.weight"
    moved = centre[name] + 0.25  # a centre that is not the live weight
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        alone = []
        for noise_id, sign in MEMBERS:
            _load(model, _merged({**centre, name: moved}, SEED, STEP, SIGMA, RANK, noise_id, sign))
            alone.append(model(ids).logits)
        _load(model, centre)
        with LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=RANK,
                                      centres={name: moved}):
            batched = model(ids.repeat(len(MEMBERS), 1)).logits
        plain = model(ids.repeat(len(MEMBERS), 1)).logits
    torch.testing.assert_close(batched, torch.cat(alone), rtol=0, atol=1e-5)
    assert not torch.allclose(batched, plain, atol=1e-3)



class _OddStrides(TorchDispatchMode):
    """Records the matmul operands that count as contiguous but do not have the canonical strides (a transposed
    ``[k, n, 1]`` has (n, 1, 1)): CPU ``bmm`` takes a ~4× slower path for them."""

    OPS = {torch.ops.aten.bmm.default, torch.ops.aten.baddbmm_.default, torch.ops.aten.baddbmm.default}

    def __init__(self):
        super().__init__()
        self.matmuls, self.odd = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.matmuls += 1
            for t in args:
                if isinstance(t, torch.Tensor) and t.is_contiguous() and t.stride() != t.contiguous().view(t.shape).stride():
                    self.odd.append((str(func), tuple(t.shape), t.stride()))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("which", ["tiny fp32", "qwen-like bf16"])
def test_rank1_member_matmuls_get_canonical_strides(which, tiny_model_dir, qwen_like_dir):
    """At rank 1 every stacked factor the batched forward hands to ``bmm``/``baddbmm_`` has canonical strides — on
    the tiny model and on the Qwen-like fixture in bf16 (151,936-row tied embedding/head, the real-model path)."""
    if which == "tiny fp32":
        model = load_policy(tiny_model_dir).model.eval()
    else:
        model = load_policy(qwen_like_dir, dtype="bfloat16").model.eval()
    named = list(model.named_parameters())
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    mode = _OddStrides()
    with torch.no_grad(), LowRankPopulationForward(model, named, MEMBERS, seed=SEED, step=STEP, sigma=SIGMA, rank=1):
        with mode:
            model(ids.repeat(len(MEMBERS), 1))
    assert mode.matmuls > 0 and mode.odd == [], mode.odd[:8]
