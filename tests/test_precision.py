"""fp32 master weights (es_lightning/precision.py, ESOptimizer's masters), on the tiny HF model loaded in bf16.

Every update is checked against an independent float64 computation: the ES update ``(α/N) Σ z_n ε_n`` summed by hand,
and AdamW written out by hand. The settings are the papers' (Ba et al. 2026): ES α = 2.5e-4 over N = 32 members
(α/√N ≈ 4.4e-5 per element), GRPO's AdamW at lr = 1e-6 — both well under half a bf16 ulp of a 0.02 weight (6.1e-5)
and of a norm weight ≈ 1 (3.9e-3).
"""

from __future__ import annotations

import lightning as L
import pytest
import torch

from es_lightning.es.noise import param_noise
from es_lightning.es.update import ESOptimizer, normalize_rewards
from es_lightning.policy import load_policy
from es_lightning.precision import MasterAdamW, check_device_dtype, copy_masters, resolve_master_dtype

N, ALPHA, SIGMA = 32, 2.5e-4, 1.5e-3
LINEAR, NORM = "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"


def _bf16_model(model_dir):
    return load_policy(model_dir, dtype="bfloat16").model


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _intended_es_update(name: str, numel: int, z: torch.Tensor, step: int = 0) -> torch.Tensor:
    """(α/N) Σ_n z_n ε_n in float64, from the seeded noise of each member."""
    total = torch.zeros(numel, dtype=torch.float64)
    for member in range(N):
        total += float(z[member]) * param_noise(0, step, member, name, numel).double()
    return total * (ALPHA / N)


# ---------------------------------------------------------------------------------------------------- the knob
@pytest.mark.parametrize("model, knob, expected", [
    (torch.bfloat16, "float32", torch.float32), (torch.float16, "fp32", torch.float32),
    (torch.bfloat16, torch.float64, torch.float64), (torch.float32, "float32", None), (torch.bfloat16, "same", None),
    (torch.bfloat16, None, None), (torch.float32, "float64", torch.float64),
    (torch.float64, "float32", None),  # the default on a float64 model (precision: 64-true): its own master
])
def test_resolve_master_dtype(model, knob, expected):
    assert resolve_master_dtype(model, knob) == expected


@pytest.mark.parametrize("model, knob", [(torch.float32, "bfloat16"), (torch.bfloat16, "float16"),
                                         (torch.float16, "bfloat16"), (torch.float64, "bfloat16")])
def test_a_master_below_the_model_is_refused_naming_the_fix(model, knob):
    with pytest.raises(ValueError, match="master_dtype: float32") as err:
        resolve_master_dtype(model, knob)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown master_dtype"):
        resolve_master_dtype(torch.bfloat16, "fp8")


def test_device_dtype_check():
    check_device_dtype("cpu", torch.float32)
    check_device_dtype("cpu", torch.bfloat16)  # this CPU computes in bf16 (the probe runs a matmul and a softmax)
    with pytest.raises(ValueError, match=r"use dtype='bfloat16' with Trainer\(precision='bf16-true'\)") as err:
        check_device_dtype("cpu", torch.float16)  # a script's call: Python's words, not the recipe's
    assert "\n" not in str(err.value) and "trainer.precision" not in str(err.value)
    with pytest.raises(ValueError, match=r"use GRPOModule\(dtype='bfloat16'\) with Trainer\(precision='bf16-true'\), "
                                         r"or GRPOModule\(dtype='float32'\) with Trainer\(precision='32-true'\)$"):
        check_device_dtype("cpu", torch.float16, owner="GRPOModule")


# ---------------------------------------------------------------------------------------------------- ES
def _es_step(model, master_dtype, z, step=0):
    named = list(model.named_parameters())
    opt = ESOptimizer(named, lr=ALPHA, sigma=SIGMA, master_dtype=master_dtype)
    opt.set_update(0, step, torch.arange(N), z)
    return opt, named


def test_es_update_below_a_bf16_ulp_reaches_the_fp32_master(tiny_model_dir):
    z = normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(0)))
    model = _bf16_model(tiny_model_dir)
    start = {n: p.detach().double().clone().flatten() for n, p in model.named_parameters()}
    assert float(start[LINEAR].std()) == pytest.approx(0.02, rel=0.1) and bool((start[NORM] == 1).all())
    opt, named = _es_step(model, torch.float32, z)
    opt.step()
    intended_sq = 0.0
    for name, p in named:
        intended = _intended_es_update(name, p.numel(), z)
        intended_sq += float(intended.square().sum())
        master = opt.centre(p)
        assert master.dtype == torch.float32 and p.dtype == torch.bfloat16
        assert torch.equal(p, master.to(torch.bfloat16))  # the weight is the master rounded to nearest
        applied = master.double().flatten() - start[name]
        assert _cos(applied, intended) >= 0.9999, name
        assert float((applied - intended).abs().max()) <= 0.6 * torch.finfo(torch.float32).eps * (1 + float(
            start[name].abs().max()))  # at most the master's own rounding
    assert opt.last_update_norm == pytest.approx(intended_sq**0.5, rel=1e-5)

    # the same update on the bf16 weights themselves (no master) keeps a fraction of it and freezes the norms
    plain = _bf16_model(tiny_model_dir)
    opt, named = _es_step(plain, None, z)
    opt.step()
    weights = dict(named)
    intended = _intended_es_update(LINEAR, weights[LINEAR].numel(), z)
    applied = weights[LINEAR].detach().double().flatten() - start[LINEAR]
    kept = float((applied != 0).double().mean())
    assert kept < 0.6 and _cos(applied, intended) < 0.9, (kept, _cos(applied, intended))  # ~43% and ~0.83
    assert torch.equal(weights[NORM].detach().double().flatten(), start[NORM])  # frozen


def test_es_small_updates_accumulate_over_steps(tiny_model_dir):
    K = 5
    model = _bf16_model(tiny_model_dir)
    plain = _bf16_model(tiny_model_dir)
    named = list(model.named_parameters())
    start = {n: p.detach().double().clone().flatten() for n, p in named}
    opt = ESOptimizer(named, lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    plain_opt = ESOptimizer(list(plain.named_parameters()), lr=ALPHA, sigma=SIGMA)
    total = {n: torch.zeros(p.numel(), dtype=torch.float64) for n, p in named if n in (LINEAR, NORM)}
    for step in range(K):
        z = normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(step)))
        for o in (opt, plain_opt):
            o.set_update(0, step, torch.arange(N), z)
            o.step()
        for name in total:
            total[name] += _intended_es_update(name, total[name].numel(), z, step)
    for name, p in named:
        if name in total:
            applied = opt.centre(p).double().flatten() - start[name]
            assert _cos(applied, total[name]) >= 0.9999
            assert float((applied - total[name]).abs().max()) <= K * torch.finfo(torch.float32).eps * float(
                start[name].abs().max())
        assert torch.equal(p, opt.centre(p).to(p.dtype))
    # after K steps the norm weights of the bf16-only run have still not moved
    assert torch.equal(dict(plain.named_parameters())[NORM].detach().double().flatten(), start[NORM])


def test_es_centre_restores_perturbed_weights_bitwise(tiny_model_dir):
    model = _bf16_model(tiny_model_dir)
    named = list(model.named_parameters())
    opt, _ = _es_step(model, torch.float32, normalize_rewards(torch.arange(N, dtype=torch.float32)))
    opt.step()  # the masters now hold bits the bf16 weights do not
    before = {n: p.detach().clone() for n, p in named}
    assert any(not torch.equal(opt.centre(p), p.float()) for _, p in named)
    with torch.no_grad():
        for name, p in named:  # one member, perturbed in place from the fp32 centre and rounded once
            centre = opt.centre(p)
            p.copy_(centre + SIGMA * param_noise(0, 1, 0, name, p.numel()).view_as(p))
        assert not all(torch.equal(p, before[n]) for n, p in named)
        opt.write_centre()
    assert all(torch.equal(p, before[n]) for n, p in named)
    # the in-place evaluator's other form: write centre(p) back with copy_
    with torch.no_grad():
        for _, p in named:
            centre = opt.centre(p)
            p.add_(1.0)
            p.copy_(centre)
    assert all(torch.equal(p, before[n]) for n, p in named)
    pieces = opt.centre_views(opt._views())  # the sharded evaluators' form, on one process
    assert all(c.dtype == torch.float32 and c.data_ptr() == opt.centre(opt._by_name[v.name]).data_ptr()
               for v, c in pieces)


def test_es_without_low_precision_parameters_is_unchanged_bitwise(tiny_model_dir):
    """fp32 parameters get no master: the update is today's, bit for bit; a bf16 model mixed with an fp32 tensor
    masters only the bf16 ones."""
    z = normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(3)))
    a, b = load_policy(tiny_model_dir).model, load_policy(tiny_model_dir).model
    opt_a, named_a = _es_step(a, torch.float32, z)
    opt_b, named_b = _es_step(b, None, z)
    assert not any(opt_a.has_master(p) for _, p in named_a)
    opt_a.step()
    opt_b.step()
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(named_a, named_b))
    assert opt_a.last_update_norm == opt_b.last_update_norm
    mixed = _bf16_model(tiny_model_dir)
    dict(mixed.named_parameters())[NORM].data = dict(a.named_parameters())[NORM].data.clone()  # an fp32 norm
    opt, named = _es_step(mixed, torch.float32, z)
    assert [n for n, p in named if not opt.has_master(p)] == [NORM]


def test_es_masters_survive_a_state_dict_round_trip_fp32_and_bitwise(tiny_model_dir, tmp_path):
    z = normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(1)))
    model = _bf16_model(tiny_model_dir)
    opt, named = _es_step(model, torch.float32, z)
    opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = _bf16_model(tiny_model_dir)  # built before the checkpoint is loaded, as Lightning does
    fresh_opt = ESOptimizer(list(fresh.named_parameters()), lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])
    for (_, p), (_, q) in zip(named, fresh.named_parameters()):
        assert fresh_opt.centre(q).dtype == torch.float32 and torch.equal(fresh_opt.centre(q), opt.centre(p))
    z2 = normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(2)))
    for o in (opt, fresh_opt):  # and the next step continues exactly
        o.set_update(0, 1, torch.arange(N), z2)
        o.step()
    for (_, p), (_, q) in zip(named, fresh.named_parameters()):
        assert torch.equal(p, q) and torch.equal(fresh_opt.centre(q), opt.centre(p))


def test_es_masters_follow_weights_restored_after_the_optimizer_was_built(tiny_model_dir):
    """Lightning builds optimizers before it restores ``ckpt_path`` weights: without optimizer state in the
    checkpoint the masters are taken from the restored weights at their first use."""
    model = _bf16_model(tiny_model_dir)
    opt = ESOptimizer(list(model.named_parameters()), lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    other = {n: t + 0.5 for n, t in model.state_dict().items()}
    model.load_state_dict(other)
    for _, p in model.named_parameters():
        assert torch.equal(opt.centre(p), p.float())


def test_es_master_step_is_the_same_under_bf16_as_the_default_dtype(tiny_model_dir):
    """Lightning's bf16-true makes bf16 the default dtype inside steps: nothing in the step may depend on it."""
    z = normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(4)))
    results = []
    for default in (torch.float32, torch.bfloat16):
        model = _bf16_model(tiny_model_dir)
        opt, named = _es_step(model, torch.float32, z)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(default)
        try:
            opt.step()
        finally:
            torch.set_default_dtype(previous)
        results.append([(p.clone(), opt.centre(p).clone(), opt.state[p]["step"].dtype) for _, p in named])
    for (p, m, s), (q, n, t) in zip(*results):
        assert torch.equal(p, q) and torch.equal(m, n) and s == t == torch.float32


def test_es_checkpoint_without_masters_takes_them_from_the_restored_weights(tiny_model_dir):
    model = _bf16_model(tiny_model_dir)
    opt, named = _es_step(model, None, normalize_rewards(torch.randn(N, generator=torch.Generator().manual_seed(5))))
    opt.step()
    fresh = _bf16_model(tiny_model_dir)
    fresh_opt = ESOptimizer(list(fresh.named_parameters()), lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    fresh.load_state_dict(model.state_dict())
    fresh_opt.load_state_dict(opt.state_dict())  # a run without masters (master_dtype: same) resumed with them
    for (_, p), (_, q) in zip(named, fresh.named_parameters()):
        assert fresh_opt.centre(q).dtype == torch.float32 and torch.equal(fresh_opt.centre(q), p.float())


# ---------------------------------------------------------------------------------------------------- AdamW
def _lm_loss(model, seed: int) -> torch.Tensor:
    ids = torch.randint(3, model.config.vocab_size, (4, 12), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def _adamw_by_hand(theta, grads, lr, betas, eps, weight_decay):
    """AdamW (Loshchilov & Hutter 2019, Alg. 2) in float64 over a list of gradients, one step each."""
    theta, m, v = theta.double().clone(), torch.zeros_like(theta, dtype=torch.float64), torch.zeros_like(
        theta, dtype=torch.float64)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        theta = theta * (1 - lr * weight_decay)
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        theta = theta - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return theta


@pytest.mark.parametrize("fused", [None, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_master_adamw_on_fp32_parameters_is_torch_adamw_bitwise(tiny_model_dir, amsgrad, fused):
    ours, theirs = load_policy(tiny_model_dir).model, load_policy(tiny_model_dir).model
    kw = dict(lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1, amsgrad=amsgrad, fused=fused)
    opt_ours, opt_theirs = MasterAdamW(ours.parameters(), **kw), torch.optim.AdamW(theirs.parameters(), **kw)
    for step in range(3):
        for model, opt in ((ours, opt_ours), (theirs, opt_theirs)):
            opt.zero_grad()
            _lm_loss(model, step).backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
    assert not any("master" in s for s in opt_ours.state.values())
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert all(torch.equal(opt_ours.state[p][k], opt_theirs.state[q][k]) for k in opt_theirs.state[q])


@pytest.mark.parametrize("fused", [None, True], ids=["unfused", "fused"])
def test_master_adamw_at_lr_1e_6_moves_the_fp32_master_by_the_intended_amount(tiny_model_dir, fused):
    lr, betas, eps, wd = 1e-6, (0.9, 0.999), 1e-8, 0.01
    model = _bf16_model(tiny_model_dir)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MasterAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=fused)
    _lm_loss(model, 0).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert all(g.dtype == torch.bfloat16 for g in grads.values())
    opt.step()
    for name, p in model.named_parameters():
        state = opt.state[p]
        assert {k: state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == dict.fromkeys(
            ("master", "exp_avg", "exp_avg_sq"), torch.float32)
        intended = _adamw_by_hand(start[name], [grads[name]], lr, betas, eps, wd) - start[name].double()
        applied = state["master"].double() - start[name].double()
        bound = torch.finfo(torch.float32).eps * start[name].double().abs() + 1e-5 * intended.abs() + 1e-30
        assert bool(((applied - intended).abs() <= bound).all()), name  # up to the master's own rounding
        assert torch.equal(p, state["master"].to(torch.bfloat16))
        if name in (LINEAR, NORM):
            assert _cos(applied, intended) >= 0.999 and float(intended.abs().mean()) > 5e-7
    # plain AdamW on the bf16 weights: the same step is (almost everywhere) rounded away
    plain = _bf16_model(tiny_model_dir)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=wd)
    _lm_loss(plain, 0).backward()
    plain_opt.step()
    weights = dict(plain.named_parameters())
    assert float((weights[LINEAR] != start[LINEAR]).double().mean()) < 0.05
    assert torch.equal(weights[NORM], start[NORM])


def test_master_adamw_small_steps_accumulate(tiny_model_dir):
    K, lr, betas, eps = 10, 1e-6, (0.9, 0.999), 1e-8
    model = _bf16_model(tiny_model_dir)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = MasterAdamW(model.parameters(), lr=lr, betas=betas, eps=eps, weight_decay=0.0)
    history = {n: [] for n in start}
    for step in range(K):
        opt.zero_grad()
        _lm_loss(model, step).backward()  # the bf16 weights of each step give its gradient
        for n, p in model.named_parameters():
            history[n].append(p.grad.clone())
        opt.step()
    for name, p in model.named_parameters():
        intended = _adamw_by_hand(start[name], history[name], lr, betas, eps, 0.0) - start[name].double()
        applied = opt.state[p]["master"].double() - start[name].double()
        # each of the K fp32 steps rounds the master once, by at most an fp32 ulp of its value (a bias that starts at 0
        # is ~K·lr in size, so the bound scales with the largest value the master takes, not with the start)
        largest = max(float(start[name].double().abs().max()), float((start[name].double() + intended).abs().max()))
        assert float((applied - intended).abs().max()) <= K * torch.finfo(torch.float32).eps * largest + 1e-15, name
        if name in (LINEAR, NORM):  # fp32's own ulp at 1.0 (1.2e-7) is an eighth of a 1e-6 step: each step's
            # rounding leaves the norm weights at cosine ~0.9997 — the precision of any fp32 master (DeepSpeed's too)
            assert _cos(applied, intended) >= (0.9999 if name == LINEAR else 0.999)
            assert float(intended.abs().mean()) > 2 * lr  # several steps' worth


def test_master_adamw_state_survives_a_state_dict_round_trip_fp32_and_bitwise(tiny_model_dir, tmp_path):
    model = _bf16_model(tiny_model_dir)
    opt = MasterAdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    for step in range(2):
        opt.zero_grad()
        _lm_loss(model, step).backward()
        opt.step()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, tmp_path / "ckpt.pt")
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    fresh = _bf16_model(tiny_model_dir)
    fresh_opt = MasterAdamW(fresh.parameters(), lr=1e-6, weight_decay=0.0)
    fresh.load_state_dict(saved["model"])
    fresh_opt.load_state_dict(saved["opt"])  # torch.optim.Optimizer's own would round these to bf16
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key in ("master", "exp_avg", "exp_avg_sq"):
            assert fresh_opt.state[q][key].dtype == torch.float32 and torch.equal(fresh_opt.state[q][key],
                                                                                   opt.state[p][key])
    for m, o in ((model, opt), (fresh, fresh_opt)):  # the next step continues exactly
        o.zero_grad()
        _lm_loss(m, 5).backward()
        o.step()
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q) and torch.equal(fresh_opt.state[q]["master"], opt.state[p]["master"])


@pytest.mark.parametrize("chunk", [1 << 24, 5])  # 5: the comparison in chunks cut across rows
def test_master_adamw_takes_weights_changed_outside_the_optimizer(tiny_model_dir, chunk, monkeypatch):
    monkeypatch.setattr("es_lightning.precision.SYNC_CHUNK", chunk)
    model = _bf16_model(tiny_model_dir)
    opt = MasterAdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    _lm_loss(model, 0).backward()
    opt.step()
    p = dict(model.named_parameters())[LINEAR]
    master = opt.state[p]["master"].clone()
    with torch.no_grad():
        p[0].fill_(0.25)  # e.g. weights loaded without optimizer state
    assert opt.sync_masters() == p.shape[1]
    assert bool((opt.state[p]["master"][0] == 0.25).all()) and torch.equal(opt.state[p]["master"][1:], master[1:])


#: a chunk length whose boundaries fall inside the Qwen-like embedding (151,936 × 64 = 9,723,904 elements), across its
#: rows: 9 whole chunks and a partial one
EMBED_CHUNK = 1_000_003


def test_master_adamw_sync_in_chunks_cut_inside_the_qwen_like_embedding(qwen_like_dir, monkeypatch):
    """sync_masters compared in chunks whose boundaries cut the bf16 151,936-row embedding across rows takes exactly
    the elements that plain torch on the whole tensors finds stale, and keeps the other masters' extra bits."""
    monkeypatch.setattr("es_lightning.precision.SYNC_CHUNK", EMBED_CHUNK)
    model = _bf16_model(qwen_like_dir)
    embed = model.get_input_embeddings().weight
    flat, width = embed.detach().view(-1), embed.shape[1]
    assert embed.shape == (151_936, 64) and embed.dtype == torch.bfloat16
    assert flat.numel() > EMBED_CHUNK and flat.numel() % EMBED_CHUNK and EMBED_CHUNK % width
    opt = MasterAdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    boundaries = range(EMBED_CHUNK, flat.numel(), EMBED_CHUNK)
    with torch.no_grad():
        for p in model.parameters():  # masters with bits below bf16 (as after AdamW steps); ~28% round elsewhere
            opt.master(p).mul_(1 + (torch.rand(p.shape, generator=gen) - 0.5) * 2 ** -7)
        for b in boundaries:  # weights written outside the optimizer on both sides of every chunk boundary
            flat[b - 40:b + 40].neg_()
        embed[151_645].fill_(0.25)  # <|im_end|>'s row, and a row of another weight
        dict(model.named_parameters())[LINEAR][3].fill_(-0.25)

    expected, stale = {}, 0
    for p in model.parameters():  # plain torch on the whole tensors
        master = opt.state[p]["master"]
        differs = p.detach().ne(master.to(p.dtype))
        expected[p] = torch.where(differs, p.detach().float(), master)
        stale += int(differs.sum())
    kept = expected[embed].ne(flat.view(embed.shape).float())
    assert 0.1 < float(kept.double().mean()) < 0.9  # both kinds of element, in bulk, in every chunk (~72% kept)

    assert opt.sync_masters() == stale
    assert all(torch.equal(opt.state[p]["master"], expected[p]) for p in model.parameters())
    master = opt.state[embed]["master"].view(-1)
    assert all(torch.equal(master[b - 40:b + 40], flat[b - 40:b + 40].float()) for b in boundaries)


def test_copy_masters_hands_grpo_masters_to_es(tiny_model_dir):
    model = _bf16_model(tiny_model_dir)
    adamw = MasterAdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
    _lm_loss(model, 0).backward()
    adamw.step()
    es = ESOptimizer(list(model.named_parameters()), lr=ALPHA, sigma=SIGMA, master_dtype=torch.float32)
    assert copy_masters(adamw, es) == len(list(model.parameters()))
    assert all(torch.equal(es.centre(p), adamw.state[p]["master"]) for p in model.parameters())


# ---------------------------------------------------------------------------------------------------- Lightning
class _TinyLM(L.LightningModule):
    """A real HF model trained with MasterAdamW under whatever precision the Trainer applies."""

    def __init__(self, model_dir: str) -> None:
        super().__init__()
        self.model_dir = model_dir
        self.model = None
        self.param_dtype = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = load_policy(self.model_dir).model  # fp32: the trainer's precision decides

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        self.param_dtype = next(self.parameters()).dtype
        return MasterAdamW(self.parameters(), lr=1e-6, weight_decay=0.0,
                           master_dtype=resolve_master_dtype(self.param_dtype, "float32"))

    def train_dataloader(self):
        ids = torch.randint(3, 40, (4, 12), generator=torch.Generator().manual_seed(0))  # 2 steps an epoch
        return torch.utils.data.DataLoader(ids, batch_size=2)


def _fit(model_dir, root, max_steps, ckpt_path=None):
    module = _TinyLM(model_dir)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, precision="bf16-true", logger=False,
                        default_root_dir=root, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(module, ckpt_path=ckpt_path)
    return module, trainer


def test_bf16_true_trainer_keeps_fp32_masters_through_a_checkpoint_resume(tiny_model_dir, tmp_path):
    """Lightning's bf16-true converts the parameters to bf16 before configure_optimizers and runs steps with bf16
    as the default dtype; a resumed fit restores the masters bitwise and continues as the uninterrupted fit."""
    whole, _ = _fit(tiny_model_dir, tmp_path / "whole", 3)
    assert whole.param_dtype == torch.bfloat16
    first, trainer = _fit(tiny_model_dir, tmp_path / "first", 2)
    trainer.save_checkpoint(tmp_path / "step2.ckpt")
    saved = torch.load(tmp_path / "step2.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert {s["master"].dtype for s in saved.values()} == {s["exp_avg"].dtype for s in saved.values()} == {torch.float32}
    resumed, trainer = _fit(tiny_model_dir, tmp_path / "resumed", 3, ckpt_path=tmp_path / "step2.ckpt")
    assert trainer.global_step == 3
    opt_whole, opt_resumed = whole.trainer.optimizers[0], trainer.optimizers[0]
    for p, q in zip(whole.parameters(), resumed.parameters()):
        assert q.dtype == torch.bfloat16 and torch.equal(p, q)
        assert torch.equal(opt_whole.state[p]["master"], opt_resumed.state[q]["master"])
        assert opt_resumed.state[q]["master"].dtype == torch.float32
    moved = [float((opt_whole.state[p]["master"] - p.float()).abs().max()) for p in whole.parameters()]
    assert max(moved) > 0  # the masters hold what the bf16 weights could not
