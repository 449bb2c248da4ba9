"""The run's log directory without a collective.

``Trainer.log_dir`` broadcasts rank 0's value to every rank, which is a collective under DDP/FSDP: called from code
that only rank 0 runs (``@rank_zero_only`` writers, the end-of-fit summary) it waits forever for the other ranks, or
fails once they have exited. This is the same value read locally — rank 0's own, which is what the broadcast returns.
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger


def run_log_dir(trainer: L.Trainer) -> str:
    """``trainer.log_dir`` as this process computes it (the first logger's directory, else ``default_root_dir``)."""
    if trainer.loggers:
        logger = trainer.loggers[0]
        path = logger.log_dir if isinstance(logger, (TensorBoardLogger, CSVLogger)) else logger.save_dir
        if path is not None:
            return str(path)
    return str(trainer.default_root_dir)
