"""GRPO: the settings and training step (:mod:`.algorithm`), the loss (:mod:`.loss`) and the training forward's
log-probs (:mod:`.logprobs`)."""

from es_lightning.grpo.logprobs import completion_logprobs, enable_gradient_checkpointing, selective_logprobs

__all__ = ["completion_logprobs", "enable_gradient_checkpointing", "selective_logprobs"]
