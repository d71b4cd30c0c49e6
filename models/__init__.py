"""Budget-gated BERT-style encoder classifier: config, head-mask policy, modules and checkpoints."""

from headbudget.models.budget import BUDGET_GRID, GateParams, crossing_budgets, head_mask, head_order, n_kept
from headbudget.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import GateConfig, ModelConfig

__all__ = [
    "BUDGET_GRID",
    "BudgetedClassifier",
    "CheckpointError",
    "GateConfig",
    "GateParams",
    "ModelConfig",
    "crossing_budgets",
    "head_mask",
    "head_order",
    "load_checkpoint",
    "n_kept",
    "save_checkpoint",
]
