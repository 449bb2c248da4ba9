"""Lightning's precisions for every algorithm (issue 11, item 7), GRPO's memory knobs, and the precision settings a
fit refuses before any step (issue 11, "Bad input") — on real Trainers, the tiny HF model and the Qwen-like fixture.

The GPU trainer fragments (``configs/trainer/{gpu,ddp,fsdp,fsdp2,multinode_fsdp}.yaml``) use ``bf16-true``: the
module's parameters are converted to bf16 and bf16 is the default dtype inside steps. ``bf16-mixed`` keeps fp32
parameters and runs ``training_step`` — rollouts included — under bf16 autocast. Both run here on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

import es_lightning.grpo.algorithm as grpo_algorithm
from es_lightning import ESModule, GRPOModule, ReasoningDataModule, SequentialStrategy
from es_lightning.es.update import ESOptimizer
from es_lightning.precision import MasterAdamW
from es_lightning.tasks import CountdownTask


@pytest.fixture(params=["tiny_model_dir", "qwen_like_small_dir"], ids=["tiny", "qwen_like"])
def model_dir(request) -> str:
    return request.getfixturevalue(request.param)


class _CharSum(CountdownTask):
    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


ES = dict(population_size=4, sigma=0.05, lr=0.01, temperature=1.0)


def _module(kind, model_dir, **kw):
    if kind == "es":
        return ESModule(model=model_dir, task=_CharSum(), max_new_tokens=6, **ES, **kw)
    return GRPOModule(model=model_dir, task=_CharSum(), group_size=2, lr=1e-3, max_new_tokens=6, **kw)


def _dm(batch_size=2):
    return ReasoningDataModule(task="countdown", train_size=16, val_size=4, test_size=4, batch_size=batch_size, seed=0)


def _trainer(max_steps=1, callbacks=(), **kw):
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=list(callbacks), **kw)


# ---------------------------------------------------------------------------------------------------- item 7
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
@pytest.mark.parametrize("kind", ["es", "es_lowrank", "grpo", "grpo_es"])
def test_every_algorithm_trains_under_bf16_precisions(kind, precision, model_dir):
    """ES (full-rank, and low-rank with the whole population in one batch), GRPO and the GRPO→ES switch each take
    their steps: bf16-true trains bf16 weights through fp32 masters, bf16-mixed fp32 weights (no master) under
    autocast (low-rank members once crashed there)."""
    if kind == "es_lowrank":
        module = _module("es", model_dir, noise_rank=1, members_per_batch=ES["population_size"])
    else:
        module = _module("es" if kind == "es" else "grpo", model_dir)
    module.configure_model()
    before = {n: p.detach().float().clone() for n, p in module.model.named_parameters()}
    callbacks = [SequentialStrategy(switch_step=1, es=ES)] if kind == "grpo_es" else []
    steps = 2 if kind == "grpo_es" else 1
    trainer = _trainer(steps, callbacks, precision=precision)
    trainer.fit(module, _dm())
    assert trainer.global_step == steps and module.algorithm.name == ("grpo" if kind == "grpo" else "es")
    if kind != "grpo":
        assert module.algorithm.settings.noise_rank == (1 if kind == "es_lowrank" else 0)
    params = dict(module.model.named_parameters())
    true = precision == "bf16-true"
    assert all(p.dtype == (torch.bfloat16 if true else torch.float32) and torch.isfinite(p).all()
               for p in params.values())
    assert any(not torch.equal(p.float(), before[n]) for n, p in params.items()), "the steps moved the weights"
    opt = trainer.optimizers[0]
    assert isinstance(opt, ESOptimizer if kind != "grpo" else MasterAdamW)
    assert opt.master_dtype == (torch.float32 if true else None)
    if kind == "grpo":  # the fused AdamW kernel, except under a mixed precision (Lightning would refuse the clipping)
        assert opt.defaults["fused"] is (True if true else None)
        assert all(s["step"].device == p.device for p, s in opt.state.items()) and opt.state
    for p in params.values():
        has = p in opt.state and "master" in opt.state[p]
        assert has == true
        if has:
            assert opt.state[p]["master"].dtype == torch.float32 and torch.equal(p, opt.state[p]["master"].to(p.dtype))
    assert torch.isfinite(trainer.logged_metrics["train/reward_mean"])


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_64_true_trains_without_a_master(kind, tiny_model_dir):
    """precision: 64-true with the default master_dtype (float32): float64 weights are their own master (it was
    refused once, with a message that named the default as the fix)."""
    module = _module(kind, tiny_model_dir)
    module.configure_model()
    before = {n: p.detach().double().clone() for n, p in module.model.named_parameters()}
    trainer = _trainer(1, precision="64-true")
    trainer.fit(module, _dm())
    assert trainer.global_step == 1 and trainer.optimizers[0].master_dtype is None
    params = dict(module.model.named_parameters())
    assert all(p.dtype == torch.float64 and torch.isfinite(p).all() for p in params.values())
    assert any(not torch.equal(p, before[n]) for n, p in params.items())


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-mixed"])
def test_grpo_reference_takes_the_policys_dtype(precision, model_dir):
    """The KL reference (beta > 0) loads with the module's dtype (float32) and then takes the policy's as Lightning
    converted it: bf16 under bf16-true (half the memory, as TRL's reference), fp32 under bf16-mixed. Before any
    update the two are the same model, so the first step's KL is exactly 0."""
    module = _module("grpo", model_dir, beta=0.1)
    trainer = _trainer(1, precision=precision)
    trainer.fit(module, _dm())
    ref = module.algorithm.reference_model(module)
    want = torch.bfloat16 if precision == "bf16-true" else torch.float32
    assert all(p.dtype == want for p in ref.parameters())
    assert float(trainer.logged_metrics["train/kl"]) == 0.0


class _StateAtFirstStep(L.Callback):
    """What the first step of a fit starts from: each parameter's master where it has one, else the weight."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not hasattr(self, "state"):
            opt = trainer.optimizers[0]
            self.state = {n: (opt.state[p]["master"] if "master" in opt.state.get(p, {}) else p).detach().double().clone()
                          for n, p in pl_module.model.named_parameters()}


@pytest.mark.parametrize("saved, resumed", [("32-true", "bf16-true"), ("bf16-true", "32-true")])
@pytest.mark.parametrize("kind", ["es_lowrank", "grpo"])
def test_resuming_under_another_precision_keeps_the_most_precise_state(kind, saved, resumed, model_dir, tmp_path):
    """A 32-true checkpoint resumed under bf16-true: the masters start from the checkpoint's fp32 weights, not from
    their bf16 rounding; a bf16-true checkpoint resumed under 32-true: the weights take the saved fp32 masters. Either
    way the next step starts from exactly the state the last one left (it lost up to 4e-3 once, without a word)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def make():
        if kind == "grpo":
            return _module("grpo", model_dir)
        return _module("es", model_dir, noise_rank=1, members_per_batch=ES["population_size"])

    first, then = _StateAtFirstStep(), _StateAtFirstStep()
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="{step}", save_top_k=-1, every_n_train_steps=1)
    L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, limit_val_batches=0, enable_progress_bar=False,
              enable_model_summary=False, callbacks=[ckpt], precision=saved, default_root_dir=tmp_path).fit(make(), _dm())
    left = _trainer(2, [first], precision=saved)  # the state the saved run's second step starts from
    left.fit(make(), _dm(), ckpt_path=str(tmp_path / "step=1.ckpt"))
    _trainer(2, [then], precision=resumed).fit(make(), _dm(), ckpt_path=str(tmp_path / "step=1.ckpt"))
    rounded = {n: t.to(torch.bfloat16).double() for n, t in first.state.items()}
    assert any(not torch.equal(rounded[n], first.state[n]) for n in first.state)  # bits below bf16 exist to lose
    for name, value in first.state.items():
        assert torch.equal(then.state[name], value), name


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_rollout_logprobs_equal_the_training_forward(precision, model_dir, monkeypatch):
    """π_old (recorded while sampling) against the first pass's training forward of the same weights: equal to 1e-5 in
    fp32; under bf16 within what bf16 logits allow (both run in bf16 — bf16-mixed autocasts the rollout and the
    loss alike — but a KV-cached decode and a full forward round differently): |Δ log p| <= 0.1 per token, <= 0.01 on
    average, and no token's ratio outside GRPO's clip range [0.8, 1.2]. Measured: max 0.053 / mean 0.0034 (tiny,
    bf16-true), 0.033 / 0.0006 (tiny, bf16-mixed), 0.0019 / 0.00014 (Qwen-like); fp32 3.8e-6."""
    seen = []
    real = grpo_algorithm.completion_logprobs

    def recording(model, rollout, rows, temperature, **kw):  # the real function, its inputs and outputs kept
        out = real(model, rollout, rows, temperature, **kw)
        if torch.is_grad_enabled():
            seen.append((out[0].detach().float(), rollout.logprobs[rows].float(), rollout.completion_mask[rows].bool(),
                         torch.is_autocast_enabled("cpu")))
        return out

    monkeypatch.setattr(grpo_algorithm, "completion_logprobs", recording)
    module = GRPOModule(model=model_dir, task=_CharSum(), group_size=4, lr=1e-6, max_new_tokens=16)
    _trainer(1, precision=precision).fit(module, _dm(batch_size=4))
    logps, old, mask, autocast = seen[0]
    assert autocast == (precision == "bf16-mixed")
    gap = (logps - old)[mask]
    assert int(mask.sum()) >= 32
    if precision == "32-true":
        assert float(gap.abs().max()) < 1e-5
        return
    assert float(gap.abs().max()) <= 0.1 and float(gap.abs().mean()) <= 0.01, (gap.abs().max(), gap.abs().mean())
    ratio = gap.exp()
    assert bool(((ratio >= 0.8) & (ratio <= 1.2)).all())


# ---------------------------------------------------------------------------------------------------- memory knobs
class _Grads(L.Callback):
    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.grads = {n: p.grad.detach().clone() for n, p in pl_module.model.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_and_chunk_size_change_memory_not_gradients(model_dir):
    """The same step with activation checkpointing and a 3-token log-prob chunk: the layers really recompute
    (HF's flag is set in training), and the gradients equal those of the plain step (fp32)."""
    grads = []
    for kw in ({"share_prompt_prefix": False},
               {"share_prompt_prefix": False, "gradient_checkpointing": True, "logprob_chunk_size": 3}):
        module = _module("grpo", model_dir, mini_batch_size=2, **kw)
        record = _Grads()
        _trainer(1, [record]).fit(module, _dm())
        layers = [m for m in module.model.modules() if hasattr(m, "gradient_checkpointing")]
        assert layers and all(m.gradient_checkpointing == kw.get("gradient_checkpointing", False) for m in layers)
        grads.append(record.grads)
    plain, checkpointed = grads
    assert plain.keys() == checkpointed.keys()
    for name in plain:
        assert torch.allclose(plain[name], checkpointed[name], rtol=1e-4, atol=1e-7), name
    assert any(float(g.abs().max()) > 0 for g in plain.values())


def test_gradient_checkpointing_with_a_shared_prompt_prefix_is_refused_at_construction(tiny_model_dir):
    with pytest.raises(ValueError, match="share_prompt_prefix: false") as err:
        GRPOModule(model=tiny_model_dir, gradient_checkpointing=True)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="logprob_chunk_size must be >= 1"):
        GRPOModule(model=tiny_model_dir, logprob_chunk_size=0)


# ---------------------------------------------------------------------------------------------------- bad input
class _NoStep(L.Callback):
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        raise AssertionError("a training step started")


def _refused(module, match, precision="32-true", callbacks=(), batch_size=2):
    generated = []
    generator = module.generator

    class _Spy:  # the real generator, noting whether anything generated
        def generate(self, *args, **kwargs):
            generated.append(1)
            return generator.generate(*args, **kwargs)

    module._generator = _Spy()
    trainer = _trainer(1, [*callbacks, _NoStep()], precision=precision)
    with pytest.raises(ValueError, match=match) as err:
        trainer.fit(module, _dm(batch_size))
    assert "\n" not in str(err.value) and trainer.global_step == 0 and not generated
    return str(err.value)


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_a_dtype_the_device_cannot_run_is_refused_before_any_step(kind, tiny_model_dir):
    # from a script the fix is the Python calls (the command's form, recipe keys: the test below)
    cls = "ESModule" if kind == "es" else "GRPOModule"
    _refused(_module(kind, tiny_model_dir, dtype="float16"),
             rf"use {cls}\(dtype='bfloat16'\) with Trainer\(precision='bf16-true'\), or {cls}\(dtype='float32'\) with "
             r"Trainer\(precision='32-true'\)$")
    # the trainer's precision made the weights float16, not the module's dtype: the message names the precision
    # from a script it speaks in Trainer(...) calls (the command's form, `trainer.precision`: tests/test_cli_errors.py)
    _refused(_module(kind, tiny_model_dir), r"^Trainer\(precision='16-true'\) computes in float16: .* use "
             r"Trainer\(precision='bf16-true'\) or Trainer\(precision='32-true'\)$", precision="16-true")


def test_the_command_refuses_a_dtype_the_device_cannot_run_in_its_recipe_keys(capsys, tmp_path, monkeypatch):
    """Inside the `es-lightning` command the dtype refusal names the recipe's keys (a script's: the Python calls,
    above) — and once the command has ended, a script in the same process is spoken to in Python again."""
    from es_lightning.cli import cli_main

    monkeypatch.chdir(tmp_path)  # whatever the command writes
    with pytest.raises(SystemExit) as stop:
        cli_main(["fit", "--config", str(Path(__file__).parents[1] / "recipes" / "es.yaml"), "--model.init_args.dtype",
                  "float16", "--trainer.max_steps", "1", "--trainer.enable_checkpointing", "false", "--trainer.logger",
                  "false", "--data.init_args.train_size", "4", "--data.init_args.val_size", "2",
                  "--data.init_args.test_size", "2"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and err.startswith("es-lightning: error: --model.init_args.dtype: float16 weights on a CPU")
    assert err.endswith("use dtype: bfloat16 with trainer.precision: bf16-true, or dtype: float32 with "
                        "trainer.precision: 32-true") and "ESModule(" not in err
    _refused(ESModule(model="builtin:countdown-tiny", dtype="float16", max_new_tokens=2, **ES),
             r"use ESModule\(dtype='bfloat16'\) with Trainer\(precision='bf16-true'\)")


def test_a_script_that_ran_the_command_in_process_is_spoken_to_in_python_again(tiny_model_dir, capsys):
    """The command's context (its argv, read to speak `trainer.precision` instead of `Trainer(precision=...)`) ends
    with the command: a script (or a test session) that ran `cli_main` and then builds its own Trainer is told the
    fix in Python. It leaked, so the refusal below spoke the command's option after any in-process command."""
    from es_lightning.cli import cli_main

    with pytest.raises(SystemExit) as stop:  # an in-process command that ends in a mistake's one line
        cli_main(["fit", "--trainer.no_such_option", "1"])
    assert stop.value.code == 2 and "no_such_option" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # and one that ends normally (--print_config exits with status 0)
        cli_main(["fit", "--print_config"])
    assert stop.value.code in (0, None)
    capsys.readouterr()
    _refused(_module("es", tiny_model_dir), r"^Trainer\(precision='16-true'\) computes in float16", precision="16-true")


@pytest.mark.parametrize("kind", ["es", "grpo"])
def test_a_master_dtype_below_the_model_is_refused(kind, tiny_model_dir):
    with pytest.raises(ValueError, match="master_dtype: float32") as err:
        _module(kind, tiny_model_dir, master_dtype="bfloat16")  # dtype float32: refused when built
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown master_dtype"):
        _module(kind, tiny_model_dir, master_dtype="fp8")
    # dtype: auto loads the tiny model's fp32 weights: known only at setup, refused there
    _refused(_module(kind, tiny_model_dir, dtype="auto", master_dtype="bfloat16"), "master_dtype: float32")
    _module(kind, tiny_model_dir, dtype="bfloat16", master_dtype="bfloat16")  # equal to the model's: no master, fine


def test_a_grpo_mini_batch_that_cannot_split_the_batch_is_refused_at_setup(tiny_model_dir):
    message = _refused(_module("grpo", tiny_model_dir, mini_batch_size=3), "does not divide the 4 completions")
    assert "mini_batch_size: 2" in message and "data.batch_size 2 × group_size 2" in message
    # a second GRPO stage is checked when the fit starts, not at the switch
    _refused(_module("es", tiny_model_dir), "mini_batch_size: 2",
             callbacks=[SequentialStrategy(switch_step=5, grpo=dict(group_size=2, mini_batch_size=3))])
    for ok in (1, 2, 4, 64):  # divisors of 4, or all at once
        module = _module("grpo", tiny_model_dir, mini_batch_size=ok)
        module.algorithm.check_batch(2)
