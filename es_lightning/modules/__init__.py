"""LightningModules: the shared base and the algorithms (ES, GRPO)."""

from es_lightning.modules.base import EvalBatch, ReasoningModule

__all__ = ["EvalBatch", "ReasoningModule"]
