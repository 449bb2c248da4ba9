"""Generation backends behind one interface (:class:`Generator`)."""

from __future__ import annotations

from typing import Any

from es_lightning.generation.base import Generator, Rollout, SamplingParams
from es_lightning.generation.hf import HFGenerator
from es_lightning.policy import Policy

BACKENDS = ("hf", "vllm")


def make_generator(backend: str, policy: Policy, **options: Any) -> Generator:
    """The generator for ``generation_backend``: ``"hf"`` (transformers ``generate``, no options) or ``"vllm"`` (a
    colocated vLLM engine; ``options`` are :class:`~es_lightning.generation.vllm.VLLMGenerator`'s engine settings —
    ``configs/generation/vllm.yaml``). vLLM is imported only when asked for: it is an optional extra."""
    if backend == "hf":
        if options:
            raise ValueError(f"generation_backend 'hf' takes no engine options, got {sorted(options)}")
        return HFGenerator(policy)
    if backend == "vllm":
        from es_lightning.generation.vllm import VLLMGenerator, import_vllm

        import_vllm()  # one line naming the install command when vLLM is missing
        return VLLMGenerator(policy, **options)
    raise ValueError(f"generation_backend must be one of {BACKENDS}, got {backend!r}")


__all__ = ["BACKENDS", "Generator", "HFGenerator", "Rollout", "SamplingParams", "make_generator"]
