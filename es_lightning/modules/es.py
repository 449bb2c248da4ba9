"""ESModule: evolution-strategies post-training without autograd — :class:`ReasoningModule` + :class:`ESAlgorithm`.

The algorithm (one ES step = evaluate the population → seeded update → log) is in :mod:`es_lightning.es.algorithm`,
the population evaluators in :mod:`es_lightning.es.evaluators`; every ES setting is documented once, on
:class:`~es_lightning.es.algorithm.ESSettings`, and is an ``ESModule`` argument (a YAML key) from there.
"""

from __future__ import annotations

from es_lightning.es.algorithm import ESAlgorithm
from es_lightning.modules.base import ReasoningModule


class ESModule(ReasoningModule, algorithm=ESAlgorithm):
    """Evolution strategies over the policy's weights (Qiu et al. 2025, Alg. 2; Ba et al. 2026, App. G).

    To run: ``es-lightning fit --config recipes/es.yaml``; in a script,
    ``Trainer(max_steps=50).fit(ESModule(sigma=5e-3, lr=3e-3), datamodule=ReasoningDataModule("countdown"))``.

    Per step, on one batch of prompts shared by the whole population, N members θ + σε_n are scored with the task's
    reward (greedy by default, as Ba et al.; with ``temperature > 0`` every member samples with the same random
    numbers), the centre weights are restored bit for bit, and θ += (α/N) Σ z_n ε_n is applied with the noise
    regenerated from its seeds. Population-parallel under DDP (rank r scores members r, r + W, …), prompt-parallel
    under FSDP. ``train/drift`` is logged by the default :class:`~es_lightning.callbacks.ParameterDrift` callback.
    """
