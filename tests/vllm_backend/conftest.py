"""Fixtures of the vLLM backend's tests (run in .venv-vllm by ``make test-vllm``; skipped where vLLM is absent).

Engines are built once per session (a few seconds each on a CPU) and shared; tests that change an engine's weights
put the centre back. The Qwen-like model is the project's fixture (:func:`es_lightning.builtin.qwen_like.build_qwen_like`:
Qwen2.5's vocabulary size, special tokens, chat template and generation_config.json defaults; tied embeddings, head_dim
32 for vLLM's CPU attention), loaded in fp32.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: engine settings of the tests: a small KV cache (the CPU engine reserves it up front) and short sequences
ENGINE = dict(max_model_len=128, cpu_kv_cache_gib=0.0625, max_num_seqs=64)


@pytest.fixture(scope="session")
def qwen_like_dir(tmp_path_factory) -> str:
    """The Qwen2.5-Instruct look-alike at the real vocabulary size (151,936), bf16 on disk."""
    from es_lightning.builtin.qwen_like import build_qwen_like

    return build_qwen_like(tmp_path_factory.mktemp("qwen-like"))


@pytest.fixture(scope="session")
def keep_alive() -> list:
    """Append engines (or modules holding one) built inside a test: they then live until the session ends. A vLLM
    engine that is garbage-collected shuts down vLLM's process-wide state (its parallel groups), which the session's
    other engines still use — one engine per process is the supported layout; a test session holds several."""
    return []


@pytest.fixture
def closed_engines(monkeypatch) -> list:
    """The vLLM engines shut down during the test, as each is: (its max_model_len, whether it was running)."""
    from es_lightning.generation.vllm import VLLMGenerator

    closed = []
    real_close = VLLMGenerator.close
    monkeypatch.setattr(VLLMGenerator, "close", lambda self: (closed.append((self.max_model_len, self.llm is not None)),
                                                              real_close(self)))
    return closed


def _policy(name: str):
    from es_lightning.policy import load_policy

    return load_policy(name, dtype="float32")


def _engine(policy, **kw):
    from es_lightning.generation.vllm import VLLMGenerator

    return VLLMGenerator(policy, **{**ENGINE, **kw})


@pytest.fixture(scope="session")
def builtin_pair():
    """(policy, its vLLM generator) for the built-in model (tied embeddings, char tokenizer)."""
    policy = _policy("builtin:countdown-tiny")
    gen = _engine(policy)
    yield policy, gen
    gen.close()


@pytest.fixture(scope="session")
def qwen_pair(qwen_like_dir):
    """(policy, its vLLM generator) for the Qwen-like fixture."""
    policy = _policy(qwen_like_dir)
    gen = _engine(policy)
    yield policy, gen
    gen.close()


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    """(policy, its vLLM generator) for the Llama-3.2-Instruct look-alike (2,048 rows: one token per byte, so its
    chat template's system turn takes ~100 tokens; fp32). The engine is LoRA-enabled (three rank-2 adapters a call,
    tests/vllm_backend/test_vllm_lora.py) and has the ES worker extension: one engine serves the full-rank and the
    low-rank tests."""
    from es_lightning.builtin.llama_like import build_llama_like

    policy = _policy(build_llama_like(tmp_path_factory.mktemp("llama-like"), vocab_size=2048))
    gen = _engine(policy, max_model_len=256, max_num_seqs=32, enable_lora=True, max_lora_rank=8, max_loras=3,
                  max_cpu_loras=3)
    yield policy, gen
    gen.close()


@pytest.fixture(scope="session")
def llama_like_seq40_dir(llama_like_dir, tmp_path_factory) -> str:
    """The Llama-3.2 look-alike of tests/conftest.py (scaled RoPE: no position limit known) whose config also says
    ``seq_length: 40`` (as ChatGLM's and Qwen-1's configs do): vLLM takes the smallest such length as its
    max_model_len when generation_options sets none. A compact Countdown prompt of 24 numbers has 69 tokens on it."""
    import json
    import shutil

    model = tmp_path_factory.mktemp("llama-like-seq40") / "model"
    shutil.copytree(llama_like_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "seq_length": 40}))
    return str(model)


@pytest.fixture(scope="session")
def hf_generate():
    """HFGenerator.generate on a policy (a new generator per call: it holds no state between calls)."""
    from es_lightning.generation import HFGenerator

    def generate(policy, *args, **kwargs):
        return HFGenerator(policy).generate(*args, **kwargs)

    return generate


@pytest.fixture
def es_fit(keep_alive):
    """``es_fit(steps, **ESModule kwargs)``: an ESModule fit through the Python API on the built-in model and compact
    Countdown (4 prompts a step, greedy, population 4, no evaluation); returns (module, trainer)."""
    import lightning as L

    from es_lightning import CountdownTask, ESModule, ReasoningDataModule

    def run(steps: int, **kwargs):
        L.seed_everything(0, verbose=False)
        kwargs = {"population_size": 4, "sigma": 0.02, "lr": 0.01, "max_new_tokens": 8, "temperature": 0.0, **kwargs}
        module = ESModule(**kwargs)
        keep_alive.append(module)
        data = ReasoningDataModule(CountdownTask(prompt_format="compact"), train_size=16, val_size=2, test_size=2,
                                   batch_size=4)
        trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0)
        trainer.fit(module, data)
        return module, trainer

    return run
