"""Token entropy of sampled completions: how spread out the policy's next-token distribution is where it generated.

Entropy collapse is the standard symptom of RL post-training over-sharpening a policy (Cui et al. 2025, "The Entropy
Mechanism of Reinforcement Learning for Reasoning Language Models"): it comes with pass@k at large k falling below the
base model's. We log it as TRL's GRPOTrainer logs ``entropy``: the per-token Shannon entropy (nats) of the policy's
softmax at each generated position, averaged over completion tokens (padding and prompt positions masked out), so
long completions weigh in proportion to their length.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric

from es_lightning.metrics.plotting import Plottable
from es_lightning.metrics.state import ExactSums, KeepsStateOnError, sum_dtype

__all__ = ["TokenEntropy", "token_entropy"]


def token_entropy(logits: torch.Tensor, mask: torch.Tensor | None = None, chunk_size: int = 1024) -> torch.Tensor:
    """Per-token entropy ``H = -sum_v p_v log p_v`` (nats) of ``softmax(logits)``, computed stably via ``log_softmax``.

    Args:
        logits: ``[B, L, V]`` (any leading shape works: ``[..., V]``); bf16/fp16 is upcast to fp32 for the reduction.
        mask: optional ``[B, L]`` bool/0-1 tensor; positions where it is false get entropy 0 (combine with
            :class:`TokenEntropy`, which ignores them).
        chunk_size: tokens processed at once, bounding the fp32 working memory to ``chunk_size x V`` per temporary
            (the same trick as TRL's ``entropy_from_logits``); the result does not depend on it.

    Returns:
        ``[B, L]`` entropies in the fp32 (or wider) dtype. Tokens with ``-inf`` logits (top-k/top-p filtered vocab)
        contribute 0, not NaN. Differentiable; wrap in ``torch.no_grad()`` when it is only a diagnostic.
    """
    if logits.ndim < 1:
        raise ValueError("logits must end with a vocabulary dimension, e.g. [B, L, V]")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}")
    vocab_size = logits.shape[-1]
    compute_dtype = torch.promote_types(logits.dtype, torch.float32)
    flat_logits = logits.reshape(-1, vocab_size)  # [B*L, V]
    chunks = []
    for chunk in flat_logits.split(chunk_size):  # [C, V]
        log_probs = torch.log_softmax(chunk.to(compute_dtype), dim=-1)  # [C, V]
        probs = log_probs.exp()  # [C, V]
        plogp = torch.where(probs > 0, probs * log_probs, torch.zeros_like(probs))  # [C, V]; 0 * -inf := 0
        chunks.append(-plogp.sum(dim=-1))  # [C]
    if chunks:
        entropy = torch.cat(chunks).reshape(logits.shape[:-1])  # [B, L]
    else:
        entropy = torch.zeros(logits.shape[:-1], dtype=compute_dtype, device=logits.device)
    if mask is not None:
        mask = _validate_mask(mask, entropy.shape)
        entropy = entropy.masked_fill(~mask, 0.0)
    return entropy


def _validate_mask(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"mask must be a torch.Tensor of shape {tuple(shape)}, got {type(mask).__name__}")
    if mask.shape != shape:
        raise ValueError(
            f"mask shape {tuple(mask.shape)} must equal the per-token shape {tuple(shape)} (e.g. the completion "
            "mask [B, L] with True on generated tokens)"
        )
    if mask.is_floating_point() or mask.is_complex():
        raise TypeError(f"mask must be bool or 0/1 integers, got dtype {mask.dtype}")
    if mask.dtype != torch.bool and mask.numel() and not bool(((mask == 0) | (mask == 1)).all()):
        # counts, not a mask: per-sequence entropy sums [B] with their token counts [B] read as a mask weighed every
        # sequence's sum as one token
        raise ValueError(
            f"mask must be bool or 0/1 integers, got values up to {int(mask.max())}; for per-sequence entropy sums and "
            "token counts call update(entropy_sums.sum(), token_counts.sum())"
        )
    return mask if mask.dtype == torch.bool else mask != 0


class TokenEntropy(KeepsStateOnError, ExactSums, Plottable, Metric):
    """Token-weighted mean entropy (nats) of the policy over generated tokens, synced as sums across processes.

    The entropy is the policy's next-token distribution's at the sampling temperature (T = 1 for a greedy evaluation,
    which reports it too: the model's entropy is a property of the weights, whatever the decoding) and before top-p
    truncation (``Rollout.entropy``); training logs it only for sampled rollouts, where it comes at no extra cost.

    Two ways to feed it:

    * ``update(per_token_entropy, mask=None)`` with ``[B, L]`` entropies (from :func:`token_entropy`) and an optional
      ``[B, L]`` completion mask; masked-out positions are ignored.
    * ``update(entropy_sum, num_tokens)`` with two scalars (or by keyword, ``update(entropy_sum=..., num_tokens=...)``,
      as a ``MetricCollection`` passes them), when the caller already reduced (e.g. a generation backend that reports
      per-sequence sums).

    ``compute()`` returns the scalar ``sum(entropy) / num_tokens`` over everything seen since the last reset: a token-
    weighted mean, not a mean of per-batch means. NaN when no token was seen (torchmetrics warns).
    """

    is_differentiable = False
    higher_is_better = None
    full_state_update = False
    _count_states = ("num_tokens",)  # int64 whatever set_dtype makes the sums
    plot_lower_bound = 0.0

    entropy_sum: torch.Tensor
    num_tokens: torch.Tensor

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("entropy_sum", default=torch.zeros((), dtype=sum_dtype()), dist_reduce_fx="sum")
        self.add_state("num_tokens", default=torch.zeros((), dtype=torch.long), dist_reduce_fx="sum")

    def update(self, per_token_entropy: torch.Tensor | None = None, mask: torch.Tensor | int | None = None, *,
               entropy_sum: torch.Tensor | float | None = None, num_tokens: torch.Tensor | int | None = None) -> None:
        if entropy_sum is not None or num_tokens is not None:  # update(entropy_sum=..., num_tokens=...), as documented
            if per_token_entropy is not None or mask is not None or entropy_sum is None or num_tokens is None:
                raise ValueError(
                    "update takes per_token_entropy [B, L] with an optional mask, or entropy_sum= and num_tokens= "
                    "together, not a mix"
                )
            if torch.as_tensor(entropy_sum).ndim != 0:
                raise ValueError("entropy_sum must be a scalar; pass [B, L] entropies as per_token_entropy")
            per_token_entropy, mask = entropy_sum, num_tokens
        if per_token_entropy is None:
            raise ValueError("update needs per_token_entropy [B, L] (with an optional mask), or entropy_sum= and num_tokens=")
        if not isinstance(per_token_entropy, torch.Tensor):
            per_token_entropy = torch.as_tensor(per_token_entropy, dtype=self.entropy_sum.dtype)
        if per_token_entropy.ndim == 0:  # update(entropy_sum, num_tokens)
            if mask is None:
                raise ValueError("update(entropy_sum, num_tokens) needs num_tokens when entropy_sum is a scalar")
            num_tokens = torch.as_tensor(mask)
            if num_tokens.ndim != 0 or num_tokens.is_floating_point() or int(num_tokens) < 0:
                raise ValueError(f"num_tokens must be a non-negative integer scalar, got {mask!r}")
            entropy_sum = per_token_entropy.detach()
        else:  # update(per_token_entropy, mask)
            # summed in the state's dtype (or wider): a bf16/fp16 sum rounds to 3 digits, and fp16 overflows at 65504
            entropy = per_token_entropy.detach().to(torch.promote_types(per_token_entropy.dtype, self.entropy_sum.dtype))
            if mask is None:
                entropy_sum, num_tokens = entropy.sum(), torch.tensor(entropy.numel())
            else:
                mask = _validate_mask(mask, entropy.shape)
                entropy_sum = torch.where(mask, entropy, torch.zeros_like(entropy)).sum()
                num_tokens = mask.sum()
        self.entropy_sum += entropy_sum.to(self.entropy_sum)
        self.num_tokens += num_tokens.to(self.num_tokens)

    def compute(self) -> torch.Tensor:
        return self.entropy_sum / self.num_tokens  # NaN when no token was seen
