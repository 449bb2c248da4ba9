"""SequentialStrategy: switch a running fit from GRPO to ES at a set step (or ES to GRPO, or to any registered algorithm).

Ba et al. 2026 (§3.2) find that GRPO followed by ES combines GRPO's Pass@1 gain with ES's broader coverage, with the
update budget split 50/50; they also study the reverse order. This callback does the switch inside one ``fit``: the
same policy weights are carried over, the first stage's optimizer state and LR schedulers are dropped, and the second
stage's are created — exactly as if the second algorithm had started from the first one's final weights. The one
piece of optimizer state that *is* the weights goes on: with bf16 weights the fp32 masters
(:func:`~es_lightning.precision.copy_masters`), so GRPO → ES and ES → GRPO lose no update below a bf16 ulp.

How: the module keeps its class; it is given the second stage's algorithm object (``module.set_algorithm``) and the
trainer's optimizers are replaced by the new ``configure_optimizers()``. ``module.algorithm.name`` says which stage
runs. The active stage is part of the module's own checkpoint, so a resume before or after the switch continues in the
right stage under every strategy (:mod:`es_lightning.modules.stage`). Everything about the second stage is validated
when the callback is constructed — names and values, through the algorithm's settings dataclass — not hours into a run
at the switch.

Usage in a script::

    trainer = Trainer(max_steps=200, callbacks=[SequentialStrategy(switch_step=100, es={"sigma": 5e-3, "lr": 3e-3})])
    trainer.fit(GRPOModule(lr=1e-4), datamodule=ReasoningDataModule("countdown"))
"""

from __future__ import annotations

import copy
from typing import Any

import lightning as L
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from es_lightning.algorithms import SAMPLING_KEYS, check_types, get_algorithm, settings_hints
from es_lightning.generation import SamplingParams
from es_lightning.precision import copy_masters


class SequentialStrategy(L.Callback):
    """Switch the algorithm of a running fit at ``switch_step``.

    Args:
        switch_step: the global step at which the second stage starts (0 = from the start). When the first stage is
            GRPO with ``num_iterations`` = k (k optimizer steps per batch) it must be a multiple of k.
        es: settings of an ES second stage (:class:`~es_lightning.es.algorithm.ESSettings` fields plus the rollout
            keys ``temperature`` (default 0, greedy), ``top_p``, ``max_new_tokens``): use with a ``GRPOModule`` fit.
        grpo: settings of a GRPO second stage (:class:`~es_lightning.grpo.algorithm.GRPOSettings` fields plus rollout
            keys; ``temperature`` defaults to 1): use with an ``ESModule`` fit (the reverse order).
        algorithm: the registered name of any other second stage (:func:`~es_lightning.algorithms.register_algorithm`),
            with ``settings`` its settings plus rollout keys — the general form of ``es=`` / ``grpo=``.
        settings: see ``algorithm``.
    """

    def __init__(
        self,
        switch_step: int,
        es: dict[str, Any] | None = None,
        grpo: dict[str, Any] | None = None,
        algorithm: str | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        stages = [(name, s) for name, s in (("es", es), ("grpo", grpo)) if s is not None]
        if algorithm is not None:
            stages.append((algorithm, settings or {}))
        elif settings is not None:
            raise ValueError("SequentialStrategy(settings=...) needs algorithm='<registered name>' too")
        if len(stages) != 1:
            raise ValueError(
                "SequentialStrategy needs the settings of exactly one second stage: es={...} to go GRPO → ES, "
                "grpo={...} to go ES → GRPO (or algorithm='<name>', settings={...})"
            )
        if switch_step < 0:
            raise ValueError(f"switch_step must be >= 0, got {switch_step}")
        self.switch_step = int(switch_step)
        self.target, given = stages[0]
        #: the second stage's settings as given (rollout keys included), for messages and reports
        self.settings = dict(given)
        cls = get_algorithm(self.target)
        known = [f for f in cls.Settings.__dataclass_fields__] + list(SAMPLING_KEYS)
        unknown = sorted(set(given) - set(known))
        if unknown:
            raise ValueError(f"SequentialStrategy {self.target}= has unknown key(s) {unknown}; accepted: {known}")
        values = {k: v for k, v in given.items() if k not in SAMPLING_KEYS}
        check_types(f"SequentialStrategy {self.target}=", given, {**settings_hints(cls.Settings), **settings_hints(SamplingParams)})
        self.stage_settings = cls.Settings(**values)  # validates every value now, not at the switch
        self.stage_sampling = {**cls.default_sampling(), **{k: given[k] for k in SAMPLING_KEYS if k in given}}
        cls.check_sampling(SamplingParams(**self.stage_sampling))  # values checked (missing ones: any valid default)
        if "temperature" in self.stage_sampling:  # else the module's carries over: checked at the switch
            cls(copy.deepcopy(self.stage_settings)).check_rollouts(SamplingParams(**self.stage_sampling))
        self._module: L.LightningModule | None = None

    @property
    def switched(self) -> bool:
        """Whether the module now runs the second stage."""
        algorithm = getattr(self._module, "algorithm", None)
        return algorithm is not None and algorithm.name == self.target

    # ------------------------------------------------------------------ checks
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._module = pl_module
        if stage != "fit":
            return
        first = getattr(pl_module, "algorithm", None)
        if first is None:
            raise TypeError(f"SequentialStrategy switches the algorithm of a training module (GRPOModule, ESModule), "
                            f"but the module is a {type(pl_module).__name__} without one")
        batch_size = pl_module.train_batch_size() if hasattr(pl_module, "train_batch_size") else None
        if batch_size is not None:  # the second stage's batch split, now rather than at the switch
            get_algorithm(self.target)(self.stage_settings).check_batch(batch_size)
        if first.name != self.target:  # e.g. a full-rank ES stage batching members on vLLM: refused now, not at the switch
            get_algorithm(self.target)(copy.deepcopy(self.stage_settings)).check_generation(
                pl_module.generation_backend, pl_module.generation_options)
        if first.name != self.target and 0 <= trainer.max_steps <= self.switch_step:
            # under fast_dev_run=N the max_steps is Lightning's (N), not the user's: name the flag to raise
            fix = (f"fast_dev_run runs {int(trainer.fast_dev_run)} batch(es): give --trainer.fast_dev_run "
                   f"{self.switch_step // first.steps_per_batch + 1}" if trainer.fast_dev_run else "raise max_steps")
            rank_zero_warn(f"SequentialStrategy: switch_step={self.switch_step} is not below trainer.max_steps="
                           f"{trainer.max_steps}, so this fit never reaches {self.target.upper()}; {fix} or lower "
                           f"switch_step")
        k = first.steps_per_batch
        if first.name != self.target and self.switch_step % k:
            lower, upper = self.switch_step // k * k, (self.switch_step // k + 1) * k
            raise ValueError(
                f"switch_step={self.switch_step} is not reachable: the first stage ({first.name}) makes {k} optimizer "
                f"steps per batch (num_iterations={k}), so global_step goes {lower} → {upper}; use a multiple of {k} "
                f"(e.g. switch_step: {upper})"
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.algorithm.name != self.target:  # what needs the loaded policy (e.g. LoRA coverage on vLLM): now
            get_algorithm(self.target)(copy.deepcopy(self.stage_settings)).check_stage(pl_module)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        algorithm = pl_module.algorithm
        if algorithm.name == self.target and trainer.global_step > self.switch_step:
            if algorithm.settings != self.stage_settings:  # resumed after the switch: the checkpoint's stage runs
                rank_zero_warn(f"SequentialStrategy: continuing {self.target} with the settings the checkpoint saved, "
                               f"{algorithm.settings}; this callback's differ: {self.stage_settings}")
        elif algorithm.name == self.target and self.switch_step:
            raise TypeError(
                f"SequentialStrategy(…, {self.target}=…) switches a fit to {self.target.upper()} at step "
                f"{self.switch_step}, but the module already runs {self.target.upper()} at step {trainer.global_step}: "
                f"train a module of the first stage (e.g. GRPOModule for es=, ESModule for grpo=)"
            )

    # ------------------------------------------------------------------ the switch
    def _switch_now(self, trainer: L.Trainer, pl_module) -> None:
        """Give the module the second stage's algorithm, then replace the first stage's optimizers and schedulers."""
        for p in pl_module.model.parameters():
            p.grad = None  # nothing of the first stage's optimisation survives
        algorithm = get_algorithm(self.target)(copy.deepcopy(self.stage_settings))
        pl_module.set_algorithm(algorithm, self.stage_sampling)
        previous = list(trainer.strategy.optimizers)
        trainer.strategy.optimizers, trainer.strategy.lr_scheduler_configs = _init_optimizers_and_lr_schedulers(pl_module)
        for old in previous:  # fp32 master weights go on: the switch loses no sub-ulp bits (es_lightning/precision.py)
            for new in trainer.strategy.optimizers:
                copy_masters(old, new)
        algorithm.on_fit_start(pl_module)
        _forget_step_metrics(trainer, "training_step")
        rank_zero_info(
            f"SequentialStrategy: step {trainer.global_step}: switching to {self.target.upper()} "
            f"({type(algorithm).__name__}) with {self.settings}"
        )

    def on_train_batch_start(self, trainer: L.Trainer, pl_module, batch, batch_idx: int) -> None:
        if pl_module.algorithm.name != self.target and trainer.global_step >= self.switch_step:
            self._switch_now(trainer, pl_module)
        pl_module.log("train/stage", float(pl_module.algorithm.name == "es"), prog_bar=True, on_step=True, on_epoch=False)

    def state_dict(self) -> dict[str, Any]:
        # informational: the module's checkpoint holds the active stage (its own record decides on resume)
        return {"switched": self.switched, "switch_step": self.switch_step, "target": self.target}


def _forget_step_metrics(trainer: L.Trainer, hook: str) -> None:
    """Drop what the first stage logged in ``hook``: Lightning keeps a step metric's last value for the rest of the
    epoch, so GRPO's ``train/grad_norm`` (or ES's ``train/pass_pop``) would be written into every row of the second stage
    — and a run resumed past the switch, which never logged them, would write different rows. Keys the second stage
    logs too come back at its first step."""
    results = trainer._results  # the active loop's ResultCollection (Lightning has no public way to forget a key)
    if results is None:
        return
    for key in [k for k in results if k.startswith(hook + ".")]:
        del results[key]
