"""The state-store contract, for MemoryState and RedisState (a real redis-server), and Redis going away."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from headbudget.service.settings import StateConfig, parse_config
from headbudget.service.state.redis_store import RedisState
from headbudget.service.state.store import (
    AlreadyReported,
    AnswerNotFound,
    AnswerRecord,
    MemoryState,
    StateStore,
    StateUnavailable,
    gcra,
)
from tests.service.conftest import cid, config_dict, headers, redis_process, running_app

pytestmark = pytest.mark.anyio


def test_gcra_allows_burst_then_the_rate() -> None:
    tat, allowed = None, []
    for _ in range(4):
        ok, tat, _ = gcra(tat, 100.0, per_minute=60, burst=3)
        allowed.append(ok)
    assert allowed == [True, True, True, False]
    ok, _, retry = gcra(tat, 100.0, 60, 3)
    assert not ok and retry == pytest.approx(1.0)
    assert gcra(tat, 101.0, 60, 3)[0]


async def test_rate_limit_is_exact_per_bucket(store: StateStore) -> None:
    results = await asyncio.gather(*[store.admit("k1", 60, 5, None, 0, cid()) for _ in range(8)])
    assert [r.allowed for r in results].count(True) == 5
    denied = next(r for r in results if not r.allowed)
    assert 0 < denied.retry_after_s <= 1.01
    assert (await store.admit("k2", 60, 5, None, 0, cid())).allowed


async def test_feedback_claim_once_and_owner_only(store: StateStore) -> None:
    await store.remember("r1", AnswerRecord(owner="o1", tier="t", labels=["a", "b"], budgets=[0.5, 0.5]))
    assert (await store.claim("r1", "o1", 1)).labels == ["a", "b"]
    with pytest.raises(AlreadyReported):
        await store.claim("r1", "o1", 1)
    for rid, owner, index in (("r1", "o2", 0), ("nope", "o1", 0), ("r1", "o1", 2)):
        with pytest.raises(AnswerNotFound):
            await store.claim(rid, owner, index)


async def test_one_request_id_names_one_answer_per_owner(store: StateStore) -> None:
    """A second tenant re-using a (guessable, client-chosen) id neither overwrites nor consumes the first's."""
    await store.remember("id", AnswerRecord(owner="first", tier="cheap", labels=["a", "b"], budgets=[0.25, 0.25]))
    await store.remember("id", AnswerRecord(owner="second", tier="quality", labels=["c"], budgets=[1.0]))
    assert (await store.claim("id", "second", 0)).labels == ["c"]
    with pytest.raises(AnswerNotFound):
        await store.claim("id", "second", 1)  # the first tenant's second text is not the second tenant's
    assert (await store.claim("id", "first", 0)).labels == ["a", "b"]
    assert (await store.claim("id", "first", 1)).tier == "cheap"
    with pytest.raises(AlreadyReported):
        await store.claim("id", "second", 0)


async def test_online_accuracy_is_a_rolling_window(store: StateStore) -> None:
    got = [await store.record_outcome("0.5", c) for c in (True, False, True, True, True)]
    assert got == pytest.approx([1.0, 0.5, 2 / 3, 2 / 3, 1.0])  # window of 3


async def test_memory_feedback_is_bounded_in_time_and_size() -> None:
    now = [0.0]
    s = MemoryState(StateConfig(feedback_ttl_s=10, feedback_max_entries=2), clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        await s.remember(rid, AnswerRecord("o", "t", ["x"], [1.0]))
    with pytest.raises(AnswerNotFound):
        await s.claim("a", "o", 0)  # evicted: size bound
    now[0] = 11.0
    with pytest.raises(AnswerNotFound):
        await s.claim("c", "o", 0)  # expired: time bound


async def test_redis_rate_limit_is_shared_between_clients(redis_url: str) -> None:
    a, b = (RedisState(StateConfig(redis_url=redis_url)) for _ in range(2))
    await a._redis.flushdb()
    results = await asyncio.gather(*[(a if i % 2 else b).admit("shared", 60, 6, None, 0, cid()) for i in range(10)])
    assert [r.allowed for r in results].count(True) == 6
    await a.close()
    await b.close()


async def test_redis_unreachable_raises_state_unavailable() -> None:
    s = RedisState(StateConfig(redis_url="redis://127.0.0.1:1/0", redis_timeout_s=0.2))
    with pytest.raises(StateUnavailable):
        await s.admit("k", 60, 1, None, 0, cid())
    with pytest.raises(StateUnavailable):
        await s.remember("r", AnswerRecord("o", "t", ["x"], [1.0]))
    assert await s.ping() is False
    await s.close()


@pytest.mark.parametrize("on_error", ["open", "closed"])
async def test_service_when_redis_goes_away(tmp_path: Path, on_error: str) -> None:
    with redis_process(tmp_path) as (url, proc):
        d = config_dict()
        d["state"] = {"redis_url": url, "on_error": on_error, "redis_timeout_s": 0.3}
        config = parse_config(d)
        async with running_app(config) as (client, _, _):
            ok = await client.post("/classify", json={"text": "x"}, headers=headers())
            assert ok.status_code == 200
            assert (await client.get("/readyz")).json()["checks"]["state"] == "redis ok"
            proc.terminate()
            proc.wait(10)
            r = await client.post("/classify", json={"text": "x"}, headers=headers())
            ready = await client.get("/readyz")
            fb = await client.post("/feedback", json={"request_id": ok.json()["request_id"], "label": "positive"},
                                   headers=headers())
            metrics = (await client.get("/metrics")).text
    assert "headbudget_state_backend_up 0.0" in metrics
    assert 'headbudget_state_errors_total{operation="rate_limit"}' in metrics
    assert ready.json()["checks"]["state"] == f"redis down (failing {on_error})"
    if on_error == "open":
        assert r.status_code == 200 and ready.status_code == 200
    else:
        assert r.status_code == 503 and "retry-after" in r.headers and ready.status_code == 503
    assert fb.status_code == 503  # the feedback store is down either way


async def test_a_revocation_reaches_every_watcher_once(store: StateStore) -> None:
    """Redis: a watcher first pushes its own revocations and sees all the store holds, then each new one as it is
    made; a key revoked again keeps its first time and is not announced again. Memory (one process, whose config
    file revokes and restores keys): nothing is held or announced."""
    a, b, c = "aa" * 32, "bb" * 32, "cc" * 32
    if store.kind == "memory":
        heard: list[str] = []
        watching = asyncio.create_task(store.watch_revocations(lambda: {a: ""}, heard.extend))
        await store.revoke({b: ""})
        await asyncio.sleep(0.05)
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        assert heard == [] and watching.cancelled()
        return
    seen: list[str] = []
    first = asyncio.create_task(store.watch_revocations(lambda: {a: "2026-01-01T00:00:00Z"}, seen.extend))
    later: list[str] = []
    second = None
    try:
        await wait_for(lambda: a in seen)
        await store.revoke({b: "2026-01-02T00:00:00Z"})
        await wait_for(lambda: b in seen)
        await store.revoke({b: "2026-01-03T00:00:00Z", a: ""})  # both held already
        second = asyncio.create_task(store.watch_revocations(dict, later.extend))
        await wait_for(lambda: {a, b} <= set(later))
        await store.revoke({c: ""})
        await wait_for(lambda: c in seen and c in later)
        assert seen.count(b) == 1 and seen.count(c) == 1 and later.count(c) == 1
    finally:
        for task in (first, second):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)


async def wait_for(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "not seen in time"
        await asyncio.sleep(0.01)


async def test_a_redis_that_lost_its_data_learns_the_revocations_again(tmp_path: Path) -> None:
    """Redis restarted empty: the watcher reconnects, hands its own revocations to the store again, and hears the
    ones made after."""
    from tests.service.replicas import RedisServer

    redis = RedisServer(tmp_path / "redis")
    redis.start()
    store = RedisState(StateConfig(redis_url=redis.url))
    a, b = "aa" * 32, "bb" * 32
    seen: list[str] = []
    watching = asyncio.create_task(store.watch_revocations(lambda: {a: ""}, seen.extend))
    try:
        await wait_for(lambda: a in seen)
        redis.stop()
        assert (tmp_path / "redis" / "appendonlydir").is_dir()
        shutil.rmtree(tmp_path / "redis" / "appendonlydir")  # its data gone with it
        redis.start()
        seen.clear()
        await wait_for(lambda: a in seen)  # read back from the store, which the watcher refilled
        assert await store._redis.hkeys("headbudget:revoked") == [a]
        await store.revoke({b: ""})
        await wait_for(lambda: b in seen)
    finally:
        watching.cancel()
        await asyncio.gather(watching, return_exceptions=True)
        await store.close()
        redis.stop()
