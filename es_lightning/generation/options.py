"""The checks of a vLLM ``generation_options`` mapping: the engine options es-lightning owns (refused, because the backend
sets them itself and correctness depends on them) and the values of those it lets through but vLLM reports late or
under another option's name.

Its own module, with no imports of the package, so that both :func:`es_lightning.generation.check_generation_options`
(at construction) and :class:`~es_lightning.generation.vllm.VLLMGenerator` (when the engine is built) use it without
importing each other (``generation`` <-> ``generation.vllm`` would be an import cycle, tests/test_imports.py).
"""

from __future__ import annotations

from typing import Any

#: vLLM engine arguments the backend sets itself because correctness depends on them, each with why (a
#: ``generation_options`` entry would otherwise override them silently: the engine's ``kwargs.update``)
_OWNED = {
    "model": "the engine is built from the policy trained or evaluated, whose weights it is sent",
    "load_format": "the engine's weights come from the policy, not from disk",
    "generation_config": "the checkpoint's sampling defaults must not leak into sampling (the module's temperature, "
                         "top_p and max_new_tokens are the sampling settings)",
    "logprobs_mode": "GRPO's ratio needs log-probs at the sampling temperature (processed_logprobs)",
    "worker_extension_cls": "engine-side ES needs es-lightning's worker extension (engine_side_es: false turns it off)",
}


def refuse_owned_options(options: dict[str, Any]) -> None:
    """One line for the first ``generation_options`` key the vLLM backend owns (:data:`_OWNED`), saying why."""
    owned = sorted(set(options) & set(_OWNED))
    if owned:
        raise ValueError(f"generation_options.{owned[0]} is set by es-lightning and cannot be changed: "
                         f"{_OWNED[owned[0]]}; remove it")


#: vLLM engine options that are counts (``max_model_len`` may also be None: the model's)
_COUNTS = ("max_model_len", "max_num_seqs", "tensor_parallel_size", "max_num_batched_tokens", "max_loras",
           "max_lora_rank")
_VLLM_DTYPES = ("auto", "bfloat16", "float16", "half", "float32", "float")


def check_vllm_values(options: dict[str, Any]) -> None:
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
