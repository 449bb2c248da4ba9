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
