"""The state store in Redis: rate limits exact across workers and replicas, feedback found by any worker."""

from __future__ import annotations

import json
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from headbudget.service.settings import StateConfig
from headbudget.service.state import (
    AlreadyReported,
    AnswerNotFound,
    AnswerRecord,
    RateDecision,
    StateUnavailable,
    answer_key,
)

PREFIX = "headbudget:"

# GCRA in one atomic step, on Redis's clock so that every worker agrees. Returns {allowed, retry_after_ms}.
_GCRA = """
local interval = tonumber(ARGV[1])
local tolerance = tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local tat = tonumber(redis.call('GET', KEYS[1]))
if tat == nil or tat < now then tat = now end
local allow_at = tat - tolerance
if now < allow_at then
  return {0, math.ceil((allow_at - now) * 1000)}
end
local new_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 1000)
return {1, 0}
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


class RedisState:
    """State in Redis; every operation raises StateUnavailable when Redis cannot be reached in time."""

    kind = "redis"

    def __init__(self, config: StateConfig, client: Any = None) -> None:
        self._config = config
        self._redis: Any = client or aioredis.Redis.from_url(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s, retry=Retry(NoBackoff(), 0), decode_responses=True)
        self._gcra = self._redis.register_script(_GCRA)
        self._outcome = self._redis.register_script(_OUTCOME)

    async def hit(self, bucket: str, per_minute: float, burst: int) -> RateDecision:
        interval = 60.0 / per_minute
        try:
            allowed, retry_ms = await self._gcra(keys=[f"{PREFIX}rate:{bucket}"],
                                                 args=[repr(interval), repr((burst - 1) * interval)])
        except (RedisError, OSError) as e:
            raise StateUnavailable(f"redis: {e}") from None
        return RateDecision(bool(int(allowed)), int(retry_ms) / 1000.0)

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
