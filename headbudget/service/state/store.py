"""Shared state behind one small interface: per-key rate limits and compute quotas, and the feedback store.

``MemoryState`` keeps it in this process (one worker); ``RedisState`` (service/state/redis_store.py) shares it
between workers and replicas. Rate limits use GCRA (the generic cell rate algorithm: one timestamp per key,
exact, with a burst allowance); compute quotas are the same algorithm weighted by each request's charge, in
integers (milli-units and milliseconds), so that a key is admitted up to its quota exactly; a request is admitted
only if both pass, in one atomic step. Feedback matches a request id to the answer given, once per text.

Every write that counts compute (an admission, a settlement, a usage record) carries the id of the charge it
belongs to and counts once per id, so that a write whose reply was lost can be sent again (docs/operations.md,
'Usage and billing under faults').
"""

from __future__ import annotations

import asyncio
import functools
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol

from headbudget.service.accounting.compute import milli_of_units
from headbudget.service.metrics import budget_bucket
from headbudget.service.settings import StateConfig, TierConfig


class StateError(Exception):
    """Base class of state-store errors."""


class StateUnavailable(StateError):
    """The backend (Redis) cannot be reached."""


class AnswerNotFound(StateError):
    """No answer with this request id (never given, expired, or another key's)."""


class AlreadyReported(StateError):
    """Feedback for this text of this request was already recorded."""


@dataclass(frozen=True)
class ComputeLimit:
    """A key's compute quota in milli-units: what it may spend at once, refilled at a rate per minute."""

    per_minute: int  # milli-units per minute, >= 1
    burst: int  # milli-units

    @classmethod
    def of(cls, tier: TierConfig) -> ComputeLimit | None:
        """The tier's quota (None: it has none)."""
        burst = tier.burst_units
        if tier.compute_per_minute is None or burst is None:
            return None
        return cls(max(1, milli_of_units(tier.compute_per_minute)), max(1, milli_of_units(burst)))


@dataclass(frozen=True)
class Admission:
    """Whether a request passed its key's request rate and compute quota, and if not, which refused it and when
    to retry (the later of the two when both did)."""

    allowed: bool
    retry_after_s: float = 0.0
    refused_by: Literal["", "rate", "compute"] = ""


@dataclass(frozen=True)
class QuotaLeft:
    """What a key could send at once now."""

    requests: int
    compute: int | None  # milli-units; None without a compute quota


# How many write ids a store remembers (Redis: for DONE_TTL_S): a write repeated after that would count twice.
_DONE_KEPT = 200_000
DONE_TTL_S = 7 * 86_400

# A compute level of L milli-units is kept as L * PER_MINUTE_MS, which drains by per_minute every millisecond:
# integers throughout, whatever the rate, so that a reload that changes the rate keeps the level.
PER_MINUTE_MS = 60_000


def drained(stored: tuple[int, int] | None, now_ms: int, limit: ComputeLimit) -> int:
    """A stored (time in ms, level) after draining to ``now_ms``."""
    if stored is None:
        return 0
    at, level = stored
    return max(0, level - max(0, now_ms - at) * limit.per_minute)


def compute_gcra(stored: tuple[int, int] | None, now_ms: int, limit: ComputeLimit,
                 charge: int) -> tuple[bool, int, int]:
    """One weighted GCRA step: (allowed, level if admitted, retry after ms)."""
    need = drained(stored, now_ms, limit) + charge * PER_MINUTE_MS
    cap = limit.burst * PER_MINUTE_MS
    if need > cap:
        return False, need, -(-(need - cap) // limit.per_minute)
    return True, need, 0


def refusal(rate_retry_s: float, compute_retry_s: float) -> Admission:
    """The Admission of a refused request (a retry of 0: that check passed)."""
    by: Literal["rate", "compute"] = "compute" if compute_retry_s >= rate_retry_s else "rate"
    return Admission(False, max(rate_retry_s, compute_retry_s), by)


@dataclass(frozen=True)
class Usage:
    """What a key spent: compute in milli-units (``units``, and ``saved`` against the dense model), requests
    answered, texts and tokens."""

    units: int = 0
    requests: int = 0
    texts: int = 0
    tokens: int = 0
    saved: int = 0

    def plus(self, other: Usage) -> Usage:
        return Usage(self.units + other.units, self.requests + other.requests, self.texts + other.texts,
                     self.tokens + other.tokens, self.saved + other.saved)

    def fields(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def parse(cls, d: dict[str, Any]) -> Usage:
        return cls(**{k: int(d.get(k) or 0) for k in ("units", "requests", "texts", "tokens", "saved")})


@dataclass(frozen=True)
class UsageRow:
    """One key's usage in one tier on one UTC day, as ``headbudget usage`` lists it."""

    day: str  # YYYY-MM-DD
    owner: str  # the key's hash prefix (Caller.owner)
    name: str  # its name when it was used
    tier: str
    usage: Usage


_DAY_S = 86_400


def utc_day(now: float | None = None) -> str:
    """The UTC date usage is recorded under (every answered request asks: the day's text is kept)."""
    day = int((time.time() if now is None else now) // _DAY_S)
    return _day_text(day)


@functools.lru_cache(maxsize=4)
def _day_text(day: int) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(day * _DAY_S))


@dataclass(frozen=True)
class AnswerRecord:
    """What the service answered, kept so that feedback can be scored."""

    owner: str  # hash prefix of the key (or the anonymous client), never the key
    tier: str
    labels: list[str]  # predicted label per text
    budgets: list[float]  # applied budget per text (on BudgetFormer checkpoints, the text's own under the cap)
    bucket: str = ""  # metrics budget label of the run ("0.5", "auto"); "" in records of older servers

    def budget_label(self, index: int) -> str:
        """The label feedback on text ``index`` is counted under."""
        return self.bucket or budget_bucket(self.budgets[index])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AnswerRecord:
        return cls(owner=str(d["owner"]), tier=str(d["tier"]), labels=[str(x) for x in d["labels"]],
                   budgets=[float(x) for x in d["budgets"]], bucket=str(d.get("bucket", "")))


class StateStore(Protocol):
    """Rate limits and feedback, shared by every worker that points at the same backend."""

    kind: str  # "memory" or "redis", for /readyz

    async def admit(self, bucket: str, per_minute: float, burst: int, compute: ComputeLimit | None,
                    charge: int, charge_id: str) -> Admission:
        """One request of ``charge`` milli-units against ``bucket``'s request rate and compute quota, in one atomic
        step: both are spent if both pass, neither otherwise. Asked again with the same ``charge_id``, it spends
        nothing and gives the first decision."""
        ...

    async def settle(self, bucket: str, compute: ComputeLimit, delta: int, charge_id: str) -> None:
        """Correct an admitted charge by ``delta`` milli-units (negative: a refund, down to an empty quota), once
        per ``charge_id``."""
        ...

    async def quota_left(self, bucket: str, per_minute: float, burst: int,
                         compute: ComputeLimit | None) -> QuotaLeft:
        """What ``bucket`` could spend at once now (nothing is spent)."""
        ...

    async def record_usage(self, row: UsageRow, charge_id: str) -> bool:
        """Add one answered request's usage to its key's day and all-time total, once per ``charge_id``: True when
        this call added it, False when it was already there."""
        ...

    async def usage_of(self, owner: str, day: str) -> tuple[Usage, Usage]:
        """``owner``'s usage on ``day`` and in all (zeros when it has none)."""
        ...

    async def counted(self, charge_ids: list[str]) -> list[bool]:
        """Which of ``charge_ids`` have their usage in the store (remembered for DONE_TTL_S)."""
        ...

    async def remember(self, request_id: str, record: AnswerRecord) -> None:
        """Keep an answer for feedback under ``answer_key(record.owner, request_id)`` (bounded in time and size)."""
        ...

    async def claim(self, request_id: str, owner: str, index: int) -> AnswerRecord:
        """``owner``'s answer for feedback on text ``index``, at most once; AnswerNotFound / AlreadyReported."""
        ...

    async def record_outcome(self, budget_label: str, correct: bool) -> float:
        """Add one feedback outcome to the budget's rolling window; returns the window's accuracy."""
        ...

    async def revoke(self, revoked: Mapping[str, str]) -> None:
        """Hold keys revoked (SHA-256 -> when, as UTC text) for every process that shares the store, and tell the
        processes watching it at once. A revocation in the store is final for that key."""
        ...

    async def watch_revocations(self, own: Callable[[], Mapping[str, str]],
                                seen: Callable[[Iterable[str]], None]) -> None:
        """Until cancelled: ``seen`` gets the hashes of every key the store holds revoked, then each one revoked
        later, within milliseconds. On every (re)connection ``own()`` (this process's config's revocations) goes to
        the store first, so that a store which lost them, or was down when they were made, holds them again."""
        ...

    async def ping(self) -> bool:
        """Whether the backend answers now."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


def answer_key(owner: str, request_id: str) -> str:
    """Where an answer is kept: scoped to the key that got it, so that a request id chosen by one tenant can
    never name, overwrite or consume another tenant's answer (ids are client-chosen and guessable)."""
    return f"{owner}/{request_id}"


def gcra(tat: float | None, now: float, per_minute: float, burst: int) -> tuple[bool, float, float]:
    """One GCRA step: (allowed, new theoretical arrival time, retry after seconds)."""
    interval = 60.0 / per_minute
    tolerance = (burst - 1) * interval
    tat = now if tat is None or tat < now else tat
    allow_at = tat - tolerance
    if now < allow_at:
        return False, tat, allow_at - now
    return True, tat + interval, 0.0


def requests_left(tat: float | None, now: float, per_minute: float, burst: int) -> int:
    """How many requests GCRA would admit at once now."""
    interval = 60.0 / per_minute
    tat = now if tat is None or tat < now else tat
    return max(0, min(burst, math.floor((now + (burst - 1) * interval - tat) / interval + 1e-9) + 1))


class MemoryState:
    """State in this process: exact for one worker; with several, use Redis."""

    kind = "memory"

    def __init__(self, config: StateConfig, clock: Any = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._tats: dict[str, float] = {}
        self._levels: dict[str, tuple[int, int]] = {}  # bucket -> (ms, compute level), see PER_MINUTE_MS
        # answer_key(owner, request id) -> (expiry, answer, indices already reported), oldest first
        self._answers: OrderedDict[str, tuple[float, AnswerRecord, set[int]]] = OrderedDict()
        self._windows: dict[str, deque[bool]] = {}
        self._usage: dict[tuple[str, str], dict[str, UsageRow]] = {}  # (day, owner) -> tier -> usage; this worker's
        self._totals: dict[str, Usage] = {}
        self._done: OrderedDict[str, Admission | None] = OrderedDict()  # write id -> its answer, oldest first

    def _first(self, write_id: str, answer: Admission | None = None) -> bool:
        """Whether ``write_id`` is new (then remember it, with ``answer`` for an admission)."""
        if write_id in self._done:
            return False
        self._done[write_id] = answer
        while len(self._done) > _DONE_KEPT:
            self._done.popitem(last=False)
        return True

    def _now_ms(self) -> int:
        return math.floor(float(self._clock()) * 1000)

    async def admit(self, bucket: str, per_minute: float, burst: int, compute: ComputeLimit | None,
                    charge: int, charge_id: str) -> Admission:
        first = self._done.get(f"admit:{charge_id}")
        if first is not None:
            return first
        decision = self._admit(bucket, per_minute, burst, compute, charge)
        self._first(f"admit:{charge_id}", decision)
        return decision

    def _admit(self, bucket: str, per_minute: float, burst: int, compute: ComputeLimit | None,
               charge: int) -> Admission:
        now = self._clock()
        rate_ok, tat, rate_retry = gcra(self._tats.get(bucket), now, per_minute, burst)
        compute_ok, level, compute_retry_ms = True, 0, 0
        now_ms = math.floor(now * 1000)
        if compute is not None:
            compute_ok, level, compute_retry_ms = compute_gcra(self._levels.get(bucket), now_ms, compute, charge)
        if not (rate_ok and compute_ok):
            return refusal(rate_retry, compute_retry_ms / 1000.0)
        self._tats[bucket] = tat
        if compute is not None:
            self._levels[bucket] = (now_ms, level)
        if len(self._tats) > 100_000 or len(self._levels) > 100_000:  # anonymous clients: drop idle buckets
            self._tats = {k: v for k, v in self._tats.items() if v > now}
            # a level drains by at least 1 a millisecond (per_minute >= 1): one older than itself is empty
            self._levels = {k: v for k, v in self._levels.items() if v[1] > now_ms - v[0]}
        return Admission(True)

    async def settle(self, bucket: str, compute: ComputeLimit, delta: int, charge_id: str) -> None:
        if not self._first(f"settle:{charge_id}"):
            return
        now_ms = self._now_ms()
        level = drained(self._levels.get(bucket), now_ms, compute)
        self._levels[bucket] = (now_ms, max(0, level + delta * PER_MINUTE_MS))

    async def quota_left(self, bucket: str, per_minute: float, burst: int,
                         compute: ComputeLimit | None) -> QuotaLeft:
        requests = requests_left(self._tats.get(bucket), self._clock(), per_minute, burst)
        if compute is None:
            return QuotaLeft(requests, None)
        level = drained(self._levels.get(bucket), self._now_ms(), compute)
        return QuotaLeft(requests, max(0, compute.burst - -(-level // PER_MINUTE_MS)))

    async def record_usage(self, row: UsageRow, charge_id: str) -> bool:
        if not self._first(f"usage:{charge_id}"):
            return False
        tiers = self._usage.setdefault((row.day, row.owner), {})  # a key moved between tiers keeps a row per tier
        old = tiers.get(row.tier)
        tiers[row.tier] = UsageRow(row.day, row.owner, row.name, row.tier,
                                   old.usage.plus(row.usage) if old else row.usage)
        self._totals[row.owner] = self._totals.get(row.owner, Usage()).plus(row.usage)
        if len(self._usage) > 100_000:  # anonymous clients could grow this: keep the latest days
            for k in sorted(self._usage)[:len(self._usage) // 10]:
                del self._usage[k]
        if len(self._totals) > 100_000:
            for owner in list(self._totals)[:len(self._totals) // 10]:
                del self._totals[owner]
        return True

    async def counted(self, charge_ids: list[str]) -> list[bool]:
        return [f"usage:{i}" in self._done for i in charge_ids]

    async def usage_of(self, owner: str, day: str) -> tuple[Usage, Usage]:
        today = Usage()
        for row in self._usage.get((day, owner), {}).values():
            today = today.plus(row.usage)
        return today, self._totals.get(owner, Usage())

    async def remember(self, request_id: str, record: AnswerRecord) -> None:
        self._expire()
        key = answer_key(record.owner, request_id)
        self._answers.pop(key, None)  # a re-used id starts a fresh entry at the young end of the queue
        self._answers[key] = (self._clock() + self._config.feedback_ttl_s, record, set())
        while len(self._answers) > self._config.feedback_max_entries:
            self._answers.popitem(last=False)

    async def claim(self, request_id: str, owner: str, index: int) -> AnswerRecord:
        self._expire()
        entry = self._answers.get(answer_key(owner, request_id))
        if entry is None or index >= len(entry[1].labels):
            raise AnswerNotFound(request_id)
        if index in entry[2]:
            raise AlreadyReported(request_id)
        entry[2].add(index)
        return entry[1]

    async def record_outcome(self, budget_label: str, correct: bool) -> float:
        window = self._windows.setdefault(budget_label, deque(maxlen=self._config.accuracy_window))
        window.append(correct)
        return sum(window) / len(window)

    async def revoke(self, revoked: Mapping[str, str]) -> None:
        return None  # one process: its config file is where keys are revoked, and undone

    async def watch_revocations(self, own: Callable[[], Mapping[str, str]],
                                seen: Callable[[Iterable[str]], None]) -> None:
        await asyncio.Event().wait()  # no other process to hear from

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        return None

    def _expire(self) -> None:
        now = self._clock()
        while self._answers:
            deadline = next(iter(self._answers.values()))[0]
            if deadline > now:
                break
            self._answers.popitem(last=False)
