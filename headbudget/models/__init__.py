"""Budget-gated BERT-style encoder classifier: config, head-mask policy, modules and checkpoints.

Exports resolve lazily, so that torch-free users (the ONNX Runtime engine, the service) can import
``headbudget.models.budget`` or ``headbudget.models.checkpoint_meta`` without paying for torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "BUDGET_GRID": "budget", "GateParams": "budget", "crossing_budgets": "budget", "head_mask": "budget",
    "head_order": "budget", "n_kept": "budget",
    "CheckpointError": "checkpoint_meta", "read_config": "checkpoint_meta", "weights_digest": "checkpoint_meta",
    "load_checkpoint": "checkpoint", "save_checkpoint": "checkpoint",
    "BudgetedClassifier": "classifier",
    "GateConfig": "config", "ModelConfig": "config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
