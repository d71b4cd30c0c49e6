"""API keys and tiers: key generation and hashing, who a request is, and its rate limit and compute quota."""

from __future__ import annotations

import hashlib
import secrets
import time
from collections.abc import Callable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass

from headbudget.service.accounting.compute import unit_text, units
from headbudget.service.errors import ComputeQuotaExceeded, Forbidden, RateLimited, Unauthorized, Unavailable
from headbudget.service.metrics import Metrics
from headbudget.service.settings import ServiceConfig, StateConfig, TierConfig, utc_text
from headbudget.service.state.store import ComputeLimit, StateStore, StateUnavailable

KEY_PREFIX = "hb_"


def new_key() -> str:
    """A fresh random API key (shown once, stored only as its hash)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The SHA-256 hex digest a key is stored as."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Caller:
    """Who sent a request: the tier, a stable id for limits and feedback (never the key), a log label."""

    tier: TierConfig
    owner: str
    name: str


def presented_key(x_api_keys: Sequence[str], authorizations: Sequence[str]) -> str | None:
    """The key from ``X-API-Key`` or ``Authorization: Bearer`` (each header's values, as sent); None when neither
    is given; 401 when a header is repeated with different values, or both are given and name different keys (two
    credentials that disagree are refused, never resolved silently)."""
    x_api_key, authorization = _one_value(x_api_keys, "X-API-Key"), _one_value(authorizations, "Authorization")
    bearer = None
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("the Authorization header must be 'Bearer <key>'")
        bearer = token.strip()
    key = x_api_key.strip() if x_api_key else None
    if key and bearer and not secrets.compare_digest(key.encode(), bearer.encode()):
        raise Unauthorized("X-API-Key and Authorization: Bearer carry different keys; send one key")
    return key or bearer


def _one_value(values: Sequence[str], header: str) -> str | None:
    if any(v != values[0] for v in values[1:]):
        raise Unauthorized(f"{header} is given more than once with different values; send one key")
    return values[0] if values else None


def identify(config: ServiceConfig, extra_hashes: dict[str, str], key: str | None, client: str,
             now: float | None = None, revoked: AbstractSet[str] = frozenset()) -> Caller:
    """The caller a key belongs to; 401 for no key (unless an anonymous tier is configured), a wrong one, a revoked
    one (in the config or in ``revoked``, the hashes the state store holds revoked), or one past its expiry at
    ``now`` (Unix seconds; default: the clock, so no reload is needed)."""
    if key is None:
        anon = config.development.anonymous_tier
        if anon is None:
            raise Unauthorized("an API key is required (X-API-Key or Authorization: Bearer)")
        return Caller(config.tier(anon), f"anon:{client}", "anonymous")
    digest = hash_key(key)
    if digest in revoked:
        raise Unauthorized("this API key has been revoked")
    entry = config.key(digest)
    if entry is not None:
        state = entry.state(time.time() if now is None else now)
        if state == "revoked":
            raise Unauthorized("this API key has been revoked")
        if state == "expired":
            raise Unauthorized(f"this API key expired at {utc_text(entry.expires)}")
        return Caller(config.tier(entry.tier), digest[:16], entry.name or digest[:8])
    tier = extra_hashes.get(digest)
    if tier is not None and tier in config.tiers:
        return Caller(config.tier(tier), digest[:16], "dev")
    raise Unauthorized("unknown API key")


class RateMemo:
    """Keys the request rate refused, and until when: till then the store would refuse them again (a refusal
    spends nothing, and other workers' admissions only move a key's next allowance later), so /classify refuses
    such a key from its headers, before its body is read, parsed or priced. One per process; a reload clears it."""

    MAX_KEYS = 10_000  # past this, expired entries are dropped (anonymous callers are keyed by address)

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._until: dict[str, float] = {}
        self.clock = clock

    def __bool__(self) -> bool:
        return bool(self._until)

    def note(self, owner: str, asked_at: float, retry_after_s: float) -> None:
        """The store refused ``owner`` for ``retry_after_s`` when asked at ``asked_at`` (this memo's clock, read
        before the store was asked, so that the memo never outlasts the store's refusal)."""
        if len(self._until) >= self.MAX_KEYS:
            now = self.clock()
            self._until = {k: t for k, t in self._until.items() if t > now}
        self._until[owner] = asked_at + retry_after_s

    def refused_for(self, owner: str) -> float | None:
        """Seconds ``owner`` is still refused for, or None."""
        until = self._until.get(owner)
        if until is None:
            return None
        left = until - self.clock()
        if left <= 0:
            del self._until[owner]
            return None
        return left

    def clear(self) -> None:
        self._until.clear()


def check_budget(tier: TierConfig, budget: float) -> None:
    """403 when an explicit budget is above the tier's maximum."""
    if budget > tier.max_budget + 1e-9:
        raise Forbidden(f"budget {budget:g} is above the maximum of tier {tier.name!r}: {tier.max_budget:g}")


async def enforce_rate(state: StateStore, state_cfg: StateConfig, metrics: Metrics, caller: Caller,
                       charge_id: str, memo: RateMemo | None = None) -> None:
    """429 with Retry-After over the tier's rate (noted in ``memo``); when the store is down, fail open or closed
    as configured."""
    asked_at = memo.clock() if memo is not None else 0.0
    try:
        decision = await state.admit(caller.owner, caller.tier.rate_limit, caller.tier.burst, None, 0, charge_id)
    except StateUnavailable:
        _state_down(state_cfg, metrics)
        return
    metrics.set_state_up(True)
    if not decision.allowed:
        if memo is not None:
            memo.note(caller.owner, asked_at, decision.retry_after_s)
        raise rate_limited(caller.tier, decision.retry_after_s)


async def admit(state: StateStore, state_cfg: StateConfig, metrics: Metrics, caller: Caller, charge: int,
                charge_id: str, memo: RateMemo | None = None) -> bool:
    """429 with Retry-After over the tier's request rate or its compute quota for a request of ``charge``
    milli-units, both checked in one atomic step (a refused request spends neither); when the store is down, fail
    open or closed as configured. True when ``charge`` was reserved against a quota: the answer then settles it to
    what ran (``StateStore.settle``). A refusal by the request rate is noted in ``memo``."""
    tier, compute = caller.tier, ComputeLimit.of(caller.tier)
    asked_at = memo.clock() if memo is not None else 0.0
    try:
        decision = await state.admit(caller.owner, tier.rate_limit, tier.burst, compute, charge, charge_id)
    except StateUnavailable:
        _state_down(state_cfg, metrics)
        return False
    metrics.set_state_up(True)
    if decision.allowed:
        return compute is not None
    if decision.refused_by == "compute":
        raise ComputeQuotaExceeded(
            f"compute quota of tier {tier.name!r} exceeded: this request would be charged at least "
            f"{unit_text(units(charge))} compute units and the key may spend {unit_text(tier.compute_per_minute or 0)} "
            f"per minute, at most {unit_text(tier.burst_units or 0)} at once", retry_after_s=decision.retry_after_s)
    if memo is not None:
        memo.note(caller.owner, asked_at, decision.retry_after_s)
    raise rate_limited(tier, decision.retry_after_s)


def rate_limited(tier: TierConfig, retry_after_s: float) -> RateLimited:
    return RateLimited(f"rate limit of tier {tier.name!r} exceeded ({tier.rate_limit:g}/min, burst {tier.burst})",
                       retry_after_s=retry_after_s)


def _state_down(state_cfg: StateConfig, metrics: Metrics) -> None:
    """The store did not answer: count it, and refuse (503) if limits fail closed."""
    metrics.state_errors.labels(operation="rate_limit").inc()
    metrics.set_state_up(False)
    if state_cfg.on_error == "closed":
        raise Unavailable("rate limits cannot be checked (state store unavailable)", retry_after_s=1) from None
