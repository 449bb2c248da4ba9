"""`es-lightning eval` on the vLLM backend (``--eval.generation_backend vllm``): an engine per model, closed before the
next one is built; greedy results equal the transformers backend's."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

ENGINE = {"max_model_len": 96, "cpu_kv_cache_gib": 0.0625}


def test_eval_on_vllm_greedy_equals_hf(tmp_path, monkeypatch):
    from es_lightning.analysis.evaluate import eval_command
    from es_lightning.analysis.settings import EvalSettings
    from es_lightning.cli import cli_main
    from es_lightning.generation.vllm import VLLMGenerator

    closed = []  # the engines the command built, as each is shut down
    real_close = VLLMGenerator.close
    monkeypatch.setattr(VLLMGenerator, "close", lambda self: (closed.append(self.llm is not None), real_close(self)))

    common = ["--eval.num_problems", "6", "--eval.num_samples", "1", "--eval.temperature", "0", "--eval.max_new_tokens",
              "12", "--eval.batch_size", "4"]
    hf = eval_command(checkpoints=["builtin:countdown-tiny"], labels=["hf"], eval=EvalSettings(
        num_problems=6, num_samples=1, temperature=0.0, max_new_tokens=12, batch_size=4), out_dir=str(tmp_path / "hf"),
        plot=False, progress=False)
    # two models in one command: the first model's engine is closed before the second one's is built
    try:
        cli_main(["eval", "--checkpoints", "builtin:countdown-tiny", "builtin:countdown-tiny", "--labels", "a", "b",
                  *common, "--eval.generation_backend", "vllm", "--eval.generation_options", json.dumps(ENGINE),
                  "--out_dir", str(tmp_path / "vllm"), "--plot", "false", "--progress", "false"])
    except SystemExit as done:
        assert not done.code
    assert closed == [True, True]  # an engine per model, each closed before the next was built
    got = json.loads((tmp_path / "vllm" / "eval.json").read_text())
    assert got["settings"]["generation_backend"] == "vllm"
    expected = hf.results["hf"]["countdown"]
    for label in ("a", "b"):
        row = got["results"][label]["countdown"]
        assert {k: row[k] for k in ("pass@1", "maj@1", "format", "reward_mean")} == \
            {k: expected[k] for k in ("pass@1", "maj@1", "format", "reward_mean")}
        assert row["entropy"] == pytest.approx(expected["entropy"], abs=1e-4)


def test_eval_of_the_qwen_like_fixture_on_vllm_greedy_equals_hf(tmp_path, qwen_like_dir):
    """The real-model path: Qwen's vocabulary size (151,936), chat template, pad = EOS and generation_config defaults
    (which must not leak into the engine's sampling) — greedy results on vLLM equal transformers'."""
    from es_lightning.analysis.evaluate import eval_command
    from es_lightning.analysis.settings import EvalSettings

    def run(backend: str, options: dict | None):
        settings = EvalSettings(num_problems=4, num_samples=1, temperature=0.0, max_new_tokens=8, batch_size=4,
                                chat_template=True, generation_backend=backend, generation_options=options)
        return eval_command(checkpoints=[qwen_like_dir], labels=[backend], eval=settings, out_dir=str(tmp_path / backend),
                            plot=False, progress=False).results[backend]["countdown"]

    hf, vllm = run("hf", None), run("vllm", {"max_model_len": 256, "cpu_kv_cache_gib": 0.0625})
    assert {k: vllm[k] for k in ("pass@1", "format", "reward_mean")} == {k: hf[k] for k in ("pass@1", "format", "reward_mean")}
    assert vllm["entropy"] == pytest.approx(hf["entropy"], abs=1e-3)


def test_eval_on_vllm_of_a_model_of_its_own_code(tmp_path, qwen_like_dir):
    """A model whose config.json's auto_map names its own modelling code, evaluated with --eval.trust_remote_code on
    vLLM: the engine's directory held the config and tokenizer but not the modelling .py files, so vLLM could not
    import the architecture even with trust_remote_code; now they are written beside them, and greedy results equal
    transformers' of the plain model the code subclasses."""
    from es_helpers import model_of_its_own_code

    from es_lightning.analysis.evaluate import eval_command
    from es_lightning.analysis.settings import EvalSettings

    custom = str(model_of_its_own_code(qwen_like_dir, tmp_path / "custom"))

    def run(model: str, backend: str, options: dict | None):
        settings = EvalSettings(num_problems=4, num_samples=1, temperature=0.0, max_new_tokens=8, batch_size=4,
                                generation_backend=backend, generation_options=options, trust_remote_code=True)
        return eval_command(checkpoints=[model], labels=[backend], eval=settings, out_dir=str(tmp_path / backend),
                            plot=False, progress=False).results[backend]["countdown"]

    hf, vllm = run(qwen_like_dir, "hf", None), run(custom, "vllm", {"max_model_len": 256, "cpu_kv_cache_gib": 0.0625})
    assert {k: vllm[k] for k in ("pass@1", "format", "reward_mean")} == {k: hf[k] for k in ("pass@1", "format", "reward_mean")}
    assert vllm["entropy"] == pytest.approx(hf["entropy"], abs=1e-4)


def _long_problem_setup():
    """Two Countdown problems, the second of 24 numbers (69 tokens as prompted on the Llama-like fixture), and greedy
    vLLM settings with a small KV cache and no max_model_len (vLLM derives its own)."""
    from es_lightning.analysis.settings import EvalSettings

    problems = [{"nums": [3, 5, 7], "target": 22}, {"nums": list(range(1, 25)), "target": 17}]
    return problems, EvalSettings(num_problems=2, num_samples=1, temperature=0.0, max_new_tokens=8, batch_size=2,
                                  generation_backend="vllm",
                                  generation_options={"cpu_kv_cache_gib": 0.0625, "max_num_seqs": 4})


def test_a_problem_past_the_max_model_len_vllm_derives_is_refused_and_the_engine_closed(closed_engines,
                                                                                       llama_like_seq40_dir):
    """With no max_model_len among the generation options, vLLM takes its own from the model's config (seq_length 40;
    the scaled RoPE gives no limit to check before the engine exists): the problems are checked against it once the
    engine is built, refused in one line with shorter prompts the fix (vLLM refuses a larger max_model_len), and the
    engine is closed, as after an evaluation."""
    from es_lightning import CountdownTask
    from es_lightning.analysis.evaluate import evaluate_policy
    from es_lightning.policy import load_policy

    closed = closed_engines
    problems, settings = _long_problem_setup()
    policy = load_policy(llama_like_seq40_dir, dtype="float32")
    with pytest.raises(ValueError) as refused:
        evaluate_policy(policy, CountdownTask(prompt_format="compact"), problems, settings)
    assert str(refused.value) == (
        "1 of the 2 problems has 40 tokens or more, and the vLLM engine's max_model_len (vLLM's own for this model, from "
        "its config: generation_options sets none, and vLLM refuses a larger one) is 40: no room for a completion; "
        "the first is problem 1 of those evaluated (69 tokens as prompted); shorten the prompts (the task's "
        "prompt format or system_prompt), or remove those rows from the data"), refused.value
    assert closed == [(40, True)]


def test_a_kv_cache_short_of_the_max_model_len_vllm_derives_names_the_one_the_problems_need(llama_like_dir):
    """With no max_model_len among the generation options, vLLM takes Llama 3's 131,072 from the model's config, which
    a small KV cache cannot hold one sequence of: the refusal names the max_model_len these problems need (their
    longest prompt, 69 tokens, + max_new_tokens 8), as a fit's names its data's, not a bare "the run needs"; with that
    max_model_len the evaluation runs."""
    from dataclasses import replace

    from es_lightning import CountdownTask
    from es_lightning.analysis.evaluate import evaluate_policy
    from es_lightning.policy import load_policy

    problems, settings = _long_problem_setup()
    policy = load_policy(llama_like_dir, dtype="float32")
    with pytest.raises(ValueError) as refused:
        evaluate_policy(policy, CountdownTask(prompt_format="compact"), problems, settings)
    assert str(refused.value) == (
        "the vLLM engine's KV cache (generation_options.cpu_kv_cache_gib=0.0625) holds 130944 tokens, short of one "
        "sequence of its max_model_len 131072 (vLLM's own for this model, from its config: generation_options sets "
        "none): set generation_options.max_model_len to the longest prompt + max_new_tokens the run needs (here 77), "
        "or raise generation_options.cpu_kv_cache_gib"), refused.value
    settings = replace(settings, generation_options={**settings.generation_options, "max_model_len": 77})
    metrics = evaluate_policy(policy, CountdownTask(prompt_format="compact"), problems, settings)
    assert 0.0 <= metrics["pass@1"] <= 1.0
