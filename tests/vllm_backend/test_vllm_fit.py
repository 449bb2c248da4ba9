"""`es-lightning fit` of the shipped recipes with ``generation_backend: vllm`` (configs/generation/vllm.yaml stacked on
the recipe, sizes shrunk on the command line), 2 steps each, run in this process through the CLI class the console
script runs — and checked against the HF backend where the two must agree.

- ES, greedy: HF, vLLM engine-side and vLLM pushed give the same rewards and the same weights, bit for bit; the
  engine's copy of θ equals the policy's after the updates.
- ES, sampled: engine-side and pushed give the same rewards and weights (the same engine, seeds and common random
  numbers). Against HF they differ: both samplers are exact, seeded and batch-independent, but HF draws Gumbel noise
  from a ``torch.Generator`` per call while vLLM draws from a generator per request — different random streams.
- GRPO: for the same reason its rollouts differ from HF's at the same seeds; what must hold is that every rollout comes
  from the weights of the current step (a push after each optimizer step), checked before every step.
- GRPO → ES: the switch re-sets the engine's ES centre from GRPO's weights; a full-rank ES stage that batches members
  is refused before the fit trains.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml

pytest.importorskip("vllm")

from es_lightning.generation import SamplingParams  # noqa: E402
from es_lightning.generation.vllm import policy_token_stats  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VLLM = ["--config", str(ROOT / "configs" / "generation" / "vllm.yaml"),
        "--model.init_args.generation_options.max_model_len", "96",
        "--model.init_args.generation_options.cpu_kv_cache_gib", "0.0625",
        "--model.init_args.generation_options.max_num_seqs", "64"]
SMALL = ["--trainer.max_steps", "2", "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
         "--data.init_args.val_size", "4", "--data.init_args.val_batch_size", "4",
         "--model.init_args.max_new_tokens", "8"]


def _recipe(tmp_path: Path, name: str, **stage) -> str:
    """recipes/<name> with its callbacks' evaluations shrunk and their outputs under tmp_path (list entries cannot be
    changed from the command line); ``stage``: SequentialStrategy's ES settings to change."""
    cfg = yaml.safe_load((ROOT / "recipes" / name).read_text())
    for cb in cfg["trainer"].get("callbacks", []):
        args = cb.setdefault("init_args", {})
        kind = cb["class_path"].rsplit(".", 1)[-1]
        if kind == "PassAtKCallback":
            args.update(num_samples=4, ks=[1, 4])
            args.pop("num_problems", None)
            args.pop("batch_size", None)
        elif kind == "SequentialStrategy":
            args["switch_step"] = 1
            args["es"].update(stage)
        elif kind == "HFExport":
            args["dirpath"] = str(tmp_path / "export")
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return str(path)


@pytest.fixture
def fit(keep_alive):
    """``fit(recipe, *args)`` runs ``es-lightning fit --config <recipe> <args>`` and returns (module, trainer); the
    module (and its engine) lives until the session ends (see ``keep_alive``)."""
    from es_lightning.lightning_cli import ESLightningCLI

    def run(recipe: str, *args: str):
        root = str(Path(recipe).parent)  # the saved config.yaml and any checkpoint land next to the recipe's copy
        cli = ESLightningCLI(args=["fit", "--config", recipe, *args, "--trainer.default_root_dir", root])
        keep_alive.append(cli.model)
        return cli.model, cli.trainer

    return run


def _weights(module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.model.named_parameters()}


def _moved(weights: dict[str, torch.Tensor]) -> bool:
    """Whether the fit changed the built-in model's weights."""
    from es_lightning.policy import load_policy

    base = dict(load_policy("builtin:countdown-tiny").model.named_parameters())
    return any(not torch.equal(base[n].detach(), w) for n, w in weights.items())


def _engine_matches_policy(module) -> None:
    """The engine's next rollout comes from the policy's weights: greedy log-probs equal the policy's forward."""
    gen = module.generator
    prompts = module.prompts([{"nums": [3, 5, 7], "target": 22}, {"nums": [2, 9, 4], "target": 14}])
    rollout = gen.generate(prompts, 1, SamplingParams(max_new_tokens=6, temperature=0.0), return_logprobs=True)
    forward, _ = policy_token_stats(module.model, rollout, 1.0)
    assert (rollout.logprobs - forward).abs().max() < 1e-5


ES_SMALL = [*SMALL, "--model.init_args.population_size", "4", "--model.init_args.members_per_batch", "1",
            "--data.init_args.batch_size", "4"]


def test_es_recipe_greedy_vllm_equals_hf(tmp_path, fit):
    """recipes/es.yaml greedy, 2 steps: the HF backend, vLLM engine-side and vLLM pushed agree bit for bit."""
    recipe = _recipe(tmp_path, "es.yaml")
    greedy = [*ES_SMALL, "--model.init_args.temperature", "0", "--model.init_args.samples_per_member", "1",
              "--model.init_args.sigma", "0.02", "--data.init_args.batch_size", "8"]  # members that score differently
    runs = {}
    for name, extra in (("hf", []), ("engine", VLLM),
                        ("push", [*VLLM, "--model.init_args.generation_options.engine_side_es", "false"])):
        module, trainer = fit(recipe, *greedy, *extra)
        assert trainer.global_step == 2
        runs[name] = (module, module.last_rewards.clone(), _weights(module))
    hf, engine, push = runs["hf"], runs["engine"], runs["push"]
    assert type(engine[0].algorithm.evaluator).__name__ == "VLLMEngineEvaluator"
    assert type(push[0].algorithm.evaluator).__name__ == "VLLMPushEvaluator"
    assert hf[1].std() > 0  # the members scored differently: the update moved the weights
    for run in (engine, push):
        assert torch.equal(run[1], hf[1])
        assert all(torch.equal(run[2][n], hf[2][n]) for n in hf[2])
    assert _moved(hf[2])
    master = engine[0].generator.engine_worker._es_master  # the engine's copy of θ followed both updates
    assert all(torch.equal(master[n], engine[2][n]) for n in master)
    for module, _, _ in (engine, push):
        _engine_matches_policy(module)


def test_es_recipe_sampled_engine_side_equals_pushed(tmp_path, fit):
    """recipes/es.yaml as shipped samples (T=1, 2 completions per prompt, common random numbers): engine-side and
    pushed members give the same rewards and weights."""
    recipe = _recipe(tmp_path, "es.yaml")
    a_module, _ = fit(recipe, *ES_SMALL, *VLLM)
    b_module, _ = fit(recipe, *ES_SMALL, *VLLM, "--model.init_args.generation_options.engine_side_es", "false")
    assert a_module.sampling.temperature == 1.0 and a_module.algorithm.settings.samples_per_member == 2
    assert torch.equal(a_module.last_rewards, b_module.last_rewards)
    # the members' token entropy is measured where the policy holds the member (pushed), not of the engine-side
    # member (the policy's forward holds the centre there: it logged the centre's entropy)
    assert "train/entropy" in b_module.trainer.logged_metrics
    assert "train/entropy" not in a_module.trainer.logged_metrics
    a, b = _weights(a_module), _weights(b_module)
    assert all(torch.equal(a[n], b[n]) for n in a)


class _EngineFollowsPolicy(L.Callback):
    """Before each training step after the first: the engine generates from the policy's current weights."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step > 0:
            _engine_matches_policy(pl_module)
            self.checked += 1


def test_grpo_recipe_pushes_after_each_optimizer_step(tmp_path, keep_alive):
    """recipes/grpo.yaml, 3 optimizer steps on vLLM: each rollout after the first step comes from the updated weights."""
    from es_lightning.lightning_cli import ESLightningCLI

    check = _EngineFollowsPolicy()
    at = VLLM.index("--model.init_args.generation_options.max_model_len")
    fragment = VLLM[:at] + VLLM[at + 2:]  # the fragment's own max_model_len
    args = ["--config", _recipe(tmp_path, "grpo.yaml"), *SMALL, *fragment, "--trainer.max_steps", "3",
            "--trainer.default_root_dir", str(tmp_path),
            "--data.init_args.batch_size", "2", "--model.init_args.group_size", "4"]
    cli = ESLightningCLI(args=args, run=False)  # `es-lightning fit`, with a checking callback added
    keep_alive.append(cli.model)
    cli.trainer.callbacks.append(check)
    # the fragment's max_model_len 2048 is beyond the built-in model's 128 positions (vLLM refused it): capped
    with pytest.warns(UserWarning, match=r"max_model_len=2048 is beyond the model's max_position_embeddings \(128\)"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.model.generator.max_model_len == 128
    assert cli.trainer.global_step == 3 and check.checked == 2
    assert _moved(_weights(cli.model))
    metrics = cli.trainer.logged_metrics
    assert torch.isfinite(metrics["train/grad_norm"]) and float(metrics["train/clip_ratio/region_mean"]) == 0.0


def test_grpo_es_recipe_switches_on_vllm(tmp_path, fit):
    """recipes/grpo_es.yaml (GRPO 1 step → ES 1 step) on vLLM: the ES stage takes its engine centre from GRPO's
    weights; the report and export are written."""
    recipe = _recipe(tmp_path, "grpo_es.yaml", population_size=4, members_per_batch=1)
    module, trainer = fit(recipe, *SMALL, *VLLM, "--data.init_args.batch_size", "2", "--model.init_args.group_size", "4",
                          "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                          "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"))
    assert trainer.global_step == 2 and module.algorithm.name == "es"
    assert type(module.algorithm.evaluator).__name__ == "VLLMEngineEvaluator"
    master = module.generator.engine_worker._es_master
    assert all(torch.equal(master[n], p.detach()) for n, p in module.model.named_parameters())
    _engine_matches_policy(module)
    assert (tmp_path / "export" / "config.json").exists()


def test_batched_full_rank_members_refused_before_training(tmp_path, fit):
    """members_per_batch > 1 with full-rank noise on vLLM: refused when the module is built (ESModule) or when the fit
    is set up (a SequentialStrategy ES stage), before anything trains."""
    with pytest.raises(ValueError, match=r"members_per_batch=32 with full-rank noise cannot run on vLLM.*noise_rank > 0"):
        fit(_recipe(tmp_path, "es.yaml"), *SMALL, *VLLM)
    with pytest.raises(ValueError, match=r"members_per_batch=32 with full-rank noise cannot run on vLLM"):
        fit(_recipe(tmp_path, "grpo_es.yaml"), *SMALL, *VLLM, "--data.init_args.batch_size", "2")


def test_a_lowrank_es_stage_lora_cannot_cover_is_refused_before_the_grpo_stage(tmp_path, keep_alive):
    """A GRPO → low-rank ES fit on vLLM whose ES stage perturbs what LoRA cannot (the default trainable: embeddings,
    norms) was refused at the switch, after GRPO had trained; now at fit start."""
    from es_lightning.lightning_cli import ESLightningCLI

    recipe = _recipe(tmp_path, "grpo_es.yaml", population_size=4, members_per_batch=4, noise_rank=1)
    cli = ESLightningCLI(args=["--config", recipe, *SMALL, *VLLM, "--data.init_args.batch_size", "2",
                               "--model.init_args.group_size", "4", "--trainer.default_root_dir", str(tmp_path)],
                         run=False)
    keep_alive.append(cli.model)
    with pytest.raises(ValueError, match="perturbs the transformer blocks' linear layers only"):
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 0 and cli.model.algorithm.name == "grpo"


@pytest.mark.parametrize("option, value, match", [
    ("max_model_length", "9", r"unknown vLLM generation_options \['max_model_length'\]; accepted: \['max_model_len'"),
    ("max_num_seqs", "0", r"generation_options.max_num_seqs must be a whole number >= 1, got 0"),  # was: "max_num_batched_tokens"
    ("gpu_memory_utilization", "1.5", r"generation_options.gpu_memory_utilization .* in \(0, 1\], got 1.5"),
    ("dtype", "float64", r"generation_options.dtype must be one of \['auto', 'bfloat16'"),
    # engine settings correctness depends on were overridden silently
    ("logprobs_mode", "raw_logprobs", r"generation_options.logprobs_mode is set by es-lightning .* sampling temperature"),
    ("generation_config", "auto", r"generation_options.generation_config is set by es-lightning .* must not leak"),
])
def test_bad_generation_option_refused_at_construction(tmp_path, fit, option, value, match):
    with pytest.raises(ValueError, match=match):
        fit(_recipe(tmp_path, "grpo.yaml"), *SMALL, *VLLM, f"--model.init_args.generation_options.{option}", value)


def test_a_cpu_kv_cache_too_small_names_its_option(tmp_path, fit):
    """vLLM's advice ("increase gpu_memory_utilization") does nothing on a CPU, where the cache is cpu_kv_cache_gib."""
    with pytest.raises(ValueError, match=r"generation_options.cpu_kv_cache_gib=1e-05 holds no KV-cache block"):
        fit(_recipe(tmp_path, "grpo.yaml"), *SMALL, *VLLM, "--model.init_args.generation_options.cpu_kv_cache_gib",
            "0.00001")


def test_a_cpu_kv_cache_larger_than_the_host_names_its_option(tmp_path, fit):
    """A KV cache asked larger than the host's free memory: vLLM's refusal named its own flags (--kv-cache-memory-bytes,
    VLLM_CPU_KVCACHE_SPACE) under "vLLM cannot load this model"; the line names the option that set it."""
    with pytest.raises(ValueError, match=r"^the vLLM engine cannot get the memory it was set to take \(Available memory "
                       r"on node \d+ .*\): it takes generation_options.cpu_kv_cache_gib=2000 of host memory for its KV "
                       r"cache; lower that$"):
        fit(_recipe(tmp_path, "grpo.yaml"), *SMALL, *VLLM, "--model.init_args.generation_options.cpu_kv_cache_gib",
            "2000")


def test_bf16_engine_side_keeps_the_trainers_master(es_fit):
    """bf16 policy, fp32 master in the ES optimizer (master_dtype float32): after 3 updates the engine's copy of θ is
    the trainer's fp32 master bit for bit and the engine's weights are the policy's bf16 weights (= bf16(master));
    engine-side and pushed members give the same rewards and weights."""
    options = dict(max_model_len=96, cpu_kv_cache_gib=0.0625, max_num_seqs=64)
    engine, trainer = es_fit(3, dtype="bfloat16", generation_backend="vllm", generation_options=options)
    push, _ = es_fit(3, dtype="bfloat16", generation_backend="vllm",
                      generation_options={**options, "engine_side_es": False})
    opt = trainer.optimizers[0]
    named = dict(engine.model.named_parameters())
    assert all(p.dtype == torch.bfloat16 and opt.has_master(p) for p in named.values())
    master = engine.generator.engine_worker._es_master
    assert all(master[n].dtype == torch.float32 and torch.equal(master[n], opt.state[p]["master"]) for n, p in named.items())
    assert sum(int((opt.state[p]["master"].to(torch.bfloat16) != opt.state[p]["master"]).sum()) for p in named.values())
    assert torch.equal(engine.last_rewards, push.last_rewards)
    pushed = dict(push.model.named_parameters())
    assert all(torch.equal(p, pushed[n]) for n, p in named.items())
    engine_params = {n: p.detach().clone() for n, p in engine.generator.engine_model.named_parameters()}
    engine.generator.push_weights()  # the policy's bf16 weights, pushed: the engine's weights already were these
    assert all(torch.equal(engine_params[n], p) for n, p in engine.generator.engine_model.named_parameters())


def test_resumed_engine_side_fit_equals_the_uninterrupted_one(tmp_path, keep_alive):
    """bf16 + fp32 master, engine-side ES on vLLM: a fit resumed from its step-1 checkpoint ends with the same weights
    and master as the fit that ran 3 steps in one go — the new engine's centre is taken from the checkpoint's master
    (restored after the engine started), not from the bf16 weights."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from es_lightning import CountdownTask, ESModule, ReasoningDataModule

    def run(steps, ckpt_path=None, save=False):
        L.seed_everything(0, verbose=False)
        module = ESModule(population_size=4, sigma=0.02, lr=0.01, max_new_tokens=8, temperature=0.0, dtype="bfloat16",
                          generation_backend="vllm", generation_options=dict(max_model_len=96, cpu_kv_cache_gib=0.0625))
        keep_alive.append(module)
        callbacks = [ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)] if save else []
        trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=save, callbacks=callbacks,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                            num_sanity_val_steps=0)
        data = ReasoningDataModule(CountdownTask(prompt_format="compact"), train_size=16, val_size=2, test_size=2,
                                   batch_size=4)
        trainer.fit(module, data, ckpt_path=ckpt_path)
        opt = trainer.optimizers[0]
        engine = module.generator.engine_worker._es_master  # the engine's θ: the trainer's master, bitwise
        assert all(torch.equal(engine[n], opt.state[p]["master"]) for n, p in module.model.named_parameters())
        return {n: (p.detach().clone(), opt.state[p]["master"].clone()) for n, p in module.model.named_parameters()}

    whole = run(3, save=True)
    resumed = run(3, ckpt_path=str(next(tmp_path.glob("*step=1.ckpt"))))
    assert all(torch.equal(whole[n][0], resumed[n][0]) and torch.equal(whole[n][1], resumed[n][1]) for n in whole)


def _gsm8k(directory: Path) -> str:
    """train.jsonl / test.jsonl in openai/gsm8k's columns (``question``; ``answer`` ending in ``#### <n>``)."""
    import json

    directory.mkdir()
    for split, n in (("train", 8), ("test", 4)):
        with open(directory / f"{split}.jsonl", "w") as f:
            for i in range(n):
                a, b = 3 + i, 10 + 2 * i
                f.write(json.dumps({"question": f"Tom has {a} apples and buys {b} more. How many now?",
                                    "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}) + "\n")
    return str(directory)


def _qwen_recipe(name: str, tmp_path: Path, qwen_like_dir: str, *extra: str) -> list[str]:
    """``fit`` arguments for recipes/qwen2.5-1.5b-instruct/gsm8k/<name> + configs/generation/vllm.yaml — the GPU command
    of its header — on a CPU: the model pointed at the Qwen-like fixture (bf16 weights, fp32 masters, Qwen's chat
    template), local GSM8K, the recipe's callbacks and sizes shrunk."""
    recipe = ROOT / "recipes" / "qwen2.5-1.5b-instruct" / "gsm8k" / name
    cfg = yaml.safe_load(recipe.read_text())
    for cb in cfg["trainer"]["callbacks"]:
        args = cb.setdefault("init_args", {}) or {}
        kind = cb["class_path"].rsplit(".", 1)[-1]
        if kind == "PassAtKCallback":
            args.update(num_samples=2, ks=[1, 2], max_new_tokens=8, batch_size=2, every_n_train_steps=2)
        elif kind == "SequentialStrategy":
            args.update(switch_step=1)
            args["es"]["population_size"] = 2
    shrunk = tmp_path / name
    shrunk.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return [str(shrunk), "--config", str(ROOT / "configs" / "generation" / "vllm.yaml"),
            "--model.init_args.generation_options.max_model_len", "512",
            "--model.init_args.generation_options.cpu_kv_cache_gib", "0.0625",
            "--model.init_args.model", qwen_like_dir, "--model.init_args.max_new_tokens", "8", *extra,
            "--data.init_args.source", _gsm8k(tmp_path / "gsm8k"), "--data.init_args.val_size", "2",
            "--data.init_args.test_size", "2", "--data.init_args.batch_size", "2",
            "--data.init_args.val_batch_size", "2", "--trainer.max_steps", "2",
            "--trainer.logger.init_args.save_dir", str(tmp_path / "logs")]


def test_qwen_grpo_es_recipe_with_the_vllm_fragment(tmp_path, fit, qwen_like_dir):
    """recipes/qwen2.5-1.5b-instruct/gsm8k/grpo_es.yaml with the vLLM fragment on the Qwen-like fixture: GRPO then ES,
    both generating through the engine, the switch re-setting the engine's ES centre."""
    module, trainer = fit(*_qwen_recipe("grpo_es.yaml", tmp_path, qwen_like_dir, "--model.init_args.group_size", "2",
                                        "--model.init_args.mini_batch_size", "2"))
    assert trainer.global_step == 2 and module.algorithm.name == "es" and module.generation_backend == "vllm"
    assert next(module.model.parameters()).dtype == torch.bfloat16
    assert type(module.algorithm.evaluator).__name__ == "VLLMEngineEvaluator"
    opt = trainer.optimizers[0]
    master = module.generator.engine_worker._es_master  # the ES stage's engine centre: the trainer's fp32 masters
    assert all(torch.equal(master[n], opt.state[p]["master"]) for n, p in module.model.named_parameters())
    import csv

    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    assert any(r.get("val/pass@1") for r in rows)  # the recipe's Pass@K evaluation ran through the engine
    assert [float(r["train/stage"]) for r in rows if r.get("train/reward_mean")] == [0.0, 1.0]


ENGINE_PROBE = """
import json
import os
import lightning as L

import torch
from es_lightning.generation import SamplingParams
from es_lightning.generation.vllm import policy_token_stats

def say(tag, payload):
    # both ranks share one stdout pipe: one write() per line keeps their lines whole (print may write the text and
    # its newline apart, and a line of the other rank can land between them)
    os.write(1, (tag + " " + json.dumps(payload) + "\\n").encode())

class EngineProbe(L.Callback):
    def on_train_end(self, trainer, pl_module):
        gen = pl_module.generator
        config = gen.llm.llm_engine.vllm_config.parallel_config
        say("ENGINE", [trainer.global_rank, config.distributed_executor_backend, gen.engine_worker.rank, trainer.world_size])
        # the engine generates from this rank's policy weights (greedy log-probs = the policy's forward), and the
        # ranks' weights agree (a checksum per rank)
        prompts = pl_module.prompts([{"nums": [3, 5, 7], "target": 22}, {"nums": [2, 9, 4], "target": 14}])
        rollout = gen.generate(prompts, 1, SamplingParams(max_new_tokens=6, temperature=0.0), return_logprobs=True)
        forward, _ = policy_token_stats(pl_module.model, rollout, 1.0)
        gap = float((rollout.logprobs - forward).abs().max())
        total = sum(float(p.detach().double().sum()) for p in pl_module.model.parameters())
        say("WEIGHTS", [trainer.global_rank, gap < 1e-5, total])
"""


def _probed(stdout: str, tag: str) -> list:
    # found anywhere in a line: the other rank's output (a progress bar, a log line without its newline) may precede it
    return sorted(json.loads(found) for found in re.findall(tag + r" (\[[^\[\]]*\])", stdout))


def test_ddp_two_processes_equal_one(tmp_path, fit):
    """recipes/es.yaml on vLLM under DDP (2 CPU processes, gloo, an engine each, members split across ranks; each
    engine applies the same update from seeds) ends with the weights of the 1-process run, bit for bit."""
    import os
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    recipe = _recipe(tmp_path, "es.yaml")
    args = [*ES_SMALL, *VLLM, "--model.init_args.temperature", "0", "--model.init_args.samples_per_member", "1",
            "--model.init_args.sigma", "0.02", "--data.init_args.batch_size", "8", "--trainer.callbacks", "null"]
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "callbacks": [
        {"class_path": "es_lightning.HFExport", "init_args": {"dirpath": str(tmp_path / "export")}},
        {"class_path": "engine_probe.EngineProbe"}]}}))
    (tmp_path / "engine_probe.py").write_text(ENGINE_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-m", "es_lightning.cli", "fit", "--config", recipe, *args, "--config", str(ddp),
                           "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
                           "--trainer.logger.init_args.save_dir", str(tmp_path / "logs"),
                           "--trainer.default_root_dir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "MEMBER: 2/2" in proc.stdout + proc.stderr, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # the engines shut down before the trainer's group
    # each rank's engine is its own worker of vLLM's external launcher: worker rank = trainer rank (the in-process
    # executor made every engine worker 0 on device index 0 — on CUDA, every rank's engine on the first GPU)
    assert _probed(proc.stdout, "ENGINE") == [[r, "external_launcher", r, 2] for r in range(2)], proc.stdout[-2000:]
    module, _ = fit(recipe, *args)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").state_dict()
    weights = _weights(module)
    assert _moved(weights) and all(torch.equal(exported[n], weights[n]) for n in weights)


def test_grpo_ddp_two_processes_on_vllm(tmp_path):
    """recipes/grpo.yaml on vLLM under DDP (2 CPU processes, gloo, an engine per rank): both steps run, each rank's
    engine is its own external-launcher worker and generates from its rank's weights after the last step, and the
    ranks' weights agree."""
    import os
    import subprocess
    import sys

    recipe = _recipe(tmp_path, "grpo.yaml")
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "callbacks": [
        {"class_path": "engine_probe.EngineProbe"}]}}))
    (tmp_path / "engine_probe.py").write_text(ENGINE_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-m", "es_lightning.cli", "fit", "--config", recipe, *SMALL, *VLLM,
                           "--model.init_args.group_size", "4", "--data.init_args.batch_size", "2",
                           "--config", str(ddp), "--trainer.default_root_dir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert _probed(proc.stdout, "ENGINE") == [[r, "external_launcher", r, 2] for r in range(2)], proc.stdout[-2000:]
    weights = _probed(proc.stdout, "WEIGHTS")
    assert [w[:2] for w in weights] == [[0, True], [1, True]] and weights[0][2] == weights[1][2], weights


def test_qwen_lowrank_recipe_with_the_vllm_command_of_its_header(tmp_path, fit, qwen_like_dir):
    """recipes/qwen2.5-1.5b-instruct/gsm8k/es_lowrank.yaml with its header's vLLM options (the whole population per
    engine call, the blocks' linear layers perturbed) on the Qwen-like fixture: two steps of low-rank members as LoRA
    adapters through the engine, and the recipe's Pass@K evaluation."""
    import csv

    pattern = r"\.(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)\.weight$"
    header = (ROOT / "recipes" / "qwen2.5-1.5b-instruct" / "gsm8k" / "es_lowrank.yaml").read_text()
    assert f"--model.init_args.trainable '{pattern}'" in header and "--model.init_args.members_per_batch 32" in header
    module, trainer = fit(*_qwen_recipe("es_lowrank.yaml", tmp_path, qwen_like_dir, "--model.init_args.population_size",
                                        "2", "--model.init_args.members_per_batch", "32",
                                        "--model.init_args.trainable", pattern))
    assert trainer.global_step == 2 and module.generation_backend == "vllm" and module.algorithm.settings.noise_rank == 1
    assert type(module.algorithm.evaluator).__name__ == "VLLMLowRankEvaluator"
    assert next(module.model.parameters()).dtype == torch.bfloat16
    rows = list(csv.DictReader(open(next((tmp_path / "logs").rglob("metrics.csv")))))
    assert len([r for r in rows if r.get("train/reward_mean")]) == 2 and any(r.get("val/pass@1") for r in rows)


BLOCK_MATRICES = r"\.(down_proj|gate_proj|k_proj|o_proj|q_proj|up_proj|v_proj)\.weight$"


@pytest.fixture
def text_reward(tmp_path, monkeypatch) -> list[str]:
    """Arguments setting a Countdown task whose reward varies with the completion's text: the random-weight fixture
    solves nothing, so only such a reward makes members / a group's completions score apart and the updates move."""
    (tmp_path / "text_reward_task.py").write_text(
        "from es_lightning.tasks.countdown import CountdownTask\n\n\nclass TextReward(CountdownTask):\n"
        "    def reward(self, completions, examples):\n        return [float(sum(map(ord, c)) % 7) for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return ["--data.init_args.task", "text_reward_task.TextReward"]


@pytest.mark.parametrize("mode", ["engine-side", "low-rank"])
def test_es_fit_of_a_model_of_its_own_code_on_vllm_equals_hf(tmp_path, fit, qwen_like_dir, text_reward, mode):
    """A model whose config.json's auto_map names modelling code of its own (``trust_remote_code: true``), fitted with
    ES on vLLM — which builds it through its Transformers backend (``TransformersForCausalLM``), so the engine's weight
    names and layers are that backend's, not vLLM's Qwen2 ones: full-rank members perturbed inside the engine, and
    rank-1 members as LoRA adapters. Two greedy steps give the same rewards and weights as the transformers backend on
    the plain Qwen-like fixture the code subclasses (fp32: the same arithmetic up to kernels)."""
    from es_helpers import model_of_its_own_code
    from transformers import AutoModelForCausalLM

    custom = str(model_of_its_own_code(qwen_like_dir, tmp_path / "custom"))
    recipe = _recipe(tmp_path, "es.yaml")
    args = [*ES_SMALL, "--model.init_args.temperature", "0", "--model.init_args.samples_per_member", "1",
            "--model.init_args.sigma", "0.02", "--model.init_args.dtype", "float32", *text_reward]
    if mode == "low-rank":
        args += ["--model.init_args.noise_rank", "1", "--model.init_args.trainable", BLOCK_MATRICES]
    engine = [*VLLM, "--model.init_args.generation_options.max_model_len", "256", "--model.init_args.trust_remote_code",
              "true"]
    hf, _ = fit(recipe, *args, "--model.init_args.model", qwen_like_dir)
    ours, trainer = fit(recipe, *args, "--model.init_args.model", custom, *engine)
    assert trainer.global_step == 2 and type(ours.model).__name__ == "CustomForCausalLM"
    assert ours.generator.llm.llm_engine.model_config._architecture == "TransformersForCausalLM"  # vLLM's own log line
    assert type(ours.algorithm.evaluator).__name__ == {"engine-side": "VLLMEngineEvaluator",
                                                       "low-rank": "VLLMLowRankEvaluator"}[mode]
    assert hf.last_rewards.std() > 0 and torch.equal(ours.last_rewards, hf.last_rewards)
    theirs, mine = _weights(hf), _weights(ours)
    base = dict(AutoModelForCausalLM.from_pretrained(qwen_like_dir, dtype=torch.float32).named_parameters())
    assert any(not torch.equal(weight, base[name].detach()) for name, weight in theirs.items())  # the updates moved it
    for name, weight in theirs.items():
        assert torch.allclose(mine[name], weight, atol=1e-6), name
    _engine_matches_policy(ours)


def test_grpo_fit_of_a_model_of_its_own_code_pushes_to_vllm(tmp_path, fit, qwen_like_dir, text_reward):
    """GRPO on vLLM with a model of its own code (vLLM's Transformers backend): each optimizer step's weights reach the
    engine under that backend's names — after two steps the engine's greedy log-probs equal the policy's forward."""
    from es_helpers import model_of_its_own_code
    from transformers import AutoModelForCausalLM

    custom = str(model_of_its_own_code(qwen_like_dir, tmp_path / "custom"))
    module, trainer = fit(_recipe(tmp_path, "grpo.yaml"), *SMALL, "--model.init_args.model", custom, *VLLM,
                          "--model.init_args.generation_options.max_model_len", "256",
                          "--model.init_args.trust_remote_code", "true", "--model.init_args.group_size", "2",
                          "--data.init_args.batch_size", "2", "--model.init_args.mini_batch_size", "2",
                          "--model.init_args.lr", "0.01", *text_reward)
    assert trainer.global_step == 2 and module.last_rewards.std() > 0
    assert module.generator.llm.llm_engine.model_config._architecture == "TransformersForCausalLM"
    base = dict(AutoModelForCausalLM.from_pretrained(qwen_like_dir).named_parameters())  # the steps moved the weights
    assert any(not torch.equal(weight.float(), base[name].detach().float()) for name, weight in _weights(module).items())
    _engine_matches_policy(module)


def test_a_dataset_row_past_max_model_len_is_refused_before_the_engine_starts(tmp_path, fit):
    """A data file row whose prompt (68 tokens) fills the engine's max_model_len (64) but fits the model's 128
    positions: refused at fit start, before an engine is built, naming its row and raising max_model_len among the
    fixes (a row past the model's positions is the HF backend's case: tests/test_cli_errors.py)."""
    rows = [{"nums": [a + 1, 3, 4], "target": (a + 1) * 3 + 4} for a in range(20)]
    rows[7] = {"nums": list(range(1, 25)), "target": 17}
    source = tmp_path / "countdown.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ValueError) as refused:
        fit(_recipe(tmp_path, "es.yaml"), *ES_SMALL, *VLLM, "--model.init_args.generation_options.max_model_len", "64",
            "--data.init_args.source", str(source), "--data.init_args.train_size", "16", "--data.init_args.test_size", "0")
    assert str(refused.value) == (
        "1 of the 16 train prompts has 64 tokens or more, and generation_options.max_model_len is 64: no room for a "
        f"completion; the first is row 7 (counting from 0) of the 'train' split of data.source '{source}' (68 tokens as "
        "prompted); raise generation_options.max_model_len above 68, shorten the prompts (the task's prompt format or "
        "system_prompt), or remove those rows from the data"), refused.value


def _long_row_data(tmp_path: Path, split: str, at: int):
    """Compact Countdown from a directory whose ``split`` file (train.jsonl / validation.jsonl) has one row of 69
    tokens (the Llama-like tokenizer, as prompted; the others 11-12) at ``at``."""
    from es_lightning import CountdownTask, ReasoningDataModule

    source = tmp_path / "countdown"
    source.mkdir()
    for name, rows in (("train", 16), ("validation", 4)):
        first = 1 if name == "train" else 30  # no validation problem is a training problem
        lines = [{"nums": [a, 3, 4], "target": a * 3 + 4} for a in range(first, first + rows)]
        if name == split:
            lines[at] = {"nums": list(range(1, 25)), "target": 17}
        (source / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in lines))
    data = ReasoningDataModule(CountdownTask(prompt_format="compact"), source=str(source), train_size=16, val_size=4,
                               test_size=0, batch_size=4, val_batch_size=4)
    return data, source / f"{split}.jsonl"


def _derived_engine_module(model: str, keep_alive: list):
    from es_lightning import ESModule

    module = ESModule(model=model, population_size=4, members_per_batch=1, max_new_tokens=8, temperature=0.0,
                      generation_backend="vllm", generation_options=dict(cpu_kv_cache_gib=0.0625, max_num_seqs=16))
    keep_alive.append(module)  # its engine lives until the session ends (see keep_alive)
    return module


def _refusal(what: str, where: str) -> str:
    return (f"1 of the {what} has 40 tokens or more, and the vLLM engine's max_model_len (vLLM's own for this model, "
            "from its config: generation_options sets none, and vLLM refuses a larger one) is 40: no room for a "
            f"completion; the first is row {where} (69 tokens as prompted); shorten the prompts (the task's prompt "
            "format or system_prompt), or remove those rows from the data")


def test_a_row_past_the_max_model_len_vllm_derives_is_refused_before_the_first_step(tmp_path, keep_alive, closed_engines,
                                                                                    llama_like_seq40_dir):
    """With no generation_options.max_model_len, vLLM takes its own from the model's config (here its seq_length,
    40; the scaled RoPE gives no position limit to check the rows against before the engine exists): the rows are
    checked again once the engine is built, refused in one line before the first step — shorter prompts the fix, not
    a max_model_len vLLM would refuse — not at the step that draws the row. The refused fit's engine is closed (its
    memory not held while the script goes on); a second fit of the same module builds its own and trains."""
    closed = closed_engines
    module = _derived_engine_module(llama_like_seq40_dir, keep_alive)
    data, source = _long_row_data(tmp_path, "train", 7)
    trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(ValueError) as refused:
        trainer.fit(module, data)
    assert closed == [(40, True)] and module._generator is None and trainer.global_step == 0
    where = f"7 (counting from 0) of the 'train' split of data.source '{source.parent}'"
    assert str(refused.value) == _refusal("16 train prompts", where), refused.value
    (tmp_path / "short").mkdir()
    data, _ = _long_row_data(tmp_path / "short", "none", 0)  # no long row
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert trainer.global_step == 1 and module.generator.max_model_len == 40 and module.generator.llm is not None


def test_a_validation_row_past_the_max_model_len_vllm_derives_is_refused_before_validating(tmp_path, keep_alive,
                                                                                          closed_engines,
                                                                                          llama_like_seq40_dir):
    """``validate`` builds its engine at its start: its rows are checked against the engine's own max_model_len then,
    refused in one line before a problem is generated, and the engine closed."""
    closed = closed_engines
    module = _derived_engine_module(llama_like_seq40_dir, keep_alive)
    data, source = _long_row_data(tmp_path, "validation", 2)
    trainer = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError) as refused:
        trainer.validate(module, data)
    assert closed == [(40, True)] and module._generator is None
    where = f"2 (counting from 0) of the 'validation' split of data.source '{source.parent}'"
    assert str(refused.value) == _refusal("4 val prompts", where), refused.value


def test_a_kv_cache_short_of_the_max_model_len_vllm_derives_names_the_one_the_data_needs(tmp_path, keep_alive,
                                                                                         llama_like_dir):
    """With no generation_options.max_model_len, vLLM takes Llama 3's 131,072 from the model's config (rope scaling
    ``llama3``), which a small KV cache cannot hold one sequence of: the engine is refused in one line that names the
    max_model_len the fit needs (its longest prompt, 69 tokens, + max_new_tokens 8) and the KV-cache option, not
    "vLLM cannot load this model" with vLLM's advice (``gpu_memory_utilization``, which a CPU engine does not take);
    with that max_model_len the fit runs."""
    module = _derived_engine_module(llama_like_dir, keep_alive)
    data, _ = _long_row_data(tmp_path, "train", 7)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    with pytest.raises(ValueError) as refused:
        trainer.fit(module, data)
    assert str(refused.value) == (
        "the vLLM engine's KV cache (generation_options.cpu_kv_cache_gib=0.0625) holds 130944 tokens, short of one "
        "sequence of its max_model_len 131072 (vLLM's own for this model, from its config: generation_options sets "
        "none): set generation_options.max_model_len to the longest prompt + max_new_tokens the run needs (here 77), "
        "or raise generation_options.cpu_kv_cache_gib"), refused.value
    assert trainer.global_step == 0
    module.generation_options["max_model_len"] = 77
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
    trainer.fit(module, data)
    assert trainer.global_step == 1 and module.generator.max_model_len == 77


#: a fit whose task's verifier returns 0.5 for a verdict (a verifier bug: the scorer stops the run in step 0), in a
#: fresh process: closing an engine shuts down vLLM's process-wide parallel groups, which the session's other engines
#: (builtin_pair, ...) still use — one engine per process is vLLM's layout (see ``keep_alive``)
FAILING_FIT = """
import json
import lightning as L
from es_lightning import CountdownTask, ESModule, ReasoningDataModule
from es_lightning.generation.vllm import VLLMGenerator
from es_lightning.scoring import RewardError

class ScoreAsVerdict(CountdownTask):
    def is_correct(self, completion, example):
        return 0.5

closed, real_close = [], VLLMGenerator.close
VLLMGenerator.close = lambda self: (closed.append((self.max_model_len, self.llm is not None)), real_close(self))
module = ESModule(population_size=4, sigma=0.02, lr=0.01, max_new_tokens=8, temperature=0.0, generation_backend="vllm",
                  generation_options=dict(max_model_len=96, cpu_kv_cache_gib=0.0625, max_num_seqs=16))
data = ReasoningDataModule(ScoreAsVerdict(prompt_format="compact"), train_size=16, val_size=2, test_size=2,
                           batch_size=4)
trainer = L.Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
try:
    trainer.fit(module, data)
    raised = None
except RewardError as err:
    raised = str(err)
print("RESULT " + json.dumps(dict(raised=raised, closed=closed, generator=module._generator is None,
                                  steps=trainer.global_step)))
"""


def test_a_fit_that_fails_in_a_step_closes_its_engine_and_raises_the_original_error(tmp_path):
    """A fit that fails after its engine was built (here a task's verifier returning 0.5 for a verdict, in the first
    training step; an out-of-memory error alike) closed nothing: the engine's memory and worker stayed held while the
    user's script went on. It is closed as the error propagates, and the error raised is the verifier's."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", FAILING_FIT], capture_output=True, text=True, env=env, timeout=600,
                          cwd=tmp_path)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["raised"] is not None and re.match(
        r"ScoreAsVerdict at step 0: is_correct returned 0.5 \(float\), not a correctness verdict", out["raised"]), out
    assert out["closed"] == [[96, True]] and out["generator"] and out["steps"] == 0


GROUP_PROBE = """
import os
import json
import lightning as L
import torch

class GroupProbe(L.Callback):
    def on_train_end(self, trainer, pl_module):
        # the trainer's group after the switch closed and rebuilt each rank's engine: a collective over both ranks,
        # and the rebuilt engine holds LoRA adapters (the low-rank ES stage's members)
        group_alive = torch.distributed.is_initialized()
        total = torch.tensor([trainer.global_rank + 1.0])
        if group_alive:
            torch.distributed.all_reduce(total)
        payload = [trainer.global_rank, group_alive, float(total), pl_module.algorithm.name,
                   pl_module.generator.max_loras]
        os.write(1, ("GROUP " + json.dumps(payload) + "\\n").encode())
"""


def test_grpo_to_lowrank_es_switch_under_ddp_keeps_the_trainers_group(tmp_path):
    """recipes/grpo_es.yaml on vLLM under DDP (2 CPU processes, gloo) with a low-rank ES stage: the switch closes each
    rank's engine and builds it again with LoRA adapters. vLLM's engine shutdown destroyed torch.distributed's default
    group — the trainer's, under DDP — so the ES step's first collective failed mid-fit. Both ranks finish the ES step
    with equal weights, the engine generating from them, and the trainer's group still answers a collective."""
    import os
    import subprocess
    import sys

    cfg = yaml.safe_load((ROOT / "recipes" / "grpo_es.yaml").read_text())
    stage = next(cb for cb in cfg["trainer"]["callbacks"] if cb["class_path"].endswith("SequentialStrategy"))
    stage["init_args"]["switch_step"] = 1
    stage["init_args"]["es"].update(population_size=4, members_per_batch=2, noise_rank=1, samples_per_member=1,
                                    trainable=BLOCK_MATRICES)
    cfg["trainer"].update(accelerator="cpu", devices=2, strategy="ddp", logger=False, callbacks=[
        stage, {"class_path": "engine_probe.EngineProbe"}, {"class_path": "engine_probe.GroupProbe"}])
    recipe = tmp_path / "grpo_es.yaml"
    recipe.write_text(yaml.safe_dump(cfg, sort_keys=False))
    (tmp_path / "engine_probe.py").write_text(ENGINE_PROBE + GROUP_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-m", "es_lightning.cli", "fit", "--config", str(recipe), *SMALL, *VLLM,
                           "--model.init_args.group_size", "4", "--data.init_args.batch_size", "2",
                           "--trainer.default_root_dir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert _probed(proc.stdout, "GROUP") == [[r, True, 3.0, "es", 2] for r in range(2)], proc.stdout[-2000:]
    assert _probed(proc.stdout, "ENGINE") == [[r, "external_launcher", r, 2] for r in range(2)], proc.stdout[-2000:]
    weights = _probed(proc.stdout, "WEIGHTS")
    assert [w[:2] for w in weights] == [[0, True], [1, True]] and weights[0][2] == weights[1][2], weights


FAILURE_PROBE = """
import atexit
import os
import json
import lightning as L
import torch
from es_lightning import CountdownTask

class ScoreAsVerdict(CountdownTask):
    def is_correct(self, completion, example):
        return 0.5

class FailureProbe(L.Callback):
    def on_exception(self, trainer, pl_module, exception):
        def report():  # at exit, before the default group is destroyed (atexit runs the last registered first)
            alive = torch.distributed.is_initialized()
            payload = [trainer.global_rank, type(exception).__name__, pl_module._generator is None, alive]
            os.write(1, ("FAILED " + json.dumps(payload) + "\\n").encode())
        atexit.register(report)
"""


def test_a_ddp_fit_that_fails_in_a_step_closes_both_engines_and_raises_the_original_error(tmp_path):
    """recipes/es.yaml on vLLM under DDP (2 CPU processes) whose task's verifier returns 0.5 for a verdict: both ranks
    stop at the first step with the verifier's error (no hang), each rank's engine closed, the trainer's group kept."""
    import os
    import subprocess
    import sys

    recipe = _recipe(tmp_path, "es.yaml")
    ddp = tmp_path / "ddp.yaml"
    ddp.write_text(yaml.safe_dump({"trainer": {"accelerator": "cpu", "devices": 2, "strategy": "ddp", "callbacks": [
        {"class_path": "failure_probe.FailureProbe"}]},
        "data": {"init_args": {"task": {"class_path": "failure_probe.ScoreAsVerdict",
                                        "init_args": {"prompt_format": "compact"}}}}}))
    (tmp_path / "failure_probe.py").write_text(FAILURE_PROBE)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    proc = subprocess.run([sys.executable, "-m", "es_lightning.cli", "fit", "--config", recipe, *ES_SMALL, *VLLM,
                           "--trainer.callbacks", "null", "--config", str(ddp), "--trainer.default_root_dir", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0, proc.stderr[-3000:]
    assert "ScoreAsVerdict at step 0: is_correct returned 0.5 (float), not a correctness verdict" in proc.stderr, \
        proc.stderr[-3000:]
    assert _probed(proc.stdout, "FAILED") == [[r, "RewardError", True, True] for r in range(2)], (proc.stdout[-2000:],
                                                                                                  proc.stderr[-3000:])
