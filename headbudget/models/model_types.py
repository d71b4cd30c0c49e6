"""Every model type, registered once: how it is built, trained and served (torch-free).

``config.json`` stores the type's name (``model.model_type``); what differs per type is asked of this registry,
never switched on that string. Classes are named as import paths, so that the serving process can ask what a
type needs without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Literal

# Training stages (training/stages.py: STAGES says what each does), as run folders and done.json name them.
Stage = Literal["dense", "budget", "hard", "recover", "adapt"]


@dataclass(frozen=True)
class ModelType:
    """One model type and what the rest of the code needs to know about it."""

    name: str
    module: str  # headbudget.models.<module>.<cls> builds it from a ModelConfig
    cls: str
    stages: tuple[Stage, ...]  # training stages, in order (training/stages.py runs each)
    # One head set per budget, the same for every input: the budget sweep, the ONNX Runtime engine (fp32 and
    # int8) and export apply. Otherwise the type chooses per input and runs on the adaptive PyTorch engine.
    static_plans: bool
    supports_auto: bool = False  # it can predict each input's own budget (budget=auto)
    scopes: tuple[str, ...] = ("attention",)  # what its budget may span (GateConfig.scope)

    def build(self, cfg: Any) -> Any:
        """An untrained model of this type (imports torch)."""
        return getattr(importlib.import_module(f"headbudget.models.{self.module}"), self.cls)(cfg)


REGISTRY: dict[str, ModelType] = {t.name: t for t in (
    ModelType("budgeted", "classifier", "BudgetedClassifier", ("dense", "budget", "hard"), static_plans=True,
              scopes=("attention", "model")),
    ModelType("budgetformer", "budgetformer", "BudgetFormerClassifier", ("dense", "adapt"), static_plans=False,
              supports_auto=True),
    ModelType("span", "span", "SpanClassifier", ("dense", "adapt"), static_plans=False),
    ModelType("adaattention", "adaattention", "AdaAttentionClassifier", ("dense", "adapt"), static_plans=False),
)}


def model_type(name: str) -> ModelType:
    """The registered type called ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model_type {name!r}; one of {', '.join(REGISTRY)}") from None


def adaptive_types() -> tuple[str, ...]:
    """The types that choose per input (no static plans), in registry order: the adaptive engine runs them."""
    return tuple(t.name for t in REGISTRY.values() if not t.static_plans)
