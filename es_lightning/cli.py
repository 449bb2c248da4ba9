"""The ``es-lightning`` command: LightningCLI with the project's modules, data and callbacks.

To run::

    es-lightning validate --config recipes/eval.yaml
    es-lightning fit --config recipes/grpo_es.yaml --trainer.max_steps 20   # any key can be overridden
    es-lightning fit --config configs/trainer/cpu.yaml --config recipes/es.yaml --print_config

``--config`` stacks (later files override earlier ones). Unknown keys and wrong types are refused by jsonargparse with
a message naming the key, and a non-zero exit.
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.cli import LightningCLI


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


def cli_main(args: list[str] | None = None) -> None:
    """Entry point of the ``es-lightning`` console script."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import es_lightning  # noqa: F401  (registers the package's classes for short class_path names)

    ESLightningCLI(args=args)


if __name__ == "__main__":
    cli_main()
