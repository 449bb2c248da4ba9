"""Low-rank ES members as LoRA adapters of a vLLM engine: the whole population in one engine call.

A member's perturbation of a matrix W [m, n] is ``sign·σ·A Bᵀ/√r`` (EGGROLL, :mod:`es_lightning.es.lowrank`). A LoRA
adapter in PEFT's layout — the one vLLM loads — adds ``(lora_alpha/r)·lora_B lora_A`` to W, with ``lora_A`` [r, n] and
``lora_B`` [m, r]. Hence, with

    lora_A = Bᵀ,    lora_B = (sign·σ/√r)·A,    lora_alpha = r (scaling 1),

the adapter *is* the member: vLLM computes ``x Wᵀ + (x lora_Aᵀ) lora_Bᵀ = x Wᵀ + (x B)(s A)ᵀ``, the products
:class:`~es_lightning.es.lowrank.LowRankPopulationForward` computes on the HF path (``tests/vllm_backend`` checks the greedy
outputs are equal). vLLM serves requests with different adapters in one batch (punica's kernels, also on its CPU build),
so ``k`` members are one ``generate`` call whose rows carry their member's adapter — no weight copies, no pushes.

What LoRA cannot express, and the decision here. vLLM applies adapters to the linear layers of the transformer blocks
(q/k/v/o, gate/up/down, fused or not); not to the input embedding, the output head (one matrix with the embedding when
tied, as Qwen2.5 ≤ 3B) or vectors (biases, norm weights), which low-rank ES perturbs full-rank. Those are the engine's
*shared* weights: they cannot differ between the members of one call. The choices were (1) perturb them per member
engine-side, which takes one engine call per member and loses what low-rank batching is for; (2) freeze them silently,
so that the same recipe trains different parameters on HF and on vLLM; (3) refuse, naming the ``trainable`` pattern
that selects the block matrices. (3) is taken (:func:`check_lora_coverage`): low-rank ES on vLLM perturbs and updates
the block matrices, and says so before anything trains. EGGROLL's own LLM experiments perturb the matrices the same way
(vectors full-rank); freezing embeddings and norms is common in parameter-efficient fine-tuning.

Adapters are written once per step and member slot (``slot-j`` of a temporary directory, fp32 safetensors: r·(m+n)
numbers per matrix, ~4.6 MB·r per member for Qwen2.5-1.5B) and reloaded by the engine on every call
(:meth:`~es_lightning.generation.vllm.VLLMGenerator.member_adapters`): vLLM caches an adapter by its id and would
otherwise keep serving last step's member under the same id (tested).
"""

from __future__ import annotations

import json
import math
import os
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

__all__ = ["VLLM_LORA_RANKS", "check_lora_coverage", "lora_engine_options", "lora_matrices", "write_member_adapter"]

#: max_lora_rank values vLLM accepts (vllm.config.lora.MaxLoRARanks in 0.32); an adapter of rank r needs one >= r
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_matrices(model: nn.Module) -> dict[str, str]:
    """Parameter name → module name of every matrix a vLLM LoRA adapter can perturb: the weight of an ``nn.Linear``
    that is not the output head (vLLM's LoRA layers wrap the blocks' linear layers, not the embeddings)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = {}
    for module_name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module is not head:
            out[f"{module_name}.weight"] = module_name
    return out


def check_lora_coverage(model: nn.Module, named: Sequence[tuple[str, Tensor]], noise_rank: int) -> None:
    """Refuse a low-rank ES setup on vLLM whose perturbed parameters (``trainable``) include some that LoRA adapters
    cannot perturb per member (embeddings, output head, vectors), naming the pattern that selects the ones they can."""
    covered = lora_matrices(model)
    missing = [name for name, _ in named if name not in covered]
    if not missing:
        return
    if not covered:  # GPT-2's Conv1D layers, say: no pattern selects anything LoRA perturbs
        raise ValueError(
            f"noise_rank={noise_rank} on vLLM runs each member as a LoRA adapter over the transformer blocks' nn.Linear "
            f"layers, and {type(model).__name__} has none (e.g. GPT-2's Conv1D layers; vLLM serves no LoRA for it): use "
            "generation_backend: hf (low-rank members batched there), or noise_rank: 0"
        )
    leaves = sorted({m.rsplit(".", 1)[-1] for m in covered.values()})
    pattern = r"\.(" + "|".join(re.escape(leaf) for leaf in leaves) + r")\.weight$"
    shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
    raise ValueError(
        f"noise_rank={noise_rank} on vLLM runs each member as a LoRA adapter, which perturbs the transformer blocks' "
        f"linear layers only; ES would also perturb {shown} (embeddings, output head, biases and norms are the engine's "
        f"shared weights). Set trainable: '{pattern}' (the block matrices), or use generation_backend: hf, or "
        "noise_rank: 0"
    )


def lora_engine_options(current: Mapping[str, Any], noise_rank: int, adapters_per_call: int) -> dict[str, Any]:
    """The engine settings ``adapters_per_call`` members of rank ``noise_rank`` need, merged with ``current`` (the
    user's ``generation_options``; larger values there are kept)."""
    rank = max(noise_rank, int(current.get("max_lora_rank") or 0))
    allowed = [r for r in VLLM_LORA_RANKS if r >= rank]
    if not allowed:
        raise ValueError(f"noise_rank={noise_rank}: vLLM's LoRA adapters have rank <= {VLLM_LORA_RANKS[-1]}")
    loras = max(adapters_per_call, int(current.get("max_loras") or 0))
    return {"enable_lora": True, "max_lora_rank": allowed[0], "max_loras": loras,
            "max_cpu_loras": max(loras, int(current.get("max_cpu_loras") or 0))}


def write_member_adapter(path: str, modules: Mapping[str, str], factors: Mapping[str, tuple[Tensor, Tensor]],
                         sign: float, sigma: float, rank: int) -> None:
    """Write one member as a PEFT LoRA adapter in directory ``path``: for every matrix ``name`` in ``factors``
    (``(A [m, r], B [n, r])``, fp32), ``lora_A = Bᵀ`` and ``lora_B = (sign·σ/√r)·A`` on module ``modules[name]``."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    scale = sign * sigma / math.sqrt(rank)
    tensors = {}
    for name, (a, b) in factors.items():
        prefix = f"base_model.model.{modules[name]}"
        tensors[f"{prefix}.lora_A.weight"] = b.detach().T.float().cpu().contiguous()  # [r, n]
        tensors[f"{prefix}.lora_B.weight"] = (a.detach().float() * scale).cpu().contiguous()  # [m, r]
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "lora_dropout": 0.0,
              "bias": "none", "fan_in_fan_out": False, "base_model_name_or_path": None,
              "target_modules": sorted({modules[name].rsplit(".", 1)[-1] for name in factors})}
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump(config, f)


def vllm_allowed_ranks() -> tuple[int, ...]:
    """vLLM's accepted ``max_lora_rank`` values when vLLM is importable (a check that VLLM_LORA_RANKS is current)."""
    from vllm.config.lora import MaxLoRARanks

    return tuple(typing.get_args(MaxLoRARanks))

