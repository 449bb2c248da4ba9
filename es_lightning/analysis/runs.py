"""Recipe fits inside an analysis (population sweep, method comparison): one way to build them.

An analysis fits a shipped recipe exactly as ``es-lightning fit --config recipe`` would — the same
:class:`~es_lightning.lightning_cli.ESLightningCLI` parses it — but quietly and without the recipe's own evaluation and export
callbacks: the analysis evaluates every result itself, the same way, and decides what to write.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path


def recipe_cli(recipe: str | Path, steps: int, root: str | Path, args: Sequence[str] = (), progress_bar: bool = False):
    """The (not yet run) ``ESLightningCLI`` of ``recipe`` for ``steps`` updates, logging and checkpointing off,
    working directory ``root``, further command-line ``args`` applied last; its PassAtKCallback, TrainingReport and
    HFExport callbacks removed."""
    from es_lightning.callbacks import HFExport, PassAtKCallback, TrainingReport
    from es_lightning.lightning_cli import ESLightningCLI

    argv = [
        "--config", str(recipe),
        "--trainer.max_steps", str(steps),
        "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false",
        "--trainer.limit_val_batches", "0",
        "--trainer.num_sanity_val_steps", "0",
        "--trainer.enable_progress_bar", str(progress_bar).lower(),
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", str(root),
        *args,
    ]
    with warnings.catch_warnings():  # LightningCLI warns when args= is used while sys.argv holds the analysis's own
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = ESLightningCLI(args=argv, run=False, save_config_callback=None)
    dropped = (PassAtKCallback, TrainingReport, HFExport)
    cli.trainer.callbacks[:] = [cb for cb in cli.trainer.callbacks if not isinstance(cb, dropped)]
    return cli
