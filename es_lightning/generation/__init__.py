"""Generation backends behind one interface (:class:`Generator`), built by name with :func:`make_generator`."""

from __future__ import annotations

import importlib.util
from typing import Any

from es_lightning.generation.base import Generator, Rollout, SamplingParams
from es_lightning.generation.hf import HFGenerator
from es_lightning.generation.options import refuse_owned_options

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
    _check_vllm_values(options)


#: vLLM engine options that are counts (``max_model_len`` may also be None: the model's)
_COUNTS = ("max_model_len", "max_num_seqs", "tensor_parallel_size", "max_num_batched_tokens", "max_loras",
           "max_lora_rank")
_VLLM_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


def _check_vllm_values(options: dict[str, Any]) -> None:
    """The values of the engine settings es-lightning sets, checked before the engine starts: vLLM reports some of
    them under another option's name (``max_num_seqs: 0`` as ``max_num_batched_tokens``) or only after loading."""
    for key in _COUNTS:
        value = options.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"generation_options.{key} must be a whole number >= 1, got {value!r}")
    fraction = options.get("gpu_memory_utilization")
    if fraction is not None and (isinstance(fraction, bool) or not isinstance(fraction, (int, float))
                                 or not 0 < fraction <= 1):
        raise ValueError(f"generation_options.gpu_memory_utilization is the fraction of GPU memory vLLM may take, in "
                         f"(0, 1], got {fraction!r} (colocated with training: e.g. 0.3)")
    gib = options.get("cpu_kv_cache_gib")
    if gib is not None and (isinstance(gib, bool) or not isinstance(gib, (int, float)) or not gib > 0):
        raise ValueError(f"generation_options.cpu_kv_cache_gib must be > 0 (GiB of KV cache on a CPU), got {gib!r}")
    dtype = options.get("dtype")
    if dtype is not None and str(dtype).removeprefix("torch.") not in _VLLM_DTYPES:
        raise ValueError(f"generation_options.dtype must be one of {list(_VLLM_DTYPES)} (vLLM's), got {dtype!r}")


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
