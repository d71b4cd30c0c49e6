"""The state store in Redis: rate limits and compute quotas exact across workers and replicas, usage kept for
billing, feedback found by any worker."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from headbudget.service.settings import StateConfig
from headbudget.service.state.store import (
    DONE_TTL_S,
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
log = logging.getLogger("headbudget.service")

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
# Returns {allowed, rate retry ms, compute retry ms}. KEYS[3] keeps the decision for the charge's id (ARGV[7] ms):
# the same admission asked again (its reply was lost) gets the first decision and spends nothing.
_ADMIT = _QUOTA_PRELUDE + """
local first = redis.call('GET', KEYS[3])
if first then return cjson.decode(first) end
local function decided(d)
  redis.call('SET', KEYS[3], cjson.encode(d), 'PX', ARGV[7])
  return d
end
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
if rate_retry > 0 or compute_retry > 0 then return decided({0, rate_retry, compute_retry}) end
local new_tat = tat + interval
redis.call('SET', KEYS[1], string.format('%.6f', new_tat), 'PX', math.ceil((new_tat - now) * 1000) + 1000)
if ARGV[3] == '1' then
  redis.call('HSET', KEYS[2], 't', string.format('%.0f', now_ms), 'level', string.format('%.0f', level))
  redis.call('PEXPIRE', KEYS[2], string.format('%.0f', math.ceil(level / rate) + 60000))
end
return decided({1, 0, 0})
"""

# Correct an admitted charge: ARGV per_minute, delta (milli-units; negative: a refund, down to empty), once per
# charge id (KEYS[2], kept ARGV[3] ms).
_SETTLE = _QUOTA_PRELUDE + """
if not redis.call('SET', KEYS[2], '1', 'NX', 'PX', ARGV[3]) then return 0 end
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

# One answered request's usage, once per charge id (KEYS[1], kept ARGV[1] ms): the key's day in its tier and its
# all-time hashes (KEYS[2], KEYS[3]), and the indexes `headbudget usage` lists by: the day's rows (KEYS[4]), the key's
# tiers that day (KEYS[5]), the days (KEYS[6]). ARGV: ttl ms, name, tier, row member, day, day score, then field and
# value pairs. Returns 1 when it counted, 0 when the id had been counted.
_USAGE = """
if not redis.call('SET', KEYS[1], '1', 'NX', 'PX', ARGV[1]) then return 0 end
for k = 2, 3 do
  for i = 7, #ARGV, 2 do redis.call('HINCRBY', KEYS[k], ARGV[i], ARGV[i + 1]) end
  redis.call('HSET', KEYS[k], 'name', ARGV[2], 'tier', ARGV[3])
end
redis.call('SADD', KEYS[4], ARGV[4])
redis.call('SADD', KEYS[5], ARGV[3])
redis.call('ZADD', KEYS[6], ARGV[6], ARGV[5])
return 1
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


# Revoked keys: a hash (key SHA-256 -> when) every replica reads on connecting, and a channel that announces each
# new one. HSETNX keeps the first time a key was revoked; only new ones are announced. ARGV: channel, then pairs.
REVOKED = f"{PREFIX}revoked"
_REVOKE = """
local new = {}
for i = 2, #ARGV, 2 do
  if redis.call('HSETNX', KEYS[1], ARGV[i], ARGV[i + 1]) == 1 then new[#new + 1] = ARGV[i] end
end
if #new > 0 then redis.call('PUBLISH', ARGV[1], table.concat(new, ' ')) end
return #new
"""
# Between tries to (re)subscribe to revocations while Redis is away.
_WATCH_PAUSE_S = 1.0


# A write that counts compute is sent again when its reply does not come in time: it carries its charge's id, so a
# write that had landed counts once. The pauses before each further try, in seconds.
_RETRY_PAUSES_S = (0.05, 0.2)


class RedisState:
    """State in Redis; every operation raises StateUnavailable when Redis cannot be reached in time."""

    kind = "redis"

    def __init__(self, config: StateConfig, client: Any = None) -> None:
        self._config = config
        # One retry, on a closed connection only: after Redis restarts, every pooled connection is closed and its
        # next command would fail. A timeout is not retried here: the command may have run. Writes that count
        # compute are sent again by ``_again``, which their charge ids make safe.
        self._redis: Any = client or aioredis.Redis.from_url(
            config.redis_url, socket_timeout=config.redis_timeout_s,
            socket_connect_timeout=config.redis_timeout_s,
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)), decode_responses=True)
        self._outcome = self._redis.register_script(_OUTCOME)
        self._admit = self._redis.register_script(_ADMIT)
        self._settle = self._redis.register_script(_SETTLE)
        self._left = self._redis.register_script(_LEFT)
        self._usage = self._redis.register_script(_USAGE)
        self._revoke = self._redis.register_script(_REVOKE)
        self._done_ms = int(DONE_TTL_S * 1000)

    async def _again(self, write: Callable[[], Awaitable[Any]]) -> Any:
        """Run a write that counts once however often it is sent (by its charge id, or as a plain SET), sending it
        again while its reply is late."""
        for pause in (*_RETRY_PAUSES_S, None):
            try:
                return await write()
            except RedisTimeoutError as e:  # a refused or dropped connection: Redis is away, the journal takes it
                if pause is None:
                    raise StateUnavailable(f"redis: {e}") from None
                log.info("redis: %s; sending the write again", e)
                await asyncio.sleep(pause)
            except (RedisError, OSError) as e:
                raise StateUnavailable(f"redis: {e}") from None

    async def admit(self, bucket: str, per_minute: float, burst: int, compute: ComputeLimit | None,
                    charge: int, charge_id: str) -> Admission:
        interval = 60.0 / per_minute
        args: list[str | int] = [repr(interval), repr((burst - 1) * interval), "1" if compute else "0",
                                 compute.per_minute if compute else 0, compute.burst if compute else 0, charge,
                                 self._done_ms]
        keys = [f"{PREFIX}rate:{bucket}", f"{PREFIX}compute:{bucket}", f"{PREFIX}done:admit:{charge_id}"]
        allowed, rate_ms, compute_ms = await self._again(lambda: self._admit(keys=keys, args=args))
        if int(allowed):
            return Admission(True)
        return refusal(int(rate_ms) / 1000.0, int(compute_ms) / 1000.0)

    async def settle(self, bucket: str, compute: ComputeLimit, delta: int, charge_id: str) -> None:
        keys = [f"{PREFIX}compute:{bucket}", f"{PREFIX}done:settle:{charge_id}"]
        await self._again(lambda: self._settle(keys=keys, args=[compute.per_minute, delta, self._done_ms]))

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

    async def record_usage(self, row: UsageRow, charge_id: str) -> bool:
        # A key moved between tiers keeps a row per tier.
        keys = [f"{PREFIX}done:usage:{charge_id}", _usage_key(row.day, row.owner, row.tier),
                f"{PREFIX}usage:total:{row.owner}", f"{PREFIX}usage:rows:{row.day}", _tiers_key(row.day, row.owner),
                f"{PREFIX}usage:days"]
        args: list[Any] = [self._done_ms, row.name, row.tier, json.dumps([row.owner, row.tier]), row.day,
                           _day_score(row.day)]
        for field, value in row.usage.fields().items():
            args += [field, value]
        return bool(int(await self._again(lambda: self._usage(keys=keys, args=args))))

    async def counted(self, charge_ids: list[str]) -> list[bool]:
        """Which of ``charge_ids`` have their usage in the store (within DONE_TTL_S of being counted)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for charge_id in charge_ids:
                    pipe.exists(f"{PREFIX}done:usage:{charge_id}")
                return [bool(n) for n in await pipe.execute()] if charge_ids else []
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
        key, value = f"{PREFIX}answer:{answer_key(record.owner, request_id)}", json.dumps(record.to_dict())
        await self._again(lambda: self._redis.set(key, value, px=ttl_ms))

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

    async def revoke(self, revoked: Mapping[str, str]) -> None:
        if not revoked:
            return
        args = [REVOKED]
        for digest, when in revoked.items():
            args += [digest, when]
        await self._again(lambda: self._revoke(keys=[REVOKED], args=args))

    async def watch_revocations(self, own: Callable[[], Mapping[str, str]],
                                seen: Callable[[Iterable[str]], None]) -> None:
        was_up = True
        while True:
            # A connection of its own with no read timeout: it waits for announcements, which may never come.
            # No retry either: a connection lost is read again from the hash, not resubscribed blind.
            listener = aioredis.Redis.from_url(self._config.redis_url, decode_responses=True, socket_keepalive=True,
                                               socket_connect_timeout=self._config.redis_timeout_s,
                                               retry=Retry(NoBackoff(), 0))
            pubsub = listener.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(REVOKED)  # before reading the hash: nothing revoked in between is missed
                await self.revoke(own())
                seen(await self._redis.hkeys(REVOKED))
                if not was_up:
                    log.info("redis: watching revocations again")
                was_up = True
                async for message in pubsub.listen():
                    seen(str(message["data"]).split())
            except (RedisError, OSError, StateUnavailable) as e:
                if was_up:
                    log.warning("redis: revocations from other replicas wait until it is back (%s)", e)
                was_up = False
            finally:  # each closed even when the other fails to
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]  # untyped before redis 8.2
                with contextlib.suppress(RedisError, OSError):
                    await listener.aclose()
            await asyncio.sleep(_WATCH_PAUSE_S)

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
