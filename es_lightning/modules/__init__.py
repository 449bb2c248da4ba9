"""LightningModules: the shared base and the algorithms (ES, GRPO)."""

from es_lightning.modules.base import EvalBatch, ReasoningModule
from es_lightning.modules.es import ESModule
from es_lightning.modules.grpo import GRPOModule

__all__ = ["ESModule", "EvalBatch", "GRPOModule", "ReasoningModule"]
