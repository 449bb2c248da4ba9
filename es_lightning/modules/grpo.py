"""GRPOModule: group-relative policy optimisation — :class:`ReasoningModule` + :class:`GRPOAlgorithm`.

To run::

    es-lightning fit --config recipes/grpo.yaml
    es-lightning fit --config recipes/grpo.yaml --model.init_args.lr 1e-4     # override any value

The algorithm (rollout → group advantages → clipped policy loss, TRL's loss types) is in
:mod:`es_lightning.grpo.algorithm`; every GRPO setting is documented once, on
:class:`~es_lightning.grpo.algorithm.GRPOSettings`, and is a ``GRPOModule`` argument (a YAML key) from there.
"""

from __future__ import annotations

from es_lightning.grpo.algorithm import GRPOAlgorithm
from es_lightning.modules.base import ReasoningModule


class GRPOModule(ReasoningModule, algorithm=GRPOAlgorithm):
    """GRPO / Dr. GRPO / DAPO (Shao et al. 2024; Liu et al. 2025; Yu et al. 2025) with the knobs and metric names of
    TRL's ``GRPOTrainer``.

    To run: ``es-lightning fit --config recipes/grpo.yaml``; in a script,
    ``Trainer(max_steps=200).fit(GRPOModule(lr=1e-4), datamodule=ReasoningDataModule("countdown"))``.

    Features: DDP and FSDP through the Trainer's strategy; exact resume (weights, AdamW and scheduler state, step,
    sampling seeds); a frozen reference for the KL term loaded only when ``beta > 0`` and kept out of checkpoints.
    """
