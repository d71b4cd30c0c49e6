"""A small typed client for the headbudget HTTP API (httpx; ``Client`` sync, ``AsyncClient`` async).

    with Client("http://127.0.0.1:8000", api_key="hb_...", retries=3) as hb:
        answer = hb.classify("a great movie", budget=0.5)
        print(answer.results[0].label, answer.results[0].budget_applied)

``retries=N`` retries answers 429 (over the rate) and 503 (queue full) after their ``Retry-After``, at most N
times and never waiting more than ``max_retry_wait_s`` in all for one call; past either bound the error is
raised. Both statuses mean the server refused the request before running it, so a retry never runs a text twice.
This module needs only httpx and pydantic: ``pip install headbudget`` (no extras) installs it.
"""

from __future__ import annotations

import asyncio
import email.utils
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx

from headbudget.service.http.schemas import ClassifyResponse, FeedbackResponse, ModelList, Readiness

__all__ = ["AsyncClient", "Client", "HeadbudgetError", "RetryPolicy"]

RETRY_STATUSES = frozenset({429, 503})  # refused before running: rate limit, queue full or shutting down


class HeadbudgetError(Exception):
    """An error answer: HTTP status, the API's error code and message, Retry-After and request id if given."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.retry_after_s, self.request_id = retry_after_s, request_id

    @classmethod
    def from_response(cls, r: httpx.Response) -> HeadbudgetError:
        try:
            err = r.json()["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "http_error", r.text[:200]
        return cls(r.status_code, code, message, parse_retry_after(r.headers.get("retry-after")),
                   r.headers.get("x-request-id"))


def parse_retry_after(value: str | None, now: datetime | None = None) -> float | None:
    """Seconds to wait from a Retry-After header (delay-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        if when.tzinfo is None:
            when = when.replace(tzinfo=UTC)
        seconds = (when - (now or datetime.now(UTC))).total_seconds()
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass(frozen=True)
class RetryPolicy:
    """When a refused call (429, 503) is tried again: after its Retry-After (``default_wait_s`` if it has none),
    at most ``retries`` times, and only while the waits of this call add up to at most ``max_wait_s``."""

    retries: int = 0
    max_wait_s: float = 30.0
    default_wait_s: float = 1.0

    def __post_init__(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        for name in ("max_wait_s", "default_wait_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")

    def wait_s(self, error: HeadbudgetError, attempt: int, waited_s: float) -> float | None:
        """Seconds to wait before retry ``attempt + 1`` after ``error``, or None: give up and raise it."""
        if error.status not in RETRY_STATUSES or attempt >= self.retries:
            return None
        wait = error.retry_after_s if error.retry_after_s is not None else self.default_wait_s
        return wait if waited_s + wait <= self.max_wait_s else None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"X-API-Key": api_key} if api_key else {}


def _classify_body(text: str | Sequence[str], budget: float | str | None,
                   max_latency_ms: float | None, max_budget: float | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"text": text} if isinstance(text, str) else {"texts": list(text)}
    if budget is not None:
        body["budget"] = budget
    if max_latency_ms is not None:
        body["max_latency_ms"] = max_latency_ms
    if max_budget is not None:
        body["max_budget"] = max_budget
    return body


def _policy(retries: int, max_retry_wait_s: float) -> RetryPolicy:
    return RetryPolicy(retries=retries, max_wait_s=max_retry_wait_s)


class Client:
    """Synchronous client; one connection pool, close it (or use ``with``). ``retries``: see the module doc;
    ``sleep`` is how it waits (tests pass a recorder)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None, *, retries: int = 0,
                 max_retry_wait_s: float = 30.0, sleep: Callable[[float], None] = time.sleep) -> None:
        self.retry = _policy(retries, max_retry_wait_s)
        self._sleep = sleep
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                                  transport=transport)

    def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send; retry refusals as the policy allows; raise HeadbudgetError for an error answer."""
        attempt, waited = 0, 0.0
        while True:
            r = self._http.request(method, url, **kwargs)
            if r.status_code < 400:
                return r
            error = HeadbudgetError.from_response(r)
            wait = self.retry.wait_s(error, attempt, waited)
            if wait is None:
                raise error
            self._sleep(wait)
            attempt, waited = attempt + 1, waited + wait

    def classify(self, text: str | Sequence[str], budget: float | str | None = None,
                 max_latency_ms: float | None = None, request_id: str | None = None,
                 max_budget: float | None = None) -> ClassifyResponse:
        """Classify one text or several; ``budget`` or ``max_latency_ms`` (or neither: the tier's default);
        ``max_budget``: with budget="auto", the ceiling no text spends more than."""
        headers = {"X-Request-ID": request_id} if request_id else None
        r = self._request("POST", "/classify", json=_classify_body(text, budget, max_latency_ms, max_budget),
                          headers=headers)
        return ClassifyResponse.model_validate(r.json())

    def feedback(self, request_id: str, label: str, index: int = 0) -> FeedbackResponse:
        """Report the true label of text ``index`` of an earlier answer."""
        r = self._request("POST", "/feedback", json={"request_id": request_id, "label": label, "index": index})
        return FeedbackResponse.model_validate(r.json())

    def models(self) -> ModelList:
        """The loaded checkpoint and its budget grid."""
        return ModelList.model_validate(self._request("GET", "/v1/models").json())

    def ready(self) -> Readiness:
        """Readiness with its checks (does not raise on 503)."""
        return Readiness.model_validate(self._http.get("/readyz").json())

    def metrics(self) -> str:
        """The Prometheus exposition text."""
        return self._request("GET", "/metrics").text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Asynchronous client with the same methods and retries as ``Client`` (``sleep`` is awaited)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None, *, retries: int = 0,
                 max_retry_wait_s: float = 30.0,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.retry = _policy(retries, max_retry_wait_s)
        self._sleep = sleep
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                                       transport=transport)

    async def _request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        """Send; retry refusals as the policy allows; raise HeadbudgetError for an error answer."""
        attempt, waited = 0, 0.0
        while True:
            r = await self._http.request(method, url, **kwargs)
            if r.status_code < 400:
                return r
            error = HeadbudgetError.from_response(r)
            wait = self.retry.wait_s(error, attempt, waited)
            if wait is None:
                raise error
            await self._sleep(wait)
            attempt, waited = attempt + 1, waited + wait

    async def classify(self, text: str | Sequence[str], budget: float | str | None = None,
                       max_latency_ms: float | None = None, request_id: str | None = None,
                       max_budget: float | None = None) -> ClassifyResponse:
        """Classify one text or several; ``budget`` or ``max_latency_ms`` (or neither: the tier's default);
        ``max_budget``: with budget="auto", the ceiling no text spends more than."""
        headers = {"X-Request-ID": request_id} if request_id else None
        r = await self._request("POST", "/classify", json=_classify_body(text, budget, max_latency_ms, max_budget),
                                headers=headers)
        return ClassifyResponse.model_validate(r.json())

    async def feedback(self, request_id: str, label: str, index: int = 0) -> FeedbackResponse:
        """Report the true label of text ``index`` of an earlier answer."""
        r = await self._request("POST", "/feedback", json={"request_id": request_id, "label": label, "index": index})
        return FeedbackResponse.model_validate(r.json())

    async def models(self) -> ModelList:
        """The loaded checkpoint and its budget grid."""
        return ModelList.model_validate((await self._request("GET", "/v1/models")).json())

    async def ready(self) -> Readiness:
        """Readiness with its checks (does not raise on 503)."""
        return Readiness.model_validate((await self._http.get("/readyz")).json())

    async def metrics(self) -> str:
        """The Prometheus exposition text."""
        return (await self._request("GET", "/metrics")).text

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
