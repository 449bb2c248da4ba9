"""Generation backends behind one interface (:class:`Generator`), built by name with :func:`make_generator`."""

from __future__ import annotations

from typing import Any

from es_lightning.generation.base import Generator, Rollout, SamplingParams
from es_lightning.generation.hf import HFGenerator

__all__ = ["GENERATION_BACKENDS", "Generator", "HFGenerator", "Rollout", "SamplingParams", "check_backend",
           "make_generator"]

#: the ``generation_backend`` values this installation can build
GENERATION_BACKENDS = ("hf",)


def check_backend(backend: str) -> None:
    """Refuse a backend name this installation cannot build, naming the fix (called when a module is constructed)."""
    if backend == "vllm" and "vllm" not in GENERATION_BACKENDS:
        raise NotImplementedError(
            "generation_backend='vllm' is not available in this version of es-lightning (planned, CUDA only); "
            "use generation_backend: hf"
        )
    if backend not in GENERATION_BACKENDS:
        raise ValueError(f"generation_backend must be {' or '.join(map(repr, GENERATION_BACKENDS))}, got {backend!r}")


def make_generator(backend: str, policy: Any, **options: Any) -> Generator:
    """The :class:`Generator` of ``backend`` for ``policy`` (``options``: backend-specific settings)."""
    check_backend(backend)
    if backend == "hf":
        return HFGenerator(policy, **options)
    raise AssertionError(f"unreachable: backend {backend!r} passed check_backend but has no branch here")
