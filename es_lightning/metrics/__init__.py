"""torchmetrics Metrics for reasoning post-training: coverage (pass@k), consensus (maj@k), token entropy, ES population
diversity. All keep sum states, so they sync exactly across DDP/FSDP ranks."""

from es_lightning.metrics.diversity import PopulationDiversity, js_succ, population_pass
from es_lightning.metrics.entropy import TokenEntropy, token_entropy
from es_lightning.metrics.majority import MajorityAtK
from es_lightning.metrics.pass_at_k import PassAtK, pass_at_k

__all__ = [
    "MajorityAtK",
    "PassAtK",
    "PopulationDiversity",
    "TokenEntropy",
    "js_succ",
    "pass_at_k",
    "population_pass",
    "token_entropy",
]
