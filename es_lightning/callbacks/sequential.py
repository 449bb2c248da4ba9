"""SequentialStrategy: turn a running GRPO fit into ES at a set step (or ES into GRPO).

Ba et al. 2026 (§3.2) find that GRPO followed by ES combines GRPO's Pass@1 gain with ES's broader coverage, with the
update budget split 50/50; they also study the reverse order. This callback does the switch inside one ``fit``: the
same policy weights are carried over, the first stage's optimizer state and LR schedulers are dropped, and the second
stage's state is created — exactly as if the second algorithm had started from the first one's final weights.

How: the module's class changes in place (``GRPOModule`` → ``ESModule`` or back) and the new stage's settings are
applied with its ``configure_es`` / ``configure_grpo``; the trainer's optimizers are replaced by the new stage's
``configure_optimizers()``. Because the class is part of what runs, not of what is saved, a checkpoint resumes
correctly on either side of the switch: before it, the run switches again at ``switch_step``; after it, the callback's
saved state switches the freshly built first-stage module *before* the optimizers are created and restored.

Usage in a script::

    trainer = Trainer(max_steps=200, callbacks=[SequentialStrategy(switch_step=100, es={"sigma": 5e-3, "lr": 1e-2})])
    trainer.fit(GRPOModule(lr=1e-4), datamodule=ReasoningDataModule("countdown"))
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities import rank_zero_info

#: settings of a stage that belong to the shared sampling configuration rather than to the algorithm
_SAMPLING_KEYS = ("temperature", "top_p", "max_new_tokens")


class SequentialStrategy(L.Callback):
    """Switch the algorithm of a running fit at ``switch_step``.

    Args:
        switch_step: the global step at which the second stage starts (0 = from the start).
        es: settings of an ES second stage (``ESModule.configure_es`` arguments plus ``temperature``, ``top_p``,
            ``max_new_tokens``): use with a ``GRPOModule`` fit.
        grpo: settings of a GRPO second stage (``GRPOModule.configure_grpo`` arguments plus sampling keys): use with an
            ``ESModule`` fit (the reverse order).
    """

    def __init__(self, switch_step: int, es: dict[str, Any] | None = None, grpo: dict[str, Any] | None = None) -> None:
        if (es is None) == (grpo is None):
            raise ValueError(
                "SequentialStrategy needs the settings of exactly one second stage: es={...} to go GRPO → ES, or "
                "grpo={...} to go ES → GRPO"
            )
        if switch_step < 0:
            raise ValueError(f"switch_step must be >= 0, got {switch_step}")
        self.switch_step = int(switch_step)
        self.target = "es" if es is not None else "grpo"
        self.settings = dict(es if es is not None else grpo)
        self._check_settings()
        self.switched = False
        self._module: L.LightningModule | None = None
        self._trainer: L.Trainer | None = None

    # ------------------------------------------------------------------ the switch
    def _target_class(self):
        from es_lightning.modules.es import ESModule
        from es_lightning.modules.grpo import GRPOModule

        return ESModule if self.target == "es" else GRPOModule

    def _check_settings(self) -> None:
        """Refuse unknown keys now, not at the switch step hours into a run."""
        import inspect

        target = self._target_class()
        configure = target.configure_es if self.target == "es" else target.configure_grpo
        known = set(inspect.signature(configure).parameters) - {"self"} | set(_SAMPLING_KEYS)
        unknown = sorted(set(self.settings) - known)
        if unknown:
            raise ValueError(
                f"SequentialStrategy {self.target}= has unknown key(s) {unknown}; accepted: {sorted(known)}"
            )

    def _check_first_stage(self, pl_module) -> None:
        from es_lightning.modules.es import ESModule
        from es_lightning.modules.grpo import GRPOModule

        first = GRPOModule if self.target == "es" else ESModule
        if not isinstance(pl_module, first) and not self.switched:
            raise TypeError(
                f"SequentialStrategy(…, {self.target}=…) switches a {first.__name__} fit to {self.target.upper()}, "
                f"but the module is a {type(pl_module).__name__}"
            )

    def _convert(self, pl_module) -> None:
        """Change the module into the second stage's class and apply its settings (weights untouched)."""
        target = self._target_class()
        settings = dict(self.settings)
        sampling = {k: settings.pop(k) for k in _SAMPLING_KEYS if k in settings}
        # each algorithm's own default temperature unless set: greedy ES (Ba et al.), sampled GRPO
        sampling.setdefault("temperature", 0.0 if self.target == "es" else 1.0)
        for key, value in sampling.items():
            setattr(pl_module.sampling, key, value)
        pl_module.sampling.__post_init__()  # validate the new sampling values
        pl_module.__class__ = target
        if self.target == "es":
            pl_module.configure_es(**settings)
        else:
            pl_module.configure_grpo(**settings)
        pl_module.configure_model()  # e.g. a GRPO reference model when beta > 0
        self.switched = True

    def _switch_now(self, trainer: L.Trainer, pl_module) -> None:
        """Mid-fit switch: convert, then replace the optimizers and LR schedulers of the first stage."""
        for p in pl_module.model.parameters():
            p.grad = None  # nothing of GRPO's optimisation survives
        self._convert(pl_module)
        optimizers, schedulers = _init_optimizers_and_lr_schedulers(pl_module)
        trainer.strategy.optimizers = optimizers
        trainer.strategy.lr_scheduler_configs = schedulers
        pl_module.on_fit_start()
        rank_zero_info(
            f"SequentialStrategy: step {trainer.global_step}: switching to {self.target.upper()} "
            f"({type(pl_module).__name__}) with {self.settings}"
        )

    # ------------------------------------------------------------------ hooks
    def setup(self, trainer: L.Trainer, pl_module, stage: str) -> None:
        self._trainer, self._module = trainer, pl_module
        if stage == "fit":
            self._check_first_stage(pl_module)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if not self.switched and trainer.global_step >= self.switch_step:
            self._switch_now(trainer, pl_module)
        pl_module.log("train/stage", float(self.switched if self.target == "es" else not self.switched),
                      prog_bar=True, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        return {"switched": self.switched, "switch_step": self.switch_step, "target": self.target}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Called while the checkpoint is restored, before the strategy creates and restores the optimizers: a module
        # that had switched is switched again here, so its own configure_optimizers() builds the saved state's kind.
        if state_dict.get("switched") and not self.switched and self._module is not None:
            self._convert(self._module)
