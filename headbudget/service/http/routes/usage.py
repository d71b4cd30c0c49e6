"""GET /v1/usage: the calling key's own quota and usage, never another key's."""

from __future__ import annotations

from fastapi import APIRouter

from headbudget.service.accounting.auth import Caller
from headbudget.service.accounting.compute import units
from headbudget.service.errors import Unavailable
from headbudget.service.http.deps import CallerDep, RuntimeDep
from headbudget.service.http.routes import error_responses
from headbudget.service.http.schemas import QuotaNow, UsageAmounts, UsageReport
from headbudget.service.runtime import Runtime
from headbudget.service.state.store import ComputeLimit, QuotaLeft, StateUnavailable, Usage, utc_day

router = APIRouter(tags=["usage"])


@router.get("/v1/usage", response_model=UsageReport, responses=error_responses(401, 429, 503))
async def my_usage(runtime: RuntimeDep, caller: CallerDep) -> UsageReport:
    """The calling key's compute quota left now, and what it spent today (UTC) and in all (this call counts
    against its request rate)."""
    day = utc_day()
    tier = caller.tier
    try:
        left = await runtime.state.quota_left(caller.owner, tier.rate_limit, tier.burst, ComputeLimit.of(tier))
        today, total = await runtime.state.usage_of(caller.owner, day)
    except StateUnavailable:
        runtime.metrics.state_errors.labels(operation="usage").inc()
        runtime.metrics.set_state_up(False)
        raise Unavailable("usage cannot be read now (state store unavailable)", retry_after_s=1) from None
    return UsageReport(key=caller.name, tier=tier.name, date=day, quota=_quota(runtime, caller, left),
                       today=_amounts(today), total=_amounts(total))


def _quota(runtime: Runtime, caller: Caller, left: QuotaLeft) -> QuotaNow:
    tier = caller.tier
    return QuotaNow(requests_per_minute=tier.rate_limit, request_burst=tier.burst, requests_left=left.requests,
                    compute_per_minute=tier.compute_per_minute, compute_burst=tier.burst_units,
                    compute_left=None if left.compute is None else units(left.compute),
                    max_request_compute=tier.max_request_compute)


def _amounts(u: Usage) -> UsageAmounts:
    return UsageAmounts(units=units(u.units), requests=u.requests, texts=u.texts, tokens=u.tokens,
                        saved_units=units(u.saved))
