"""make_generator: the backend factory, and the one-line refusal when vLLM is not installed (this suite's venv)."""

from __future__ import annotations

import importlib.util

import pytest

from es_lightning.generation import HFGenerator, make_generator
from es_lightning.policy import load_policy


@pytest.fixture(scope="module")
def policy():
    return load_policy("builtin:countdown-tiny")


def test_hf_backend(policy):
    assert isinstance(make_generator("hf", policy), HFGenerator)
    with pytest.raises(ValueError, match="takes no generation_options"):
        make_generator("hf", policy, max_model_len=128)


def test_hf_backend_refuses_engine_options_at_construction():
    """generation_options are the vLLM engine's: with generation_backend hf they are refused when the module is built."""
    from es_lightning import GRPOModule

    with pytest.raises(ValueError, match=r"generation_backend 'hf' takes no generation_options, got \['max_model_len'\]"):
        GRPOModule(generation_options={"max_model_len": 128})


def test_unknown_backend(policy):
    with pytest.raises(ValueError, match=r"generation_backend must be one of \('hf', 'vllm'\), got 'sglang'"):
        make_generator("sglang", policy)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here (.venv-vllm)")
def test_vllm_missing_names_the_install_command(policy):
    with pytest.raises(ImportError) as err:
        make_generator("vllm", policy)
    message = str(err.value)
    assert "\n" not in message
    assert 'pip install "es-lightning[vllm]"' in message and "make test-vllm" in message


def test_vllm_fragment_options_are_vllm_generator_arguments():
    """configs/generation/vllm.yaml's options reach VLLMGenerator(**options): every key must be one of its arguments
    (the module is importable without vLLM; only building an engine needs it)."""
    import inspect
    from pathlib import Path

    import yaml

    from es_lightning.generation.vllm import VLLMGenerator

    fragment = Path(__file__).resolve().parents[1] / "configs" / "generation" / "vllm.yaml"
    model = yaml.safe_load(fragment.read_text())["model"]["init_args"]
    assert model["generation_backend"] == "vllm"
    accepted = set(inspect.signature(VLLMGenerator.__init__).parameters) - {"self", "policy", "engine_kwargs"}
    assert set(model["generation_options"]) <= accepted


@pytest.mark.parametrize("option, value, match", [
    ("max_num_seqs", 0, r"generation_options.max_num_seqs must be a whole number >= 1, got 0"),
    ("gpu_memory_utilization", 1.5, r"generation_options.gpu_memory_utilization .* in \(0, 1\], got 1.5"),
    ("max_loras", -1, r"generation_options.max_loras must be a whole number >= 1, got -1"),
])
def test_vllm_generator_built_directly_checks_its_values(policy, option, value, match):
    """VLLMGenerator(policy, ...) from a script checks the values a module's generation_options get checked for,
    before vLLM is imported or an engine starts (was: only through a module; directly, vLLM's own late error)."""
    from es_lightning.generation.vllm import VLLMGenerator

    with pytest.raises(ValueError, match=match):
        VLLMGenerator(policy, **{option: value})


def test_vllm_rollout_logprobs_stay_fp32_under_bf16_true(policy, monkeypatch):
    """Lightning's bf16-true (the GPU trainer fragments) makes bf16 the default dtype inside a training step, where
    GRPO's rollouts are generated: vLLM's log-probs (GRPO's π_old) were written into a default-dtype tensor and rounded
    to bf16 (-7.123456 → -7.125). They are fp32, as HFGenerator's. No engine needed: the rows are vLLM-shaped."""
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.plugins.precision import HalfPrecision

    import es_lightning.generation.vllm as vllm_module
    from es_lightning.generation import SamplingParams

    gen = vllm_module.VLLMGenerator.__new__(vllm_module.VLLMGenerator)  # _rollout reads only the policy
    gen.policy = policy
    monkeypatch.setattr(vllm_module, "policy_token_stats", lambda model, rollout, T: (rollout.logprobs, rollout.logprobs))
    values = [-7.123456, -0.0123456]
    row = SimpleNamespace(token_ids=[5, 6], finish_reason="stop",
                          logprobs=[{5: SimpleNamespace(logprob=values[0])}, {6: SimpleNamespace(logprob=values[1])}])
    with HalfPrecision("bf16-true").forward_context():
        assert torch.get_default_dtype() == torch.bfloat16
        rollout = gen._rollout([[3, 4]], [SimpleNamespace(outputs=[row])], 1, SamplingParams(), return_logprobs=True)
    assert rollout.logprobs.dtype == torch.float32
    assert torch.equal(rollout.logprobs, torch.tensor([values], dtype=torch.float32))


def test_owned_engine_options_name_no_fit_only_option():
    """The reasons a vLLM engine option is refused are read by a fit and by `es-lightning eval` alike: they named
    model.init_args.model, a fit's option, to an evaluation (whose models are --checkpoints)."""
    from es_lightning.generation.options import _OWNED, refuse_owned_options

    for key in _OWNED:
        with pytest.raises(ValueError, match=rf"^generation_options.{key} is set by es-lightning") as err:
            refuse_owned_options({key: "x"})
        assert "init_args" not in str(err.value) and "--" not in str(err.value)
