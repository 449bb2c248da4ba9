"""The vLLM engine options es-lightning owns: ``generation_options`` keys that are refused because the backend sets them
itself and correctness depends on them.

Its own module, with no imports of the package, so that both :func:`es_lightning.generation.check_generation_options`
(at construction) and :class:`~es_lightning.generation.vllm.VLLMGenerator` (when the engine is built) use it without
importing each other (``generation`` <-> ``generation.vllm`` would be an import cycle, tests/test_imports.py).
"""

from __future__ import annotations

from typing import Any

#: vLLM engine arguments the backend sets itself because correctness depends on them, each with why (a
#: ``generation_options`` entry would otherwise override them silently: the engine's ``kwargs.update``)
_OWNED = {
    "model": "the engine is built from the policy (model.init_args.model), whose weights it is sent",
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
