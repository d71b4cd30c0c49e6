"""Shared state behind one small interface: per-key rate limits and the feedback store.

``MemoryState`` keeps it in this process (one worker); ``RedisState`` (service/redis_state.py) shares it
between workers and replicas. Rate limits use GCRA (the generic cell rate algorithm: one timestamp per key,
exact, with a burst allowance); feedback matches a request id to the answer given, once per text.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from headbudget.service.settings import StateConfig, budget_bucket


class StateError(Exception):
    """Base class of state-store errors."""


class StateUnavailable(StateError):
    """The backend (Redis) cannot be reached."""


class AnswerNotFound(StateError):
    """No answer with this request id (never given, expired, or another key's)."""


class AlreadyReported(StateError):
    """Feedback for this text of this request was already recorded."""


@dataclass(frozen=True)
class RateDecision:
    """Whether one request may pass, and if not, when to retry."""

    allowed: bool
    retry_after_s: float = 0.0


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

    async def hit(self, bucket: str, per_minute: float, burst: int) -> RateDecision:
        """Count one request against ``bucket``; allowed unless it exceeds the rate plus burst."""
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


class MemoryState:
    """State in this process: exact for one worker; with several, use Redis."""

    kind = "memory"

    def __init__(self, config: StateConfig, clock: Any = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._tats: dict[str, float] = {}
        # answer_key(owner, request id) -> (expiry, answer, indices already reported), oldest first
        self._answers: OrderedDict[str, tuple[float, AnswerRecord, set[int]]] = OrderedDict()
        self._windows: dict[str, deque[bool]] = {}

    async def hit(self, bucket: str, per_minute: float, burst: int) -> RateDecision:
        now = self._clock()
        allowed, tat, retry = gcra(self._tats.get(bucket), now, per_minute, burst)
        self._tats[bucket] = tat
        if len(self._tats) > 100_000:  # anonymous clients could grow this: drop buckets that are idle
            self._tats = {k: v for k, v in self._tats.items() if v > now}
        return RateDecision(allowed, retry)

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


def make_state(config: StateConfig) -> StateStore:
    """The store the config asks for: Redis when ``redis_url`` is set, else memory."""
    if config.redis_url:
        from headbudget.service.redis_state import RedisState

        return RedisState(config)
    return MemoryState(config)
