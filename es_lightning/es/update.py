"""The ES update rule: reward normalisation and an optimizer whose ``step()`` applies the seeded update.

Update (Qiu et al. 2025, Alg. 2; Ba et al. 2026, App. G): with N members, noise ε_n and normalised rewards z_n,

    θ ← θ + (α / N) Σ_n z_n ε_n            (``scale="alpha"``: 1/σ folded into α, as both papers do)
    θ ← θ + (α / (N σ)) Σ_n z_n ε_n        (``scale="textbook"``: the Gaussian-smoothing gradient estimate of
                                             Salimans et al. 2017)

The update goes through :meth:`ESOptimizer.step` because Lightning counts optimizer steps in manual optimization:
``trainer.global_step``, ``max_steps``, checkpoint cadence and the GRPO→ES switch all follow it (README "Design"). The
optimizer keeps no state — the noise is regenerated from its keys — and the sum is accumulated in fp32 one tensor at a
time and added once, whatever the parameter dtype.

With ``master_dtype`` (see :mod:`es_lightning.precision`) the centre θ of a bf16/fp16 parameter is an fp32 master in
``state[p]["master"]``: members are perturbed from it (:meth:`ESOptimizer.centre`, :meth:`ESOptimizer.centre_views`),
the update is added to it, and the model's weight is the master rounded to nearest — so an update below half a bf16
ulp (α/√N ≈ 4e-5 against an ulp of 1.2e-4 at 0.02 and 7.8e-3 at 1.0) is kept instead of rounded away.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor, nn

from es_lightning.es.lowrank import lowrank_view_delta
from es_lightning.es.sharding import ShardView, all_reduce_sum, clean_name, is_dtensor, shard_views, sync_mirrors
from es_lightning.precision import MasterState, local

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


class ESOptimizer(MasterState, torch.optim.Optimizer):
    """Applies ``θ += scale · Σ_n w_n ε_n`` for the member weights set by :meth:`set_update`.

    It holds the parameters by name (the name is part of each noise key). Its state per parameter is the count of
    applied updates and, for a parameter with less precision than ``master_dtype``, the fp32 centre θ
    (``state[p]["master"]``, a DTensor with the parameter's placements when ``p`` is one). ``lr`` lives in
    ``param_groups`` so Lightning's LR schedulers act on α. With ``noise_rank = r > 0`` a matrix's ε is the EGGROLL
    direction ``A Bᵀ/√r`` and its update is one matmul (es_lightning/es/lowrank.py).

    Masters are allocated here (``torch.distributed.checkpoint`` loads only state keys a fresh optimizer already has)
    and refreshed from the model's weights at their first use — :meth:`centre`, :meth:`centre_views`,
    :meth:`write_centre` or :meth:`step` — unless :meth:`load_state_dict` installed them from a checkpoint: Lightning
    restores ``ckpt_path`` weights after it builds optimizers. Parameters without a master are updated exactly as
    without ``master_dtype`` (bitwise).
    """

    def __init__(self, named_params: Sequence[tuple[str, Tensor]], lr: float, sigma: float, scale: str = "alpha",
                 master_dtype: torch.dtype | None = None, noise_rank: int = 0):
        if scale not in ("alpha", "textbook"):
            raise ValueError(f"update scale must be 'alpha' or 'textbook', got {scale!r}")
        self.names = [n for n, _ in named_params]
        self.master_dtype = master_dtype
        # weight_decay 0 (ES has none): every torch optimizer's group carries one, and Lightning's LearningRateMonitor
        # (log_weight_decay=True) read it with a KeyError
        super().__init__([p for _, p in named_params], dict(lr=lr, sigma=sigma, scale=scale, weight_decay=0.0))
        self._pending: tuple[int, int, Tensor, Tensor] | None = None
        self._noise_cache: dict[tuple[int, str], Tensor] = {}
        self.last_update_norm = 0.0
        #: > 0: matrices were perturbed by rank-``noise_rank`` factors (EGGROLL); their update is one matmul (lowrank.py)
        self.noise_rank = noise_rank
        #: the trainer's wrapped model when it may hold FSDP1 units (set by ESModule); DTensors need nothing
        self.shard_root: nn.Module | None = None
        # the count of applied updates is the optimizer's only state, one per parameter: distributed checkpoints
        # (FSDP) want state for every parameter, "initialise" a stateless optimizer by stepping it with zero gradients
        # (which would allocate a .grad per parameter), and load a full checkpoint into a sharded run only when some
        # state tensor has a dimension (it tells them the device): hence a 1-element tensor on the parameter's device
        for p in self.param_groups[0]["params"]:
            self.state[p]["step"] = torch.zeros(1, dtype=torch.float32, device=p.device)
            self.master(p)
        self._masters_from_model = True  # refresh them from the weights at first use (see the class docstring)
        self._by_name = {clean_name(n): p for n, p in zip(self.names, self.param_groups[0]["params"])}

    # ------------------------------------------------------------------ the centre θ
    def has_master(self, p: Tensor) -> bool:
        return "master" in self.state[p] if p in self.state else False

    def _current(self) -> None:
        if self._masters_from_model:
            self._masters_from_model = False
            self.sync_masters()

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._masters_from_model = False  # the checkpoint's masters are the centre
        for group in self.param_groups:  # a checkpoint of an older version: its groups had no weight_decay
            group.setdefault("weight_decay", 0.0)

    def _master_pairs(self):
        """Through the shard views, so an FSDP1 parameter's shard segment pairs with its master."""
        if not any(self.has_master(p) for p in self.param_groups[0]["params"]):
            return
        for v in self._views():
            master = self._master_view(v)
            if master is not None:
                yield v.local.reshape(-1), master.local.reshape(-1)

    def centre(self, p: Tensor) -> Tensor:
        """The tensor members of ``p`` are perturbed from: its master when it has one (read-only to callers), else
        ``p`` itself (copy it before perturbing ``p`` in place). Writing ``centre(p)`` into ``p`` restores ``p`` bit
        for bit, as ``p`` is always the rounded master between steps."""
        self._current()
        return self.state[p]["master"] if self.has_master(p) else p

    def centre_views(self, views: Sequence[ShardView]) -> list[tuple[ShardView, Tensor]]:
        """For a sharded evaluation: each of this rank's pieces (:func:`~es_lightning.es.sharding.shard_views` of
        these parameters) with its centre elements, flat — the master's piece (no copy) for a parameter with a master,
        else a copy of the piece. An FSDP1 gathered mirror of a parameter with a master is left out: write the
        perturbed shards, then :meth:`sync_mirrors`. Writing each centre back into its view restores the weights."""
        self._current()
        out = []
        for v in views:
            master = self._master_view(v)
            if master is not None:
                out.append((v, master.local.reshape(-1)))
            elif not (v.mirror and self.has_master(self._by_name[v.name])):
                out.append((v, v.read()))
        return out

    def sync_mirrors(self, views: Sequence[ShardView]) -> None:
        """Refill the FSDP1 gathered mirrors of parameters with masters from the ranks' shards (a collective; a no-op
        without such mirrors)."""
        sync_mirrors([v for v in views if self.has_master(self._by_name[v.name])])

    def write_centre(self, views: Sequence[ShardView] | None = None) -> None:
        """Write the rounded master into every parameter that has one (all of this rank's pieces, FSDP1 mirrors
        included): the exact centre weights after an in-place perturbation. Parameters without a master are left
        to the caller, who holds their copy."""
        self._current()
        views = self._views() if views is None else views
        for v in views:
            master = self._master_view(v)
            if master is not None:
                v.write(master.local)
        self.sync_mirrors(views)

    def _views(self) -> list[ShardView]:
        return shard_views(zip(self.names, self.param_groups[0]["params"]), self.shard_root)

    def _master_view(self, view: ShardView) -> ShardView | None:
        """The piece of the parameter's master at the positions of ``view`` (``None`` without a master or for a
        mirror): the master has the parameter's layout, so its local tensor lines up with the parameter's."""
        p = self._by_name[view.name]
        if view.mirror or not self.has_master(p):
            return None
        m = local(self.state[p]["master"])
        if m.numel() != view.local.numel():
            raise RuntimeError(f"the master of {view.name!r} holds {m.numel()} elements, its shard {view.local.numel()}: "
                               "the optimizer was built while the parameter was gathered; build it on the sharded model")
        return replace(view, local=m.view(view.local.shape))

    # ------------------------------------------------------------------ the update
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
        instead of regenerating changes nothing but the time. Missing entries are regenerated. With ``noise_rank > 0`` a
        matrix's entry is its factor pair ``(A, B)`` (``LowRankPopulationForward`` fills the cache).
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
        self._current()
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
        views = self._views()
        for view in views:
            master = self._master_view(view)
            if master is None and view.mirror and self.has_master(self._by_name[view.name]):
                continue  # refilled from the updated shards below
            lowrank = bool(self.noise_rank) and view.shape is not None and len(view.shape) == 2  # Σ w E: one matmul
            acc = (lowrank_view_delta(view, seed, step, active, self.noise_rank, cache) if lowrank else
                   torch.zeros(view.local.numel(), dtype=torch.float32, device=view.local.device))  # fp32 accumulator
            for member, w in ([] if lowrank else active):
                cached = cache.get((member, view.name))
                usable = cached is not None and view.index is None and cached.numel() == view.local.numel()
                acc.add_(cached.to(acc.device) if usable else view.noise(seed, step, member), alpha=w)
            acc.mul_(coef)
            if not view.mirror:  # an FSDP1 gathered mirror repeats elements some rank's shard already counts
                sq += float(acc.square().sum()) / view.replicas
            if master is None:
                view.write(view.local.float().reshape(-1) + acc)
            else:  # θ += update in the master dtype, then the weight is θ rounded once
                master.write(master.local.reshape(-1) + acc)
                view.write(master.local)
        self.sync_mirrors(views)
        if self.shard_root is not None or any(is_dtensor(p) for p in group["params"]):  # sharded: sum the pieces
            sq = all_reduce_sum([sq], group["params"][0].device)[0]
        self.last_update_norm = sq**0.5
        return None
