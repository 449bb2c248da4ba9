"""Engine-side ES: a vLLM worker extension that perturbs, restores and updates the engine's own weights from seeds.

At scale, pushing each member's full weights into the engine costs a model-sized copy per member (and a transfer when
the engine lives in another process). Qiu et al. 2025 instead send each vLLM worker only a seed and regenerate the noise
there. Their public code has two faults this design removes:

- every tensor of a member is perturbed with the *same* seed (equally shaped layers get identical noise) — here the
  noise is es-lightning's own :func:`~es_lightning.es.noise.param_noise`, keyed by (seed, step, member, **Hugging
  Face parameter name**), the very numbers the training process draws for the same member;
- the centre is restored by subtracting the noise again and the update is added to bf16 weights, so rounding
  accumulates over steps — here the centre is kept (restored by a copy, bit for bit) and the update is applied to an
  **fp32 master** held inside the engine, then cast once.

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

from es_lightning.es.noise import param_noise


class ESWorkerExtension:
    """Methods vLLM adds to its worker. State: ``_es_master`` (HF name → fp32 θ), ``_es_dtype`` (the policy's dtype
    per name: members are cast to it, as in-place perturbation does), ``_es_centre`` (the engine's own parameters at
    θ, restored by copy)."""

    def _es_model(self) -> torch.nn.Module:
        return self.model_runner.model

    @torch.no_grad()
    def es_set_centre(self, named: Sequence[tuple[str, Tensor]]) -> bool:
        """Adopt θ: keep an fp32 master of these HF-named tensors, load them, snapshot the engine's parameters."""
        device = next(self._es_model().parameters()).device
        self._es_master = {n: t.detach().to(device=device, dtype=torch.float32, copy=True) for n, t in named}
        self._es_dtype = {n: t.dtype for n, t in named}
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
                yield name, (master + (sign * sigma) * eps.view_as(master)).to(self._es_dtype[name])

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
                  sigma: float, scale: str = "alpha") -> float:
        """θ ← θ + coef·Σ_m w_m ε_m on the fp32 master, with :class:`~es_lightning.es.update.ESOptimizer`'s
        coefficient (``lr/N``, or ``lr/(Nσ)`` for ``scale="textbook"``) and its order of operations (fp32 accumulator,
        members in order, one multiply), so the engine's θ equals the trainer's bit for bit. Returns ‖Δθ‖."""
        self._es_require()
        n = len(weights)
        coef = lr / n / (sigma if scale == "textbook" else 1.0)
        active = [(int(i), float(w)) for i, w in zip(noise_ids, weights) if w != 0.0]
        sq = 0.0
        if coef != 0.0 and active:
            for name, master in self._es_master.items():
                acc = torch.zeros(master.numel(), dtype=torch.float32, device=master.device)
                for member, w in active:
                    acc.add_(param_noise(seed, step, member, name, master.numel(), device=master.device), alpha=w)
                acc.mul_(coef)
                sq += float(acc.square().sum())
                master.copy_((master.reshape(-1) + acc).view_as(master))
            self._es_load_centre()
        return sq**0.5
