"""GET /healthz, /readyz and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from headbudget.service.http.deps import RuntimeDep
from headbudget.service.http.schemas import Health, Readiness

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """Alive: the process answers."""
    return Health()


@router.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
async def readyz(runtime: RuntimeDep) -> JSONResponse:
    """Ready: model loaded and warmed up, not draining, rate limits enforceable."""
    ready, checks = await runtime.readiness()
    body = Readiness(status="ready" if ready else "not_ready", checks=checks)
    return JSONResponse(body.model_dump(), status_code=200 if ready else 503)


@router.get("/metrics", response_class=Response)
async def metrics(runtime: RuntimeDep) -> Response:
    """Prometheus metrics (aggregated over workers)."""
    content, content_type = runtime.metrics.render()
    return Response(content=content, media_type=content_type)
