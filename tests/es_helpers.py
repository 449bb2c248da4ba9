"""Pieces the tests share: a reward every member earns differently, a callback that records the batches, and one that
records when each update ended."""

from __future__ import annotations

import time

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


class StepClock(L.Callback):
    """Seconds from the start of training to the end of each update, one list per fit in ``StepClock.runs`` (a class
    attribute: a fit built from a config, ``--trainer.callbacks+ es_helpers.StepClock``, is still seen)."""

    runs: list[list[float]] = []

    def on_train_start(self, trainer, module):
        self.start = time.monotonic()
        StepClock.runs.append([])

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        StepClock.runs[-1].append(time.monotonic() - self.start)
