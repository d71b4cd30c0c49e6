"""The model-type registry: every type builds, trains the stages the trainer knows, and is served by the
engine its flags name."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest

from headbudget.engine.factory import model_info
from headbudget.engine.types import EngineOptions
from headbudget.models.config import MODEL_TYPES, SCOPE_SPECS, SCOPES, TINY, ModelConfig, Scope
from headbudget.models.model_types import REGISTRY, model_type
from headbudget.training.stages import Stage


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_each_type_builds_its_class_and_trains_known_stages(name: str) -> None:
    kind = model_type(name)
    model = kind.build(ModelConfig(model_type=name, **TINY))
    assert type(model).__name__ == kind.cls and model.cfg.model_type == name
    assert kind.stages[0] == "dense" and set(kind.stages) <= set(get_args(Stage))


def test_each_scope_has_one_row_and_every_type_names_known_scopes() -> None:
    assert SCOPES == get_args(Scope) == tuple(SCOPE_SPECS)
    assert all(kind.scopes and set(kind.scopes) <= set(SCOPES) for kind in REGISTRY.values())
    assert tuple(s for s in SCOPES if SCOPE_SPECS[s].gates_ffn) == REGISTRY["budgeted"].scopes[1:] == ("model",)


def test_unknown_types_are_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown model_type 'nope'; one of budgeted, budgetformer"):
        model_type("nope")
    with pytest.raises(ValueError, match="unknown model_type"):
        ModelConfig(model_type="nope")
    assert MODEL_TYPES == tuple(REGISTRY)


def test_the_engine_follows_the_registry(tiny_checkpoint: Path, budgetformer_smoke: Path) -> None:
    budgeted = model_info(tiny_checkpoint, EngineOptions())
    adaptive = model_info(budgetformer_smoke, EngineOptions())
    assert model_type(budgeted.model_type).static_plans and budgeted.extra["backend"] == "onnxruntime"
    assert not budgeted.supports_auto
    assert not model_type(adaptive.model_type).static_plans and adaptive.extra["backend"] == "torch-adaptive"
    assert adaptive.supports_auto == REGISTRY["budgetformer"].supports_auto is True
