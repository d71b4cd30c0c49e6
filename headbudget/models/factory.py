"""One constructor for every model type, so checkpoints and bases load whichever type they hold."""

from __future__ import annotations

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import ModelConfig
from headbudget.models.model_types import model_type


def build_model(cfg: ModelConfig) -> BudgetedClassifier:
    """An untrained model of ``cfg.model_type``."""
    model: BudgetedClassifier = model_type(cfg.model_type).build(cfg)
    return model


def to_model_type(model: BudgetedClassifier, model_type: str, seed: int = 0) -> BudgetedClassifier:
    """``model``'s weights in a fresh ``model_type`` model: the dense warm start of an adaptive type.

    Only the parameters the adaptive type adds are new (and initialised so the model starts out dense).
    """
    from dataclasses import replace

    import torch

    torch.manual_seed(seed)
    target = build_model(replace(model.cfg, model_type=model_type))
    result = target.load_state_dict(model.state_dict(), strict=False)
    if result.unexpected_keys:
        raise ValueError(f"cannot turn a {model.cfg.model_type} model into {model_type}: "
                         f"unexpected {result.unexpected_keys[:3]}")
    return target.to(next(model.parameters()).device)
