"""Analyses behind the paper's findings (Ba et al. 2026): Pass@k curves, drift and functional sparsity, sparsity
ablation, forgetting and population-size sweeps. Each is a function returning a report (table, JSON, PNG) and a
command of ``es-lightning eval`` / ``es-lightning analyze``; those that evaluate share one :class:`EvalSettings`."""

from es_lightning.analysis.ablation import AblationReport, ablate_, ablation_command, sparsity_ablation, top_percent_threshold
from es_lightning.analysis.checkpoints import LoadedModel, load_model
from es_lightning.analysis.compare import CompareReport, compare_command, compare_methods
from es_lightning.analysis.drift import DriftReport, drift_command, module_kind, parameter_drift
from es_lightning.analysis.evaluate import EvalReport, eval_command, evaluate_models, evaluate_policy, heldout_problems
from es_lightning.analysis.forgetting import ForgettingReport, forgetting, forgetting_command
from es_lightning.analysis.settings import COMPARE_EVAL, PAPER_EVAL, SWEEP_EVAL, EvalSettings
from es_lightning.analysis.sweep import SweepReport, population_sweep, sweep_command

__all__ = [
    "AblationReport",
    "COMPARE_EVAL",
    "CompareReport",
    "DriftReport",
    "EvalReport",
    "EvalSettings",
    "ForgettingReport",
    "LoadedModel",
    "PAPER_EVAL",
    "SWEEP_EVAL",
    "SweepReport",
    "ablate_",
    "ablation_command",
    "compare_command",
    "compare_methods",
    "drift_command",
    "eval_command",
    "evaluate_models",
    "evaluate_policy",
    "forgetting",
    "forgetting_command",
    "heldout_problems",
    "load_model",
    "module_kind",
    "parameter_drift",
    "population_sweep",
    "sparsity_ablation",
    "sweep_command",
    "top_percent_threshold",
]
