"""GRPO: the settings and training step (:mod:`.algorithm`), the loss (:mod:`.loss`) and the training forward's
log-probs (:mod:`.logprobs`)."""
