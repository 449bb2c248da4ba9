"""The LightningCLI that parses recipes: ``es-lightning fit/validate/test`` and the analyses that fit a recipe in-process.

It lives apart from :mod:`es_lightning.cli` (the command table) so that the import graph goes one way: ``cli`` imports
the analyses and this module; the analyses that fit recipes (:mod:`es_lightning.analysis.runs`) import this module and
never ``cli``. ``tests/test_imports.py`` keeps the whole package free of import cycles.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint, ProgressBar
from lightning.pytorch.cli import LightningCLI

__all__ = ["ESLightningCLI", "check_config"]


class ESLightningCLI(LightningCLI):
    """LightningCLI over any LightningModule / LightningDataModule (ES, GRPO, evaluation, the built-in pretraining)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("save_config_kwargs", {"overwrite": True})
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            *args,
            subclass_mode_model=True,
            subclass_mode_data=True,
            **kwargs,
        )

    def instantiate_trainer(self, **kwargs):
        trainer = self._get(self.config_init, "trainer", default={})
        if trainer.get("enable_checkpointing") is False and isinstance(trainer.get("callbacks"), list):
            # `--trainer.enable_checkpointing false` also turns off a recipe's RunCheckpoint (Lightning would refuse both)
            trainer["callbacks"] = [cb for cb in trainer["callbacks"] if not isinstance(cb, ModelCheckpoint)]
        if trainer.get("enable_progress_bar") is False and isinstance(trainer.get("callbacks"), list):
            # the same for `--trainer.enable_progress_bar false` and a recipe's StageProgressBar (grpo_es.yaml)
            trainer["callbacks"] = [cb for cb in trainer["callbacks"] if not isinstance(cb, ProgressBar)]
        elif isinstance(trainer.get("callbacks"), list):
            # a bar added on the command line (`--trainer.callbacks+=...RichProgressBar`) beside a recipe's: the last
            # one given is kept (Lightning refuses two, and a list entry cannot be removed from the command line)
            bars = [cb for cb in trainer["callbacks"] if isinstance(cb, ProgressBar)]
            trainer["callbacks"] = [cb for cb in trainer["callbacks"] if not isinstance(cb, ProgressBar) or cb is bars[-1]]
        try:
            return super().instantiate_trainer(**kwargs)
        except ValueError as err:  # Lightning's FSDPStrategy refuses CPUs: say what does shard on one
            if "requires a GPU accelerator" not in str(err):
                raise
            raise ValueError(
                f"{err}\nTo shard on CPUs use FSDP2 instead: --config configs/trainer/fsdp2_cpu.yaml "
                "(ModelParallelStrategy, 2 gloo processes); strategy: fsdp is for GPU machines (configs/trainer/fsdp.yaml)"
            ) from err


    def _add_configure_optimizers_method_to_model(self, subcommand: str | None) -> None:
        """Refuse ``--optimizer`` / ``--lr_scheduler`` (or ``optimizer:`` / ``lr_scheduler:`` in a config) for a reasoning
        module, in one line naming the module's own settings. Lightning's LightningCLI replaces the module's
        ``configure_optimizers`` with one over ``model.parameters()``, which would bypass the algorithm's optimizer (ES's
        seeded update, GRPO's AdamW over fp32 masters with its warm-up); built before ``configure_model`` loads the
        policy, it even failed as "optimizer got an empty parameter list", and an ``--lr_scheduler`` alone was dropped
        without a word. Any other LightningModule keeps Lightning's behaviour."""
        from es_lightning.modules.base import ReasoningModule

        if not isinstance(self.model, ReasoningModule):
            return super()._add_configure_optimizers_method_to_model(subcommand)
        given = [f"--{key}" for key in ("optimizer", "lr_scheduler") if self._get(self.config_init, key)]
        if not given:
            return None
        from es_lightning.cli_errors import UserError

        name, algorithm = type(self.model).__name__, self.model.algorithm
        if algorithm is None:
            raise UserError(f"{' / '.join(given)}: {name} evaluates only, it has no optimizer; remove {' and '.join(given)}")
        own = {
            "grpo": "AdamW over fp32 master weights with a linear warm-up (set model.init_args.lr, betas, weight_decay, "
                    "warmup_steps, max_grad_norm)",
            "es": "the ES update rule (set model.init_args.lr, the step size alpha, and sigma, update_scale)",
        }.get(algorithm.name, "its algorithm's (set it in model.init_args)")
        raise UserError(f"{' / '.join(given)}: {name} builds its own optimizer and schedule, {own}, which Lightning's "
                        f"would replace; remove {' and '.join(given)}")


class _ParseOnlyCLI(ESLightningCLI):
    """Parses and validates a command line against the code's signatures without building or running anything."""

    def instantiate_classes(self) -> None:
        pass

    def _run_subcommand(self, subcommand: str) -> None:
        pass


def check_config(args: list[str]):
    """Validate ``args`` (e.g. ``["fit", "--config", "recipes/es.yaml"]``) and return the parsed namespace.

    Every key must exist in the signature it configures and every value must have the declared type; nothing is
    instantiated (no model is loaded), so recipes for hub models are checked without downloading them.
    """
    cli = _ParseOnlyCLI(args=args)
    return cli.config
