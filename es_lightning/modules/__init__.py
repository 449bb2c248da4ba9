"""LightningModules: the shared base and the algorithms (ES, GRPO)."""

from es_lightning.modules.base import EvalBatch, ReasoningModule
from es_lightning.modules.es import ESModule

__all__ = ["ESModule", "EvalBatch", "ReasoningModule"]
