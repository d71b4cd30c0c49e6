"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter

from headbudget.service.accounting.compute import REFERENCE_TOKENS
from headbudget.service.errors import Unavailable
from headbudget.service.http.deps import RuntimeDep
from headbudget.service.http.routes import error_responses
from headbudget.service.http.schemas import BudgetPoint, ComputeUnitInfo, ModelCard, ModelList

router = APIRouter(tags=["models"])


@router.get("/v1/models", response_model=ModelList, responses=error_responses(503))
async def list_models(runtime: RuntimeDep) -> ModelList:
    """The loaded checkpoint: its labels and size, the budget grid (the heads, neurons and layers each budget
    runs, with offline accuracy and latency), and what one compute unit is."""
    info, latency = runtime.info, runtime.batcher.latency
    if info is None or latency is None:
        raise Unavailable("the model is not loaded yet", retry_after_s=5)
    accuracy = info.sweep.accuracy if info.sweep else {}
    grid = sorted(runtime.budget_grid())
    points = [BudgetPoint(budget=b, heads_active=runtime.grid_heads.get(b, 0),
                          neurons_active=runtime.grid_neurons.get(b), layers_run=runtime.grid_depth.get(b),
                          accuracy=accuracy.get(b), latency_ms=round(ms, 3), latency_tokens=round(latency.ref_tokens))
              for b, ms in zip(grid, latency.estimates_ms(grid, latency.ref_tokens), strict=True)]
    dense = info.sweep.dense_accuracy if info.sweep else None
    unit = runtime.unit
    unit_info = None if unit is None else ComputeUnitInfo(
        description=unit.describe(), reference_tokens=REFERENCE_TOKENS, reference_macs=unit.reference_macs,
        macs=round(unit.macs, 3))
    card = ModelCard(id=info.name, checksum=info.checksum, labels=list(info.labels), n_layers=info.n_layers,
                     n_heads=info.n_heads, heads_total=info.n_layers * info.n_heads, max_length=info.max_length,
                     supports_auto=info.supports_auto, decider=info.decider.kind if info.decider else None,
                     dense_accuracy=dense, budgets=points, compute_unit=unit_info)
    return ModelList(data=[card])
