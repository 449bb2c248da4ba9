"""Engine-side ES: a vLLM worker extension that perturbs, restores and updates the engine's own weights from seeds.

At scale, pushing each member's full weights into the engine costs a model-sized copy per member (and a transfer when
the engine lives in another process). Qiu et al. 2025 instead send each vLLM worker only a seed and regenerate the noise
there. Their public code has two faults this design removes:

- every tensor of a member is perturbed with the *same* seed (equally shaped layers get identical noise) — here the
  noise is es-lightning's own :func:`~es_lightning.es.noise.param_noise`, keyed by (seed, step, member, **Hugging
  Face parameter name**), the very numbers the training process draws for the same member;
- the centre is restored by subtracting the noise again and the update is added to bf16 weights, so rounding
  accumulates over steps — here the centre is kept (restored by a copy, bit for bit) and the update is applied to the
  engine's own copy of the trainer's centre, in the trainer's precision: the ES optimizer's **fp32 master** of a bf16
  weight (``master_dtype``), else the weight itself; the engine's weights are that copy cast once. The engine's copy
  and the trainer's then take the same seeded update with the same arithmetic and stay bitwise equal
  (``tests/vllm_backend``), so the engine's weights are always bf16(master) of the trainer.

The noise is keyed by HF names, and vLLM's parameters are fused (q/k/v → ``qkv_proj``, gate/up → ``gate_up_proj``),
padded (vocabulary) and possibly sharded (tensor parallelism). Rather than re-deriving those slice maps per
architecture, each perturbed HF tensor goes through the model's own ``load_weights`` — the code that put the
checkpoint's tensors into those slices in the first place — so every architecture vLLM loads is handled alike.

vLLM mixes this class into its worker (``worker_extension_cls``); the trainer calls the methods through
``LLM.collective_rpc`` (see :class:`~es_lightning.generation.vllm.VLLMGenerator`'s ``es_*`` methods). An ES step:
``es_set_centre`` once per fit (or after a GRPO stage), then per member ``es_perturb`` → generate, then ``es_restore``
and ``es_update``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from es_lightning.es.lowrank import lowrank_delta
from es_lightning.es.noise import param_noise


class ESWorkerExtension:
    """Methods vLLM adds to its worker. State: ``_es_master`` (HF name → θ in the trainer's precision: fp32 master or
    the weight's dtype), ``_es_dtype`` (the policy's dtype per name: members are cast to it, as in-place perturbation
    does), ``_es_centre`` (the engine's own parameters at θ, restored by copy)."""

    def _es_model(self) -> torch.nn.Module:
        return self.model_runner.model

    @torch.no_grad()
    def es_set_centre(self, named: Sequence[tuple[str, Tensor]], dtypes: dict[str, torch.dtype] | None = None) -> bool:
        """Adopt θ: keep a copy of these HF-named tensors in their own precision (the trainer's centre: an fp32 master
        or the weight), members rounded to ``dtypes[name]`` (default: that precision); load them and snapshot the
        engine's parameters."""
        device = next(self._es_model().parameters()).device
        self._es_master = {n: t.detach().to(device=device, copy=True) for n, t in named}
        self._es_dtype = {n: (dtypes or {}).get(n, t.dtype) for n, t in named}
        self._es_load_centre()
        return True

    def _es_load_centre(self) -> None:
        model = self._es_model()
        model.load_weights((n, m.to(self._es_dtype[n])) for n, m in self._es_master.items())
        self._es_centre = {n: p.detach().clone() for n, p in model.named_parameters()}

    def _es_require(self) -> None:
        if getattr(self, "_es_master", None) is None:
            raise RuntimeError("engine-side ES: call es_set_centre(policy weights) before perturbing or updating")

    @torch.no_grad()
    def es_perturb(self, seed: int, step: int, noise_id: int, sign: float, sigma: float) -> bool:
        """Engine weights ← θ + sign·σ·ε, computed in fp32 and cast once to the policy's dtype — the same arithmetic as
        ``ESModule._perturbed``, so an engine-side member equals the member pushed from a perturbed policy bit for bit."""
        self._es_require()

        def members():
            for name, master in self._es_master.items():
                eps = param_noise(seed, step, noise_id, name, master.numel(), device=master.device)
                yield name, (master.float() + (sign * sigma) * eps.view_as(master)).to(self._es_dtype[name])

        self._es_model().load_weights(members())
        return True

    @torch.no_grad()
    def es_restore(self) -> bool:
        """Engine weights ← θ by copying the snapshot: exact whatever the dtype."""
        self._es_require()
        for name, p in self._es_model().named_parameters():
            p.copy_(self._es_centre[name])
        return True

    @torch.no_grad()
    def es_update(self, seed: int, step: int, noise_ids: Sequence[int], weights: Sequence[float], lr: float,
                  sigma: float, scale: str = "alpha", noise_rank: int = 0) -> float:
        """θ ← θ + coef·Σ_m w_m ε_m on the engine's copy of θ, with :class:`~es_lightning.es.update.ESOptimizer`'s
        coefficient (``lr/N``, or ``lr/(Nσ)`` for ``scale="textbook"``) and its order of operations (fp32 accumulator,
        members in order — or, for a matrix with ``noise_rank = r > 0``, EGGROLL's one matmul
        :func:`~es_lightning.es.lowrank.lowrank_delta` — one multiply, added in fp32 and rounded once to θ's dtype), so
        the engine's θ equals the trainer's bit for bit. Returns ‖Δθ‖."""
        self._es_require()
        n = len(weights)
        coef = lr / n / (sigma if scale == "textbook" else 1.0)
        active = [(int(i), float(w)) for i, w in zip(noise_ids, weights) if w != 0.0]
        sq = 0.0
        if coef != 0.0 and active:
            for name, master in self._es_master.items():
                if noise_rank and master.dim() == 2:
                    acc = lowrank_delta(seed, step, name, tuple(master.shape), [i for i, _ in active],
                                        [w for _, w in active], noise_rank, device=master.device).reshape(-1)
                else:
                    acc = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
                    for member, w in active:
                        acc.add_(param_noise(seed, step, member, name, master.numel(), device=master.device), alpha=w)
                acc.mul_(coef)
                sq += float(acc.square().sum())
                master.copy_((master.float().reshape(-1) + acc).view_as(master))
            self._es_load_centre()
        return sq**0.5
