"""Checks schemathesis runs beside its own (loaded through SCHEMATHESIS_HOOKS=lab.hostile.checks): answers the
schema allows but the service promises never to give."""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis

# tier -> its max_budget, from the run's configuration (schema.run sets it)
TIER_MAX = "HEADBUDGET_TIER_MAX"


def _tier_max() -> dict[str, float]:
    return {str(k): float(v) for k, v in json.loads(os.environ.get(TIER_MAX, "{}")).items()}


@schemathesis.check
def budget_within_tier(ctx: Any, response: Any, case: Any) -> bool | None:
    """A 200 from /classify never spends more than the caller's tier allows, and each text's cost is a fraction."""
    if case.path != "/classify" or response.status_code != 200:
        return None
    body = response.json()
    limit = _tier_max().get(body.get("tier", ""))
    for result in body.get("results", []):
        if limit is not None and result["budget_applied"] > limit + 1e-9:
            raise AssertionError(f"budget_applied {result['budget_applied']} above tier {body['tier']}'s "
                                 f"max_budget {limit}")
        if not 0 < result["cost"] <= 1 + 1e-9:
            raise AssertionError(f"cost {result['cost']} outside (0, 1]")
    return True
