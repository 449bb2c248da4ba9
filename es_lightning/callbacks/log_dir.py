"""The run's log directory without a collective.

``Trainer.log_dir`` broadcasts rank 0's value to every rank, which is a collective under DDP/FSDP: called from code
that only rank 0 runs (``@rank_zero_only`` writers, the end-of-fit summary) it waits forever for the other ranks, or
fails once they have exited. This is the same value read locally — rank 0's own, which is what the broadcast returns.
"""

from __future__ import annotations

import os

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger


def run_log_dir(trainer: L.Trainer) -> str:
    """``trainer.log_dir`` as this process computes it (the first logger's directory, else ``default_root_dir``) —
    except for another kind of logger (W&B): the run's own directory, ``<save_dir>/<name>/<version>``, where Lightning
    puts its checkpoints, not ``save_dir``, which every run shares (``trainer.log_dir``, where ``config.yaml`` goes). A
    ``~`` (a logger's ``save_dir: ~/runs``, which Lightning's paths keep) is expanded."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        if isinstance(logger, (TensorBoardLogger, CSVLogger)):
            path = logger.log_dir
        else:
            path, version = logger.save_dir, logger.version
            if path is not None and logger.name is not None and version is not None:
                path = os.path.join(path, str(logger.name), version if isinstance(version, str) else f"version_{version}")
        if path is not None:
            return os.path.expanduser(str(path))
    return os.path.expanduser(str(trainer.default_root_dir))
