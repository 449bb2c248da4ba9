"""Per-token log π(o_t | q, o_<t) and entropy of completions, at real vocabulary size (README "Design", "Memory at real
vocabulary size").

The plain way — ``log_softmax(model(ids).logits.float())`` then a gather — holds ``[rows, C, V]`` logits in the model's
dtype, their fp32 copy, and the fp32 log-softmax that autograd keeps for the backward: measured on the Qwen-like fixture
at V = 151,936, ~30 V bytes ≈ 4.5 MB per completion token at the peak, 300 GB for a 64 × 1024-token micro-batch. Here
the model's output projection is run *selectively*: the transformer computes hidden states as usual, then,
``chunk_size`` tokens at a time, lm_head → fp32 logits → ``logsumexp`` and the target's logit (→ log-prob) and, when
asked, ``lse − Σ p·z`` (→ entropy), each chunk under activation checkpointing so that its backward recomputes the chunk's
logits instead of keeping them. Nothing of size V survives a chunk (~18 V bytes per chunk token while it runs); what is
kept per token is the chunk's input hidden state. Only real completion tokens are projected (padding after EOS costs
nothing). The same idea as TRL's ``selective_log_softmax`` (row by row) and Liger's fused linear cross-entropy (chunked,
gradient in the forward); here the backward stays autograd's.

The projection happens *inside* the model's forward: its output-embedding module (``get_output_embeddings()``, tied to
the input embedding for Qwen2.5 ≤ 3B — the gradient reaches the shared weight through both uses) has its ``forward``
swapped for the duration of the call, so the model returns ``[rows, L, 2]`` (log-prob, entropy) where it would return
logits. That keeps FSDP working unchanged: the root unit's parameters (embeddings, final norm, head) are gathered only
inside the root module's forward, and its backward hooks attach only to what that forward returns. Models that
transform logits after the head (Gemma-2 soft-capping, Cohere/Granite logit scales) fall back to the model's full logits
with the same chunked, checkpointed log-softmax.

Memory model of one GRPO micro-step (forward + backward of the loss, bf16 model; T tokens through the transformer =
b·P + rows·C with the shared prompt prefix, rows·(P + C) without; K = rows·C completion tokens). Coefficients measured
with ``benchmarks/grpo_memory.py`` on Qwen2-architecture fixtures (activations at H = 512 and 1024: within 5%):

==========================  =====================================  ===========================  ========================
part                        bytes                                  Qwen2.5-1.5B                 Qwen2.5-7B
==========================  =====================================  ===========================  ========================
weights + grads + AdamW     8 per param (all bf16); 16 with an     12.3 GB; 24.6 GB fp32        61 GB; 122 GB fp32
                            fp32 master (issue 11, item 4)                                      (÷ GPUs under FSDP)
activations                 (L·(30H + 8I) + 8H) per token          3.3 MB/token: 222 GB         7.3 MB/token: 489 GB
… gradient checkpointing    (L·2H + 30H + 8I + 8H) per token       216 KB/token: 16.9 GB        488 KB/token: 38 GB
logits, plain path          ~30 V per completion token             299 GB                       299 GB
logits, this module         18 V · chunk_size + 2H per token       1.6 GB                       1.9 GB
==========================  =====================================  ===========================  ========================

(1.5B: L = 28, H = 1536, I = 8960, V = 151,936, 1.54 B params; 7B: L = 28, H = 3584, I = 18,944, V = 152,064, 7.6 B;
at ``recipes/qwen2.5-1.5b-instruct/gsm8k/grpo.yaml``'s micro-batch of 64 completions × C = 1024 from 8 prompts of
P ≈ 200: T = 67,136 shared, 78,336 unshared; K = 65,536; chunk_size 512.) ``mini_batch_size: 64`` without
checkpointing would need ~250 GB even with this module — so, on one 80 GB GPU and ≤ 60 GB with fp32 master weights, the
recipe turns ``gradient_checkpointing`` on (``share_prompt_prefix: false``) at ``mini_batch_size: 64``: 24.6 + 16.9 +
1.6 ≈ 43 GB; the alternative is no checkpointing at ``mini_batch_size: 8``: 24.6 + 27.8 + 1.4 ≈ 54 GB. The 7B model
needs FSDP over ≥ 4 GPUs for weights and optimizer (122 / 4 ≈ 31 GB each) and checkpointing at ``mini_batch_size: 32``
per GPU: 31 + 19 + 1.6 ≈ 51 GB.
(Rollouts are another phase: their KV cache, 2·L·kv_heads·head_dim·2 bytes per token — 28 KB for 1.5B, 57 KB for 7B
— times B·G·(P + C) tokens: 18.0 GB for the 1.5B recipe's 512 rows.) ``python benchmarks/grpo_memory.py
--memory-model`` prints these numbers; without the flag it measures the logits rows on the Qwen-like fixture.
"""

from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from es_lightning.generation.base import Rollout

__all__ = ["DEFAULT_CHUNK_SIZE", "completion_logprobs", "enable_gradient_checkpointing", "selective_logprobs"]

#: tokens projected to the vocabulary at once: ~18·V·chunk bytes transient (1.4 GB at V = 151,936), a GEMM large
#: enough to run at full speed on a GPU
DEFAULT_CHUNK_SIZE = 512
#: config attributes of models that transform logits after the output projection (the selective head cannot see it)
_POST_HEAD_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def completion_logprobs(
    model: torch.nn.Module, rollout: Rollout, rows: slice, temperature: float, entropy: bool = True,
    entropy_grad: bool = False, share_prompt: bool = False, chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> tuple[Tensor, Tensor | None]:
    """Per-token log π(o_t | q, o_<t) at ``temperature`` of the completion tokens of ``rollout[rows]`` ``[n, C]``, and
    optionally the per-token entropy ``[n, C]`` — the quantities the generator recorded while sampling. Both are 0 on
    padding (``completion_mask == 0``).

    Position ids count real tokens only (left-padded prompts), as ``generate`` does. With ``share_prompt`` each
    distinct prompt is run once and its key/value cache is shared by the completions of its group (gradients flow
    through the cache), instead of running every prompt G times: the same numbers (tested) for (B + B·G·C/(P+C)) /
    (B·G) of the tokens. ``entropy_grad``: the entropy carries gradients (entropy bonus); otherwise it is a detached
    diagnostic. ``chunk_size``: tokens per vocabulary projection (memory, not results).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if share_prompt and torch.is_grad_enabled() and _checkpointing_layers(model):
        raise ValueError(
            "share_prompt_prefix cannot be combined with gradient checkpointing: checkpointed transformer layers drop "
            "the key/value cache the completions would read the prompt from; set share_prompt_prefix: false"
        )
    with_entropy = entropy or entropy_grad
    with _SelectiveHead(model, temperature, chunk_size, with_entropy, entropy_grad) as head:
        out = (_shared_prompt_logprobs if share_prompt else _full_logprobs)(model, rollout, rows, head)  # [n, C, 2]
    return out[..., 0], (out[..., 1] if with_entropy else None)


def selective_logprobs(
    hidden: Tensor, weight: Tensor | None, bias: Tensor | None, targets: Tensor, temperature: float = 1.0,
    mask: Tensor | None = None, chunk_size: int = DEFAULT_CHUNK_SIZE, entropy: bool = True, entropy_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``log_softmax((hidden @ weightᵀ + bias) / T)`` at ``targets`` and its entropy, never holding more than
    ``chunk_size`` rows of logits: ``hidden [..., H]``, ``targets [...]``, ``mask [...]`` (0 = skip, result 0) →
    ``[...]`` each, in fp32. ``weight=None``: ``hidden`` are logits already. Each chunk runs under activation
    checkpointing when a gradient is being recorded."""
    shape = targets.shape
    flat_h, flat_t = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)  # [N, H], [N]
    keep = None
    if mask is not None:
        keep = mask.reshape(-1).nonzero().squeeze(1)  # [N'] positions that are real tokens
        flat_h, flat_t = flat_h.index_select(0, keep), flat_t.index_select(0, keep)
    recording = torch.is_grad_enabled() and (flat_h.requires_grad or (weight is not None and weight.requires_grad))
    step = functools.partial(_chunk_logprobs, temperature=temperature, entropy=entropy, entropy_grad=entropy_grad)
    logps, ents = [], []
    for start in range(0, flat_h.shape[0], chunk_size):
        h, t = flat_h[start : start + chunk_size], flat_t[start : start + chunk_size]  # [c, H], [c]
        lp, ent = (checkpoint(step, h, weight, bias, t, use_reentrant=False, preserve_rng_state=False) if recording
                   else step(h, weight, bias, t))
        logps.append(lp)
        ents.append(ent)
    logp = torch.cat(logps) if logps else flat_h.new_zeros(0, dtype=torch.float32)  # [N']
    ent = (torch.cat(ents) if ents else logp.new_zeros(0)) if entropy else None  # [N']
    if keep is not None:  # back to every position, 0 where masked
        total = targets.numel()
        logp = logp.new_zeros(total).index_put((keep,), logp)  # [N]
        ent = ent.new_zeros(total).index_put((keep,), ent) if ent is not None else None
    return logp.view(shape), (ent.view(shape) if ent is not None else None)


def _chunk_logprobs(hidden: Tensor, weight: Tensor | None, bias: Tensor | None, targets: Tensor, temperature: float,
                    entropy: bool, entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
    """One chunk: fp32 logits ``[c, V]`` → log-prob of each target ``[c]`` and entropy ``[c]`` (log-sum-exp form)."""
    logits = (F.linear(hidden, weight, bias) if weight is not None else hidden).float()  # [c, V]
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, -1)  # [c]
    logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # [c]
    ent = None
    if entropy:
        with torch.enable_grad() if entropy_grad else torch.no_grad():
            ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)  # [c]  H = lse − Σ p·z
    return logp, ent


class _SelectiveHead:
    """While active, the model's output projection returns ``[rows, L, 2]`` (log-prob of the target, entropy) for the
    hidden states it is given, instead of ``[rows, L, V]`` logits. ``set`` names the targets of the next forward."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk_size: int, entropy: bool,
                 entropy_grad: bool) -> None:
        self.model, self.temperature, self.chunk_size = model, temperature, chunk_size
        self.entropy, self.entropy_grad = entropy, entropy_grad
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        config = getattr(model, "config", None)
        transformed = any(getattr(config, a, None) not in (None, 0, 1, 1.0) for a in _POST_HEAD_TRANSFORMS)
        self.head = head if isinstance(head, torch.nn.Linear) and not transformed else None
        self.targets: Tensor | None = None
        self.mask: Tensor | None = None
        self.rows: Tensor | None = None

    def set(self, targets: Tensor, mask: Tensor, rows: Tensor | None = None) -> None:
        """Targets ``[n, L]`` and mask ``[n, L]`` of the hidden states the next forward passes to the head;
        ``rows [n]`` expands the head's input rows first (one prompt's last state for each of its completions)."""
        self.targets, self.mask, self.rows = targets, mask, rows

    def __enter__(self) -> _SelectiveHead:
        if self.head is not None:
            self._saved = self.head.__dict__.get("forward")
            self.head.forward = self._forward
        return self

    def __exit__(self, *exc) -> None:
        if self.head is not None:
            if self._saved is None:
                del self.head.forward
            else:
                self.head.forward = self._saved

    def _forward(self, hidden: Tensor) -> Tensor:  # hidden [b, L, H] -> [n, L, 2]
        if self.rows is not None:
            hidden = hidden.index_select(0, self.rows)  # [n, L, H]
        logp, ent = selective_logprobs(hidden, self.head.weight, self.head.bias, self.targets, self.temperature,
                                       self.mask, self.chunk_size, self.entropy, self.entropy_grad)
        return torch.stack([logp, ent if ent is not None else torch.zeros_like(logp)], -1)

    def __call__(self, **model_kwargs) -> Tensor:
        """The model's output for ``model_kwargs`` as ``[n, L, 2]`` (and the raw output, for its cache)."""
        out = self.model(**model_kwargs)
        if self.head is not None:
            return out, out.logits
        logits = out.logits  # [b, L, V]: a model whose logits are transformed after the head
        if self.rows is not None:
            logits = logits.index_select(0, self.rows)
        logp, ent = selective_logprobs(logits, None, None, self.targets, self.temperature, self.mask,
                                       self.chunk_size, self.entropy, self.entropy_grad)
        return out, torch.stack([logp, ent if ent is not None else torch.zeros_like(logp)], -1)


def _full_logprobs(model: torch.nn.Module, rollout: Rollout, rows: slice, head: _SelectiveHead) -> Tensor:
    """Per-token (log-prob, entropy) ``[n, C, 2]`` from one forward pass over prompt + completion."""
    prompt_ids, completion_ids = rollout.prompt_ids[rows], rollout.completion_ids[rows]  # [n, P], [n, C]
    completion_mask = rollout.completion_mask[rows]  # [n, C]
    ids = torch.cat([prompt_ids, completion_ids], 1)  # [n, P+C]
    attn = torch.cat([rollout.prompt_mask[rows], completion_mask], 1)  # [n, P+C]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)  # [n, P+C]
    C = completion_ids.shape[1]
    # the last C + 1 positions: position P-1+t predicts completion token t; the final one predicts nothing
    head.set(F.pad(completion_ids, (0, 1)), F.pad(completion_mask, (0, 1)))  # [n, C+1] each
    _, out = head(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=C + 1, use_cache=False)
    return out[:, :-1]  # [n, C, 2]


def _shared_prompt_logprobs(model: torch.nn.Module, rollout: Rollout, rows: slice, head: _SelectiveHead) -> Tensor:
    """As :func:`_full_logprobs`, running each distinct prompt once and reusing its KV cache for its G completions."""
    n_total, G = rollout.completion_ids.shape[0], rollout.num_samples
    start, stop, _ = rows.indices(n_total)
    first = start // G
    prompt_rows = torch.arange(first, (stop - 1) // G + 1, device=rollout.prompt_ids.device) * G  # one per prompt
    prompt_mask = rollout.prompt_mask[prompt_rows]  # [b, P]
    group_of_row = torch.arange(start, stop, device=prompt_mask.device) // G - first  # [n] row -> its prompt
    completion_ids, completion_mask = rollout.completion_ids[rows], rollout.completion_mask[rows]  # [n, C] each
    # the prompt's last position predicts completion token 0 of each of its rows
    head.set(completion_ids[:, :1], completion_mask[:, :1], rows=group_of_row)  # [n, 1]
    prompt_out, first_token = head(
        input_ids=rollout.prompt_ids[prompt_rows], attention_mask=prompt_mask,
        position_ids=(prompt_mask.cumsum(-1) - 1).clamp(min=0), use_cache=True, logits_to_keep=1)  # [n, 1, 2]
    if completion_ids.shape[1] == 1:
        return first_token
    cache_kwarg = _cache_kwarg(type(model))
    cache = getattr(prompt_out, cache_kwarg)
    cache.reorder_cache(group_of_row)  # [b, ...] -> [n, ...], differentiable (index_select)
    attn = torch.cat([rollout.prompt_mask[rows], completion_mask[:, :-1]], 1)  # [n, P+C-1]
    offsets = torch.arange(completion_ids.shape[1] - 1, device=attn.device)  # [C-1]
    pos = prompt_mask.sum(-1)[group_of_row].unsqueeze(1) + offsets  # [n, C-1] continue after the real prompt
    head.set(completion_ids[:, 1:], completion_mask[:, 1:])  # [n, C-1]
    _, rest = head(input_ids=completion_ids[:, :-1], attention_mask=attn, position_ids=pos, use_cache=True,
                   **{cache_kwarg: cache})  # [n, C-1, 2]
    return torch.cat([first_token, rest], 1)  # [n, C, 2]


@functools.cache
def _cache_kwarg(model_type: type) -> str:
    """transformers 5.x names the KV cache ``cache`` (``past_key_values`` before, deprecated since)."""
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def _checkpointing_layers(model: torch.nn.Module) -> bool:
    """Whether some submodule recomputes itself in the backward (HF gradient checkpointing, training mode)."""
    return model.training and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each transformer block in the backward instead of keeping its activations (HF
    ``activation_checkpointing_enable``, non-reentrant ``torch.utils.checkpoint``): per token and layer, 2H bytes kept
    instead of ~30H + 8I (the memory model above), for one more forward of the blocks (~+33% step FLOPs) — what makes
    ``recipes/qwen2.5-*``'s 64 × 1024-token micro-batches fit. Non-reentrant is the variant that works with FSDP and
    with inputs that do not require grad (Lightning's and PyTorch's recommendation). Incompatible with
    ``share_prompt_prefix`` (checkpointed layers drop the KV cache); :func:`completion_logprobs` refuses the pair.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(model).__name__} does not support gradient checkpointing (transformers' "
                         "supports_gradient_checkpointing is False); turn gradient_checkpointing off")
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


