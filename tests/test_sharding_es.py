"""ES on a sharded policy: 2 real CPU processes (gloo) under Lightning's ModelParallelStrategy (FSDP2, ``fully_shard``).

One subprocess run does, on both ranks: an ES fit of 2 steps that saves a distributed (sharded) checkpoint after each
step (with training-time Pass@k), then a fresh fit resumed from the step-1 checkpoint, the same with a full
(single-file) checkpoint, then the shard-view checks of
:func:`check_dtensor_views` on other DTensor layouts. Checked against independent computations: the weights after
step 1 equal those of a 1-process fit run here (fp tolerance); the resumed run's step-2 weights equal the uninterrupted
run's exactly; and the parameters really were sharded (each rank held part of them, one tensor unevenly).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import lightning as L
import pytest
import torch

from es_lightning import CountdownTask, ESModule, ReasoningDataModule

ES_KW = dict(population_size=4, sigma=0.5, lr=0.05, max_new_tokens=6, temperature=0.0, reward_normalization="centered")
DATA_KW = dict(task="countdown", train_size=32, val_size=4, test_size=4, batch_size=4, val_batch_size=1)  # 1: uneven eval calls


class LengthTask(CountdownTask):
    """A reward every member earns differently (the untrained model never solves Countdown), so updates are never 0."""

    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]

    def grade(self, completions, examples):  # the same reward when the ES step grades through Task.grade
        answers, correct, _ = super().grade(completions, examples)
        return answers, correct, self.reward(completions, examples)


def check_dtensor_views() -> str:
    """DTensor shard views on every rank of a 2-process gloo group (run inside the FSDP2 script): each rank's noise is
    exactly its slice of the whole tensor's noise for row shards (even and uneven), column shards (not one contiguous
    run) and replicated (HSDP) layouts; writes land in the DTensor; θ₀ pieces reassemble into the full tensor and cut
    back; drift counts replicas once. Raises on any mismatch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from es_lightning.es.noise import param_noise
    from es_lightning.es.sharding import gather_full, local_snapshot, localize, shard_views, sharded_drift

    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (2,))
    cases = {"rows_uneven": ((5, 3), [Shard(0)]), "cols": ((4, 5), [Shard(1)]), "vector": ((3,), [Shard(0)]),
             "one_row_cols": ((1, 7), [Shard(1)]), "replicated": ((2, 3), [Replicate()])}
    for name, (shape, placements) in cases.items():
        full = torch.randn(shape)
        dt = distribute_tensor(full.clone(), mesh, placements)
        (view,) = shard_views([(name, dt)])
        whole_noise = param_noise(7, 3, 1, name, full.numel()).view(shape)
        idx = distribute_tensor(torch.arange(full.numel()).view(shape), mesh, placements).to_local().flatten()
        assert torch.equal(view.noise(7, 3, 1), whole_noise.flatten()[idx]), name
        assert view.shape == shape and view.numel == full.numel()
        assert view.replicas == (2 if name == "replicated" else 1)
        theta0 = local_snapshot([view])
        view.write(view.read().float() + view.noise(7, 3, 1))
        assert torch.equal(dt.full_tensor(), full + whole_noise), name  # every rank wrote its own elements
        assert torch.equal(gather_full([view], theta0)[name], full), name
        assert torch.equal(localize([view], {name: full})[name], theta0[name]), name
        drift = sharded_drift([view], theta0)
        expected = float(whole_noise.norm() / full.norm())
        assert abs(drift - expected) < 1e-5 * expected, (name, drift, expected)  # each element counted once
    # HSDP: 2-D mesh, replicate over the first dimension, shard over the second (size 1 here: 2 processes)
    mesh2 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    dt = distribute_tensor(torch.ones(4, 2), mesh2, [Replicate(), Shard(0)])
    (view,) = shard_views([("hsdp", dt)])
    assert view.replicas == 2 and (view.start, view.end) == (0, 8)
    return "ok"


SCRIPT = textwrap.dedent(
    """
    import json, sys, torch, lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import ModelParallelStrategy
    sys.path.insert(0, {tests!r})
    from test_sharding_es import ES_KW, DATA_KW, LengthTask, check_dtensor_views
    from es_lightning import ESModule, ParameterDrift, PassAtKCallback, ReasoningDataModule

    def full_weights(module):  # a collective under FSDP2: every rank calls it
        out = {{}}
        for name, p in module.model.named_parameters():
            out[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().flatten().tolist()
        return out

    class Record(L.Callback):
        def __init__(self):
            self.weights, self.drift = {{}}, {{}}
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            self.weights[trainer.global_step] = full_weights(module)
            self.drift[trainer.global_step] = float(trainer.callback_metrics["train/drift"])

    class Masters(L.Callback):  # the fp32 masters as the first step of a fit starts
        masters = None
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if self.masters is None:
                opt = trainer.optimizers[0]
                full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
                self.masters = {{n: full(opt.centre(p)).flatten().tolist() for n, p in module.model.named_parameters()}}

    def fit(ckpt_path=None, checkpoints=None, full=False, max_steps=2, precision="32-true", extra=()):
        module = ESModule(model={model!r}, task=LengthTask(), **ES_KW)
        record = Record()
        callbacks = [ParameterDrift(), record, *extra]  # drift first: Record reads it at the same batch end
        if checkpoints:
            callbacks.append(ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1,
                                             filename="{{step}}"))
        if checkpoints and not full:
            # training-time Pass@k on 3 problems, 1 per call: rank 0 makes 2 generate calls, rank 1 one (+1 spare)
            callbacks.append(PassAtKCallback(num_samples=2, ks=(1,), every_n_train_steps=1, num_problems=3,
                                             batch_size=1))
        strategy = ModelParallelStrategy(save_distributed_checkpoint=not full)
        trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", devices=2, strategy=strategy, precision=precision,
                            logger=False, enable_checkpointing=bool(checkpoints), limit_val_batches=0,
                            num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False,
                            callbacks=callbacks)
        trainer.fit(module, ReasoningDataModule(**DATA_KW), ckpt_path=ckpt_path)
        return trainer, module, record

    if __name__ == "__main__":
        torch.set_num_threads(1)
        out = {out!r}
        trainer, module, first = fit(checkpoints=out + "/ckpt")
        from es_lightning import HFExport
        HFExport(dirpath=out + "/export").export(module)  # gathers the shards: every rank calls it
        history = [cb for cb in trainer.callbacks if isinstance(cb, PassAtKCallback)][0].history
        shards = [(n, p.to_local().numel(), p.numel()) for n, p in module.model.named_parameters()]
        trainer2, module2, resumed = fit(ckpt_path=out + "/ckpt/step=1.ckpt")
        fit(checkpoints=out + "/full", full=True, max_steps=1)  # a full (single-file) checkpoint of a sharded run
        _, _, from_full = fit(ckpt_path=out + "/full/step=1.ckpt")
        masters = Masters()  # the fp32 single-file checkpoint resumed under bf16-true: masters from its fp32 weights
        fit(ckpt_path=out + "/full/step=1.ckpt", precision="bf16-true", extra=[masters])
        try:  # the shard-view primitives on other layouts, in the same process group
            views = check_dtensor_views()
        except AssertionError as err:
            views = "failed: " + repr(err)
        if trainer.global_rank == 0:
            json.dump({{"weights": first.weights, "drift": first.drift, "resumed_weights": resumed.weights,
                       "resumed_drift": resumed.drift, "steps": [trainer.global_step, trainer2.global_step],
                       "rewards": module.last_rewards.tolist(), "pass_history": history,
                       "from_full_weights": from_full.weights, "bf16_masters": masters.masters}},
                      open(out + "/result.json", "w"))
        json.dump({{"shards": shards, "sharded": module.sharded, "views": views}},
                  open(out + f"/shards{{trainer.global_rank}}.json", "w"))
        from es_lightning.distributed import end_distributed_process
        end_distributed_process()  # FSDP2's units keep the gloo groups: exit past the teardown (distributed.py)
    """
)


def _single_process_step(model_dir: str) -> tuple[dict[str, list[float]], list[float]]:
    """The reference: one ES step in this process, unsharded."""
    module = ESModule(model=model_dir, task=LengthTask(), **ES_KW)
    trainer = L.Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        limit_val_batches=0, num_sanity_val_steps=0, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(module, ReasoningDataModule(**DATA_KW))
    return {n: p.detach().flatten().tolist() for n, p in module.model.named_parameters()}, module.last_rewards.tolist()


def _max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert a.keys() == b.keys()
    return max(float((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max()) for k in a)


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory, tiny_model_dir):
    out = tmp_path_factory.mktemp("es-fsdp2")
    script = out / "es_fsdp2.py"
    tests = os.path.dirname(os.path.abspath(__file__))
    script.write_text(SCRIPT.format(tests=tests, out=str(out), model=tiny_model_dir))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(script)], cwd=out, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads((out / "result.json").read_text())
    shards = [json.loads((out / f"shards{r}.json").read_text()) for r in range(2)]
    return result, shards, out


def test_fsdp2_es_step_equals_single_process(fsdp2_run, tiny_model_dir):
    result, shards, _ = fsdp2_run
    single_weights, single_rewards = _single_process_step(tiny_model_dir)
    start = {n: p.detach().flatten().tolist() for n, p in ESModule(model=tiny_model_dir).policy.model.named_parameters()}
    assert result["steps"] == [2, 2]
    assert len(set(single_rewards)) > 1 and _max_diff(single_weights, start) > 1e-3  # a real update happened
    diff = _max_diff(result["weights"]["1"], single_weights)
    assert diff < 1e-5, diff


def test_dtensor_shard_views_match_the_whole_tensor(fsdp2_run):
    _, shards, _ = fsdp2_run
    assert [s["views"] for s in shards] == ["ok", "ok"]


def test_fsdp2_really_shards_the_policy(fsdp2_run):
    _, shards, _ = fsdp2_run
    assert shards[0]["sharded"] and shards[1]["sharded"]
    for (name, local0, total), (name1, local1, total1) in zip(shards[0]["shards"], shards[1]["shards"]):
        assert name == name1 and total == total1
        assert local0 + local1 == total and local0 < total and local1 < total, name
    # the char vocabulary (51 rows) splits unevenly: 26 + 25 rows
    embed = [s for s in zip(shards[0]["shards"], shards[1]["shards"]) if "embed_tokens" in s[0][0]][0]
    assert embed[0][1] != embed[1][1]


def test_fsdp2_resume_from_sharded_checkpoint_continues_exactly(fsdp2_run):
    result, _, out = fsdp2_run
    assert (out / "ckpt" / "step=1.ckpt").is_dir(), "a distributed (sharded) checkpoint is a directory"
    assert result["resumed_weights"].keys() == {"2"}
    assert _max_diff(result["resumed_weights"]["2"], result["weights"]["2"]) == 0.0
    assert _max_diff(result["weights"]["2"], result["weights"]["1"]) > 1e-4  # step 2 moved the weights
    assert result["resumed_drift"]["2"] == pytest.approx(result["drift"]["2"], rel=1e-6)  # θ₀ came back too


def test_fsdp2_full_checkpoint_is_one_file_and_resumes_exactly(fsdp2_run):
    result, _, out = fsdp2_run
    path = out / "full" / "step=1.ckpt"
    assert path.is_file(), "save_distributed_checkpoint=False gathers one file"
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    single = dict(ESModule(model=ckpt["hyper_parameters"]["model"]).policy.model.named_parameters())
    for name, t0 in ckpt["callbacks"]["ParameterDrift"]["theta0"].items():  # θ₀ stored whole, as unsharded
        assert t0.shape == single[name].shape and torch.equal(t0, single[name].detach()), name
    assert _max_diff(result["from_full_weights"]["2"], result["weights"]["2"]) == 0.0


def test_fsdp2_resume_of_a_32_true_file_under_bf16_true_starts_the_masters_from_its_fp32_weights(fsdp2_run):
    """ModelParallelStrategy takes the state dict out of a file checkpoint before the module sees it: the sharded
    masters kept the fresh model's weights (the checkpoint's training lost) until the file was read again."""
    result, _, out = fsdp2_run
    state = torch.load(out / "full" / "step=1.ckpt", map_location="cpu", weights_only=False)["state_dict"]
    masters = result["bf16_masters"]
    state = {k.removeprefix("model."): t.flatten() for k, t in state.items()}
    assert masters.keys() <= state.keys() and len(masters) > 10  # a tied head is the embedding's master
    assert all(torch.equal(torch.tensor(m), state[k]) for k, m in masters.items())
    assert any(not torch.equal(state[k], state[k].bfloat16().float()) for k in masters)  # bits below bf16 kept


def test_a_sharded_checkpoint_resumed_under_a_precision_that_changes_the_masters_is_refused(fsdp2_run):
    """torch.distributed.checkpoint loads exactly the keys the new optimizers hold: 32-true shards resumed under
    bf16-true failed on every rank with 196 lines (a missing master), and the other way dropped the masters silently."""
    from es_lightning.cli_errors import UserError
    from es_lightning.run_dirs import check_ckpt_path

    _, _, out = fsdp2_run
    path = str(out / "ckpt" / "step=1.ckpt")  # written under 32-true: no masters
    strategy = "lightning.pytorch.strategies.ModelParallelStrategy"

    def config(precision, **model):
        return {"ckpt_path": path, "trainer": {"strategy": strategy, "precision": precision},
                "model": {"init_args": model}}

    with pytest.raises(UserError, match="written without master weights .* trainer.precision bf16-true"):
        check_ckpt_path(config("bf16-true"))
    with pytest.raises(UserError, match="es_lightning.distributed .* resume the file"):
        check_ckpt_path(config("32-true", dtype="bfloat16"))
    with pytest.raises(UserError, match="written without master weights"):
        check_ckpt_path(config("32-true", master_dtype="float64"))  # fp64 masters of fp32 weights
    check_ckpt_path(config("32-true"))  # the precision it was written with
    check_ckpt_path(config("bf16-true", master_dtype="same"))  # no masters wanted either (the documented off switch)
    check_ckpt_path(config("bf16-true", master_dtype=None))
    check_ckpt_path(config("bf16-true"), fitting=False)  # validate / test load no optimizer state


def test_training_time_pass_at_k_runs_sharded_with_uneven_rank_shares(fsdp2_run, tiny_model_dir):
    """Rank 0 evaluates problems 0 and 2, rank 1 problem 1: the figures combine both ranks' shares, each share as one
    process evaluates it (val/reward_mean was rank 0's alone)."""
    from es_lightning import PassAtKCallback

    result, _, _ = fsdp2_run
    steps = [step for step, _ in result["pass_history"]]
    assert steps == [1, 2]
    module = ESModule(model=tiny_model_dir, task=LengthTask(), **ES_KW)
    dm = ReasoningDataModule(**DATA_KW)
    dm.setup("validate")
    problems = dm.splits["val"][:3]
    for step, metrics in result["pass_history"]:
        with torch.no_grad():
            for name, p in module.policy.model.named_parameters():
                p.copy_(torch.tensor(result["weights"][str(step)][name]).view(p.shape))
        callback = PassAtKCallback(num_samples=2, ks=(1,), num_problems=3, batch_size=1)
        shares = [callback.evaluate_examples(module, problems[rank::2]) for rank in (0, 1)]
        reward = (shares[0]["val/reward_mean"] * 2 + shares[1]["val/reward_mean"]) / 3  # 2 problems and 1, n = 2
        assert metrics["val/reward_mean"] == pytest.approx(reward, rel=1e-6)
        assert metrics["val/pass@1"] == pytest.approx((shares[0]["val/pass@1"] * 2 + shares[1]["val/pass@1"]) / 3)
        assert shares[0]["val/reward_mean"] != shares[1]["val/reward_mean"]  # rank 0's alone would differ


def test_sharded_settings_are_checked_with_the_fix():
    from es_lightning.es.algorithm import ESSettings
    from es_lightning.es.evaluators import ShardedEvaluator
    from es_lightning.es.sharding import prompt_share

    assert [prompt_share(5, r, 2) for r in range(2)] == [slice(0, 3), slice(3, 5)]
    assert [prompt_share(4, r, 3) for r in range(3)] == [slice(0, 2), slice(2, 3), slice(3, 4)]
    with pytest.raises(ValueError, match="batch_size to >= 4"):
        prompt_share(3, 0, 4)
    module = ESModule(population_size=4)
    # a recipe's speed knob: one member at a time instead, with a warning
    with pytest.warns(UserWarning, match="evaluated one at a time"):
        ShardedEvaluator(ESSettings(population_size=4, members_per_batch=2)).check(module)
    module.generation_backend = "vllm"
    with pytest.raises(ValueError, match="generation_backend: hf"):
        ShardedEvaluator(ESSettings(population_size=4)).check(module)


def test_fsdp1_on_cpu_is_refused_with_the_cpu_alternative(tmp_path, capsys):
    from es_lightning.cli import cli_main

    recipe = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes", "es.yaml")
    with pytest.raises(SystemExit) as refused:  # the command's one-line error (es_lightning/cli_errors.py)
        cli_main(["fit", "--config", recipe, "--trainer.accelerator", "cpu", "--trainer.strategy", "fsdp",
                  "--trainer.default_root_dir", str(tmp_path)])
    assert refused.value.code == 2 and "fsdp2_cpu.yaml" in capsys.readouterr().err


def test_fsdp1_gets_one_unit_per_transformer_block_unless_configured(tiny_model_dir):
    from lightning.pytorch.strategies import FSDPStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from es_lightning.distributed import default_fsdp1_wrapping

    model = ESModule(model=tiny_model_dir).policy.model
    strategy = FSDPStrategy()
    default_fsdp1_wrapping(strategy, model)
    policy = strategy.kwargs["auto_wrap_policy"]
    assert isinstance(policy, ModuleWrapPolicy) and policy._module_classes == {Qwen2DecoderLayer}
    mine = FSDPStrategy(auto_wrap_policy={torch.nn.Linear})
    default_fsdp1_wrapping(mine, model)
    assert mine.kwargs["auto_wrap_policy"]._module_classes == {torch.nn.Linear}  # a configured policy is kept


def test_sharded_checkpoint_consolidates_to_the_full_one(fsdp2_run, tmp_path):
    from es_lightning.distributed import consolidate_checkpoint

    _, _, out = fsdp2_run
    merged = torch.load(consolidate_checkpoint(str(out / "ckpt" / "step=1.ckpt"), str(tmp_path / "one.ckpt")),
                        map_location="cpu", weights_only=False)
    full = torch.load(out / "full" / "step=1.ckpt", map_location="cpu", weights_only=False)
    assert merged["global_step"] == full["global_step"] == 1
    assert merged["state_dict"].keys() == full["state_dict"].keys()
    for key, value in full["state_dict"].items():  # the same step of the same run, saved sharded and saved whole
        assert torch.equal(merged["state_dict"][key], value), key
    theta0 = [c["callbacks"]["ParameterDrift"]["theta0"] for c in (merged, full)]
    assert theta0[1] and all(torch.equal(theta0[0][k], v) for k, v in theta0[1].items())
    # its optimizer state is keyed by name: the names `analyze drift` reads a master under, those of the file's index
    from es_lightning.precision import PARAMETER_NAMES_KEY, checkpoint_masters

    state = merged["optimizer_states"][0]["state"]
    for entry in state.values():
        entry["master"] = torch.zeros(1)
    for entry in full["optimizer_states"][0]["state"].values():
        entry["master"] = torch.zeros(1)
    by_name, by_index = checkpoint_masters(merged), checkpoint_masters(full)
    assert by_name[1] == by_index[1] == 0 and by_name[0].keys() == by_index[0].keys() == set(full[PARAMETER_NAMES_KEY][0])


def test_consolidation_command_refuses_bad_paths_in_one_line(fsdp2_run, tmp_path):
    _, _, out = fsdp2_run
    cases = [(str(out / "full" / "step=1.ckpt"), str(tmp_path / "a.ckpt"), "is not a directory"),  # a single file
             (str(out / "ckpt" / "step=1.ckpt"), str(tmp_path / "no" / "such" / "a.ckpt"), "does not exist")]
    for source, target, said in cases:
        proc = subprocess.run([sys.executable, "-m", "es_lightning.distributed", source, target], capture_output=True,
                              text=True, timeout=120)
        lines = [ln for ln in proc.stderr.splitlines() if "error" in ln]
        assert proc.returncode == 2 and len(lines) == 1 and said in lines[0], proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr


def test_fsdp2_export_gathers_the_weights_once(fsdp2_run, tiny_model_dir):
    """HFExport of the sharded model: a Hugging Face directory with the trained weights, the tied head written once
    (the gathered state dict held lm_head.weight beside the embedding: +467 MB at Qwen2.5-1.5B)."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    result, _, out = fsdp2_run
    with safe_open(str(out / "export" / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
    model = AutoModelForCausalLM.from_pretrained(out / "export")
    assert model.lm_head.weight is model.model.embed_tokens.weight
    final = result["weights"]["2"]
    assert all(torch.equal(p.detach().flatten(), torch.tensor(final[n])) for n, p in model.named_parameters())
