"""ParameterDrift: log how far the policy has moved from the weights the fit started with.

``train/drift`` is D_rel = ‖θ − θ₀‖ / ‖θ₀‖ over every parameter of the policy (Ba et al. 2026 §4: ES moves the weights
less than GRPO for the same gain), with θ₀ the weights at the *fit's* first step — the same reference before and after
a :class:`~es_lightning.SequentialStrategy` switch, and after a resume (θ₀ is part of this callback's checkpoint state).

Every :class:`~es_lightning.modules.base.ReasoningModule` fit gets one by default (``configure_callbacks``), as it gets a
:class:`~es_lightning.PassAtKCallback`. Cost: θ₀ is a **fp32 copy of the weights in host memory** (4 bytes a parameter:
6 GB for a 1.5B model; 1/W of that per rank under FSDP, which keeps only the rank's shard) and in every checkpoint
(saved whole, so checkpoints load into sharded and unsharded runs alike); each logged step reads every parameter once.
A run resumed from a checkpoint that holds no θ₀ (drift was off) measures from the resumed weights. Choose the cadence
with ``ParameterDrift(every_n_steps=10)`` in the trainer's callbacks, or turn it off — no copy kept — with
``every_n_steps: 0``::

    callbacks:
      - class_path: es_lightning.ParameterDrift
        init_args: {every_n_steps: 0}

With bf16 weights and fp32 master weights (``master_dtype``, es_lightning/precision.py) θ and θ₀ are read from the
masters — the weights the optimizer updates: a bf16 weight is off its master by up to half an ulp (2⁻⁹ relative),
more than a whole run of GRPO at lr 1e-6 moves it, so drift read from the bf16 weights would be rounding noise (or 0
where no update crossed an ulp). Without a master (fp32 weights, ``master_dtype: same``) the weights are read.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import lightning as L
import torch

from es_lightning.callbacks.cadence import StepCadence
from es_lightning.es.sharding import ShardView, clean_name, gather_full, local_snapshot, localize, shard_views, sharded_drift
from es_lightning.es.update import ESOptimizer
from es_lightning.precision import MasterState, local

#: elements of a parameter read at a time by :meth:`ParameterDrift.compute` (fp64 transients of 128 MB each)
DRIFT_CHUNK = 1 << 24


class ParameterDrift(L.Callback):
    """Logs ``train/drift`` = ‖θ − θ₀‖/‖θ₀‖ every ``every_n_steps`` optimizer steps (see the module docstring).

    Args:
        every_n_steps: log every this many optimizer steps; 0 turns the callback off (no θ₀ copy is kept).
    """

    def __init__(self, every_n_steps: int = 1) -> None:
        if every_n_steps < 0:
            raise ValueError(f"every_n_steps must be >= 0 (0 = off), got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)
        #: θ₀ of this rank's elements, ``{clean name: fp32 CPU tensor}`` (whole tensors when unsharded); a checkpoint's
        #: whole tensors are cut down to the rank's elements at the first use
        self.theta0: dict[str, torch.Tensor] | None = None
        self._module: L.LightningModule | None = None
        self._cadence = StepCadence()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        # a ReasoningModule's policy (checked by what it provides: importing modules.base here would close an import cycle)
        if not callable(getattr(pl_module, "evaluate_batch", None)):  # it failed at train start: no attribute 'model'
            raise TypeError(f"ParameterDrift measures the policy of a ReasoningModule (ESModule, GRPOModule), but the "
                            f"module is a {type(pl_module).__name__}; drop the callback from this trainer")
        self._module = pl_module

    def _views(self, pl_module) -> list[ShardView]:
        """This rank's pieces of every parameter — of its fp32 master where the optimizer keeps one (see the module
        docstring), so that θ and θ₀ are the weights the optimizer updates."""
        named = [(clean_name(n), p) for n, p in pl_module.model.named_parameters()]
        views = shard_views(named, pl_module.trainer.strategy.model if pl_module.sharded else None)
        masters = _masters(pl_module.trainer.strategy.optimizers, named)
        out = []
        for v in views:
            m = masters.get(v.name)
            if m is not None and not v.mirror and local(m).numel() == v.local.numel():
                v = replace(v, local=local(m).view(v.local.shape))
            out.append(v)
        return out

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.every_n_steps:
            self.theta0 = None
            return
        views = self._views(pl_module)
        self.theta0 = local_snapshot(views) if self.theta0 is None else localize(views, self.theta0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx) -> None:
        self._cadence.batch_started(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        if self.theta0 is not None and self._cadence.due(trainer, self.every_n_steps):  # GRPO may step past a multiple
            pl_module.log("train/drift", self.compute(pl_module), on_step=True, on_epoch=False)

    @torch.no_grad()
    def compute(self, pl_module) -> float:
        """D_rel of the module's current weights (a collective when the policy is sharded: every rank calls it)."""
        views = self._views(pl_module)
        if pl_module.sharded:  # per-shard sums, reduced across ranks
            return sharded_drift(views, self.theta0)
        device = views[0].local.device if views else torch.device("cpu")
        sums = torch.zeros(2, dtype=torch.float64, device=device)  # [Σ (θ − θ₀)², Σ θ₀²]
        for v in views:
            theta, t0 = v.local.detach().reshape(-1), self.theta0[v.name].reshape(-1)
            for start in range(0, theta.numel(), DRIFT_CHUNK):  # bounded transients: a 7B model's embedding whole
                a = theta[start:start + DRIFT_CHUNK].to(device=device, dtype=torch.float64)  # in fp64 would be 4.4 GB
                b = t0[start:start + DRIFT_CHUNK].to(device=device, dtype=torch.float64)
                sums[0] += (a - b).square().sum()
                sums[1] += b.square().sum()
        num, den = sums.tolist()  # the one device sync of the computation
        return (num / max(den, 1e-30)) ** 0.5

    def state_dict(self) -> dict[str, Any]:
        if self.theta0 is None or self._module is None:
            return {"every_n_steps": self.every_n_steps}
        views = self._views(self._module)
        if self._module.sharded:  # a collective: every rank saving a checkpoint gets here
            full = gather_full(views, self.theta0)
        else:
            full = {v.name: self.theta0[v.name].reshape(v.shape) for v in views if not v.mirror}
        return {"every_n_steps": self.every_n_steps, "theta0": full}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict.get("theta0") is not None:
            self.theta0 = dict(state_dict["theta0"])

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        """Checkpoints written before this callback existed kept θ₀ at the top level (``checkpoint["theta0"]``)."""
        if self.theta0 is None and checkpoint.get("theta0") is not None:
            self.theta0 = dict(checkpoint["theta0"])


def _masters(optimizers, named) -> dict[str, torch.Tensor]:
    """``{clean name: master}`` of the parameters whose optimizer keeps an fp32 master (current: an ES optimizer
    refreshes masters a checkpoint did not restore from the weights first; AdamW's exist from its first step)."""
    out = {}
    for opt in optimizers:
        if not isinstance(opt, MasterState):
            continue
        for name, p in named:
            if isinstance(opt, ESOptimizer) and opt.has_master(p):
                out[name] = opt.centre(p)
            elif p in opt.state and "master" in opt.state[p]:
                out[name] = opt.state[p]["master"]
    return out
