"""GRPO's pieces: completion log-probs at real vocabulary size (:mod:`es_lightning.grpo.logprobs`)."""

from es_lightning.grpo.logprobs import completion_logprobs, enable_gradient_checkpointing, selective_logprobs

__all__ = ["completion_logprobs", "enable_gradient_checkpointing", "selective_logprobs"]
