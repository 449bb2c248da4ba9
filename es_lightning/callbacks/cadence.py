"""Step cadences that survive batches of several optimizer steps.

A callback asked to act every K optimizer steps acts after each training batch whose steps reach a new multiple of K.
Testing ``global_step % K == 0`` after the batch instead misses every multiple a batch jumps over: a GRPO batch with
``num_iterations`` 3 advances the step by 3, so ``every_n_train_steps: 2`` fired at steps 6, 12, … only — a third of
the evaluations asked for (:class:`~es_lightning.callbacks.RunCheckpoint` counts its checkpoints the same way).
"""

from __future__ import annotations

import lightning as L


class StepCadence:
    """Remembers the optimizer step a training batch started at; :meth:`due` says whether the batch crossed a multiple
    of ``every``. One step per batch (ES, GRPO with ``num_iterations: 1``): exactly ``global_step % every == 0``."""

    def __init__(self) -> None:
        self._start: int | None = None

    def batch_started(self, trainer: L.Trainer) -> None:
        self._start = trainer.global_step

    def due(self, trainer: L.Trainer, every: int) -> bool:
        step = trainer.global_step
        start = self._start if self._start is not None else step - 1
        return every > 0 and step > start and step // every > start // every
