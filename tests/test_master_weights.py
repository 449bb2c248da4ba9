"""fp32 master weights wired into training (issue 11, item 4): real ``Trainer`` fits of ``ESModule`` and ``GRPOModule``
with bf16 weights, on the tiny HF model and on the Qwen-like fixture (1,024-row vocabulary variant).

Every update is checked against an independent float64 computation from what the step saw: the ES update
``Σ_steps (α/N) Σ_n z_n ε_n`` with z-scores computed here from the logged member rewards and the noise regenerated from
its key; GRPO's AdamW written out by hand over the gradients the optimizer was handed (captured in
``on_before_optimizer_step``). Step sizes are the papers' per-element sizes (Ba et al. 2026): ES α/√N ≈ 4.4e-5
(α = 2.5e-4 over N = 32; here N = 4 with α = 8.8e-5), AdamW at lr = 1e-6 — below half a bf16 ulp of a 0.02 weight
(6.1e-5) and of a norm weight ≈ 1 (3.9e-3), so without a master most of each update is lost.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from es_lightning import ESModule, GRPOModule, ParameterDrift, ReasoningDataModule, SequentialStrategy
from es_lightning.es.noise import param_noise
from es_lightning.es.update import ESOptimizer
from es_lightning.precision import MasterAdamW
from es_lightning.tasks import CountdownTask, get_task

N = 4
ES_LR = 2.5e-4 * math.sqrt(N / 32)  # the per-element step of α = 2.5e-4 over N = 32 members
GRPO_LR = 1e-6
LINEAR, NORM = "model.layers.0.mlp.up_proj.weight", "model.layers.0.input_layernorm.weight"
F32_EPS = torch.finfo(torch.float32).eps


@pytest.fixture(params=["tiny_model_dir", "qwen_like_small_dir"], ids=["tiny", "qwen_like"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


class _CharSum(CountdownTask):
    """A reward that differs between completions (an untrained model never solves Countdown)."""

    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


class _Record(L.Callback):
    """What each step used: ES member rewards; the gradients AdamW was handed; the masters at chosen moments."""

    def __init__(self):
        self.rewards, self.grads, self.masters_before = [], [], {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads.append({n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters()
                           if p.grad is not None})

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.masters_before[trainer.global_step] = (type(trainer.optimizers[0]).__name__, _masters(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if pl_module.algorithm.name == "es":
            self.rewards.append(pl_module.last_rewards.double().clone())


def _masters(module) -> dict[str, torch.Tensor]:
    """{name: fp32 master} of the fit's current optimizer (ES: its centre)."""
    opt = module.trainer.optimizers[0]
    out = {}
    for name, p in module.model.named_parameters():
        if isinstance(opt, ESOptimizer):
            if opt.has_master(p):
                out[name] = opt.centre(p).detach().clone()
        elif p in opt.state and "master" in opt.state[p]:
            out[name] = opt.state[p]["master"].detach().clone()
    return out


def _dm():
    return ReasoningDataModule(task="countdown", train_size=16, val_size=4, test_size=4, batch_size=2, seed=0)


def _es(model_dir, **kw):
    kw = {"dtype": "bfloat16", "population_size": N, "sigma": 0.05, "lr": ES_LR, "temperature": 1.0,
          "max_new_tokens": 6, "reward_normalization": "zscore", **kw}
    return ESModule(model=model_dir, task=_CharSum(), **kw)


def _grpo(model_dir, **kw):
    kw = {"dtype": "bfloat16", "group_size": 2, "lr": GRPO_LR, "max_new_tokens": 6, "weight_decay": 0.0, **kw}
    return GRPOModule(model=model_dir, task=_CharSum(), **kw)


def _fit(module, max_steps, root=None, callbacks=(), ckpt_path=None, **kw):
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, limit_val_batches=0,
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=root,
                        callbacks=list(callbacks), **kw)
    trainer.fit(module, _dm(), ckpt_path=ckpt_path)
    return trainer


def _start(module) -> dict[str, torch.Tensor]:
    module.configure_model()
    return {n: p.detach().double().clone() for n, p in module.model.named_parameters()}


def _cos(a, b) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


def _intended_es(seed: int, rewards: list[torch.Tensor], name: str, numel: int, lr: float = ES_LR) -> torch.Tensor:
    """Σ_steps (α/N) Σ_n z_n ε_n in float64, z the z-scored member rewards of each step."""
    total = torch.zeros(numel, dtype=torch.float64)
    for step, r in enumerate(rewards):
        z = (r - r.mean()) / r.std(unbiased=False)
        for member in range(N):
            total += float(z[member]) * param_noise(seed, step, member, name, numel).double()
    return total * (lr / N)


def _adamw_by_hand(theta, grads, lr=GRPO_LR, betas=(0.9, 0.999), eps=1e-8):
    """AdamW (Loshchilov & Hutter 2019, Alg. 2; weight decay 0) in float64, one step per gradient."""
    theta = theta.double().clone()
    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        theta = theta - lr * (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
    return theta


# ---------------------------------------------------------------------------------------------------- ES
@pytest.mark.parametrize("members_per_batch", [1, N], ids=["in_place", "batched"])
def test_es_steps_update_the_fp32_master_as_intended(model_dir, members_per_batch):
    """K = 3 ES steps through a real Trainer on bf16 weights: every parameter's master moved by the intended update
    (cosine >= 0.9999, error within the master's own rounding), nearly every element moved (bf16 alone keeps
    fewer than 60%, norm weights none), and the weights are the masters rounded to nearest."""
    K = 3
    module, record = _es(model_dir, members_per_batch=members_per_batch), _Record()
    start = _start(module)
    trainer = _fit(module, K, callbacks=[record])
    opt = trainer.optimizers[0]
    assert isinstance(opt, ESOptimizer) and opt.master_dtype == torch.float32
    assert len(record.rewards) == K and all(not bool((r == r[0]).all()) for r in record.rewards)
    for name, p in module.model.named_parameters():
        master = opt.centre(p)
        assert p.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(p, master.to(torch.bfloat16)), name  # the weight is the master rounded once
        intended = _intended_es(module.seed, record.rewards, name, p.numel())
        applied = master.double().flatten() - start[name].flatten()
        assert _cos(applied, intended) >= 0.9999, name
        bound = K * F32_EPS * (1 + float(start[name].abs().max()))
        assert float((applied - intended).abs().max()) <= bound, name
        if name in (LINEAR, NORM):
            assert float((applied != 0).double().mean()) >= 0.99, name

    # the same fit with master_dtype: same — the bf16 weights take the update themselves and lose most of it
    plain, record = _es(model_dir, members_per_batch=members_per_batch, master_dtype="same"), _Record()
    _fit(plain, 1, callbacks=[record])
    weights = dict(plain.model.named_parameters())
    intended = _intended_es(plain.seed, record.rewards, LINEAR, weights[LINEAR].numel())
    applied = weights[LINEAR].detach().double().flatten() - start[LINEAR].flatten()
    assert float((applied != 0).double().mean()) < 0.6 and _cos(applied, intended) < 0.95
    assert torch.equal(weights[NORM].detach().double(), start[NORM])  # frozen


@pytest.mark.parametrize("members_per_batch, antithetic, fixture", [
    (1, False, "tiny_model_dir"), (N, False, "tiny_model_dir"),
    (N, True, "qwen_like_small_dir"),  # the batched pair path (θ + σε, θ − σε) on the real-vocabulary fixture
], ids=["in_place", "batched", "batched_antithetic_qwen_like"])
def test_es_members_are_perturbed_from_the_master_and_the_weights_restored(request, monkeypatch, members_per_batch,
                                                                           antithetic, fixture):
    """Step 1 (after a step, the masters hold bits the bf16 weights do not): each member the evaluator scores is
    θ + σε computed from the fp32 master and rounded once — read from the policy while it generates (in place) or
    from the stacked member weights (batched) — and after the population the weights are back bit for bit.
    Antithetic members 2i and 2i+1 share noise i with signs + and −."""
    from es_lightning.es import evaluators

    seen: list[dict[str, torch.Tensor]] = []
    module = _es(request.getfixturevalue(fixture), members_per_batch=members_per_batch, antithetic=antithetic)
    record = _Record()

    class _ForwardSpy(evaluators.PopulationForward):  # the real batched forward, keeping its member weights
        def __init__(self, model, stacked):
            super().__init__(model, stacked)
            seen.extend({n: stacked[n][j].clone() for n in (LINEAR, NORM)} for j in range(self.k))

    class _GenerateSpy:  # the module's real generator, reading the weights it generates with
        def __init__(self, generator):
            self.generator = generator

        def generate(self, *args, **kwargs):
            if members_per_batch == 1:
                weights = dict(module.model.named_parameters())
                seen.append({n: weights[n].detach().clone() for n in (LINEAR, NORM)})
            return self.generator.generate(*args, **kwargs)

    monkeypatch.setattr(evaluators, "PopulationForward", _ForwardSpy)
    module._generator = _GenerateSpy(module.generator)

    class _Restored(L.Callback):  # the weights right after step 1's population, before its update
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            if trainer.global_step == 1:
                self.weights = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    restored = _Restored()
    _fit(module, 2, callbacks=[record, restored])
    _, masters = record.masters_before[1]
    members = seen[N:]  # step 1's population
    assert len(members) == N
    differs = 0  # elements where a member perturbed from the rounded weights would have differed
    for member, weights in enumerate(members):
        for name in (LINEAR, NORM):
            noise_id, sign = (member // 2, (-1.0) ** member) if antithetic else (member, 1.0)
            eps = sign * param_noise(module.seed, 1, noise_id, name, weights[name].numel()).view_as(weights[name])
            # the contract (evaluators.perturb): θ + σε in fp32 from the master, rounded once to bf16 ...
            expected = (masters[name] + 0.05 * eps).to(torch.bfloat16)
            assert weights[name].dtype == torch.bfloat16 and torch.equal(weights[name], expected), (member, name)
            # ... which is the exact sum rounded to bf16 but where fp32's own rounding of σε and of the sum lands on a
            # bf16 tie (one element of one antithetic pair on the Qwen-like fixture): never more than one bf16 ulp off
            exact = (masters[name].double() + 0.05 * eps.double()).float().to(torch.bfloat16)
            ulp = torch.finfo(torch.bfloat16).eps * exact.float().abs().clamp_min(torch.finfo(torch.bfloat16).tiny)
            assert bool(((weights[name].float() - exact.float()).abs() <= ulp).all()), (member, name)
            from_weights = (masters[name].to(torch.bfloat16).float() + 0.05 * eps).to(torch.bfloat16)
            differs += int((from_weights != expected).sum())
    assert differs > 0
    for name, m in masters.items():
        assert torch.equal(restored.weights[name], m.to(torch.bfloat16)), name  # restored bit for bit


# ---------------------------------------------------------------------------------------------------- GRPO
def test_grpo_steps_update_the_fp32_master_as_intended(model_dir):
    """K = 3 GRPO optimizer steps at lr 1e-6 on bf16 weights: the MasterAdamW masters equal AdamW by hand (float64)
    over the gradients each step was handed, within the master's rounding; bf16 AdamW keeps almost none of it."""
    K = 3
    module, record = _grpo(model_dir), _Record()
    start = _start(module)
    trainer = _fit(module, K, callbacks=[record])
    opt = trainer.optimizers[0]
    assert isinstance(opt, MasterAdamW) and opt.master_dtype == torch.float32 and len(record.grads) == K
    for name, p in module.model.named_parameters():
        state = opt.state[p]
        assert {state[k].dtype for k in ("master", "exp_avg", "exp_avg_sq")} == {torch.float32}
        assert torch.equal(p, state["master"].to(torch.bfloat16)), name
        grads = [g[name] for g in record.grads]
        assert all(g.dtype == torch.bfloat16 for g in grads)
        intended = _adamw_by_hand(start[name], grads) - start[name]
        applied = state["master"].double() - start[name]
        bound = K * F32_EPS * start[name].abs() + 1e-5 * intended.abs() + 1e-12
        assert bool(((applied - intended).abs() <= bound).all()), name
        if name in (LINEAR, NORM):
            assert _cos(applied, intended) >= (0.9999 if name == LINEAR else 0.999), name
            assert float(intended.abs().mean()) > GRPO_LR  # more than one step's worth: the steps accumulated
            assert float((applied != 0).double().mean()) >= 0.9, name

    plain, record = _grpo(model_dir, master_dtype="same"), _Record()
    _fit(plain, 1, callbacks=[record])
    assert type(plain.trainer.optimizers[0]) is MasterAdamW and plain.trainer.optimizers[0].master_dtype is None
    weights = dict(plain.model.named_parameters())
    assert float((weights[LINEAR].detach().double() != start[LINEAR]).double().mean()) < 0.05
    assert torch.equal(weights[NORM].detach().double(), start[NORM])


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_drift_reads_the_master(kind, model_dir, tmp_path, capsys, monkeypatch):
    """train/drift — and `analyze drift` / `analyze ablation` of the run's .ckpt — are ‖θ − θ₀‖/‖θ₀‖ and s_τ of the
    fp32 masters: at these step sizes the bf16 weights say something else entirely. (train/drift read in chunks of
    1000 elements here, as a 7B model's embedding is read in chunks of 16M: the sums must not depend on where they
    are cut.)"""
    monkeypatch.setattr("es_lightning.callbacks.drift.DRIFT_CHUNK", 1000)
    from es_lightning.analysis.ablation import snapshot, sparsity_ablation
    from es_lightning.analysis.checkpoints import load_model
    from es_lightning.analysis.drift import drift_command
    from es_lightning.precision import PARAMETER_NAMES_KEY

    module = (_es if kind == "es" else _grpo)(model_dir)
    start = _start(module)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, filename="last")
    trainer = _fit(module, 2, root=tmp_path, callbacks=[ckpt])
    masters = _masters(module)  # taken from the optimizer by parameter identity
    num = sum(float((masters[n].double() - start[n]).square().sum()) for n in start)
    den = sum(float(t.square().sum()) for t in start.values())
    by_hand = (num / den) ** 0.5
    weights = sum(float((p.detach().double() - start[n]).square().sum()) for n, p in module.model.named_parameters())
    assert float(trainer.logged_metrics["train/drift"]) == pytest.approx(by_hand, rel=1e-4)
    if kind == "grpo":  # the rounded weights would mismeasure it (ES's norm survives rounding; its s_τ does not)
        assert abs((weights / den) ** 0.5 - by_hand) > 0.5 * by_hand

    report = drift_command(str(tmp_path / "last.ckpt"), out_dir=str(tmp_path / "drift"), plot=False)
    assert "fp32 masters" in capsys.readouterr().out and report.masters == len(start)
    assert report.relative_drift == pytest.approx(by_hand, rel=1e-9)
    tau = 1e-6
    unchanged = sum(int(((masters[n].double() - start[n]).abs() <= tau).sum()) for n in start)
    numel = sum(t.numel() for t in start.values())
    rounded = sum(int(((p.detach().double() - start[n]).abs() <= tau).sum()) for n, p in module.model.named_parameters())
    assert report.sparsity(tau) == unchanged / numel and abs(rounded - unchanged) > 0.05 * numel

    # the ablation resets by the masters' update, and τ = 0 gives back the tuned bf16 weights bit for bit
    loaded = load_model(str(tmp_path / "last.ckpt"))
    before = snapshot(loaded.policy.model)
    rows = sparsity_ablation(loaded.policy.model, {n: t.to(torch.bfloat16) for n, t in start.items()}, dict,
                             taus=[tau], masters=loaded.masters)
    assert rows[2]["sparsity"] == unchanged / numel
    assert all(torch.equal(before[n], p) for n, p in loaded.policy.model.named_parameters())

    # a checkpoint from before masters were named: the rounded weights, said once
    old = torch.load(tmp_path / "last.ckpt", weights_only=False)
    del old[PARAMETER_NAMES_KEY]
    torch.save(old, tmp_path / "old.ckpt")
    legacy = load_model(str(tmp_path / "old.ckpt"))
    assert not legacy.masters and legacy.unmatched_masters == len(start)
    assert "cannot be tied to its weights" in legacy.masters_note()


def test_drift_in_chunks_cut_inside_the_qwen_like_embedding(qwen_like_dir, monkeypatch):
    """train/drift read in chunks whose boundaries cut the bf16 151,936-row embedding across rows (9 whole chunks of
    1,000,003 elements and a partial one) is ‖θ − θ₀‖/‖θ₀‖ of plain torch on the whole fp32 masters after a GRPO step
    (tied embeddings: the LM head's gradient moves every row)."""
    chunk = 1_000_003
    monkeypatch.setattr("es_lightning.callbacks.drift.DRIFT_CHUNK", chunk)
    module = _grpo(qwen_like_dir, max_new_tokens=2)
    start = _start(module)
    embed = start["model.embed_tokens.weight"]
    assert embed.shape == (151_936, 64) and embed.numel() > chunk and embed.numel() % chunk and chunk % 64
    trainer = _fit(module, 1)
    drift = next(c for c in trainer.callbacks if isinstance(c, ParameterDrift))
    masters = _masters(module)
    moved = masters["model.embed_tokens.weight"].double() != embed
    assert bool(moved.any(1).all()) and float(moved.double().mean()) > 0.99
    assert masters.keys() == start.keys()
    num = sum(float((masters[n].double() - start[n]).square().sum()) for n in start)
    den = sum(float(t.square().sum()) for t in start.values())
    by_hand = (num / den) ** 0.5
    assert drift.compute(module) == pytest.approx(by_hand, rel=1e-12)
    assert float(trainer.logged_metrics["train/drift"]) == pytest.approx(by_hand, rel=1e-6)  # logged as fp32


def test_drift_and_ablation_read_a_checkpoint_base_from_its_masters(qwen_like_small_dir, tmp_path, capsys):
    """`analyze drift` / `ablation` of one checkpoint of a bf16 run against an earlier one (a GRPO → ES stage, two steps
    of a run): θ₀ is the earlier checkpoint's fp32 masters, as θ is the later one's. Its rounded weights are off the
    masters by the whole update at lr 1e-6, so a checkpoint measured against itself drifted by ~2e-5 with s_0 = 0.0004."""
    from es_lightning.analysis.ablation import ablation_command
    from es_lightning.analysis.drift import drift_command
    from es_lightning.analysis.settings import EvalSettings

    module = _grpo(qwen_like_small_dir, max_new_tokens=2)
    record = _Record()
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit(module, 2, root=tmp_path, callbacks=[ckpt, record])
    first, second = str(tmp_path / "step=1.ckpt"), str(tmp_path / "step=2.ckpt")
    m1, m2 = record.masters_before[1][1], _masters(module)  # the masters each checkpoint holds
    assert m1.keys() == m2.keys() == {n for n, _ in module.model.named_parameters()}

    capsys.readouterr()
    same = drift_command(first, base=first, taus=[0.0], out_dir=str(tmp_path / "same"), plot=False)
    assert same.relative_drift == 0.0 and same.sparsity(0.0) == 1.0
    out = capsys.readouterr().out  # no kind is named the one that moved most when none moved
    assert "no weight moved: Δθ = 0 everywhere" in out and "largest relative drift" not in out

    tau = 1e-7
    stage = drift_command(second, base=first, taus=[0.0, tau], out_dir=str(tmp_path / "stage"), plot=False)
    num = sum(float((m2[n].double() - m1[n].double()).square().sum()) for n in m1)
    den = sum(float(m1[n].double().square().sum()) for n in m1)
    numel = sum(t.numel() for t in m1.values())
    below = sum(int(((m2[n].double() - m1[n].double()).abs() <= tau).sum()) for n in m1)
    assert stage.relative_drift == pytest.approx((num / den) ** 0.5, rel=1e-9)
    assert stage.sparsity(tau) == below / numel

    tiny = EvalSettings(num_problems=1, num_samples=1, max_new_tokens=1, temperature=0.0)
    rows = ablation_command(second, base=first, taus=[tau], eval=tiny, out_dir=str(tmp_path / "ablation"), plot=False,
                            progress=False).rows
    assert [r["label"] for r in rows] == ["base", "tuned", f"tau={tau:g}"]
    assert rows[2]["sparsity"] == below / numel


def test_drift_of_a_bf16_export_says_it_cannot_see_sub_ulp_updates(qwen_like_small_dir, tmp_path, capsys):
    """An HF export of a bf16 run holds the rounded weights only: `analyze drift` of it against its base misses what
    the fp32 masters kept (here nearly the whole GRPO step at lr 1e-6) and says so in one line, naming the .ckpt to
    measure instead; the run's .ckpt and a bf16 base directory say nothing."""
    from es_lightning import HFExport
    from es_lightning.analysis.drift import drift_command

    module = _grpo(qwen_like_small_dir, max_new_tokens=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, filename="last")
    _fit(module, 1, root=tmp_path, callbacks=[ckpt, HFExport(tmp_path / "export")])
    capsys.readouterr()

    exported = drift_command(str(tmp_path / "export"), base=qwen_like_small_dir, taus=[0.0], out_dir=str(tmp_path / "e"),
                             plot=False)
    err = capsys.readouterr().err
    assert "stores bfloat16 weights, without the fp32 masters" in err and "measure the run's .ckpt" in err
    assert len([line for line in err.splitlines() if line.startswith("warning")]) == 1
    measured = drift_command(str(tmp_path / "last.ckpt"), base=qwen_like_small_dir, taus=[0.0],
                             out_dir=str(tmp_path / "c"), plot=False)
    assert "warning" not in capsys.readouterr().err
    assert exported.sparsity(0.0) > 0.9 > 0.1 > measured.sparsity(0.0)  # the export shows almost none of the update


class _Constant(CountdownTask):
    """Every completion scores alike: z-scores are 0 and the ES update is exactly zero."""

    def reward(self, completions, examples):
        return [0.5] * len(completions)


def test_drift_of_a_bf16_true_run_of_an_fp32_model_starts_from_the_cast_weights(tiny_model_dir, tmp_path, capsys):
    """``precision: bf16-true`` with the model's default ``dtype: float32`` (configs/trainer/gpu.yaml on the built-in
    recipes): Lightning casts the fp32 base to bf16 and the masters start from there. An update of exactly zero is a
    drift of 0 in `analyze drift` of the .ckpt and of its HF export, and an ablation resets nothing that did not move;
    the base was read in float32, and the cast counted as an update (D_rel 1.6e-3, s_0 1e-5)."""
    from es_lightning import HFExport
    from es_lightning.analysis.ablation import ablation_command
    from es_lightning.analysis.drift import drift_command
    from es_lightning.analysis.settings import EvalSettings

    module = ESModule(model=tiny_model_dir, task=_Constant(), population_size=2, sigma=0.05, lr=ES_LR, max_new_tokens=2)
    ckpt = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, filename="last")
    trainer = _fit(module, 1, root=tmp_path, callbacks=[ckpt, HFExport(tmp_path / "export")], precision="bf16-true")
    assert module.hparams.dtype == "float32" and next(module.model.parameters()).dtype == torch.bfloat16
    assert float(trainer.logged_metrics["train/update_norm"]) == 0.0 == float(trainer.logged_metrics["train/drift"])

    for tuned in (str(tmp_path / "last.ckpt"), str(tmp_path / "export")):
        report = drift_command(tuned, base=tiny_model_dir, taus=[0.0], out_dir=str(tmp_path / "drift"), plot=False)
        assert report.relative_drift == 0.0 and report.sparsity(0.0) == 1.0, tuned
    tiny = EvalSettings(num_problems=1, num_samples=1, max_new_tokens=1, temperature=0.0)
    rows = ablation_command(str(tmp_path / "last.ckpt"), taus=[1e-9], eval=tiny, out_dir=str(tmp_path / "ablation"),
                            plot=False, progress=False).rows
    assert [r["sparsity"] for r in rows] == [1.0, 1.0, 1.0]  # s_τ of the rows: no weight moved, at any τ


def test_eval_of_a_bf16_true_run_of_an_fp32_model_loads_every_model_in_bf16(tiny_model_dir, tmp_path, capsys):
    """The same run (bf16-true, ``dtype: float32``): its .ckpt and its export (beside the run's config.yaml) record
    bfloat16, the dtype the weights were trained in, so `eval` loads the base beside them in bf16 — it took the
    ``dtype`` hyperparameter, float32, and compared an fp32 base with the bf16-trained weights."""
    import yaml

    from es_lightning import HFExport
    from es_lightning.analysis import evaluate_models, evaluate_policy, heldout_problems
    from es_lightning.analysis.checkpoints import trained_with
    from es_lightning.analysis.settings import EvalSettings
    from es_lightning.policy import load_policy

    module = ESModule(model=tiny_model_dir, task=_Constant(), population_size=2, sigma=0.05, lr=ES_LR, max_new_tokens=2)
    run = tmp_path / "run"
    ckpt = ModelCheckpoint(dirpath=run / "checkpoints", every_n_train_steps=1, filename="last")
    _fit(module, 1, root=tmp_path, callbacks=[ckpt, HFExport(run / "export")], precision="bf16-true")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"init_args": {"model": tiny_model_dir, "dtype": "float32"}},
                                                     "trainer": {"precision": "bf16-true"}}))
    for spec in (run / "checkpoints" / "last.ckpt", run / "export"):
        assert trained_with(str(spec)).dtype == "bfloat16", spec
        settings = EvalSettings(num_problems=2, num_samples=2, max_new_tokens=3, temperature=1.0)
        report = evaluate_models([tiny_model_dir, str(spec)], labels=["base", "tuned"], settings=settings, progress=False)
        assert "every model in bfloat16" in capsys.readouterr().out
        problems = heldout_problems(get_task("countdown"), 2, 0)
        by_hand = evaluate_policy(load_policy(tiny_model_dir, dtype="bfloat16"), "countdown", problems, settings)
        assert report.results["base"]["countdown"] == by_hand, spec


# ---------------------------------------------------------------------------------------------------- resume, switch
@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_resume_restores_fp32_masters_bitwise(kind, tiny_model_dir, tmp_path):
    make = _es if kind == "es" else _grpo
    whole = make(tiny_model_dir)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "a", every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _fit(whole, 3, root=tmp_path / "a", callbacks=[ckpt])
    saved = torch.load(tmp_path / "a" / "step=2.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    assert {s["master"].dtype for s in saved.values() if "master" in s} == {torch.float32}
    resumed = make(tiny_model_dir)
    trainer = _fit(resumed, 3, root=tmp_path / "b", ckpt_path=str(tmp_path / "a" / "step=2.ckpt"))
    assert trainer.global_step == 3
    a, b = _masters(whole), _masters(resumed)
    assert a.keys() == b.keys() == {n for n, _ in whole.model.named_parameters()}
    for (name, p), (_, q) in zip(whole.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q) and b[name].dtype == torch.float32 and torch.equal(a[name], b[name]), name
    assert any(not torch.equal(m, p.detach().float()) for m, (_, p) in zip(a.values(), whole.model.named_parameters()))


@pytest.mark.parametrize("order", ["grpo_es", "es_grpo"])
def test_switch_hands_the_master_over(order, model_dir):
    """At the switch the second stage's optimizer starts from the first stage's fp32 masters, bit for bit (not from
    the rounded weights); after it, the ES stage moved its master by exactly its intended update."""
    record = _Record()
    if order == "grpo_es":
        module = _grpo(model_dir)
        switch = SequentialStrategy(switch_step=1, es=dict(population_size=N, sigma=0.05, lr=ES_LR, temperature=1.0))
    else:
        module = _es(model_dir)
        switch = SequentialStrategy(switch_step=1, grpo=dict(group_size=2, lr=GRPO_LR, weight_decay=0.0))

    class _AfterFirstStage(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 1:
                self.masters = _masters(pl_module)
                self.weights = {n: p.detach().clone() for n, p in pl_module.model.named_parameters()}

    first = _AfterFirstStage()
    _fit(module, 2, callbacks=[first, switch, record])  # record after the switch: it sees the new optimizer
    kind, handed = record.masters_before[1]
    assert kind == ("ESOptimizer" if order == "grpo_es" else "MasterAdamW")
    assert handed.keys() == first.masters.keys() == set(first.weights)
    for name, m in handed.items():
        assert m.dtype == torch.float32 and torch.equal(m, first.masters[name]), name
    assert any(not torch.equal(m, first.weights[n].float()) for n, m in handed.items())  # sub-ulp bits were kept
    if order == "grpo_es":  # ES's step 1 moved the handed-over master by its own update only
        final = _masters(module)
        for name in (LINEAR, NORM):
            intended = torch.zeros(final[name].numel(), dtype=torch.float64)
            r = record.rewards[0]
            z = (r - r.mean()) / r.std(unbiased=False)
            for member in range(N):
                intended += float(z[member]) * param_noise(module.seed, 1, member, name, final[name].numel()).double()
            intended *= ES_LR / N
            applied = (final[name].double() - handed[name].double()).flatten()
            assert _cos(applied, intended) >= 0.9999, name


def test_hf_export_of_a_bf16_run_names_its_dtype_for_transformers_4_and_5(qwen_like_small_dir, tmp_path):
    """transformers 5 writes the weights' dtype as ``dtype`` alone; transformers 4 and older vLLM read ``torch_dtype``
    only and loaded a bf16 export in fp32. The export carries both, and transformers 5 still loads it in bf16."""
    import json

    from transformers import AutoModelForCausalLM

    from es_lightning import HFExport
    from es_lightning.policy import load_policy

    _fit(_es(qwen_like_small_dir, max_new_tokens=2), 1, root=tmp_path, callbacks=[HFExport(tmp_path / "export")])
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert next(load_policy(str(tmp_path / "export"), dtype=None).model.parameters()).dtype == torch.bfloat16
    for dtype in ("auto", None):  # transformers 5's default reads the file's dtype too
        kwargs = {"dtype": dtype} if dtype else {}
        assert AutoModelForCausalLM.from_pretrained(tmp_path / "export", **kwargs).dtype == torch.bfloat16


def test_float32_eval_of_a_bf16_checkpoint_evaluates_its_fp32_masters(qwen_like_small_dir, tmp_path, capsys):
    """`es-lightning eval --dtype float32` (and `analyze`) of a bf16 run's .ckpt evaluates the fp32 masters it holds —
    the values the optimizer updated, which a resume under 32-true takes as its weights — not the bf16 weights rounded
    from them (a GRPO step at lr 1e-6 sits almost wholly below half a bf16 ulp); in bf16 it is the weights."""
    from es_lightning.analysis import evaluate_models, evaluate_policy, heldout_problems
    from es_lightning.analysis.checkpoints import load_model
    from es_lightning.analysis.settings import EvalSettings
    from es_lightning.policy import load_policy

    module = _grpo(qwen_like_small_dir, max_new_tokens=2)
    _fit(module, 1, root=tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, filename="last")])
    spec = str(tmp_path / "last.ckpt")
    bf16 = load_model(spec, dtype="bfloat16")
    masters = bf16.masters
    assert masters and "fp32 masters" not in capsys.readouterr().out
    fp32 = load_model(spec, dtype="float32")
    params = dict(fp32.policy.model.named_parameters())
    assert all(torch.equal(params[n], m) for n, m in masters.items())
    assert "weights are the fp32 masters the optimizer updated" in capsys.readouterr().out
    rounded = dict(bf16.policy.model.named_parameters())
    assert any(not torch.equal(params[n], rounded[n].float()) for n in masters)

    settings = EvalSettings(num_problems=2, num_samples=2, max_new_tokens=3, temperature=1.0)
    report = evaluate_models([spec], labels=["tuned"], settings=settings, dtype="float32", progress=False)
    by_hand = load_policy(qwen_like_small_dir, dtype="float32")
    with torch.no_grad():
        for name, p in by_hand.model.named_parameters():
            p.copy_(masters.get(name, rounded[name]))
    problems = heldout_problems(get_task("countdown"), 2, 0)
    assert report.results["tuned"]["countdown"] == evaluate_policy(by_hand, "countdown", problems, settings)
