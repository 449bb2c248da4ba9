"""Generation backends behind one interface (:class:`Generator`), built by name with :func:`make_generator`."""

from __future__ import annotations

import importlib.util
from typing import Any

from es_lightning.generation.base import Generator, Rollout, SamplingParams
from es_lightning.generation.hf import HFGenerator
from es_lightning.generation.options import check_vllm_values, refuse_owned_options

__all__ = ["BACKENDS", "Generator", "HFGenerator", "Rollout", "SamplingParams", "check_backend", "check_generation_options",
           "make_generator"]

#: the ``generation_backend`` values: transformers ``generate``, or a colocated vLLM engine (the ``vllm`` extra)
BACKENDS = ("hf", "vllm")


def check_backend(backend: str) -> None:
    """Refuse a backend name this installation cannot build, naming the fix (called when a module is constructed, so
    a missing vLLM is one line before anything loads, not an error at the first rollout)."""
    if backend not in BACKENDS:
        raise ValueError(f"generation_backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        from es_lightning.generation.vllm import INSTALL_HINT

        raise ImportError(INSTALL_HINT)


def check_generation_options(backend: str, options: dict[str, Any] | None) -> None:
    """Refuse engine options the backend does not take, naming the accepted ones: ``hf`` takes none; ``vllm`` takes
    :class:`~es_lightning.generation.vllm.VLLMGenerator`'s arguments and ``vllm.LLM``'s engine arguments (so a misspelt
    key is one line at construction, not a confusing failure when the engine starts)."""
    check_backend(backend)
    options = dict(options or {})
    if backend == "hf":
        if options:
            raise ValueError(f"generation_backend 'hf' takes no generation_options, got {sorted(options)}; they are "
                             "vLLM engine settings (configs/generation/vllm.yaml sets generation_backend: vllm with them)")
        return
    refuse_owned_options(options)
    from es_lightning.generation.vllm import engine_option_names

    own, engine = engine_option_names()
    unknown = sorted(set(options) - set(own) - engine)
    if unknown:
        raise ValueError(f"unknown vLLM generation_options {unknown}; accepted: {own}, and the engine arguments of "
                         "vllm.LLM (vllm.engine.arg_utils.EngineArgs, e.g. max_num_batched_tokens, enable_lora)")
    check_vllm_values(options)


def make_generator(backend: str, policy: Any, **options: Any) -> Generator:
    """The generator for ``generation_backend``: ``"hf"`` (transformers ``generate``) or ``"vllm"`` (a colocated vLLM
    engine; ``options`` are :class:`~es_lightning.generation.vllm.VLLMGenerator`'s engine settings —
    ``configs/generation/vllm.yaml``). vLLM is imported only when asked for: it is an optional extra."""
    check_generation_options(backend, options)
    if backend == "hf":
        return HFGenerator(policy)
    from es_lightning.generation.vllm import VLLMGenerator, import_vllm

    import_vllm()  # one line naming the install command when vLLM is missing
    return VLLMGenerator(policy, **options)
