"""Pieces the ES tests share: a reward every member earns differently, and a callback that records the batches."""

from __future__ import annotations

import lightning as L

from es_lightning.tasks import CountdownTask


class CharSumTask(CountdownTask):
    """A reward every member earns differently (an untrained model never solves Countdown), so updates are non-zero."""

    def reward(self, completions, examples):
        return [sum(map(ord, c)) % 97 / 97 for c in completions]


class RecordBatches(L.Callback):
    """Records each training batch (the prompts the population was scored on)."""

    def __init__(self):
        self.batches = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        self.batches.append(list(batch))
