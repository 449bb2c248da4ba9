"""The console during a fit: a step bar on a terminal, plain progress lines anywhere else (SLURM, nohup, CI logs).

A run is counted in optimizer steps (``max_steps``), not epochs: the data is a stream of prompts, and Lightning's
default bars show ``Epoch 0/-2`` and a ``v_num`` that mean nothing here. An ES step scores N perturbed models before it
updates once, so a step can take minutes on a real model; both displays show how much of the population is scored.

- :class:`StageProgressBar` (a terminal): ``GRPO: 10%|██   | 12/120 [...] train/reward_mean=0.372`` — the stage, the
  optimizer step out of ``max_steps``, the metrics the module shows (``prog_bar=True``), and ``ES 5/16 members`` while
  the population is scored.
- :class:`ProgressLines` (stdout is not a terminal): one line at the first step, then at most one every
  ``every_seconds`` (and always at the last step, at each validation and at a stage switch) —
  ``step 12/120 [GRPO]  reward_mean 0.372  1.42 s/step  elapsed 0:00:17  eta 0:02:33``. A Rich or tqdm bar writes
  carriage returns into a log file and nothing readable until it closes.

``es-lightning`` picks one of the two for the recipes (a ``StageProgressBar`` in a recipe becomes ``ProgressLines`` when
the output is redirected); in a script, add either to ``Trainer(callbacks=...)``.
"""

from __future__ import annotations

import math
import sys
import time
from datetime import timedelta
from typing import Any

from lightning.pytorch.callbacks import ProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import convert_inf


def stage_name(pl_module) -> str:
    """``GRPO`` / ``ES`` (the active algorithm's name when the module has one; else its class without ``Module``)."""
    algorithm = getattr(pl_module, "algorithm", None)
    name = getattr(algorithm, "name", None)
    return str(name).upper() if name else type(pl_module).__name__.removesuffix("Module")


def _total_steps(trainer) -> int | None:
    """The fit's last optimizer step: ``max_steps``, or what ``max_epochs`` epochs of the data hold when that is sooner
    or ``max_steps`` is unset (a batch makes the algorithm's ``steps_per_batch`` steps: GRPO's ``num_iterations``)."""
    limit = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
    batches, epochs = trainer.num_training_batches, trainer.max_epochs
    if epochs is None or epochs < 0 or not math.isfinite(batches) or batches <= 0:
        return limit
    module = trainer.lightning_module
    per_batch = getattr(getattr(module, "algorithm", module), "steps_per_batch", 1)
    epochs_hold = int(batches) * max(epochs, 1) * (per_batch if isinstance(per_batch, int) and per_batch > 0 else 1)
    return min(limit, epochs_hold) if limit else epochs_hold


def _metrics(trainer, pl_module, bar: ProgressBar) -> dict[str, Any]:
    items = ProgressBar.get_metrics(bar, trainer, pl_module)
    items.pop("v_num", None)
    items.pop("train/stage", None)  # shown as the stage name
    return items


class StageProgressBar(TQDMProgressBar):
    """A tqdm bar over the fit's optimizer steps, with the stage and the ES population progress."""

    def get_metrics(self, trainer, pl_module) -> dict[str, Any]:
        return _metrics(trainer, pl_module, self)

    def on_train_epoch_start(self, trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        bar = self.train_progress_bar
        if bar is not None and _total_steps(trainer):
            bar.total = convert_inf(_total_steps(trainer))
            bar.n = bar.initial = trainer.global_step
            bar.refresh()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.train_progress_bar is not None:
            self.train_progress_bar.set_description(stage_name(pl_module))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.n = trainer.global_step if _total_steps(trainer) else batch_idx + 1
            bar.set_postfix(self.get_metrics(trainer, pl_module))
            bar.refresh()

    def on_population_progress(self, trainer, pl_module, done: int, total: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            stage = stage_name(pl_module)
            bar.set_description(f"{stage} {done}/{total} members" if done < total else stage)


def _clock(seconds: float) -> str:
    return str(timedelta(seconds=int(seconds))) if math.isfinite(seconds) else "?"


class ProgressLines(ProgressBar):
    """Progress as plain lines at a steady cadence, for logs (stdout redirected).

    Args:
        every_seconds: the least time between two lines (the first and last step, validation results and stage switches
            are always printed).
    """

    def __init__(self, every_seconds: float = 30.0) -> None:
        super().__init__()
        if every_seconds < 0:
            raise ValueError(f"every_seconds must be >= 0, got {every_seconds}")
        self.every_seconds = every_seconds
        self._enabled = True
        self._start = self._last_line = 0.0
        self._first_step = 0
        self._stage: str | None = None

    @property
    def is_enabled(self) -> bool:
        """Lightning's progress bar property, which ``LightningModule.print`` reads (without it, any ``self.print``
        under these lines raised AttributeError)."""
        return self._enabled

    @property
    def is_disabled(self) -> bool:
        return not self._enabled

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    def print(self, *args: Any, sep: str | None = " ", end: str | None = "\n", file: Any = None, **kwargs: Any) -> None:
        """``LightningModule.print``'s text in one write (``print`` writes the text and its newline apart: with
        unbuffered streams another rank's line could land between them)."""
        if self._enabled:
            stream = sys.stdout if file is None else file
            stream.write((" " if sep is None else sep).join(map(str, args)) + ("\n" if end is None else end))
            stream.flush()

    def _write(self, text: str) -> None:
        if self._enabled and self.trainer.is_global_zero:
            sys.stdout.write(text + "\n")
            sys.stdout.flush()
            self._last_line = time.monotonic()

    def on_train_start(self, trainer, pl_module) -> None:
        self._start = self._last_line = time.monotonic()
        self._first_step = trainer.global_step
        total = _total_steps(trainer)
        self._write(f"training {stage_name(pl_module)} from step {trainer.global_step}"
                    + (f" to {total}" if total else "") + f" (a line every {self.every_seconds:g} s at most)")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step, total = trainer.global_step, _total_steps(trainer)
        stage = stage_name(pl_module)
        due = (step == self._first_step + 1 or step == total or stage != self._stage
               or time.monotonic() - self._last_line >= self.every_seconds)
        self._stage = stage
        if not due:
            return
        elapsed = time.monotonic() - self._start
        rate = elapsed / max(1, step - self._first_step)
        eta = f"  eta {_clock(rate * (total - step))}" if total else ""
        metrics = "".join(f"  {k.split('/', 1)[-1]} {v:.4g}" if isinstance(v, float) else f"  {k.split('/', 1)[-1]} {v}"
                          for k, v in _metrics(trainer, pl_module, self).items())
        self._write(f"step {step}{f'/{total}' if total else ''} [{stage}]{metrics}  {rate:.2f} s/step"
                    f"  elapsed {_clock(elapsed)}{eta}")

    def on_population_progress(self, trainer, pl_module, done: int, total: int) -> None:
        if time.monotonic() - self._last_line >= self.every_seconds and done < total:
            self._write(f"step {trainer.global_step + 1} [{stage_name(pl_module)}]  population {done}/{total} scored")

    def on_validation_end(self, trainer, pl_module) -> None:
        if trainer.sanity_checking:
            return
        figures = {k: v for k, v in trainer.callback_metrics.items() if k.startswith(("val/", "test/"))}
        if figures:  # `validate --ckpt_path`: Lightning restores the weights, not the step (it read "step 0")
            fitting = trainer.state.fn == "fit"
            what = (f"step {trainer.global_step} validation" if fitting else
                    f"validation of {trainer.ckpt_path}" if trainer.ckpt_path else "validation")
            self._write(f"{what}: "
                        + "  ".join(f"{k.split('/', 1)[-1]} {float(v):.3f}" for k, v in figures.items()))

    def on_train_end(self, trainer, pl_module) -> None:
        elapsed = time.monotonic() - self._start
        self._write(f"trained steps {self._first_step}-{trainer.global_step} in {_clock(elapsed)}")
