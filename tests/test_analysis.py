"""Analysis tools on the built-in model, each against an expectation computed independently of the code under test:
drift of a model perturbed by known amounts (numpy, float64), ablation at τ = 0 / ∞ bitwise, top-p% on distinct known
updates, Pass@k from the correctness matrix by the binomial formula, forgetting of an unchanged and of a constant-logit
model, and the population sweep against what ``es-lightning fit`` logs for the same run."""

from __future__ import annotations

import csv
import json
import math
import os
import shutil
import signal
import sys
from dataclasses import replace
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from es_helpers import model_of_its_own_code

from es_lightning import ESModule, ReasoningDataModule
from es_lightning.analysis import (
    ablate_,
    ablation_command,
    drift_command,
    eval_command,
    evaluate_models,
    evaluate_policy,
    forgetting_command,
    heldout_problems,
    load_model,
    module_kind,
    parameter_drift,
    sweep_command,
    top_percent_threshold,
)
from es_lightning.analysis import drift as drift_module
from es_lightning.analysis.evaluate import evaluation_module
from es_lightning.analysis.settings import SWEEP_EVAL, EvalSettings, default_ks
from es_lightning.cli import cli_main, join_list_values
from es_lightning.generation import SamplingParams
from es_lightning.policy import load_policy
from es_lightning.tasks import AdditionTask, CountdownTask, get_task

ROOT = Path(__file__).resolve().parents[1]
BUILTIN = "builtin:countdown-tiny"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _perturb(model: torch.nn.Module, seed: int = 0, scale: float = 1e-3) -> None:
    """Add seeded Gaussian noise of std ``scale`` to every parameter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def es_checkpoint(tmp_path_factory):
    """A checkpoint written by a real ES fit (1 update) on the built-in model, with its weights then moved by known
    noise so the tuned model differs measurably; returns (path, the module's weights as saved)."""
    module = ESModule(model=BUILTIN, population_size=2, sigma=5e-3, lr=3e-3, max_new_tokens=4)
    dm = ReasoningDataModule("countdown", train_size=8, val_size=2, test_size=2, batch_size=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=dm)
    _perturb(module.model, seed=1, scale=2e-3)
    path = tmp_path_factory.mktemp("ckpt") / "es.ckpt"
    trainer.save_checkpoint(path)
    return str(path), {n: p.detach().clone() for n, p in module.model.named_parameters()}


def _np(weights) -> dict[str, np.ndarray]:
    return {n: t.detach().double().numpy() for n, t in weights}


# --------------------------------------------------------------------------- checkpoints
def test_load_model_rebuilds_a_lightning_checkpoint_bitwise(es_checkpoint):
    path, saved = es_checkpoint
    loaded = load_model(path)
    assert loaded.base == BUILTIN and loaded.global_step == 1 and loaded.hyperparameters["population_size"] == 2
    params = dict(loaded.policy.model.named_parameters())
    assert params.keys() == saved.keys()
    assert all(torch.equal(params[n], saved[n]) for n in saved)
    assert loaded.policy.model.lm_head.weight is loaded.policy.model.model.embed_tokens.weight  # still tied


def test_a_relative_base_model_is_found_from_another_directory(tmp_path, monkeypatch, tiny_model_dir):
    """A fit run with a relative model path (`model: base`) records it as given; analysing its checkpoint from
    another directory finds the base beside the run's logs (it was taken for a hub id once)."""
    import shutil

    shutil.copytree(tiny_model_dir, tmp_path / "work" / "base")
    monkeypatch.chdir(tmp_path / "work")
    module = ESModule(model="base", population_size=2, sigma=5e-3, lr=3e-3, max_new_tokens=4)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, datamodule=ReasoningDataModule("countdown", train_size=8, val_size=2, test_size=2, batch_size=2))
    path = tmp_path / "work" / "lightning_logs" / "es" / "version_0" / "checkpoints" / "last.ckpt"
    path.parent.mkdir(parents=True)
    trainer.save_checkpoint(path)
    monkeypatch.chdir(tmp_path)  # "base" is not here
    loaded = load_model(str(path.relative_to(tmp_path)))
    assert loaded.base == str(tmp_path / "work" / "base")
    for name, p in module.model.named_parameters():
        assert torch.equal(dict(loaded.policy.model.named_parameters())[name], p), name


def test_load_model_errors_name_the_problem(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*builtin:countdown-tiny"):
        load_model(str(tmp_path / "missing.ckpt"))
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"state_dict": {"layer.weight": torch.zeros(2)}, "epoch": 0}, foreign)
    with pytest.raises(ValueError, match="not a checkpoint of an es-lightning module"):
        load_model(str(foreign))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_text("not a checkpoint")
    with pytest.raises(ValueError, match="not a PyTorch Lightning checkpoint"):
        load_model(str(garbage))
    orphan = tmp_path / "orphan.ckpt"
    torch.save({"state_dict": {"model.lm_head.weight": torch.zeros(2)}, "hyper_parameters": {"model": "./gone"}}, orphan)
    with pytest.raises(FileNotFoundError, match="trained from base model './gone'"):
        load_model(str(orphan))
    (tmp_path / "sharded.ckpt").mkdir()
    with pytest.raises(ValueError, match="sharded.*consolidate_checkpoint"):
        load_model(str(tmp_path / "sharded.ckpt"))


# --------------------------------------------------------------------------- drift
def test_module_kinds_of_qwen2_and_gpt2_names():
    expected = {
        "model.embed_tokens.weight": "embeddings",
        "model.layers.0.self_attn.q_proj.weight": "attention",
        "model.layers.0.self_attn.o_proj.weight": "attention",
        "model.layers.3.mlp.down_proj.weight": "mlp",
        "model.layers.0.input_layernorm.weight": "norms",
        "model.layers.0.post_attention_layernorm.weight": "norms",
        "model.norm.weight": "norms",
        "lm_head.weight": "lm_head",
        "transformer.wte.weight": "embeddings",
        "transformer.h.0.ln_1.weight": "norms",
        "transformer.h.0.attn.c_attn.weight": "attention",
        "transformer.h.0.mlp.c_proj.weight": "mlp",
        "transformer.ln_f.bias": "norms",
        "score.weight": "other",
    }
    assert {name: module_kind(name) for name in expected} == expected


def test_drift_of_a_known_perturbation_matches_numpy(monkeypatch):
    monkeypatch.setattr(drift_module, "CHUNK", 1000)  # several chunks per tensor
    base = load_policy(BUILTIN).model
    tuned = load_policy(BUILTIN).model
    c_attn, c_mlp = 1e-2, 1e-4
    with torch.no_grad():
        tuned.model.layers[0].self_attn.q_proj.weight.add_(c_attn)  # every element of one attention matrix
        tuned.model.layers[1].mlp.up_proj.weight.view(-1)[:500].add_(c_mlp)  # 500 elements of one MLP matrix
    taus = [0.0, 1e-6, 1e-3, 1e-1]
    report = parameter_drift(base, tuned, taus)

    b, t = _np(base.named_parameters()), _np(tuned.named_parameters())
    delta = {n: t[n] - b[n] for n in b}
    total = sum(x.size for x in b.values())
    norm = lambda arrays: math.sqrt(sum(float(np.square(a).sum()) for a in arrays))  # noqa: E731
    assert report.overall["num_params"] == total == 991_744
    assert report.relative_drift == pytest.approx(norm(delta.values()) / norm(b.values()), rel=1e-12)
    attn = [n for n in b if ".self_attn." in n]
    assert report.per_kind["attention"]["relative_drift"] == pytest.approx(
        norm(delta[n] for n in attn) / norm(b[n] for n in attn), rel=1e-12)
    # by hand: ‖Δ‖² of the attention kind is (128 * 128) c² up to float32 rounding of θ + c
    assert report.per_kind["attention"]["update_norm"] == pytest.approx(math.sqrt(128 * 128) * c_attn, rel=1e-4)
    assert report.per_kind["mlp"]["update_norm"] == pytest.approx(math.sqrt(500) * c_mlp, rel=1e-3)
    assert report.per_kind["norms"]["relative_drift"] == 0 and report.per_kind["embeddings"]["update_norm"] == 0
    assert report.per_kind["attention"]["update_share"] + report.per_kind["mlp"]["update_share"] == pytest.approx(1)
    assert report.largest[0] == "attention" and report.tied_embeddings
    assert report.per_kind["lm_head"]["num_params"] == 0  # tied: the head is the embedding
    changed = 128 * 128 + 500
    assert report.sparsity(0.0) == 1 - changed / total
    assert report.sparsity(1e-6) == 1 - changed / total
    assert report.sparsity(1e-3) == 1 - 128 * 128 / total  # the MLP updates (1e-4) are below τ
    assert report.sparsity(1e-1) == 1.0


def test_drift_errors_and_tau_validation():
    a = {"w": torch.zeros(3)}
    with pytest.raises(ValueError, match="different parameters"):
        parameter_drift(a, {"v": torch.zeros(3)})
    with pytest.raises(ValueError, match="differ in shape"):
        parameter_drift(a, {"w": torch.zeros(4)})
    with pytest.raises(ValueError, match="tau must be >= 0"):
        parameter_drift(a, a, taus=[-1e-3])
    with pytest.raises(ValueError, match=r"every tau must be finite \(s_inf = 1 .*\), got inf; drop it"):
        parameter_drift(a, a, taus=[0.0, math.inf])  # its report's to_json() held Infinity
    report = parameter_drift(a, {"w": torch.tensor([0.0, 1e-6, 1.0])}, taus=[0.0, 1e-6])
    assert report.sparsity(1e-6) == 2 / 3 and report.sparsity(0) == 1 / 3
    with pytest.raises(ValueError, match=r"not for τ = 1e-05; add it to the grid \(taus=\[..., 1e-05\], --taus\)"):
        report.sparsity(1e-5)  # a KeyError '1e-05'


def test_drift_command_from_python_refuses_an_infinite_tau_before_loading(tmp_path):
    """The command's parser refuses ``--taus 0 inf``; the Python API wrote ``Infinity`` into drift.json (not JSON)."""
    with pytest.raises(ValueError, match="every tau must be finite"):
        drift_command(tuned=BUILTIN, base=BUILTIN, taus=[0.0, float("inf")], out_dir=str(tmp_path / "d"), plot=False)
    assert not (tmp_path / "d").exists()


def test_drift_refuses_non_finite_weights_naming_them(tmp_path):
    """An inf weight of the tuned model wrote ``Infinity`` into drift.json (not JSON); a NaN one was reported as
    "undefined (base norm 0)". Both are refused, naming the model and its parameters."""
    a = {"w": torch.zeros(3), "v": torch.ones(2)}
    for bad in (math.inf, math.nan):
        with pytest.raises(ValueError, match=r"the tuned model has non-finite weights \(inf or NaN\) in \['v'\]: .*"
                                             r"did its training diverge\? use an earlier checkpoint"):
            parameter_drift(a, {"w": torch.zeros(3), "v": torch.tensor([1.0, bad])})
        with pytest.raises(ValueError, match=r"the base model has non-finite weights \(inf or NaN\) in \['w'\]"):
            parameter_drift({"w": torch.tensor([0.0, bad, 0.0]), "v": torch.ones(2)}, a)
    policy = load_policy(BUILTIN)  # a real model directory whose final norm holds an inf
    with torch.no_grad():
        policy.model.model.norm.weight[0] = math.inf
    policy.model.save_pretrained(tmp_path / "tuned")
    policy.tokenizer.save_pretrained(tmp_path / "tuned")
    with pytest.raises(ValueError, match=r"the tuned model has non-finite weights \(inf or NaN\) in \['model.norm.weight'\]"):
        drift_command(tuned=str(tmp_path / "tuned"), base=BUILTIN, out_dir=str(tmp_path / "d"), plot=False)
    assert not (tmp_path / "d" / "drift.json").exists()
    with pytest.raises(ValueError, match="the tuned model has non-finite weights"):  # it warned "is --base the model?"
        ablation_command(tuned=str(tmp_path / "tuned"), base=BUILTIN, taus=[1e-3], out_dir=str(tmp_path / "a"), plot=False,
                         progress=False)


def test_drift_refuses_a_bf16_qwen_like_models_non_finite_weight(qwen_like_small_dir, tmp_path):
    """The refusal on the path a real recipe's run takes: a bf16 checkpoint of a Qwen-like model (its norm holding an
    inf after a diverged fit) against its bf16 base."""
    tuned = tmp_path / "tuned"
    shutil.copytree(qwen_like_small_dir, tuned)
    policy = load_policy(str(tuned), dtype=torch.bfloat16)
    with torch.no_grad():
        policy.model.model.norm.weight[1] = math.inf
    policy.model.save_pretrained(tuned)
    with pytest.raises(ValueError, match=r"the tuned model has non-finite weights \(inf or NaN\) in \['model.norm.weight'\]"):
        drift_command(tuned=str(tuned), base=qwen_like_small_dir, out_dir=str(tmp_path / "d"), plot=False)
    assert not (tmp_path / "d" / "drift.json").exists()


def test_drift_command_on_a_checkpoint_writes_json_and_png(es_checkpoint, tmp_path, capsys):
    path, saved = es_checkpoint
    report = drift_command(tuned=path, out_dir=str(tmp_path), taus=[0.0, 1e-3])
    base = _np(load_policy(BUILTIN).model.named_parameters())
    tuned = {n: t.double().numpy() for n, t in saved.items()}
    num = math.sqrt(sum(float(np.square(tuned[n] - base[n]).sum()) for n in base))
    den = math.sqrt(sum(float(np.square(base[n]).sum()) for n in base))
    assert report.relative_drift == pytest.approx(num / den, rel=1e-12)
    data = json.loads((tmp_path / "drift.json").read_text())
    assert data["overall"]["relative_drift"] == pytest.approx(num / den, rel=1e-12)
    assert data["sources"] == {"base": BUILTIN, "tuned": path}
    assert (tmp_path / "drift.png").read_bytes()[:8] == PNG_MAGIC
    out = capsys.readouterr().out
    assert "D_rel" in out and "s_τ all" in out and "largest relative drift" in out
    with pytest.raises(ValueError, match="pass base="):
        drift_command(tuned=BUILTIN, out_dir=str(tmp_path))


def _strict_json(path: Path):
    """``json.loads`` as a strict reader (JavaScript, jq) parses: NaN and Infinity are refused."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_drift_of_a_kind_whose_base_is_all_zeros_is_undefined_not_nan(tmp_path, capsys):
    """A base whose norm weights are all 0 (two real model directories of the built-in model): the norms' D_rel is
    undefined — said so in the table, null in a drift.json that strict JSON readers parse, ranked after every kind
    with a D_rel; an undefined kind listed first does not scramble the ranking (a NaN sort key did)."""
    policy = load_policy(BUILTIN)
    base = {n: t.detach().clone() for n, t in policy.model.named_parameters()}
    base.update({n: torch.zeros_like(t) for n, t in base.items() if module_kind(n) == "norms"})
    gen = torch.Generator().manual_seed(0)
    tuned = {n: t + 1e-3 * torch.randn(t.shape, generator=gen) for n, t in base.items()}
    for name, weights in (("base", base), ("tuned", tuned)):
        policy.model.load_state_dict(weights, strict=False)  # tied head: the embedding's tensor
        policy.model.save_pretrained(tmp_path / name)
        policy.tokenizer.save_pretrained(tmp_path / name)
    report = drift_command(tuned=str(tmp_path / "tuned"), base=str(tmp_path / "base"), out_dir=str(tmp_path / "out"),
                           plot=False)
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("norms ")][0].split()[1:5] == \
        ["1152", "undefined", "(base", "norm"]
    data = _strict_json(tmp_path / "out" / "drift.json")
    assert data["per_kind"]["norms"]["relative_drift"] is None and data["per_kind"]["norms"]["update_norm"] > 0
    assert data["per_kind"]["lm_head"]["mean_abs_update"] is None  # a kind without parameters (tied head)
    assert all(p["relative_drift"] is None for p in data["per_parameter"] if p["kind"] == "norms")
    defined = sorted((k for k in ("embeddings", "attention", "mlp")), key=lambda k: -report.per_kind[k]["relative_drift"])
    assert report.largest == data["largest_relative_drift"] == [*defined, "norms"]
    zero_embeddings = {n: torch.zeros_like(t) if module_kind(n) == "embeddings" else t for n, t in base.items()}
    ranked = parameter_drift(zero_embeddings, tuned, [0.0])  # the undefined kind first in the per-kind order
    assert ranked.largest == sorted(("attention", "mlp"), key=lambda k: -ranked.per_kind[k]["relative_drift"]) + \
        ["embeddings", "norms"]


def test_drift_against_an_unrelated_base_warns(es_checkpoint, tmp_path, capsys):
    """--base of another model of the same architecture (freshly initialised): the numbers are computed, and two
    warnings say the checkpoint was trained from another base and the drift is no fine-tune's."""
    from transformers import AutoModelForCausalLM

    path, _ = es_checkpoint
    policy = load_policy(BUILTIN)
    torch.manual_seed(7)
    other = AutoModelForCausalLM.from_config(policy.model.config)  # same shapes, unrelated weights
    other.save_pretrained(tmp_path / "other")
    policy.tokenizer.save_pretrained(tmp_path / "other")
    report = drift_command(tuned=path, base=str(tmp_path / "other"), out_dir=str(tmp_path / "out"), plot=False)
    err = capsys.readouterr().err
    assert report.relative_drift > 0.5
    assert f"was trained from '{BUILTIN}'" in err and f"not from base='{tmp_path / 'other'}'" in err
    assert f"relative drift {report.relative_drift:.2f} is far beyond any fine-tune" in err
    drift_command(tuned=path, base=BUILTIN, out_dir=str(tmp_path / "out2"), plot=False)  # its own base: no warning
    assert "warning" not in capsys.readouterr().err
    tiny = EvalSettings(num_problems=1, num_samples=1, max_new_tokens=2)
    ablation_command(tuned=path, base=str(tmp_path / "other"), taus=[], top_percent=[50], out_dir=str(tmp_path / "a"),
                     eval=tiny, plot=False, progress=False)  # the same two warnings: an ablation against it means nothing
    err = capsys.readouterr().err
    assert "was trained from" in err and "is far beyond any fine-tune" in err


def test_eval_of_the_file_a_checkpoint_trained_on_names_its_training_problems(tmp_path, monkeypatch):
    """`eval --eval.source train.jsonl` of a checkpoint fitted on that file (val/test carved off it): a single-split
    file is evaluated whole, so beyond the fit's test_size the problems drawn were its training problems, scored as
    held out without a word. Problems it did not train on say nothing."""
    import warnings

    from es_lightning.analysis.evaluate import evaluate_models

    monkeypatch.chdir(tmp_path)
    rows = CountdownTask().procedural(40, 0)
    Path("train.jsonl").write_text("".join(json.dumps({"nums": r["nums"], "target": r["target"]}) + "\n" for r in rows))
    module = ESModule(model=BUILTIN, population_size=2, sigma=5e-3, lr=3e-3, max_new_tokens=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[])
    trainer.fit(module, datamodule=ReasoningDataModule("countdown", source="train.jsonl", train_size=None, val_size=4,
                                                       test_size=4, batch_size=2))
    trainer.save_checkpoint(tmp_path / "es.ckpt")
    settings = EvalSettings(num_problems=20, num_samples=1, max_new_tokens=2, source="train.jsonl")
    with pytest.warns(UserWarning, match=r"^1[0-9] of the 20 countdown problems evaluated \(EvalSettings\(source='train.jsonl'\)\) "
                                         r"are training problems of .*es.ckpt \(its data.source 'train.jsonl'\): its "
                                         r"scores on them are not held out; evaluate on problems it did not train on"):
        evaluate_models([str(tmp_path / "es.ckpt")], tasks=["countdown"], settings=settings, progress=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*training problems of")
        evaluate_models([str(tmp_path / "es.ckpt")], tasks=["countdown"], progress=False,
                        settings=replace(settings, num_problems=4))  # the fit's own held-out test problems


def test_eval_prompts_and_loads_every_model_as_the_checkpoint_was_trained(qwen_like_small_dir, tmp_path, capsys):
    """A checkpoint trained on Countdown's r1 prompt in the chat template (the Qwen-like fixture, bf16): `eval` of it
    beside its base model prompts both as in training and loads both in bf16 — it used the default compact prompt
    without the template, and the base in float32. --eval.chat_template false overrides the template."""
    from es_lightning.analysis.checkpoints import trained_with
    from es_lightning.tasks.base import task_record

    task = CountdownTask(prompt_format="r1", use_chat_template=True)
    module = ESModule(model=qwen_like_small_dir, dtype="bfloat16", task=task, population_size=2, sigma=5e-3, lr=3e-3,
                      max_new_tokens=2)
    dm = ReasoningDataModule(task, train_size=4, val_size=2, test_size=2, batch_size=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[])
    trainer.fit(module, datamodule=dm)
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    assert trained_with(str(ckpt)).task == task_record(task) and trained_with(str(ckpt)).dtype == "bfloat16"
    assert trained_with(qwen_like_small_dir).task is None  # a plain model directory records nothing

    settings = EvalSettings(num_problems=2, num_samples=2, max_new_tokens=3, temperature=1.0)
    report = evaluate_models([qwen_like_small_dir, str(ckpt)], tasks=["countdown", "addition"], labels=["base", "es"],
                             settings=settings, progress=False)
    assert "tasks as" in capsys.readouterr().out
    base = load_policy(qwen_like_small_dir, dtype="bfloat16")  # by hand: the trained prompts, bf16 weights
    problems = heldout_problems(task, 2, 0)
    assert report.results["base"]["countdown"] == evaluate_policy(base, task, problems, settings)
    addition = get_task("addition", use_chat_template=True)
    assert report.results["base"]["addition"] == evaluate_policy(base, addition, heldout_problems(addition, 2, 0), settings)
    plain = evaluate_models([qwen_like_small_dir, str(ckpt)], tasks=["countdown"], labels=["base", "es"],
                            settings=replace(settings, chat_template=False), progress=False)
    untemplated = CountdownTask(prompt_format="r1")
    assert plain.results["base"]["countdown"] == evaluate_policy(base, untemplated, problems, settings)
    assert plain.results["base"]["countdown"]["entropy"] != report.results["base"]["countdown"]["entropy"]


def test_forgetting_of_a_runs_export_evaluates_both_models_as_trained(qwen_like_small_dir, tmp_path, capsys):
    """`analyze forgetting` of a bf16 run's export/ (the Qwen-like fixture, r1 prompt in the chat template): both models
    in bf16 with the template, as the run's config.yaml records. The tuned model, loaded before the base, was
    evaluated in float32 beside a bf16 base ("every model in bfloat16" said otherwise)."""
    import yaml

    from es_lightning import HFExport

    task = CountdownTask(prompt_format="r1", use_chat_template=True)
    module = ESModule(model=qwen_like_small_dir, dtype="bfloat16", task=task, population_size=2, sigma=5e-3, lr=3e-3,
                      max_new_tokens=2)
    run = tmp_path / "run"
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[HFExport(run / "export")])
    trainer.fit(module, datamodule=ReasoningDataModule(task, train_size=4, val_size=2, test_size=2, batch_size=2))
    (run / "config.yaml").write_text(yaml.safe_dump({  # what `es-lightning fit` saves beside export/
        "model": {"class_path": "es_lightning.ESModule", "init_args": {"model": qwen_like_small_dir, "dtype": "bfloat16"}},
        "data": {"class_path": "es_lightning.ReasoningDataModule", "init_args": {"task": {
            "class_path": "es_lightning.CountdownTask", "init_args": {"prompt_format": "r1", "use_chat_template": True}}}}}))

    settings = EvalSettings(num_problems=2, num_samples=2, max_new_tokens=3, temperature=1.0)
    report = forgetting_command(tuned=str(run / "export"), base=qwen_like_small_dir, tasks=["addition"], eval=settings,
                                out_dir=str(tmp_path / "forgetting"), plot=False, progress=False)
    addition = get_task("addition", use_chat_template=True)
    problems = heldout_problems(addition, 2, 0)
    for label, path in (("tuned", str(run / "export")), ("base", qwen_like_small_dir)):
        by_hand = evaluate_policy(load_policy(path, dtype="bfloat16"), addition, problems, settings)
        assert report.evaluation.results[label]["addition"] == by_hand, label
    assert "both models in bfloat16" in capsys.readouterr().out


def _fit_a_run(model: str, *options: str) -> Path:
    """`es-lightning fit` of recipes/es.yaml, one tiny ES update, its callbacks only HFExport: the run directory."""
    cli_main(["fit", "--config", str(ROOT / "recipes" / "es.yaml"), "--model.init_args.model", model,
              "--model.init_args.population_size", "4", "--model.init_args.members_per_batch", "4",
              "--data.init_args.batch_size", "4", "--data.init_args.val_size", "2",
              "--trainer.max_steps", "1", "--trainer.enable_progress_bar", "false",
              "--trainer.callbacks", "[{class_path: es_lightning.HFExport}]", *options])
    return next(Path("lightning_logs").glob("es/version_*")).resolve()


def test_the_analyses_of_a_runs_export_take_its_base_from_the_runs_config(tmp_path, monkeypatch, capsys):
    """`analyze drift / ablation / forgetting` of the export/ of an `es-lightning fit` run asked for --base, though the
    run's config.yaml beside it names the model it started from (and eval reads that file for the task): they take it
    from there, say so in one line, and --base still overrides it. An export without a run's config.yaml is refused
    in one line naming --base."""
    monkeypatch.chdir(tmp_path)
    run = _fit_a_run(BUILTIN)
    export, config = str(run / "export"), run / "config.yaml"
    capsys.readouterr()
    report = drift_command(tuned=export, taus=[0.0], out_dir="d", plot=False)
    said = f"base model {BUILTIN}, as {config} names it (base= to choose another)"
    assert said in capsys.readouterr().out
    given = drift_command(tuned=export, base=BUILTIN, taus=[0.0], out_dir="d", plot=False)
    assert report.sources["base"] == BUILTIN and report.to_json() == given.to_json() and report.relative_drift > 0
    assert said not in capsys.readouterr().out  # --base given: nothing taken from the run
    other = drift_command(tuned=export, base=export, taus=[0.0], out_dir="d", plot=False)  # --base overrides the run's
    assert other.sources["base"] == export and other.relative_drift == 0
    settings = EvalSettings(num_problems=1, num_samples=1, max_new_tokens=2)
    ablation = ablation_command(tuned=export, taus=[1e-3], eval=settings, out_dir="a", plot=False, progress=False)
    forgot = forgetting_command(tuned=export, tasks=["addition"], eval=settings, out_dir="f", plot=False, progress=False)
    assert ablation.settings["base"] == BUILTIN and forgot.evaluation.sources["base"] == BUILTIN
    assert capsys.readouterr().out.count(said) == 2

    alone = tmp_path / "alone"  # an export copied away from its run: no config.yaml beside it
    shutil.copytree(export, alone)
    for command in (drift_command, ablation_command, forgetting_command):
        with pytest.raises(ValueError, match=r"is neither a .ckpt nor a run's export/ beside its config.yaml, so its base "
                                             r"model is unknown; pass base= \(the model it was trained from, e\.g\. base="):
            command(tuned=str(alone), out_dir="x", plot=False)


def test_the_analyses_of_a_runs_export_warn_once_when_base_differs_from_the_runs_config(tmp_path, monkeypatch, capsys):
    """`es-lightning analyze drift / ablation / forgetting --tuned <run>/export --base <other>`: --base overrides the
    model the run's config.yaml names, which it did silently (a .ckpt's own base was warned about). Each command now
    warns once, in one line naming both; --base equal to the run's base says nothing."""
    monkeypatch.chdir(tmp_path)
    run = _fit_a_run(BUILTIN)
    export, config = str(run / "export"), run / "config.yaml"
    capsys.readouterr()
    tiny = ["--eval.num_problems", "1", "--eval.num_samples", "1", "--eval.max_new_tokens", "2", "--progress", "false"]
    commands = {"drift": ["--taus", "[0.0]"], "ablation": ["--taus", "[0.001]", *tiny],
                "forgetting": ["--tasks", "[addition]", *tiny]}
    warned = (f"warning: {export} was trained from '{BUILTIN}' (as {config} names it), not from --base '{export}'; "
              "leave --base out to measure against the model it was trained from")
    for command, options in commands.items():
        cli_main(["analyze", command, "--tuned", export, "--base", export, "--plot", "false", "--out_dir", command, *options])
        err = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
        assert err == [warned], command
    for command, options in commands.items():  # its own base, as the run's config.yaml names it: no warning
        cli_main(["analyze", command, "--tuned", export, "--base", BUILTIN, "--plot", "false", "--out_dir", command,
                  *options])
        assert "was trained from" not in capsys.readouterr().err, command


def test_forgetting_of_a_run_trained_on_a_suite_task_names_the_suite_to_give(tmp_path, monkeypatch):
    """`analyze forgetting` of a checkpoint trained on addition (a task of the default held-out suite) was refused
    without the way out; the line names the suite without it (`--tasks sort`), which then measures forgetting."""
    monkeypatch.chdir(tmp_path)
    ckpt = str(_fit_a_run(BUILTIN, "--data.init_args.task", "es_lightning.AdditionTask", "--trainer.callbacks",
                          "[{class_path: es_lightning.RunCheckpoint}]") / "checkpoints" / "last.ckpt")
    with pytest.raises(ValueError, match=r"contains the training task 'addition'; forgetting is measured on other tasks: "
                                         r"give tasks=\['sort'\] \("):
        forgetting_command(tuned=ckpt, out_dir="f", plot=False)
    with pytest.raises(ValueError, match=r"give other tasks, e\.g\. tasks=\['sort'\] \("):
        forgetting_command(tuned=ckpt, tasks=["addition"], out_dir="f", plot=False)
    report = forgetting_command(tuned=ckpt, tasks=["sort"], eval=EvalSettings(num_problems=1, num_samples=1),
                                out_dir="f", plot=False, progress=False)
    assert report.training_task == "addition" and report.suite == ["sort"]


def test_drift_of_a_bf16_runs_export_takes_its_relative_base_from_the_runs_config(qwen_like_small_dir, tmp_path,
                                                                                   monkeypatch, capsys):
    """The Qwen-like fixture fitted in bf16 from a relative path (as the run's config.yaml records it): `analyze drift`
    of its export/, run from elsewhere, finds that base from the run directory and loads it in bf16, as the run
    started: the drift measured against the base named by hand."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(qwen_like_small_dir, "qwen")
    run = _fit_a_run("qwen", "--model.init_args.dtype", "bfloat16", "--model.init_args.max_new_tokens", "2")
    monkeypatch.chdir(tmp_path / "lightning_logs")
    export = str(run / "export")
    report = drift_command(tuned=export, taus=[0.0], out_dir=str(tmp_path / "d"), plot=False)
    assert f"base model {tmp_path / 'qwen'}, as {run / 'config.yaml'} names it" in capsys.readouterr().out
    given = drift_command(tuned=export, base=str(tmp_path / "qwen"), dtype="bfloat16", taus=[0.0],
                          out_dir=str(tmp_path / "d"), plot=False)
    assert report.sources["base"] == str(tmp_path / "qwen") and report.to_json()["overall"] == given.to_json()["overall"]


def test_forgetting_prompts_the_suite_in_the_system_turn_of_training(qwen_like_small_dir, tmp_path, capsys):
    """A checkpoint trained under a system_prompt (the Qwen-like fixture's chat template, bf16): `analyze forgetting`
    prompts the off-task probes in that system turn too. They took the template alone, so Qwen's default "You are
    Qwen, created by Alibaba Cloud" — a turn the model never trained under — stood before every probe."""
    system = "Please reason step by step."
    task = CountdownTask(prompt_format="r1", use_chat_template=True, system_prompt=system)
    module = ESModule(model=qwen_like_small_dir, dtype="bfloat16", task=task, population_size=2, sigma=5e-3, lr=3e-3,
                      max_new_tokens=2)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[])
    trainer.fit(module, datamodule=ReasoningDataModule(task, train_size=4, val_size=2, test_size=2, batch_size=2))
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    trainer.save_checkpoint(ckpt)

    settings = EvalSettings(num_problems=2, num_samples=2, max_new_tokens=3, temperature=1.0)
    report = forgetting_command(tuned=str(ckpt), tasks=["addition"], eval=settings, out_dir=str(tmp_path / "forgetting"),
                                plot=False, progress=False)
    addition = get_task("addition", use_chat_template=True, system_prompt=system)
    base = load_policy(qwen_like_small_dir, dtype="bfloat16")
    assert base.render_prompts(["1+2="], True, system)[0].startswith(f"<|im_start|>system\n{system}<|im_end|>")
    by_hand = evaluate_policy(base, addition, heldout_problems(addition, 2, 0), settings)
    assert report.evaluation.results["base"]["addition"] == by_hand
    assert report.evaluation.results["base"]["countdown"] == evaluate_policy(base, task, heldout_problems(task, 2, 0),
                                                                             settings)
    assert f"addition (use_chat_template=True, system_prompt={system!r})" in capsys.readouterr().out


def test_tasks_as_trained_settings_given_recorded_and_chosen():
    from es_lightning.analysis.checkpoints import TrainedWith
    from es_lightning.analysis.evaluate import tasks_as_trained
    from es_lightning.tasks.base import task_record

    r1 = TrainedWith(task=task_record(CountdownTask(prompt_format="r1", use_chat_template=True)))
    recipe_task = CountdownTask()  # a recipe's own task object (sweep, compare): as given
    countdown, addition, given, spec = tasks_as_trained(
        ["countdown", "addition", recipe_task, {"class_path": "countdown", "init_args": {"prompt_format": "r1"}}], None,
        [("base", TrainedWith()), ("es.ckpt", r1)])
    assert (countdown.prompt_format, countdown.use_chat_template, addition.use_chat_template) == ("r1", True, True)
    assert (given.prompt_format, given.use_chat_template) == ("compact", False) and given is not recipe_task
    assert (spec.prompt_format, spec.use_chat_template) == ("r1", False)
    plain = tasks_as_trained(["countdown", recipe_task], False, [("es.ckpt", r1)])
    assert [t.use_chat_template for t in plain] == [False, False] and plain[0].prompt_format == "r1"
    assert [t.use_chat_template for t in tasks_as_trained(["addition"], True, [])] == [True]
    assert vars(tasks_as_trained(["countdown"], None, [("builtin", TrainedWith())])[0]) == vars(CountdownTask())
    system = TrainedWith(task=task_record(CountdownTask(use_chat_template=True, system_prompt="Think.")))
    for chat_template, expected in ((None, (True, "Think.")), (True, (True, "Think.")), (False, (False, None))):
        (other,) = tasks_as_trained(["addition"], chat_template, [("es.ckpt", system)])  # the system turn of training
        assert (other.use_chat_template, other.system_prompt) == expected, chat_template
    with pytest.raises(ValueError, match="needs class_path"):
        tasks_as_trained([{"name": "countdown"}], None, [])


def test_eval_names_only_the_task_settings_training_chose(qwen_like_small_dir, tmp_path, capsys):
    """`es-lightning eval` of an r1 Countdown checkpoint said "tasks as … was trained: countdown (prompt_format='r1',
    max_completion_chars=65536)": 65536 is r1's own default, no setting the run chose. It names what the run set; a
    bound the run did set is named. (The Qwen-like model: r1's ~530-character prompt has no room in the built-in
    model's 128 positions, which is refused.)"""
    for bound, said in ((None, "countdown (prompt_format='r1')"),
                        (4096, "countdown (prompt_format='r1', max_completion_chars=4096)")):
        task = CountdownTask(prompt_format="r1", **({} if bound is None else {"max_completion_chars": bound}))
        module = ESModule(model=qwen_like_small_dir, task=task, population_size=2, sigma=5e-3, lr=3e-3, max_new_tokens=2)
        trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, datamodule=ReasoningDataModule(task, train_size=2, val_size=1, test_size=1, batch_size=2))
        ckpt = tmp_path / f"r1-{bound}.ckpt"
        trainer.save_checkpoint(ckpt)
        capsys.readouterr()
        cli_main(["eval", "--checkpoints", str(ckpt), "--tasks", "countdown", "--eval.num_problems", "1",
                  "--eval.num_samples", "1", "--eval.max_new_tokens", "2", "--out_dir", str(tmp_path / "eval"),
                  "--progress", "false"])
        lines = [line for line in capsys.readouterr().out.splitlines() if "was trained:" in line]
        assert lines == [f"tasks as {ckpt} was trained: {said} (--eval.chat_template to choose the template)"], lines


def test_one_task_twice_is_refused():
    with pytest.raises(ValueError, match=r"tasks= names \['countdown'\] more than once"):
        evaluate_models([BUILTIN], tasks=["countdown", {"class_path": "countdown", "init_args": {"prompt_format": "r1"}}],
                        settings=EvalSettings(num_problems=1, num_samples=1), progress=False)


def test_trained_with_reads_a_runs_config_and_ignores_other_yaml(tmp_path):
    from es_lightning.analysis.checkpoints import trained_with

    export = tmp_path / "run" / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    config = tmp_path / "run" / "config.yaml"
    config.write_text("model:\n  init_args: {dtype: bfloat16}\ndata:\n  init_args:\n    task:\n"
                      "      class_path: countdown\n      init_args: {prompt_format: r1}\n")
    found = trained_with(str(export))  # a run's export: its run's config.yaml
    assert found.task == {"class_path": "countdown", "init_args": {"prompt_format": "r1"}} and found.dtype == "bfloat16"
    for text in ("- a list\n", "model: a-string\n", "model: {init_args: [1]}\n", ": not yaml: ["):
        config.write_text(text)  # a YAML of another shape beside a model directory is no run config: nothing, no crash
        assert trained_with(str(export)).task is None and trained_with(str(export)).dtype is None


def test_forgetting_of_a_model_trained_on_a_file(tmp_path):
    """--eval.source gives the training task's problems (GSM8K from a file, no generator) while the suite's probes
    stay procedural: it applied to every task and the suite's probes lacked the file's columns."""
    from es_lightning.analysis.forgetting import forgetting

    rows = [{"question": f"What is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"} for i in range(6)]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    settings = EvalSettings(num_problems=2, num_samples=1, max_new_tokens=4, source=str(tmp_path / "test.jsonl"))
    report = forgetting(BUILTIN, BUILTIN, tasks=["addition", "sort"], training_task="gsm8k", settings=settings,
                        progress=False)
    assert report.training_task == "gsm8k" and set(report.changes) == {"gsm8k", "addition", "sort"}
    expected = evaluate_policy(load_policy(BUILTIN), "addition", heldout_problems(get_task("addition"), 2, 0),
                               replace(settings, ks=[1]))
    assert report.evaluation.results["base"]["addition"]["pass@1"] == expected["pass@1"]


# --------------------------------------------------------------------------- ablation
# --------------------------------------------------------------------------- ablation
def test_ablation_at_zero_is_tuned_and_at_infinity_is_base_bitwise(monkeypatch):
    monkeypatch.setattr(drift_module, "CHUNK", 777)
    from es_lightning.analysis import ablation as ablation_module

    monkeypatch.setattr(ablation_module, "CHUNK", 777)
    base = load_policy(BUILTIN).model
    work = load_policy(BUILTIN).model
    _perturb(work, seed=3, scale=1e-3)
    base_w = {n: p.detach().clone() for n, p in base.named_parameters()}
    tuned_w = {n: p.detach().clone() for n, p in work.named_parameters()}

    assert ablate_(work, base_w, tuned_w, math.inf) == 1.0
    assert all(torch.equal(p, base_w[n]) for n, p in work.named_parameters())
    assert ablate_(work, base_w, tuned_w, 0.0) == 0.0
    assert all(torch.equal(p, tuned_w[n]) for n, p in work.named_parameters())
    tau = 1e-3
    reset = ablate_(work, base_w, tuned_w, tau)
    for n, p in work.named_parameters():  # elementwise: exactly tuned where |Δ| > τ, exactly base elsewhere
        keep = (tuned_w[n].double() - base_w[n].double()).abs() > tau
        assert torch.equal(p, torch.where(keep, tuned_w[n], base_w[n]))
    assert reset == pytest.approx(parameter_drift(base_w, tuned_w, [tau]).sparsity(tau), abs=0)
    assert 0.6 < reset < 0.75  # Δ ~ N(0, (1e-3)²): P(|Δ| <= 1e-3) ≈ 0.68
    with pytest.raises(ValueError, match="tau must be >= 0"):
        ablate_(work, base_w, tuned_w, -1.0)


def test_top_percent_keeps_exactly_the_largest_updates():
    # 200 distinct, exactly representable update magnitudes (k / 1024) in a random arrangement and random signs
    gen = torch.Generator().manual_seed(0)
    values = (torch.randperm(200, generator=gen) + 1).float() / 1024
    signs = torch.where(torch.rand(200, generator=gen) < 0.5, -1.0, 1.0)
    base = {"a": torch.randn(120, generator=gen), "b": torch.randn(40, 2, generator=gen)}
    delta = (values * signs)
    tuned = {"a": base["a"] + delta[:120], "b": base["b"] + delta[120:].view(40, 2)}
    model = torch.nn.ParameterDict({k: torch.nn.Parameter(v.clone()) for k, v in tuned.items()})
    mags = torch.cat([(tuned[k].double() - base[k].double()).abs().reshape(-1) for k in ("a", "b")])
    for percent, kept in ((10, 20), (25, 50), (100, 200), (0.5, 1)):
        tau = top_percent_threshold(base, tuned, percent)
        reset = ablate_(model, base, tuned, tau)
        assert reset == 1 - kept / 200
        kept_mask = torch.cat([(model[k].detach() != base[k]).reshape(-1) for k in ("a", "b")])
        assert set(kept_mask.nonzero().view(-1).tolist()) == set(mags.topk(kept).indices.tolist())
    for bad in (0, -5, 150):
        with pytest.raises(ValueError, match=r"\(0, 100\]"):
            top_percent_threshold(base, tuned, bad)


def test_ablation_and_forgetting_default_to_the_task_the_checkpoint_records(es_checkpoint, tmp_path, capsys):
    """A checkpoint of a GSM8K (here: addition) run is ablated on that task, and forgetting's reference row is it, when
    no --task / --training_task is given — not on Countdown, as they did whatever the run trained on."""
    from es_lightning.tasks.base import TASK_KEY, task_record

    checkpoint = torch.load(es_checkpoint[0], map_location="cpu", weights_only=False)
    checkpoint[TASK_KEY] = task_record(get_task("addition"))
    path = tmp_path / "addition.ckpt"
    torch.save(checkpoint, path)
    settings = EvalSettings(num_problems=2, num_samples=2, max_new_tokens=4)
    report = ablation_command(tuned=str(path), taus=[], top_percent=[50], eval=settings, plot=False, progress=False,
                              out_dir=str(tmp_path / "a"))
    assert report.settings["task"] == "addition"
    assert "was trained: countdown" not in capsys.readouterr().out
    forgot = forgetting_command(tuned=str(path), tasks=["sort"], eval=settings, plot=False, progress=False,
                                out_dir=str(tmp_path / "f"))
    assert forgot.training_task == "addition" and set(forgot.changes) == {"addition", "sort"}
    # the fixture's own checkpoint records Countdown; a task named on the command line still wins
    assert ablation_command(tuned=str(path), task="countdown", taus=[], top_percent=[50], eval=settings, plot=False,
                            progress=False, out_dir=str(tmp_path / "b")).settings["task"] == "countdown"


def test_ablation_command_reproduces_tuned_and_base_scores(es_checkpoint, tmp_path, capsys):
    path, saved = es_checkpoint
    kwargs = dict(task="countdown", eval=EvalSettings(num_problems=6, num_samples=4, max_new_tokens=8, seed=5), progress=False)
    report = ablation_command(tuned=path, taus=[1e-3], top_percent=[50], save_models=True, out_dir=str(tmp_path), **kwargs)
    labels = [r["label"] for r in report.rows]
    assert labels == ["base", "tuned", "tau=0.001", "top 50%"]

    task = get_task("countdown")
    problems = heldout_problems(task, 6, 5)
    settings = EvalSettings(num_samples=4, ks=[1, 4], max_new_tokens=8, seed=5, temperature=0.6)
    base_scores = evaluate_policy(load_policy(BUILTIN), task, problems, settings)
    tuned_scores = evaluate_policy(load_model(path).policy, task, problems, settings)
    for key in ("pass@1", "pass@4", "maj@4", "entropy", "reward_mean"):
        assert report.row("base")[key] == base_scores[key]
        assert report.row("tuned")[key] == tuned_scores[key]
    base_weights = {n: p.detach() for n, p in load_policy(BUILTIN).model.named_parameters()}
    s_0 = parameter_drift(base_weights, saved, [0.0]).sparsity(0.0)  # weights the update left bit-identical
    assert report.row("base")["sparsity"] == 1.0 and report.row("tuned")["sparsity"] == s_0 < 1e-5
    assert report.row("top 50%")["sparsity"] == pytest.approx(0.5, abs=1e-5)
    # the written ablated model holds exactly θ where |Δθ| > 1e-3 and θ₀ elsewhere
    written = load_policy(report.row("tau=0.001")["path"]).model
    base = dict(load_policy(BUILTIN).model.named_parameters())
    for n, p in written.named_parameters():
        keep = (saved[n].double() - base[n].detach().double()).abs() > 1e-3
        assert torch.equal(p, torch.where(keep, saved[n], base[n].detach()))
    data = json.loads((tmp_path / "ablation.json").read_text())
    assert data["rows"][0]["tau"] == "inf" and data["ks"] == [1, 4]
    assert (tmp_path / "ablation.png").read_bytes()[:8] == PNG_MAGIC
    assert "Δ pass@4" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"\(0, 100\]"):
        ablation_command(tuned=path, top_percent=[0], out_dir=str(tmp_path), **kwargs)
    with pytest.raises(ValueError, match="tau must be >= 0"):
        ablation_command(tuned=path, taus=[-1e-4], out_dir=str(tmp_path), **kwargs)


def test_ablation_of_a_bf16_runs_export_scores_its_tuned_row_as_eval_does(tmp_path, capsys):
    """`analyze ablation` of a bf16 run's export/ loaded it in float32 (its default: "a .ckpt's own, else float32")
    while `eval` and `analyze forgetting` load it in the dtype the run records: the ablation's "tuned" row had other
    Pass@k than `eval` of the same export with the same settings (0.344 against 0.328 here). Both models are loaded in
    the recorded dtype now, as forgetting does."""
    import yaml

    policy = load_policy(BUILTIN)
    export = tmp_path / "run" / "export"
    policy.model.to(torch.bfloat16).save_pretrained(export)
    policy.tokenizer.save_pretrained(export)
    run_config = {"model": {"class_path": "es_lightning.ESModule",
                            "init_args": {"model": BUILTIN, "dtype": "bfloat16", "task": "countdown"}}}
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(run_config))
    settings = EvalSettings(num_problems=16, num_samples=4)
    evaluated = eval_command(checkpoints=[str(export)], tasks=["countdown"], eval=settings, plot=False,
                                 progress=False, out_dir=str(tmp_path / "eval"))
    report = ablation_command(tuned=str(export), base=BUILTIN, taus=[0.0], eval=settings, plot=False, progress=False,
                              out_dir=str(tmp_path / "ablation"))
    scores = next(iter(evaluated.results.values()))["countdown"]
    for key in ("pass@1", "pass@4", "maj@4", "reward_mean"):
        assert report.row("tuned")[key] == scores[key], key
    assert "both models in bfloat16, as" in capsys.readouterr().out


# --------------------------------------------------------------------------- eval
def _binomial_pass_at_k(n: int, c: int, k: int) -> float:
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def test_eval_command_pass_at_k_matches_the_binomial_formula(es_checkpoint, tmp_path, capsys):
    path, _ = es_checkpoint
    cli_main(["eval", "--checkpoints", BUILTIN, path, "--labels", "base", "es", "--tasks", "countdown", "addition",
              "--eval.num_problems", "5", "--eval.num_samples", "4", "--eval.max_new_tokens", "8", "--eval.seed", "3",
              "--out_dir", str(tmp_path), "--progress", "false"])
    out = capsys.readouterr().out
    assert "pass@1" in out and "maj@4" in out and "addition" in out
    data = json.loads((tmp_path / "eval.json").read_text())
    assert data["settings"]["ks"] == [1, 2, 4] and data["settings"]["temperature"] == 0.6
    assert list(data["results"]) == ["base", "es"] and data["sources"]["es"] == path
    assert (tmp_path / "pass_at_k.png").read_bytes()[:8] == PNG_MAGIC
    md = (tmp_path / "eval.md").read_text()
    assert "| model | task | pass@1 |" in md and md.count("| es | ") == 2

    # independently: the correctness matrix of the same samples, scored by the binomial formula
    for label, spec in (("base", BUILTIN), ("es", path)):
        for task_name in ("countdown", "addition"):
            task = get_task(task_name)
            problems = heldout_problems(task, 5, 3)
            module = evaluation_module(load_model(spec).policy, task, 8)
            batch = module.evaluate_batch(problems, 4, SamplingParams(max_new_tokens=8, temperature=0.6), seed=3)
            counts = batch.correct.sum(1).tolist()  # [P]
            for k in (1, 2, 4):
                expected = sum(_binomial_pass_at_k(4, c, k) for c in counts) / len(counts)
                assert data["results"][label][task_name][f"pass@{k}"] == pytest.approx(expected, abs=1e-6)


def test_eval_of_constant_logits_is_uniform_entropy_and_zero_pass(tmp_path):
    """Zeroing the final norm makes every logit 0: the sampling distribution is uniform over the vocabulary (entropy
    ln V exactly) and greedy decoding emits no answer (pass@1 0, format 0)."""
    policy = load_policy(BUILTIN)
    with torch.no_grad():
        policy.model.model.norm.weight.zero_()
    task = get_task("addition")
    scores = evaluate_policy(policy, task, heldout_problems(task, 4, 0),
                             EvalSettings(num_samples=1, temperature=0.0, max_new_tokens=6))
    assert scores["pass@1"] == 0 and scores["format"] == 0
    assert scores["entropy"] == pytest.approx(math.log(policy.model.config.vocab_size), rel=1e-6)


def test_eval_refuses_bad_input(tmp_path):
    assert default_ks(32) == [1, 2, 4, 8, 16, 32] and default_ks(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="k=8 exceeds num_samples=4"):
        EvalSettings(num_samples=4, ks=[1, 8])
    with pytest.raises(ValueError, match="k=8 exceeds num_samples=4"):
        EvalSettings(num_samples=4).pass_at_ks(default=[1, 8])
    assert EvalSettings(num_samples=12).pass_at_ks() == [1, 2, 4, 8, 12]
    assert EvalSettings(num_samples=12, ks=[4, 1, 4]).pass_at_ks(default=[1, 12]) == [1, 4]
    for bad, option in ((dict(num_samples=0), "num_samples"), (dict(temperature=-1), "temperature"),
                        (dict(top_p=0), "top_p"), (dict(batch_size=0), "batch_size"), (dict(num_problems=0), "num_problems"),
                        (dict(max_new_tokens=0), "max_new_tokens"), (dict(ks=[0, 1]), "positive")):
        with pytest.raises(ValueError, match=option):
            EvalSettings(**bad)
    with pytest.raises(ValueError, match="max_new_tokens is null"):
        EvalSettings(max_new_tokens=None).completion_cap()
    with pytest.raises(ValueError, match=r"'hf' takes no generation_options.*add EvalSettings\(generation_backend='vllm'\)") as err:
        EvalSettings(generation_options={"max_model_len": 64})  # engine settings without the vllm backend
    assert "configs/generation" not in str(err.value)  # a fit's config fragment: no option of an evaluation
    with pytest.raises(ValueError, match=r"generation_backend must be one of \('hf', 'vllm'\), got 'vlm'"):
        EvalSettings(generation_backend="vlm")
    small = EvalSettings(num_problems=2, num_samples=2)
    with pytest.raises(ValueError, match="unknown task 'sudoku'"):
        eval_command(checkpoints=[BUILTIN], tasks=["sudoku"], eval=small, out_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        eval_command(checkpoints=[str(tmp_path / "nope.ckpt")], eval=small, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="one label per model"):
        eval_command(checkpoints=[BUILTIN], labels=["a", "b"], eval=small, out_dir=str(tmp_path))


def test_evaluation_problems_from_files_and_mistakes_in_eval_terms(tmp_path):
    """A file of problems is evaluated whatever its name (a lone test.jsonl once failed for want of a train split):
    its test split, or its only split, shuffled by the seed — the same rows as the file's, drawn without repeats;
    too few rows, missing columns and a task without a generator name the evaluation's settings, not training's data.*
    (a script, as here: EvalSettings(...) arguments; the command's --eval.* options are tested through it)."""
    import json

    task = get_task("countdown")
    rows = [{"nums": [i, 2, 3], "target": i + 5} for i in range(1, 21)]
    for name in ("test.jsonl", "problems.jsonl"):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
        got = heldout_problems(task, 7, seed=3, source=str(tmp_path / name))
        assert len(got) == 7 and len({g["target"] for g in got}) == 7
        assert {g["target"] for g in got} <= {r["target"] for r in rows}
        assert got == heldout_problems(task, 7, seed=3, source=str(tmp_path / name))  # the seed decides
    with pytest.raises(ValueError, match=r"has 20 problems in its 'train' split, fewer than eval.num_problems=21; "
                                         r"lower EvalSettings\(num_problems=\.\.\.\) \(e.g. to 20\)"):
        heldout_problems(task, 21, source=str(tmp_path / "problems.jsonl"))
    (tmp_path / "cols.jsonl").write_text('{"numbers": [1, 2], "target": 3}\n' * 4)
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['nums'\] .* Map them with EvalSettings\(column_mapping=\.\.\.\), "
                                         r"e.g. column_mapping: \{numbers: nums\}$"):
        heldout_problems(task, 2, source=str(tmp_path / "cols.jsonl"))
    mapped = heldout_problems(task, 2, source=str(tmp_path / "cols.jsonl"), column_mapping={"numbers": "nums"})
    assert mapped == [{"nums": [1, 2], "target": 3}] * 2  # as a fit with data.column_mapping reads it
    with pytest.raises(ValueError, match=r"^EvalSettings\(column_mapping=\.\.\.\) renames \['nmbrs'\], but .* has columns"):
        heldout_problems(task, 2, source=str(tmp_path / "cols.jsonl"), column_mapping={"nmbrs": "nums"})
    (tmp_path / "bad.jsonl").write_text('{"nums": "abc", "target": 3}\n' * 2)
    with pytest.raises(ValueError, match=r"'nums' column is 'abc'.* with EvalSettings\(column_mapping=\.\.\.\) — fix those rows"):
        heldout_problems(task, 2, source=str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match=r"has no procedural generator; set EvalSettings\(source=\.\.\.\)"):
        heldout_problems(get_task("gsm8k"), 2)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_evaluation_rows_the_task_refuses_are_counted_and_the_first_named(tmp_path, fmt):
    """A file with rows the task refuses: the evaluation stopped at the first one it drew, in the task's words alone
    (no count, no row number, no file), where a fit names how many, the first's row number and the fix. Now the
    evaluation names them as a fit does, and says what to do instead of the fit's data.drop_invalid_rows."""
    import datasets

    task = get_task("countdown")
    rows = [{"nums": [i, 2, 3], "target": i + 5} for i in range(10)]
    for i in (7, 3, 8):
        rows[i] = {"nums": None, "target": 1}
    path = tmp_path / f"problems.{fmt}"
    getattr(datasets.Dataset.from_list(rows), "to_json" if fmt == "jsonl" else "to_parquet")(str(path))
    with pytest.raises(ValueError) as refused:
        heldout_problems(task, 10, source=str(path))
    assert str(refused.value).startswith(
        f"3 of the 10 rows drawn from the 'train' split of EvalSettings(source={str(path)!r}) are refused by task 'countdown', "
        "the first (row 3, counting from 0) as: Countdown record")
    assert str(refused.value).endswith("— fix those rows in the file (or map its columns with EvalSettings(column_mapping=...)); "
                                       "an evaluation has no drop_invalid_rows: it scores every row it draws")
    assert "data." not in str(refused.value) and "\n" not in str(refused.value)
    ok = datasets.Dataset.from_list([r for i, r in enumerate(rows) if i not in (7, 3, 8)])
    ok.to_json(str(tmp_path / "ok.jsonl"))  # the rows drawn are those the seed drew before
    assert heldout_problems(task, 5, seed=3, source=str(tmp_path / "ok.jsonl")) == [
        task.preprocess(dict(r)) for r in ok.shuffle(seed=3).select(range(5))]


def test_cli_help_bad_keys_and_list_values(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--help"])
    assert exit_info.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--eval.num_samples" in help_text and "Ba et al. 2026: 32" in help_text and "default: 32" in help_text
    with pytest.raises(SystemExit):
        cli_main(["analyze", "sweep", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--eval.temperature" in help_text and "default: 1.0" in help_text  # sweep's own defaults, same docs
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["analyze", "--help"])
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in ("drift", "ablation", "forgetting", "sweep"))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["analyze", "drift", "--tuned", "x.ckpt", "--tauz", "1"])
    assert exit_info.value.code != 0 and "tauz" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--checkpoints", "./no/such.ckpt", "--eval.num_samples", "4"])
    assert exit_info.value.code == 2 and "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["analyze", "ablation", "--tuned", BUILTIN, "--base", BUILTIN, "--top_percent", "150"])
    assert exit_info.value.code == 2 and "(0, 100]" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a bad evaluation setting, refused before anything is loaded
        cli_main(["eval", "--checkpoints", "./no/such.ckpt", "--eval.num_samples", "4", "--eval.ks", "1", "8"])
    assert exit_info.value.code == 2 and "k=8 exceeds num_samples=4" in capsys.readouterr().err
    assert join_list_values(["--tasks", "addition", "sort", "--seed", "1", "--taus", "0", "1e-5", "inf"],
                            {"tasks", "taus"}) == ["--tasks", '["addition", "sort"]', "--seed", "1", "--taus", "[0, 1e-5, inf]"]
    assert join_list_values(["--ks", "[1, 2]", "--labels", "null"], {"ks", "labels"}) == ["--ks", "[1, 2]", "--labels", "null"]


# --------------------------------------------------------------------------- forgetting
def test_forgetting_of_unchanged_and_of_broken_models(tmp_path, capsys):
    same = tmp_path / "same"
    policy = load_policy(BUILTIN)
    policy.model.save_pretrained(same)
    policy.tokenizer.save_pretrained(same)
    settings = EvalSettings(num_problems=4, num_samples=2, max_new_tokens=8)
    kwargs = dict(eval=settings, progress=False, plot=True)
    report = forgetting_command(tuned=str(same), base=BUILTIN, out_dir=str(tmp_path / "f1"), **kwargs)
    assert report.suite == ["addition", "sort"] and report.training_task == "countdown"
    assert all(v == 0 for changes in report.changes.values() for v in changes.values())  # same weights, same seeds
    sort_problems = heldout_problems(get_task("sort"), 4, 0)
    expected = evaluate_policy(load_policy(BUILTIN), "sort", sort_problems, EvalSettings(num_samples=2, max_new_tokens=8))
    assert report.evaluation.results["base"]["sort"]["pass@1"] == expected["pass@1"]

    broken = tmp_path / "broken"
    with torch.no_grad():
        policy.model.model.norm.weight.zero_()  # constant logits: greedy decoding answers nothing
    policy.model.save_pretrained(broken)
    policy.tokenizer.save_pretrained(broken)
    report = forgetting_command(tuned=str(broken), base=BUILTIN, out_dir=str(tmp_path / "f2"),
                                **{**kwargs, "eval": replace(settings, num_samples=1, temperature=0.0)})
    base = report.evaluation.results["base"]
    for task in ("countdown", "addition", "sort"):
        assert report.changes[task]["pass@1"] == -base[task]["pass@1"]
    assert base["addition"]["pass@1"] > 0.5  # the built-in model adds; the broken one forgot it all
    out = capsys.readouterr().out
    assert "held-out" in out and "trained" in out
    data = json.loads((tmp_path / "f2" / "forgetting.json").read_text())
    assert data["changes"]["sort"]["pass@1"] == -base["sort"]["pass@1"] and data["suite"] == ["addition", "sort"]
    assert (tmp_path / "f2" / "forgetting.png").read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ValueError, match="contains the training task"):
        forgetting_command(tuned=str(same), base=BUILTIN, tasks=["countdown", "sort"], out_dir=str(tmp_path), **kwargs)


class _Doubling(AdditionTask):
    """A custom task of its own name, named to `analyze forgetting` by its import path."""

    name = "doubling"


def test_forgetting_evaluates_a_custom_task_named_by_its_import_path(tmp_path, capsys):
    """`analyze forgetting --tasks my_package.MyTask`, as the unknown-task message asks: the suite was evaluated by
    the task's name alone, so a custom task was refused as unknown ("unknown task 'doubling'"), and one that kept a
    built-in task's name was silently replaced by the built-in task."""
    cli_main(["analyze", "forgetting", "--tuned", BUILTIN, "--base", BUILTIN, "--tasks", f"{__name__}._Doubling",
              "--training_task", "countdown", "--eval.num_problems", "2", "--eval.num_samples", "2",
              "--eval.max_new_tokens", "8", "--progress", "false", "--plot", "false", "--out_dir", str(tmp_path / "f")])
    data = json.loads((tmp_path / "f" / "forgetting.json").read_text())
    assert data["suite"] == ["doubling"] and list(data["results"]["tuned"]) == ["countdown", "doubling"]
    assert any(line.split()[:2] == ["doubling", "held-out"] for line in capsys.readouterr().out.splitlines())


def test_forgetting_refuses_a_suite_with_the_training_task_before_loading_a_model(es_checkpoint, tmp_path, capsys):
    """The suite holds the task the checkpoint records: refused from the names alone. It loaded the tuned model first
    and printed "both models in float32, as … was trained" before the refusal."""
    with pytest.raises(ValueError, match=r"the held-out suite \['countdown', 'sort'\] contains the training task "
                                         r"'countdown'; forgetting is measured on other tasks") as err:
        forgetting_command(tuned=es_checkpoint[0], tasks=["countdown", "sort"], out_dir=str(tmp_path / "f"),
                           progress=False, plot=False)
    assert "\n" not in str(err.value)
    captured = capsys.readouterr()
    assert captured.out == "" and "Loading weights" not in captured.err


# --------------------------------------------------------------------------- population sweep
def test_population_sweep_matches_es_lightning_fit(tmp_path, capsys):
    recipe = str(ROOT / "recipes" / "es.yaml")
    overrides = ["--data.init_args.train_size", "16", "--model.init_args.max_new_tokens", "8"]
    report = sweep_command(recipe=recipe, populations=[2, 4], steps=1, batch_size=2, overrides=overrides,
                           eval=replace(SWEEP_EVAL, num_problems=4, num_samples=2), save_models=True,
                           out_dir=str(tmp_path / "sweep"))
    assert [r["population_size"] for r in report.rows] == [0, 2, 4]
    assert [r["steps"] for r in report.rows] == [0, 1, 1]
    row = report.rows[2]
    assert len(row["rewards"]) == 1 and 0 <= row["reward"] <= 1
    # the final evaluation is evaluate_policy of the saved final weights
    problems = heldout_problems(get_task("countdown"), 4, 0)
    again = evaluate_policy(load_policy(row["path"]), "countdown", problems,
                            EvalSettings(num_samples=2, max_new_tokens=8, temperature=1.0))
    assert again["pass@1"] == row["pass@1"] and again["pass@2"] == row["pass@2"]
    assert (tmp_path / "sweep" / "sweep.png").read_bytes()[:8] == PNG_MAGIC
    written = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert written["rows"][2]["population_size"] == 4
    assert written["settings"]["eval"]["max_new_tokens"] == 8  # null: the recipe's cap, here overridden to 8
    assert "pass@1" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the sweep's handler between fits is gone with it

    # the same run through `es-lightning fit` logs the same reward and ends on the same weights
    logs = tmp_path / "fit"
    cli_main(["fit", "--config", recipe, *overrides, "--model.init_args.population_size", "4", "--trainer.max_steps", "1",
              "--data.init_args.batch_size", "2", "--data.init_args.val_size", "2", "--trainer.enable_progress_bar",
              "false", "--trainer.val_check_interval", "1", "--trainer.logger.init_args.save_dir", str(logs)])
    metrics = [r for r in csv.DictReader(open(next(logs.rglob("metrics.csv")))) if r.get("train/reward_mean")]
    assert float(metrics[-1]["train/reward_mean"]) == pytest.approx(row["reward"], abs=1e-6)
    fitted = load_model(str(next(logs.rglob("*.ckpt")))).policy.model
    swept = dict(load_policy(row["path"]).model.named_parameters())
    assert all(torch.equal(p, swept[n]) for n, p in fitted.named_parameters())
    with pytest.raises(ValueError, match="population sizes must be >= 2"):
        sweep_command(recipe=recipe, populations=[1], out_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match="recipe"):
        sweep_command(recipe=str(tmp_path / "none.yaml"), out_dir=str(tmp_path))


def test_a_sweep_evaluated_on_its_recipes_data_file_names_its_training_problems(tmp_path, monkeypatch):
    """`analyze sweep --eval.source train.jsonl` with the recipe's data.source that same file: past the fit's test
    rows the problems evaluated were training problems, scored as held out without a word."""
    monkeypatch.chdir(tmp_path)
    rows = CountdownTask().procedural(40, 0)
    Path("train.jsonl").write_text("".join(json.dumps({"nums": r["nums"], "target": r["target"]}) + "\n" for r in rows))
    overrides = ["--data.init_args.source", "train.jsonl", "--data.init_args.train_size", "null",
                 "--data.init_args.val_size", "4", "--data.init_args.test_size", "4", "--model.init_args.max_new_tokens", "2"]
    with pytest.warns(UserWarning, match=r"^\d+ of the 20 countdown problems evaluated \(EvalSettings\(source='train.jsonl'\)\) are "
                                         r"training problems of the fits of .*es.yaml \(data.source 'train.jsonl'\)"):
        sweep_command(recipe=str(ROOT / "recipes" / "es.yaml"), populations=[2], steps=1, batch_size=2,
                      overrides=overrides, eval=replace(SWEEP_EVAL, num_problems=20, num_samples=1, source="train.jsonl"),
                      out_dir=str(tmp_path / "sweep"), plot=False)


def test_population_sweep_saves_a_bf16_model_that_names_its_dtype_for_transformers_4_and_5(tmp_path):
    """`analyze sweep --save_models` of a bf16 run wrote each model with transformers 5's `save_pretrained`, whose
    config.json names the dtype as `dtype` alone: transformers 4 and older vLLM (which read `torch_dtype`) loaded it in
    fp32. It is written as HFExport's and `analyze ablation`'s models are, with both keys."""
    from transformers import AutoModelForCausalLM

    report = sweep_command(recipe=str(ROOT / "recipes" / "es.yaml"), populations=[2], steps=1, batch_size=2,
                           overrides=["--data.init_args.train_size", "16", "--model.init_args.max_new_tokens", "8",
                                      "--model.init_args.dtype", "bfloat16"],
                           eval=replace(SWEEP_EVAL, num_problems=2, num_samples=2), save_models=True,
                           out_dir=str(tmp_path / "sweep"), plot=False)
    path = Path(report.rows[1]["path"])
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == config["torch_dtype"] == "bfloat16"
    assert AutoModelForCausalLM.from_pretrained(path).dtype == torch.bfloat16


def test_builtin_evaluate_script_runs_on_the_shared_evaluation(tmp_path):
    from es_lightning.builtin.evaluate import main

    out = tmp_path / "builtin.json"
    results = main(["--tasks", "addition", "--num-problems", "4", "--num-samples", "2", "--ks", "1", "2",
                    "--max-new-tokens", "8", "--json", str(out)])
    problems = heldout_problems(get_task("addition"), 4, 0)
    policy = load_policy(BUILTIN)
    sampled = evaluate_policy(policy, "addition", problems, EvalSettings(num_samples=2, temperature=1.0, max_new_tokens=8))
    greedy = evaluate_policy(policy, "addition", problems, EvalSettings(num_samples=1, temperature=0.0, max_new_tokens=8))
    assert results["addition"] == {"pass@1": sampled["pass@1"], "pass@2": sampled["pass@2"], "format": sampled["format"],
                                   "greedy": greedy["pass@1"]}
    assert json.loads(out.read_text()) == results


class _FixedRewardTask(CountdownTask):
    """A user's task that fixes its parents' settings (no ``**kwargs``): only its own arguments may be recorded."""

    def __init__(self, num_numbers: int = 3) -> None:
        super().__init__(num_numbers=num_numbers, format_reward=0.0, prompt_format="r1")


def test_task_record_rebuilds_a_task_whose_constructor_fixes_its_parents():
    """The record is what the class accepts: a task without ``**kwargs`` recorded its parents' arguments too
    (``format_reward``, ``prompt_format``), and rebuilding it from the checkpoint failed with a TypeError."""
    from es_lightning.tasks.base import task_record

    record = task_record(_FixedRewardTask(num_numbers=4))
    assert record["init_args"] == {"num_numbers": 4}
    rebuilt = get_task(record["class_path"], **record["init_args"])
    assert (type(rebuilt), rebuilt.num_numbers, rebuilt.format_reward) == (_FixedRewardTask, 4, 0.0)
    from es_lightning.signatures import accepted_options

    assert "task_kwargs" not in accepted_options(type(get_task("gsm8k")))  # a **kwargs parameter is no option
    full = task_record(CountdownTask(prompt_format="r1"))
    assert {"prompt_format", "num_numbers", "format_reward", "use_chat_template", "max_completion_chars"} <= set(full["init_args"])


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "qwen_like_small_dir"])
def test_eval_of_a_model_of_its_own_code_takes_eval_trust_remote_code(fixture, request, tmp_path, capsys):
    """A model directory whose auto_map names its own modelling code: `eval` had no way to allow it (the refusal said
    "set trust_remote_code: true", a setting of fits only); now it names --eval.trust_remote_code, which evaluates it —
    with the weights the directory holds (the same scores as the plain Qwen2 it was made from; the Qwen-like fixture:
    bf16 on disk, chat template, pad = EOS)."""
    tiny_model_dir = request.getfixturevalue(fixture)
    custom = str(model_of_its_own_code(tiny_model_dir, tmp_path / "custom"))
    capsys.readouterr()  # a fixture built just now wrote its progress
    small = ["--tasks", "addition", "--eval.num_problems", "2", "--eval.num_samples", "2", "--eval.max_new_tokens", "4",
             "--progress", "false", "--plot", "false"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["eval", "--checkpoints", custom, "--out_dir", str(tmp_path / "refused"), *small])
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and "\n" not in err, err
    assert "needs modelling code of its own" in err and "--eval.trust_remote_code true" in err, err
    cli_main(["eval", "--checkpoints", custom, tiny_model_dir, "--labels", "custom", "plain", "--eval.trust_remote_code",
              "true", "--out_dir", str(tmp_path / "eval"), *small])
    data = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert data["settings"]["trust_remote_code"] is True
    assert data["results"]["custom"] == data["results"]["plain"]
    loaded = load_model(custom, trust_remote_code=True)
    assert type(loaded.policy.model).__name__ == "CustomForCausalLM" and loaded.trust_remote_code
    # the modelling code's copy is in the suite's own modules cache (tests/conftest.py), not the user's
    code = Path(sys.modules[type(loaded.policy.model).__module__].__file__).resolve()
    assert code.is_relative_to(Path(os.environ["HF_MODULES_CACHE"]).resolve()), code
    with pytest.raises(ValueError, match=r"runs only with trust_remote_code=True;"):  # the library's own spelling
        load_model(custom)
    with pytest.raises(SystemExit) as exit_info:  # drift, which evaluates nothing, takes it as its own option
        cli_main(["analyze", "drift", "--tuned", custom, "--base", tiny_model_dir, "--out_dir", str(tmp_path / "d")])
    assert exit_info.value.code == 2 and "--trust_remote_code true" in capsys.readouterr().err
    cli_main(["analyze", "drift", "--tuned", custom, "--base", tiny_model_dir, "--trust_remote_code", "true",
              "--out_dir", str(tmp_path / "drift"), "--plot", "false"])
    assert "no weight moved" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli_main(["eval", "--help"])
    assert "--eval.trust_remote_code" in capsys.readouterr().out


def test_heldout_problems_source_refusals_name_eval_options(tmp_path):
    """A source the data module refuses while reading it (a glob matching nothing, mixed formats, a hub dataset
    directory of several configs) is named as the evaluation's source, with a fix it can take (a script, as here:
    EvalSettings(source=...)): an evaluation has no data.source nor data.hub_config."""
    task = get_task("countdown")
    with pytest.raises(FileNotFoundError, match=r"^EvalSettings\(source=\.\.\.\) '.*nothing-\*.jsonl' matches no files") as err:
        heldout_problems(task, 2, source=str(tmp_path / "nothing-*.jsonl"))
    assert "data." not in str(err.value)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "a.jsonl").write_text('{"nums": [1, 2], "target": 3}\n')
    (mixed / "b.csv").write_text("nums,target\n1,2\n")
    with pytest.raises(ValueError, match=r"^the 'train' split of EvalSettings\(source=\.\.\.\) .* mixes data file formats") as err:
        heldout_problems(task, 2, source=str(mixed))
    assert "data." not in str(err.value)
    hub = tmp_path / "hub"
    for config in ("main", "socratic"):
        (hub / config).mkdir(parents=True)
        (hub / config / "test.jsonl").write_text('{"nums": [1, 2], "target": 3}\n')
    with pytest.raises(ValueError,
                       match=r"its folders main, socratic hold some .*: point EvalSettings\(source=\.\.\.\) at one of them$") as err:
        heldout_problems(task, 1, source=str(hub))
    assert "hub_config" not in str(err.value) and "data." not in str(err.value)


def test_eval_settings_without_vllm_name_the_option():
    """--eval.generation_backend vllm without the vllm extra: the install line names the option that asked for it (the
    line said generation_backend, a fit's module option)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed")
    with pytest.raises(ImportError, match=r"needs vLLM: pip install .* \(EvalSettings\(generation_backend=\.\.\.\)\)$"):
        EvalSettings(generation_backend="vllm")


@pytest.mark.parametrize("command", ["drift", "ablation", "forgetting"])
def test_analyze_dtype_help_quotes_the_real_default(command, tmp_path, capsys):
    """--dtype's help said "the checkpoint's own", but a model directory (a bf16 export) is loaded in float32 when no
    --dtype is given: the help says so, as eval's does."""
    import torch

    from es_lightning.analysis.checkpoints import load_model

    with pytest.raises(SystemExit):
        cli_main(["analyze", command, "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    dtype_help = help_text.split("--dtype DTYPE ", 1)[1].split("(type:", 1)[0]
    assert "else float32" in dtype_help and "the checkpoint's own" not in dtype_help
    policy = load_policy("builtin:countdown-tiny")
    policy.model.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    policy.tokenizer.save_pretrained(tmp_path / "bf16")
    assert next(load_model(str(tmp_path / "bf16")).policy.model.parameters()).dtype == torch.float32


def test_evaluate_policy_checks_a_problem_sets_prompt_lengths_once(monkeypatch):
    """An ablation evaluates the same problems once per setting: their prompts were rendered and tokenized again for
    the length check each time. Now once per problem set; another set is still checked (and refused)."""
    from es_lightning.analysis.evaluate import evaluate_policy
    from es_lightning.analysis.settings import EvalSettings
    from es_lightning.modules import base
    from es_lightning.tasks import get_task

    counted = []
    real = base.prompt_token_counts
    monkeypatch.setattr(base, "prompt_token_counts", lambda tok, prompts: counted.append(len(prompts)) or real(tok, prompts))
    policy = load_policy(BUILTIN)
    settings = EvalSettings(num_problems=2, num_samples=1, ks=[1], max_new_tokens=2)
    problems = [{"question": "1+1", "answer": "#### 2"}, {"question": "2+2", "answer": "#### 4"}]
    task = get_task("gsm8k")  # as an ablation passes it: one task object for every setting
    for _ in range(3):
        evaluate_policy(policy, task, problems, settings)
    assert counted == [2]
    with pytest.raises(ValueError, match="no room for a completion"):
        evaluate_policy(policy, task, [{"question": "1" * 200, "answer": "#### 1"}], settings)


def test_a_missing_hub_model_or_dataset_in_an_analysis_names_the_option_that_gave_it(es_checkpoint, tmp_path, monkeypatch,
                                                                                     capsys):
    """A hub model that cannot be loaded (offline, not cached), given to an analysis command, was refused with "give a
    local model directory in its place" (of what?), and a .ckpt's hub base as if the .ckpt were that model: each
    refusal names the option the user gave (--checkpoints, --tuned, --base, --eval.source), never a fit's key."""
    from es_helpers import offline

    offline(monkeypatch)
    model, data = "es-lightning-tests/no-such-model", "es-lightning-tests/no-such-dataset"
    checkpoint = torch.load(es_checkpoint[0], map_location="cpu", weights_only=False)
    checkpoint["hyper_parameters"]["model"] = model  # a run trained from a hub model this machine does not have
    hub_based = tmp_path / "hub_based.ckpt"
    torch.save(checkpoint, hub_based)
    monkeypatch.chdir(tmp_path)
    small = ["--eval.num_problems", "2", "--eval.num_samples", "1", "--eval.ks", "[1]", "--eval.max_new_tokens", "4",
             "--plot", "false", "--progress", "false"]
    cases = [
        (["eval", "--checkpoints", model, *small], model, "give a local model directory as --checkpoints"),
        (["eval", "--checkpoints", str(hub_based), *small], model,
         "give the run's exported model directory (export/ beside checkpoints/) as --checkpoints"),
        (["eval", "--checkpoints", BUILTIN, "--tasks", "gsm8k", "--eval.source", data, *small], data,
         "point --eval.source at a local file or directory"),
        (["analyze", "drift", "--tuned", model, "--plot", "false"], model, "give a local model directory as --tuned"),
        (["analyze", "drift", "--tuned", BUILTIN, "--base", model, "--plot", "false"], model,
         "give a local model directory as --base"),
        (["analyze", "ablation", "--tuned", BUILTIN, "--base", model, *small], model, "give a local model directory as --base"),
        (["analyze", "forgetting", "--tuned", str(hub_based), *small], model,
         "give the run's exported model directory (export/ beside checkpoints/) as --tuned"),
        (["analyze", "forgetting", "--tuned", BUILTIN, "--base", model, *small], model,
         "give a local model directory as --base"),
        (["analyze", "forgetting", "--tuned", BUILTIN, "--base", BUILTIN, "--training_task", "gsm8k", "--eval.source", data,
          *small], data, "point --eval.source at a local file or directory"),
    ]
    for args, missing, fix in cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(args)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and repr(missing) in line and line.endswith(fix), (args, line)
        assert "model:" not in line and "data." not in line and "in its place" not in line, (args, line)
        if str(hub_based) in args:  # which model is missing: the .ckpt's base, not the .ckpt
            assert f"{str(hub_based)!r} was trained from base model {model!r}" in line, line


def test_an_analysis_called_from_a_script_names_its_python_arguments_the_command_its_options(tmp_path, monkeypatch, capsys):
    """The analyses a script calls (drift_command, forgetting_command, compare_methods, evaluate_models ...) worded
    their refusals as command-line options (`pass --base`, `give a local model directory as --tuned`): a script is
    told of the Python argument it passes (`base=`), the `es-lightning analyze` command still of its option."""
    from es_helpers import offline

    from es_lightning.analysis import compare_methods

    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    missing = "es-lightning-tests/no-such-model"
    afile = tmp_path / "afile"
    afile.write_text("")
    script_cases = [
        (lambda: drift_command(tuned=BUILTIN, out_dir="d"),
         "pass base= (the model it was trained from, e.g. base='builtin:countdown-tiny')"),
        (lambda: drift_command(tuned=BUILTIN, base=missing, out_dir="d"), "give a local model directory as base="),
        (lambda: drift_command(tuned=missing, out_dir="d"), "give a local model directory as tuned="),
        (lambda: drift_command(tuned=BUILTIN, taus=[], out_dir="d"), "e.g. taus=[0, 1e-6, 1e-5, 1e-4]"),
        (lambda: drift_command(tuned=BUILTIN, out_dir=str(afile)), "out_dir="),
        (lambda: forgetting_command(tuned=BUILTIN, tasks=["countdown"], out_dir="f"),
         "give other tasks, e.g. tasks=['addition', 'sort'] (the training task is added as a reference row by "
         "training_task=)"),
        (lambda: compare_methods(methods=[], seeds=[0]), "e.g. methods=['GRPO', 'ES'], seeds=[0]"),
        (lambda: compare_methods(methods=["GRPO", "GRPO→ES"], budget="time"), "leave them out: methods=['GRPO']"),
        (lambda: eval_command(checkpoints=[missing], out_dir="e"), "give a local model directory as checkpoints="),
        (lambda: evaluate_models([BUILTIN], tasks=[]), "e.g. tasks=['countdown', 'addition', 'sort']"),
    ]
    for call, said in script_cases:
        with pytest.raises((ValueError, ConnectionError, FileNotFoundError)) as refused:
            call()
        assert said in str(refused.value) and " --" not in str(refused.value), (said, str(refused.value))
    command_cases = [
        (["analyze", "drift", "--tuned", BUILTIN, "--out_dir", "d"],
         "pass --base (the model it was trained from, e.g. --base builtin:countdown-tiny)"),
        (["analyze", "drift", "--tuned", missing, "--out_dir", "d"], "give a local model directory as --tuned"),
        (["analyze", "drift", "--tuned", BUILTIN, "--out_dir", str(afile)], f"--out_dir {str(afile)!r} cannot be written"),
        (["analyze", "forgetting", "--tuned", BUILTIN, "--tasks", "countdown", "--out_dir", "f"],
         "give other tasks, e.g. --tasks addition sort (the training task is added as a reference row by --training_task)"),
        (["analyze", "compare", "--methods", "[GRPO, GRPO→ES]", "--budget", "time"], "leave them out: --methods [GRPO]"),
        (["eval", "--checkpoints", missing, "--out_dir", "e"], "give a local model directory as --checkpoints"),
    ]
    for args, said in command_cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(args)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and said in line, (args, line)
    # the command's words end with it: the script's next call is told of its Python argument again
    with pytest.raises(ValueError, match=r"pass base= "):
        drift_command(tuned=BUILTIN, out_dir="d")


def test_an_analysis_fit_of_a_missing_hub_model_names_the_option_that_gave_it(tmp_path, monkeypatch, capsys):
    """`analyze sweep --overrides '[--model.init_args.model, <hub id>]'` (or `analyze compare --method_overrides`) of a
    hub model this machine cannot load was refused naming `model:`, the recipe's key, which the override replaced:
    the line names the option the user gave it in; a recipe whose own `model:` is missing names that key in its file
    and the override that replaces it; a script calling population_sweep is told of its `overrides=`."""
    from es_helpers import offline

    from es_lightning.analysis import population_sweep

    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    missing, es = "es-lightning-tests/no-such-model", str(ROOT / "recipes" / "es.yaml")
    sweep = ["analyze", "sweep", "--populations", "2", "--steps", "1", "--eval.num_problems", "1", "--eval.num_samples", "1",
             "--plot", "false"]
    recipe = tmp_path / "hub.yaml"  # a recipe of a hub model this machine does not have
    recipe.write_text(Path(es).read_text().replace(f"model: {BUILTIN}", f"model: {missing}"))
    cases = [
        ([*sweep, "--recipe", es, "--overrides", f"[--model.init_args.model, {missing}]"],
         "point --model.init_args.model in --overrides at a local directory"),
        ([*sweep, "--recipe", str(recipe)],
         f"point model: in {recipe} at a local directory, or give --overrides '[--model.init_args.model, /path/to/model_dir]'"),
        (["analyze", "compare", "--recipes_dir", str(ROOT / "recipes"), "--methods", "[ES]", "--seeds", "[0]", "--steps", "2",
          "--method_overrides", f'{{"ES": [--model.init_args.model, {missing}]}}'],
         "point --model.init_args.model in --method_overrides at a local directory"),
    ]
    for args, fix in cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(args)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and repr(missing) in line and line.endswith(fix), (args, line)
    with pytest.raises(ConnectionError, match=r"point --model\.init_args\.model in overrides= at a local directory$"):
        population_sweep(recipe=es, populations=[2], steps=1, overrides=["--model.init_args.model", missing],
                          settings=replace(SWEEP_EVAL, num_problems=1, num_samples=1), out_dir="s")


def test_sweep_refuses_a_bad_eval_source_before_its_first_fit_is_set_up(tmp_path, monkeypatch, capsys):
    """`analyze sweep --eval.source <a missing file | a file without the task's columns>` read the held-out problems
    only after setting up the first fit (its Trainer, module and training data): it refuses them first, as compare
    does. The fits' training file here does not exist, so a refusal that came after the fit's set-up would be its."""
    from es_helpers import offline

    from es_lightning.analysis import population_sweep
    from es_lightning.data_files import SOURCE_KINDS

    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    missing, es = str(tmp_path / "no-such-train.jsonl"), str(ROOT / "recipes" / "es.yaml")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"foo": 1}\n{"foo": 2}\n')
    nope = str(tmp_path / "nope.jsonl")
    cases = [(nope, FileNotFoundError, f"--eval.source {nope!r} does not exist", f"EvalSettings(source=...) {nope!r} does not exist"),
             (str(bad), ValueError, *["its 'train' split lacks column(s) ['nums', 'target'] that task 'countdown' needs"] * 2)]
    for source, kind, said, said_to_a_script in cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(["analyze", "sweep", "--recipe", es, "--populations", "2", "--steps", "1", "--eval.num_problems", "1",
                      "--eval.num_samples", "1", "--plot", "false", "--eval.source", source, "--out_dir", "s",
                      "--overrides", f"[--data.init_args.source, {missing}]"])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and said in line and missing not in line, line
        assert kind is not FileNotFoundError or line.endswith(f"give --eval.source a {SOURCE_KINDS}"), line
        with pytest.raises(kind) as refused:
            population_sweep(recipe=es, populations=[2], steps=1, overrides=["--data.init_args.source", missing],
                             settings=replace(SWEEP_EVAL, num_problems=1, num_samples=1, source=source), out_dir="s")
        assert said_to_a_script in str(refused.value) and missing not in str(refused.value), refused.value
        assert not (tmp_path / "s").exists()


def test_eval_settings_refusals_name_the_option_in_the_command_and_the_argument_in_a_script(capsys):
    """EvalSettings' refusals named `--eval.*` options (`(option --eval.num_samples)`, `use --eval.device cpu`) even to a
    script, which has none: the command keeps its options, a script is told of `EvalSettings(<field>=...)`."""
    from es_lightning.analysis import eval_command

    cases = [(["--eval.num_samples", "0"], dict(num_samples=0),
              "(option --eval.num_samples)", "(EvalSettings(num_samples=...))"),
             (["--eval.device", "nosuchdevice"], dict(device="nosuchdevice"),
              "use auto, cpu or cuda (option --eval.device)", "use auto, cpu or cuda (EvalSettings(device=...))"),
             (["--eval.generation_options", "{max_model_len: 64}"], dict(generation_options={"max_model_len": 64}),
              "add --eval.generation_backend vllm, or drop --eval.generation_options",
              "add EvalSettings(generation_backend='vllm'), or drop EvalSettings(generation_options=...)")]
    for args, fields, command_said, script_said in cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(["eval", "--checkpoints", BUILTIN, "--out_dir", "never", *args])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and command_said in err and "EvalSettings(" not in err, err
        with pytest.raises(ValueError) as refused:
            eval_command(checkpoints=[BUILTIN], eval=EvalSettings(**fields), out_dir="never")
        assert script_said in str(refused.value) and "--eval." not in str(refused.value), refused.value


def test_analysis_overrides_as_one_string_are_split_as_a_shell_splits_them(tmp_path, monkeypatch, capsys):
    """`analyze sweep --overrides '--model.init_args.model <hub id>'` (a fit's options as one writes them on a command
    line) was refused as jsonargparse's "expected list": one string is split as a shell splits it (quotes kept
    together) and applied, here reaching the fit's model; `analyze compare --method_overrides` takes one string per
    method alike; an unbalanced quote is refused in one line naming the option."""
    from es_helpers import offline

    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    missing, es = "es-lightning-tests/no-such-model", str(ROOT / "recipes" / "es.yaml")
    sweep = ["analyze", "sweep", "--recipe", es, "--populations", "2", "--steps", "1", "--eval.num_problems", "1",
             "--eval.num_samples", "1", "--plot", "false"]
    compare = ["analyze", "compare", "--recipes_dir", str(ROOT / "recipes"), "--methods", "[ES]", "--seeds", "[0]",
               "--steps", "2"]
    cases = [([*sweep, "--overrides", f"--model.init_args.model '{missing}'"],
              "point --model.init_args.model in --overrides at a local directory"),
             ([*sweep, f"--overrides=--model.init_args.sigma 0.01 --model.init_args.model {missing}"],
              "point --model.init_args.model in --overrides at a local directory"),
             ([*compare, "--method_overrides", f'{{"ES": "--model.init_args.model {missing}"}}'],
              "point --model.init_args.model in --method_overrides at a local directory")]
    for args, fix in cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(args)
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert stop.value.code == 2 and repr(missing) in line and line.endswith(fix), (args, line)
    with pytest.raises(SystemExit) as stop:
        cli_main([*sweep, "--overrides", "--model.init_args.model 'unclosed"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and line.startswith("es-lightning analyze sweep: error: --overrides "
                                                    "\"--model.init_args.model 'unclosed\" cannot be split"), line


def test_heldout_problems_refusals_name_eval_options_in_the_command_and_eval_settings_in_a_script(tmp_path, capsys):
    """heldout_problems' refusals (too few rows: lower --eval.num_problems; rows the task refuses: map with
    --eval.column_mapping) and a drawn problem's place ("the 'train' split of --eval.source ...") named `--eval.*`
    options even to a script, which has none: the command keeps its options, a script is told of EvalSettings(...)."""
    from es_lightning.analysis import eval_command
    from es_lightning.analysis.evaluate import heldout_problems

    source = tmp_path / "problems.jsonl"
    source.write_text('{"nums": [1, 2], "target": 3}\n{"nums": "x", "target": 3}\n')
    cases = [(5, "lower --eval.num_problems (e.g. to 2)", "lower EvalSettings(num_problems=...) (e.g. to 2)"),
             (2, f"rows drawn from the 'train' split of --eval.source {str(source)!r} are refused",
              f"rows drawn from the 'train' split of EvalSettings(source={str(source)!r}) are refused"),
             (2, "fix those rows in the file (or map its columns with --eval.column_mapping)",
              "fix those rows in the file (or map its columns with EvalSettings(column_mapping=...))")]
    for num_problems, command_said, script_said in cases:
        with pytest.raises(SystemExit) as stop:
            cli_main(["eval", "--checkpoints", BUILTIN, "--tasks", "countdown", "--eval.source", str(source),
                      "--eval.num_problems", str(num_problems), "--out_dir", str(tmp_path / "never")])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and command_said in err and "EvalSettings(" not in err, err
        with pytest.raises(ValueError) as refused:
            eval_command(checkpoints=[BUILTIN], tasks=["countdown"], out_dir=str(tmp_path / "never"),
                         eval=EvalSettings(source=str(source), num_problems=num_problems))
        assert script_said in str(refused.value) and "--eval." not in str(refused.value), refused.value
    drawn = heldout_problems(get_task("countdown"), 1, source=str(source), seed=1)
    assert drawn.where == f"the 'train' split of EvalSettings(source={str(source)!r})", drawn.where


def test_sweep_names_the_option_that_gave_a_missing_training_file(tmp_path, monkeypatch, capsys):
    """`analyze sweep --overrides '--data.init_args.source x.jsonl'` with no such file was refused as "data source ...
    does not exist; give a ..." without naming where it was given: the way out names --data.init_args.source in
    --overrides (overrides= to a script), as a hub model's refusal does."""
    from es_helpers import offline

    from es_lightning.analysis import population_sweep
    from es_lightning.data_files import SOURCE_KINDS

    offline(monkeypatch)
    monkeypatch.chdir(tmp_path)
    es = str(ROOT / "recipes" / "es.yaml")
    with pytest.raises(SystemExit) as stop:
        cli_main(["analyze", "sweep", "--recipe", es, "--populations", "2", "--steps", "1", "--eval.num_problems", "1",
                  "--eval.num_samples", "1", "--plot", "false", "--out_dir", "s",
                  "--overrides", "--data.init_args.source no-such-train.jsonl"])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert stop.value.code == 2 and "data source 'no-such-train.jsonl' does not exist" in line, line
    assert line.endswith(f"; point --data.init_args.source in --overrides at a {SOURCE_KINDS}"), line
    with pytest.raises(FileNotFoundError) as refused:
        population_sweep(recipe=es, populations=[2], steps=1, overrides=["--data.init_args.source", "no-such-train.jsonl"],
                         settings=replace(SWEEP_EVAL, num_problems=1, num_samples=1), out_dir="s")
    assert str(refused.value).endswith(f"; point --data.init_args.source in overrides= at a {SOURCE_KINDS}"), refused.value
    with pytest.raises(FileNotFoundError, match=rf"does not exist .*; give a {SOURCE_KINDS}$"):  # outside: as before
        ReasoningDataModule("countdown", source="no-such-train.jsonl").setup()
