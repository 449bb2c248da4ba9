"""es-lightning: post-train language models for reasoning with Evolution Strategies, GRPO, or GRPO then ES.

Public API — everything else may change between releases.
"""

from es_lightning.algorithms import Algorithm, get_algorithm, register_algorithm
from es_lightning.callbacks import (
    HFExport,
    ParameterDrift,
    PassAtKCallback,
    ProgressLines,
    RunCheckpoint,
    SequentialStrategy,
    StageProgressBar,
    TrainingReport,
)
from es_lightning.data import ReasoningDataModule
from es_lightning.es.algorithm import ESAlgorithm, ESSettings
from es_lightning.generation import Generator, HFGenerator, Rollout, SamplingParams, make_generator
from es_lightning.generation.vllm import VLLMGenerator  # importable without vLLM; building one needs it
from es_lightning.grpo.algorithm import GRPOAlgorithm, GRPOSettings
from es_lightning.metrics import MajorityAtK, PassAtK, PopulationDiversity, TokenEntropy, js_succ, pass_at_k
from es_lightning.modules.base import ReasoningModule
from es_lightning.modules.es import ESModule
from es_lightning.modules.grpo import GRPOModule
from es_lightning.policy import Policy, load_policy
from es_lightning.precision import MasterAdamW, check_device_dtype, resolve_master_dtype
from es_lightning.scoring import RewardError
from es_lightning.tasks import AdditionTask, CountdownTask, GSM8KTask, MathTask, SortTask, Task

__version__ = "0.1.0.dev0"

__all__ = [
    "AdditionTask",
    "Algorithm",
    "CountdownTask",
    "ESAlgorithm",
    "ESModule",
    "ESSettings",
    "GSM8KTask",
    "HFExport",
    "GRPOAlgorithm",
    "GRPOModule",
    "GRPOSettings",
    "Generator",
    "HFGenerator",
    "MajorityAtK",
    "MasterAdamW",
    "MathTask",
    "ParameterDrift",
    "PassAtK",
    "PassAtKCallback",
    "Policy",
    "ProgressLines",
    "PopulationDiversity",
    "ReasoningDataModule",
    "ReasoningModule",
    "RewardError",
    "Rollout",
    "RunCheckpoint",
    "SamplingParams",
    "SequentialStrategy",
    "SortTask",
    "StageProgressBar",
    "Task",
    "TokenEntropy",
    "TrainingReport",
    "VLLMGenerator",
    "check_device_dtype",
    "get_algorithm",
    "js_succ",
    "load_policy",
    "make_generator",
    "pass_at_k",
    "register_algorithm",
    "resolve_master_dtype",
]
