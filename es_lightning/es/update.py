"""The ES update rule: reward normalisation and an optimizer whose ``step()`` applies the seeded update.

Update (Qiu et al. 2025, Alg. 2; Ba et al. 2026, App. G): with N members, noise ε_n and normalised rewards z_n,

    θ ← θ + (α / N) Σ_n z_n ε_n            (``scale="alpha"``: 1/σ folded into α, as both papers do)
    θ ← θ + (α / (N σ)) Σ_n z_n ε_n        (``scale="textbook"``: the Gaussian-smoothing gradient estimate of
                                             Salimans et al. 2017)

The update goes through :meth:`ESOptimizer.step` because Lightning counts optimizer steps in manual optimization:
``trainer.global_step``, ``max_steps``, checkpoint cadence and the GRPO→ES switch all follow it (DESIGN.md). The
optimizer keeps no state — the noise is regenerated from its keys — and the sum is accumulated in fp32 one tensor at a
time and added once, whatever the parameter dtype.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from es_lightning.es.sharding import all_reduce_sum, is_dtensor, shard_views

NORMALIZATIONS = ("zscore", "rank", "centered", "none")


def normalize_rewards(rewards: Tensor, method: str = "zscore", eps: float = 0.0) -> Tensor:
    """Population reward normalisation. Rewards with zero spread give all-zero weights (a zero update).

    - ``zscore``: (r − mean) / std, the normalisation of Qiu et al. 2025 and Ba et al. 2026;
    - ``rank``: centred ranks in [−0.5, 0.5] (Salimans et al. 2017, fitness shaping); ties share their mean rank;
    - ``centered``: r − mean;
    - ``none``: r as it is.
    """
    r = rewards.double()
    if method == "none":
        return r.float()
    if r.numel() < 2 or bool((r == r[0]).all()):
        return torch.zeros_like(rewards, dtype=torch.float32)
    if method == "zscore":
        return ((r - r.mean()) / (r.std(unbiased=False) + eps)).float()
    if method == "centered":
        return (r - r.mean()).float()
    if method == "rank":
        order = r.argsort()
        ranks = torch.empty_like(r)
        ranks[order] = torch.arange(len(r), dtype=r.dtype)
        for value in r.unique():  # ties share the mean of their ranks
            tie = r == value
            ranks[tie] = ranks[tie].mean()
        return (ranks / (len(r) - 1) - 0.5).float()
    raise ValueError(f"unknown reward_normalization {method!r}; use one of {NORMALIZATIONS}")


class ESOptimizer(torch.optim.Optimizer):
    """Applies ``θ += scale · Σ_n w_n ε_n`` for the member weights set by :meth:`set_update`.

    It holds the parameters by name (the name is part of each noise key) and no per-parameter state.
    ``lr`` lives in ``param_groups`` so Lightning's LR schedulers act on α.
    """

    def __init__(self, named_params: Sequence[tuple[str, Tensor]], lr: float, sigma: float, scale: str = "alpha"):
        if scale not in ("alpha", "textbook"):
            raise ValueError(f"update scale must be 'alpha' or 'textbook', got {scale!r}")
        self.names = [n for n, _ in named_params]
        super().__init__([p for _, p in named_params], dict(lr=lr, sigma=sigma, scale=scale))
        self._pending: tuple[int, int, Tensor, Tensor] | None = None
        self._noise_cache: dict[tuple[int, str], Tensor] = {}
        self.last_update_norm = 0.0
        #: the trainer's wrapped model when it may hold FSDP1 units (set by ESModule); DTensors need nothing
        self.shard_root: torch.nn.Module | None = None
        # the count of applied updates is the optimizer's only state, one per parameter: distributed checkpoints
        # (FSDP) want state for every parameter, "initialise" a stateless optimizer by stepping it with zero gradients
        # (which would allocate a .grad per parameter), and load a full checkpoint into a sharded run only when some
        # state tensor has a dimension (it tells them the device): hence a 1-element tensor on the parameter's device
        for p in self.param_groups[0]["params"]:
            self.state[p]["step"] = torch.zeros(1, dtype=torch.float32, device=p.device)

    def set_update(
        self,
        seed: int,
        step: int,
        noise_ids: Tensor,
        weights: Tensor,
        noise_cache: dict[tuple[int, str], Tensor] | None = None,
    ) -> None:
        """The next ``step()`` applies ``Σ_m weights[m] · ε(seed, step, noise_ids[m])`` (antithetic pairs share ids).

        ``noise_cache`` maps ``(noise id, parameter name)`` to that noise, flat fp32, when the caller still holds it
        (``ESModule`` with ``members_per_batch > 1`` drew it this step): it is the same function's output, so using it
        instead of regenerating changes nothing but the time. Missing entries are regenerated.
        """
        self._pending = (seed, step, noise_ids.clone(), weights.detach().float().cpu().clone())
        self._noise_cache = noise_cache or {}

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            closure()
        if self._pending is None and self.param_groups[0]["lr"] == 0:
            return None  # nothing to apply (a zero-lr probe step)
        if self._pending is None:
            raise RuntimeError("ESOptimizer.step() called without set_update(); ESModule sets it every step")
        seed, step, noise_ids, weights = self._pending
        self._pending = None
        cache, self._noise_cache = self._noise_cache, {}
        group = self.param_groups[0]
        n = len(weights)
        coef = group["lr"] / n / (group["sigma"] if group["scale"] == "textbook" else 1.0)
        active = [(int(i), float(w)) for i, w in zip(noise_ids, weights) if w != 0.0]
        sq = 0.0
        for p in group["params"]:
            self.state[p]["step"] = self.state[p].get("step", torch.zeros(1, dtype=torch.float32, device=p.device)) + 1
        if coef == 0.0 or not active:
            self.last_update_norm = 0.0
            return None
        # each rank updates the elements it holds (all of them unless sharded): see es_lightning/es/sharding.py
        for view in shard_views(zip(self.names, group["params"]), self.shard_root):
            acc = torch.zeros(view.local.numel(), dtype=torch.float32, device=view.local.device)  # fp32 accumulator
            for member, w in active:
                cached = cache.get((member, view.name))
                usable = cached is not None and view.index is None and cached.numel() == view.local.numel()
                acc.add_(cached.to(acc.device) if usable else view.noise(seed, step, member), alpha=w)
            acc.mul_(coef)
            if not view.mirror:  # an FSDP1 gathered mirror repeats elements some rank's shard already counts
                sq += float(acc.square().sum()) / view.replicas
            view.write(view.local.float().reshape(-1) + acc)
        if self.shard_root is not None or any(is_dtensor(p) for p in group["params"]):  # sharded: sum the pieces
            sq = all_reduce_sum([sq], group["params"][0].device)[0]
        self.last_update_norm = sq**0.5
        return None

