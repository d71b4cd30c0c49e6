"""POST /classify."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request

from headbudget.service.http.deps import MeteredCallerDep, RuntimeDep
from headbudget.service.http.routes import error_responses
from headbudget.service.http.schemas import (
    BudgetParam,
    BudgetValue,
    ClassifyRequest,
    ClassifyResponse,
    LatencyLimit,
)
from headbudget.service.pipeline import CLASSIFY_QUERY, BudgetParams, answer, check_query

router = APIRouter(tags=["inference"])


@router.post("/classify", response_model=ClassifyResponse,
             responses=error_responses(400, 401, 403, 413, 415, 422, 429, 503))
async def classify_texts(
    body: ClassifyRequest, request: Request, runtime: RuntimeDep, caller: MeteredCallerDep,
    budget: Annotated[BudgetParam | None, Query(
        description="Budget in [0.1, 1], or `auto` on checkpoints that predict their own (or in the body)")] = None,
    max_latency_ms: Annotated[LatencyLimit | None, Query(description="Latency limit instead of a budget")] = None,
    max_budget: Annotated[BudgetValue | None, Query(
        description="With budget=auto: the ceiling no text spends more than (at most the tier's max_budget)")] = None,
) -> ClassifyResponse:
    """Classify one text or up to 64, running only the heads, neurons and layers the budget buys."""
    # Served by service/http/fastpath.py unless the request is one it hands on (an error case) or it is off.
    check_query(request.query_params.multi_items(), CLASSIFY_QUERY)
    return ClassifyResponse.model_validate(
        await answer(runtime, caller, body, BudgetParams(budget, max_latency_ms, max_budget), request))
