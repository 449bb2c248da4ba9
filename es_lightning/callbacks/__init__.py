"""Callbacks users compose in their own scripts."""

from es_lightning.callbacks.checkpoint import RunCheckpoint
from es_lightning.callbacks.drift import ParameterDrift
from es_lightning.callbacks.export import HFExport
from es_lightning.callbacks.model_summary import ModelSummary, RichModelSummary
from es_lightning.callbacks.pass_at_k import PassAtKCallback
from es_lightning.callbacks.progress import ProgressLines, StageProgressBar
from es_lightning.callbacks.report import TrainingReport
from es_lightning.callbacks.sequential import SequentialStrategy

__all__ = ["HFExport", "ModelSummary", "ParameterDrift", "PassAtKCallback", "ProgressLines", "RichModelSummary",
           "RunCheckpoint", "SequentialStrategy", "StageProgressBar", "TrainingReport"]
