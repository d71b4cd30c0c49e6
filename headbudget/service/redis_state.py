"""The state store in Redis: rate limits and compute quotas exact across workers and replicas, usage kept for
billing, feedback found by any worker."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from headbudget.service.settings import StateConfig
from headbudget.service.state import (
    Admission,
    AlreadyReported,
    AnswerNotFound,
    AnswerRecord,
    ComputeLimit,
    QuotaLeft,
    StateUnavailable,
    Usage,
    UsageRow,
    answer_key,
    refusal,
)

PREFIX = "headbudget:"

# Redis's clock, and a compute level drained to now (state.drained): the prelude of every quota script.
_QUOTA_PRELUDE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local function drained(key, rate)
  local stored = redis.call('HMGET', key, 't', 'level')
  if stored[1] and stored[2] then
    return math.max(0, tonumber(stored[2]) - math.max(0, now_ms - tonumber(stored[1])) * rate)
  end
  return 0
end
"""

# The request rate (GCRA, on Redis's clock so that every worker agrees) and the compute quota (GCRA weighted by
# the charge, in integers: a level of L milli-units is kept as L * 60000 and drains by per_minute a millisecond,
# state.PER_MINUTE_MS) in one atomic step: both are spent if both pass, neither otherwise. Lua numbers are doubles: exact below 2**53, which the
# settings' bounds keep them under. ARGV: interval, tolerance, has_compute, per_minute, burst, charge.
# Returns {allowed, rate retry ms, compute retry ms}.
_ADMIT = _QUOTA_PRELUDE + """
local interval = tonumber(ARGV[1])
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then tat = now end
local allow_at = tat - tonumber(ARGV[2])
local rate_retry = 0
if now < allow_at then rate_retry = math.ceil((allow_at - now) * 1000) end
local compute_retry, level, rate = 0, 0, tonumber(ARGV[4])
if ARGV[3] == '1' then
  level = drained(KEYS[2], rate) + tonumber(ARGV[6]) * 60000
  local cap = tonumber(ARGV[5]) * 60000
  if level > cap then compute_retry = math.ceil((level - cap) / rate) end
end
if rate_retry > 0 or compute_retry > 0 then return {0, rate_retry, compute_retry} end
local new_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 1000)
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[2], 't', string.format('%.0f', now_ms), 'level', string.format('%.0f', level))
  redis.call('PEXPIRE', KEYS[2], string.format('%.0f', math.ceil(level / rate) + 60000))
end
return {1, 0, 0}
"""

# Correct an admitted charge: ARGV per_minute, delta (milli-units; negative: a refund, down to empty).
_SETTLE = _QUOTA_PRELUDE + """
local rate = tonumber(ARGV[1])
local level = math.max(0, drained(KEYS[1], rate) + tonumber(ARGV[2]) * 60000)
redis.call('HSET', KEYS[1], 't', string.format('%.0f', now_ms), 'level', string.format('%.0f', level))
redis.call('PEXPIRE', KEYS[1], string.format('%.0f', math.ceil(level / rate) + 60000))
return 1
"""

# What a key could spend at once now, spending nothing. ARGV: interval, burst, has_compute, per_minute,
# compute burst. Returns {requests, compute milli-units}.
_LEFT = _QUOTA_PRELUDE + """
local interval, burst = tonumber(ARGV[1]), tonumber(ARGV[2])
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then tat = now end
local requests = math.max(0, math.min(burst, math.floor((now + (burst - 1) * interval - tat) / interval + 1e-9) + 1))
local compute = 0
if ARGV[3] == '1' then
  local level = drained(KEYS[2], tonumber(ARGV[4]))
  compute = math.max(0, tonumber(ARGV[5]) - math.ceil(level / 60000))
end
return {requests, compute}
"""

# Push one outcome to a capped list and return {correct, total} over the window.
_OUTCOME = """
redis.call('LPUSH', KEYS[1], ARGV[1])
redis.call('LTRIM', KEYS[1], 0, tonumber(ARGV[2]) - 1)
local items = redis.call('LRANGE', KEYS[1], 0, -1)
local correct = 0
for _, v in ipairs(items) do if v == '1' then correct = correct + 1 end end
return {correct, #items}
"""


def _usage_key(day: str, owner: str, tier: str | None = None) -> str:
    """A key's usage hash on ``day`` in ``tier`` (None: the key's whole day, as rows were kept before tiers)."""
    return f"{PREFIX}usage:{day}:{owner}" if tier is None else f"{PREFIX}usage:{day}:{owner}:tier:{tier}"


def _tiers_key(day: str, owner: str) -> str:
    return f"{PREFIX}usage:tiers:{day}:{owner}"  # the tiers a key was used in on that day


def _day_score(day: str) -> int:
    """A YYYY-MM-DD date as a sortable number (20261231)."""
    return int(day.replace("-", ""))


class RedisState:
    """State in Redis; every operation raises StateUnavailable when Redis cannot be reached in time."""

    kind = "redis"

    def __init__(self, config: StateConfig, client: Any = None) -> None:
        self._config = config
        # One retry, on a closed connection only: after Redis restarts, every pooled connection is closed and its
        # next command would fail (a lost usage record, a request let through or refused). A timeout is not
        # retried: the command may have run, and a retry could count it twice.
        self._redis: Any = client or aioredis.Redis.from_url(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), decode_responses=True)
        self._outcome = self._redis.register_script(_OUTCOME)
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._left = self._redis.register_script(_LEFT)

    async def admit(self, bucket: str, per_minute: float, burst: int, compute: ComputeLimit | None,
                    charge: int) -> Admission:
        interval = 60.0 / per_minute
        args: list[str | int] = [repr(interval), repr((burst - 1) * interval), "1" if compute else "0",
                                 compute.per_minute if compute else 0, compute.burst if compute else 0, charge]
        try:
            allowed, rate_ms, compute_ms = await self._admit(
                keys=[f"{PREFIX}rate:{bucket}", f"{PREFIX}compute:{bucket}"], args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        if int(allowed):
            return Admission(True)
        return refusal(int(rate_ms) / 1000.0, int(compute_ms) / 1000.0)

    async def settle(self, bucket: str, compute: ComputeLimit, delta: int) -> None:
        try:
            await self._settle(keys=[f"{PREFIX}compute:{bucket}"], args=[compute.per_minute, delta])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None

    async def quota_left(self, bucket: str, per_minute: float, burst: int,
                         compute: ComputeLimit | None) -> QuotaLeft:
        args: list[str | int] = [repr(60.0 / per_minute), burst, "1" if compute else "0",
                                 compute.per_minute if compute else 0, compute.burst if compute else 0]
        try:
            requests, left = await self._left(keys=[f"{PREFIX}rate:{bucket}", f"{PREFIX}compute:{bucket}"],
                                              args=args)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        return QuotaLeft(int(requests), int(left) if compute else None)

    async def record_usage(self, row: UsageRow) -> None:
        # One transaction: the key's day (in its tier) and all-time hashes, and the indexes `headbudget usage`
        # lists by: a key moved between tiers keeps a row per tier.
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                for key in (_usage_key(row.day, row.owner, row.tier), f"{PREFIX}usage:total:{row.owner}"):
                    for field, value in row.usage.fields().items():
                        pipe.hincrby(key, field, value)
                    pipe.hset(key, mapping={"name": row.name, "tier": row.tier})
                pipe.sadd(f"{PREFIX}usage:rows:{row.day}", json.dumps([row.owner, row.tier]))
                pipe.sadd(_tiers_key(row.day, row.owner), row.tier)
                pipe.zadd(f"{PREFIX}usage:days", {row.day: _day_score(row.day)})
                await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None

    async def usage_of(self, owner: str, day: str) -> tuple[Usage, Usage]:
        try:
            tiers = sorted(await self._redis.smembers(_tiers_key(day, owner)))
            async with self._redis.pipeline(transaction=False) as pipe:
                for tier in [None, *tiers]:  # None: a day kept before rows had tiers
                    pipe.hgetall(_usage_key(day, owner, tier))
                pipe.hgetall(f"{PREFIX}usage:total:{owner}")
                *days, total = await pipe.execute()
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        today = Usage()
        for h in days:
            today = today.plus(Usage.parse(h))
        return today, Usage.parse(total)

    async def usage_rows(self, since: str | None = None, until: str | None = None) -> list[UsageRow]:
        """Every key's usage per UTC day from ``since`` to ``until`` (YYYY-MM-DD, both included; None: open), by
        day then key name (for ``headbudget usage``)."""
        lo = _day_score(since) if since else "-inf"
        hi = _day_score(until) if until else "+inf"
        try:
            days = await self._redis.zrangebyscore(f"{PREFIX}usage:days", lo, hi)
            keys: list[tuple[str, str, str | None]] = []  # (day, owner, tier); None: a row kept before tiers
            for day in days:
                keys += [(day, owner, None) for owner in await self._redis.smembers(f"{PREFIX}usage:owners:{day}")]
                keys += [(day, *json.loads(m)) for m in await self._redis.smembers(f"{PREFIX}usage:rows:{day}")]
            async with self._redis.pipeline(transaction=False) as pipe:
                for day, owner, tier in keys:
                    pipe.hgetall(_usage_key(day, owner, tier))
                found = await pipe.execute() if keys else []
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        rows = [UsageRow(day, owner, str(h.get("name", "")), str(h.get("tier", "")), Usage.parse(h))
                for (day, owner, _), h in zip(keys, found, strict=True) if h]
        return sorted(rows, key=lambda r: (r.day, r.name, r.owner, r.tier))

    async def remember(self, request_id: str, record: AnswerRecord) -> None:
        ttl_ms = int(self._config.feedback_ttl_s * 1000)
        try:
            key = answer_key(record.owner, request_id)
            await self._redis.set(f"{PREFIX}answer:{key}", json.dumps(record.to_dict()), px=ttl_ms)
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None

    async def claim(self, request_id: str, owner: str, index: int) -> AnswerRecord:
        try:
            key = answer_key(owner, request_id)
            raw = await self._redis.get(f"{PREFIX}answer:{key}")
            if raw is None:
                raise AnswerNotFound(request_id)
            record = AnswerRecord.from_dict(json.loads(raw))
            if record.owner != owner or index >= len(record.labels):
                raise AnswerNotFound(request_id)
            first = await self._redis.set(f"{PREFIX}feedback:{key}:{index}", "1", nx=True,
                                          px=int(self._config.feedback_ttl_s * 1000))
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        if not first:
            raise AlreadyReported(request_id)
        return record

    async def record_outcome(self, budget_label: str, correct: bool) -> float:
        try:
            good, total = await self._outcome(keys=[f"{PREFIX}outcomes:{budget_label}"],
                                              args=["1" if correct else "0", self._config.accuracy_window])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        return int(good) / max(1, int(total))

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        try:
            await self._redis.aclose()
        except (RedisError, OSError):
            pass
