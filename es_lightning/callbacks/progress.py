"""A progress bar that shows the training stage and, during ES, how much of the population has been scored.

An ES step scores N perturbed models before it updates once, so a step can take a while; the bar's description shows
``ES 5/16`` while the members are evaluated. The stage (``train/stage``: 0 = GRPO, 1 = ES) is logged to the bar by
:class:`~es_lightning.SequentialStrategy`.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import TQDMProgressBar


class StageProgressBar(TQDMProgressBar):
    """Lightning's TQDM bar plus the stage name and the population progress of ES steps."""

    def _stage(self, pl_module) -> str:
        algorithm = getattr(pl_module, "algorithm", None)  # swapped by a SequentialStrategy switch
        return algorithm.name.upper() if algorithm is not None else type(pl_module).__name__.removesuffix("Module")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.train_progress_bar is not None:
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch} [{self._stage(pl_module)}]")

    def on_population_progress(self, trainer, pl_module, done: int, total: int) -> None:
        bar = self.train_progress_bar
        if bar is not None and not bar.disable:
            bar.set_description(f"Epoch {trainer.current_epoch} [ES {done}/{total}]")
