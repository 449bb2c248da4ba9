"""Per-token log-probs (and entropy) of a rollout's completion tokens under the training forward pass.

π_old in GRPO is the log-prob the generator recorded while sampling; these functions recompute the same quantity with
gradients, in the training forward, so the importance ratio of the first pass is 1 (tested against the generator).
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from es_lightning.generation import Rollout
from es_lightning.metrics import token_entropy


def completion_logprobs(
    model: torch.nn.Module, rollout: Rollout, rows: slice, temperature: float, entropy: bool = True,
    entropy_grad: bool = False, share_prompt: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log π(o_t | q, o_<t) at ``temperature`` of the completion tokens of ``rollout[rows]``, and optionally
    the per-token entropy — the same quantities the generator recorded while sampling.

    Position ids count real tokens only (left-padded prompts), as ``generate`` does; only completion logits are
    computed. With ``share_prompt`` each distinct prompt is run once and its key/value cache is shared by the
    completions of its group (gradients flow through the cache), instead of running every prompt G times: the same
    numbers (tested) for (B + B·G·C/(P+C)) / (B·G) of the tokens.
    """
    completion_ids = rollout.completion_ids[rows]  # [n, C]
    logits = (_shared_prompt_logits if share_prompt else _full_logits)(model, rollout, rows)  # [n, C, V]
    logits = logits.float() / temperature
    logp_all = torch.log_softmax(logits, -1)  # [n, C, V]
    logps = logp_all.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # [n, C]
    ent = None
    if entropy_grad:
        ent = -(logp_all.exp() * logp_all).sum(-1)  # [n, C]
    elif entropy:  # a diagnostic: chunked, no graph
        with torch.no_grad():
            ent = token_entropy(logits)  # [n, C]
    return logps, ent


def _full_logits(model: torch.nn.Module, rollout: Rollout, rows: slice) -> Tensor:
    """Logits predicting each completion token, from one forward pass over prompt + completion."""
    prompt_ids, completion_ids = rollout.prompt_ids[rows], rollout.completion_ids[rows]  # [n, P], [n, C]
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [n, P+C]
    attn = torch.cat([rollout.prompt_mask[rows], rollout.completion_mask[rows]], 1)  # [n, P+C]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P+C]
    C = completion_ids.shape[1]
    out = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=C + 1, use_cache=False)
    return out.logits[:, :-1]  # [n, C, V]


def _shared_prompt_logits(model: torch.nn.Module, rollout: Rollout, rows: slice) -> Tensor:
    """As :func:`_full_logits`, running each distinct prompt once and reusing its KV cache for its G completions."""
    n_total, G = rollout.completion_ids.shape[0], rollout.num_samples
    start, stop, _ = rows.indices(n_total)
    first = start // G
    prompt_rows = torch.arange(first, (stop - 1) // G + 1, device=rollout.prompt_ids.device) * G  # one per prompt
    prompt_mask = rollout.prompt_mask[prompt_rows]  # [b, P]
    out = model(input_ids=rollout.prompt_ids[prompt_rows], attention_mask=prompt_mask,
                position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)
    cache_kwarg = _cache_kwarg(type(model))
    group_of_row = torch.arange(start, stop, device=prompt_mask.device) // G - first  # [n] row -> its prompt
    first_logits = out.logits[:, -1][group_of_row].unsqueeze(1)  # [n, 1, V] predicts completion token 0
    completion_ids = rollout.completion_ids[rows]  # [n, C]
    if completion_ids.shape[1] == 1:
        return first_logits
    cache = getattr(out, cache_kwarg)
    cache.reorder_cache(group_of_row)  # [b, ...] -> [n, ...], differentiable (index_select)
    attn = torch.cat([rollout.prompt_mask[rows], rollout.completion_mask[rows][:, :-1]], 1)  # [n, P+C-1]
    offsets = torch.arange(completion_ids.shape[1] - 1, device=attn.device)  # [C-1]
    pos = prompt_mask.sum(-1)[group_of_row].unsqueeze(1) + offsets  # [n, C-1] continue after the real prompt
    rest = model(input_ids=completion_ids[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True,
                 **{cache_kwarg: cache})
    return torch.cat([first_logits, rest.logits], 1)  # [n, C, V]


@functools.cache
def _cache_kwarg(model_type: type) -> str:
    """transformers 5.x names the KV cache ``cache`` (``past_key_values`` before, deprecated since)."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"
