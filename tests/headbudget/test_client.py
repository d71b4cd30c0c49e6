"""headbudget.client retries: 429 and 503 after Retry-After, bounded by a count and a total wait, sync and async,
against httpx.MockTransport (the waits are recorded by an injected sleep, never slept)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import httpx
import pytest

from headbudget.client import AsyncClient, Client, HeadbudgetError, RetryPolicy, parse_retry_after

ANSWER = {"model": {"name": "m", "checksum": "c"}, "request_id": "r1", "tier": "balanced",
          "budget_source": "request", "max_latency_ms": None, "degraded": False, "queue_ms": 0.1, "latency_ms": 1.0,
          "results": [{"label": "Sports", "scores": {"Sports": 0.9, "World": 0.1}, "budget_requested": 0.5,
                       "budget_applied": 0.5, "heads_active": 36, "heads_total": 72, "cost": 0.5,
                       "truncated": False, "n_tokens": 5, "latency_ms": 0.9, "degraded": False}]}


def refusal(status: int, retry_after: str | None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    code = "rate_limited" if status == 429 else "overloaded"
    return httpx.Response(status, json={"error": {"code": code, "message": "try later"}}, headers=headers)


class Script:
    """A server that answers the scripted responses in order (then 200s) and records each request."""

    def __init__(self, *answers: httpx.Response) -> None:
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answers.pop(0) if self.answers else httpx.Response(200, json=ANSWER)


def sync_client(script: Script, waits: list[float], **kwargs: float) -> Client:
    return Client("http://hb.test", api_key="k", transport=httpx.MockTransport(script), sleep=waits.append,
                  **kwargs)  # type: ignore[arg-type]


def test_retries_429_and_503_after_retry_after_then_answers() -> None:
    script, waits = Script(refusal(429, "2"), refusal(503, "1")), []
    with sync_client(script, waits, retries=3) as hb:
        answer = hb.classify("a match report", budget=0.5, request_id="req-7")
    assert answer.results[0].label == "Sports"
    assert len(script.requests) == 3 and waits == [2.0, 1.0]
    # every attempt is the same request: same body, key and request id
    assert [json.loads(r.content) for r in script.requests] == [{"text": "a match report", "budget": 0.5}] * 3
    assert {(r.headers["x-api-key"], r.headers["x-request-id"]) for r in script.requests} == {("k", "req-7")}


def test_gives_up_after_the_retry_count_with_the_last_error() -> None:
    script, waits = Script(*[refusal(429, "1")] * 5), []
    with sync_client(script, waits, retries=2) as hb, pytest.raises(HeadbudgetError) as e:
        hb.classify("x")
    assert (e.value.status, e.value.code, e.value.retry_after_s) == (429, "rate_limited", 1.0)
    assert len(script.requests) == 3 and waits == [1.0, 1.0]


def test_gives_up_when_the_waits_would_pass_the_bound() -> None:
    script, waits = Script(*[refusal(503, "3")] * 5), []
    with sync_client(script, waits, retries=5, max_retry_wait_s=5.0) as hb, pytest.raises(HeadbudgetError) as e:
        hb.models()
    assert e.value.status == 503 and len(script.requests) == 2 and waits == [3.0]  # 3 + 3 > 5
    script, waits = Script(refusal(429, "60")), []
    with sync_client(script, waits, retries=5, max_retry_wait_s=5.0) as hb, pytest.raises(HeadbudgetError):
        hb.classify("x")
    assert len(script.requests) == 1 and waits == []  # a Retry-After beyond the bound is not waited for


def test_no_retry_by_default_and_none_for_other_errors() -> None:
    script, waits = Script(refusal(429, "1")), []
    with sync_client(script, waits) as hb, pytest.raises(HeadbudgetError):
        hb.classify("x")
    assert len(script.requests) == 1 and waits == []
    for status in (400, 401, 403, 500):
        script = Script(httpx.Response(status, json={"error": {"code": "c", "message": "m"}}, headers={"Retry-After": "1"}))
        with sync_client(script, waits, retries=3) as hb, pytest.raises(HeadbudgetError) as e:
            hb.feedback("r1", "Sports")
        assert e.value.status == status and len(script.requests) == 1 and waits == []


def test_missing_retry_after_waits_the_default() -> None:
    script, waits = Script(refusal(503, None)), []
    with sync_client(script, waits, retries=1) as hb:
        hb.classify("x")
    assert waits == [RetryPolicy().default_wait_s] and len(script.requests) == 2


@pytest.mark.parametrize("bad", [{"retries": -1}, {"max_retry_wait_s": -1.0}, {"max_retry_wait_s": float("nan")}])
def test_bad_retry_settings_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Client("http://hb.test", **bad)  # type: ignore[arg-type]


def test_async_client_retries_the_same_way() -> None:
    script, waits = Script(refusal(503, "2"), refusal(429, "0")), []

    async def sleep(s: float) -> None:
        waits.append(s)

    async def main() -> None:
        async with AsyncClient("http://hb.test", transport=httpx.MockTransport(script), retries=2,
                               sleep=sleep) as hb:
            answer = await hb.classify(["a", "b"])
            assert answer.results[0].label == "Sports"
        assert len(script.requests) == 3 and waits == [2.0, 0.0]
        script.answers = [refusal(429, "1")] * 4
        waits.clear()
        async with AsyncClient("http://hb.test", transport=httpx.MockTransport(script), retries=2,
                               sleep=sleep) as hb:
            with pytest.raises(HeadbudgetError) as e:
                await hb.classify("x")
        assert e.value.status == 429 and waits == [1.0, 1.0]

    asyncio.run(main())


def test_parse_retry_after() -> None:
    now = datetime(2026, 11, 23, 12, 0, 0, tzinfo=UTC)
    assert parse_retry_after("7", now) == 7.0 and parse_retry_after("0.25", now) == 0.25
    assert parse_retry_after("Mon, 23 Nov 2026 12:00:30 GMT", now) == 30.0
    assert parse_retry_after("Mon, 23 Nov 2026 11:00:00 GMT", now) == 0.0  # in the past: now
    for bad in (None, "", "soon", "nan", "inf"):
        assert parse_retry_after(bad, now) is None
