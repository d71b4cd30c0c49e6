"""Replicas, not only workers: two `headbudget serve` processes behind a real haproxy (round robin, /readyz health
checks, a refused connection redispatched), sharing one redis-server. Through the balancer: compute quotas are
exact across the replicas, usage equals the charges of the answers and the `headbudget usage` export, a replica
killed mid-load loses no usage of an answered request while the client's retries land on the other, and a Redis
restart mid-load keeps the answers flowing (fail open) and the usage counting again once it is back, every answer
it could not record logged with its charge; a replica that fails closed answers 503 with Retry-After meanwhile."""

from __future__ import annotations

import asyncio
import json
import math
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.service.accounting.auth import hash_key
from headbudget.service.accounting.journal import UsageJournal
from headbudget.service.settings import StateConfig
from headbudget.service.state.redis_store import RedisState
from headbudget.service.state.store import StateUnavailable, Usage, UsageRow
from tests.service.conftest import (
    KEYS,
    charge_of,
    cid,
    config_dict,
    service_env,
    toml_of,
    two_tier_traffic,
)
from tests.service.replicas import Cluster, RedisServer, Replica, cluster
from tests.service.test_api import sample

KEY = {"small": "hb_test_replica_small_key_00000000000", "large": "hb_test_replica_large_key_00000000000",
       "kill": "hb_test_replica_kill_key_000000000000", "redis": "hb_test_replica_redis_key_00000000000",
       "busy": "hb_test_replica_busy_key_000000000000", "revoked": "hb_test_replica_revoked_key_0000000000"}
TEXT = " ".join(["word"] * 20)  # 22 tokens on the real tokenizer
SMALL_Q, LARGE_Q = 100.0, 500.0  # units a quota key may spend; they refill by 1 milli-unit a minute
LOST = re.compile(r"usage of key (\S+) lost \((.*)\): charge \S+, ([0-9.]+) compute units")


def replica_config(on_error: str) -> str:
    d = config_dict(max_batch_size=64)
    for tier in ("cheap", "quality"):
        d["tiers"][tier].update(compute_per_minute=100_000)
    quota = {"rate_limit": 6000, "burst": 100, "compute_per_minute": 0.001}
    d["tiers"]["small"] = {"default_budget": 0.5, "max_budget": 0.5, "priority": 0, **quota,
                           "compute_burst": SMALL_Q}
    d["tiers"]["large"] = {"default_budget": 1.0, "max_budget": 1.0, "priority": 5, **quota,
                           "compute_burst": LARGE_Q}
    # the load tests' tier: a request rate and a quota that a few seconds of load stay well under
    d["tiers"]["bulk"] = {"default_budget": 0.5, "max_budget": 1.0, "rate_limit": 600_000, "burst": 1000,
                          "max_queue": 256, "compute_per_minute": 10_000_000, "compute_burst": 1_000_000}
    d["keys"] += [{"sha256": hash_key(KEY[n]), "tier": t, "name": f"replica-{n}"}
                  for n, t in (("small", "small"), ("large", "large"), ("kill", "bulk"), ("redis", "bulk"),
                               ("busy", "bulk"), ("revoked", "bulk"))]
    d["state"] = {"redis_url": "@REDIS@", "on_error": on_error, "journal_dir": "@JOURNAL@"}
    return toml_of(d)


@pytest.fixture(scope="module")
def lb(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(tiny_checkpoint, replica_config("open"), replica_config("closed"),
                 tmp_path_factory.mktemp("replicas")) as c:
        yield c


@pytest.fixture
def both(lb: Cluster) -> Cluster:
    if lb.redis.proc is None or lb.redis.proc.poll() is not None:  # a test that stopped it failed midway
        lb.redis.start()
    lb.ensure_replicas()
    return lb


def milli(charge: float | str) -> int:
    return round(float(charge) * 1000)


def usage_of(url: str, key: str) -> dict[str, Any]:
    r = httpx.get(f"{url}/v1/usage", headers={"X-API-Key": key}, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json())


def served(replica: Replica, key_name: str) -> dict[str, int]:
    """Request id -> charge (milli-units) of the answers the replica's access log shows for a key."""
    return {r["request_id"]: milli(r["charge"]) for r in replica.records()
            if r.get("logger") == "headbudget.access" and r.get("key_name") == key_name and r.get("status") == 200
            and "charge" in r}


def lost_usage(replica: Replica, key_name: str) -> list[tuple[int, str]]:
    """(charge in milli-units, why) of the answers whose usage the replica logged it could not record."""
    found = (LOST.search(str(r.get("msg", ""))) for r in replica.records())
    return [(milli(m.group(3)), m.group(2)) for m in found if m is not None and m.group(1) == key_name]


def store_errors_since(replicas: list[Replica], since: float) -> list[str]:
    """The warnings about the state store the replicas logged from wall time ``since`` on."""
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(since)) + f".{int(since % 1 * 1000):03d}Z"
    return [r["msg"] for replica in replicas for r in replica.records()
            if r.get("level") in ("warning", "error") and "redis" in str(r.get("msg")) and str(r.get("ts")) >= stamp]


def state_errors(replicas: list[Replica]) -> float:
    """The replicas' failed state-store operations so far (admissions let through unchecked among them)."""
    total = 0.0
    for r in replicas:
        for line in httpx.get(f"{r.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("headbudget_state_errors_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


# -- (1) quotas ------------------------------------------------------------------------------------------------
def test_a_quota_is_exact_across_replicas(both: Cluster) -> None:
    """A key with a quota of Q units is answered up to Q and refused after with the quota's Retry-After, its
    requests alternating between the replicas (one key sends one at a time, one sends all at once)."""
    lb = both.lb.url
    small = [httpx.post(f"{lb}/classify", json={"text": TEXT}, headers={"X-API-Key": KEY["small"]}, timeout=30)
             for _ in range(12)]

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=lb, timeout=30) as c:
            return list(await asyncio.gather(*[
                c.post("/classify", json={"texts": [TEXT] * 8}, headers={"X-API-Key": KEY["large"]})
                for _ in range(8)]))

    large = asyncio.run(burst())
    for name, rs, quota in (("small", small, SMALL_Q), ("large", large, LARGE_Q)):
        ok = [milli(r.json()["charge"]) for r in rs if r.status_code == 200]
        refused = [r for r in rs if r.status_code != 200]
        assert ok and len(set(ok)) == 1, name  # one text size and budget: one charge
        charge, q = ok[0], round(quota * 1000)
        assert len(ok) == q // charge and sum(ok) <= q < sum(ok) + charge, (name, ok)
        assert {r.headers["x-replica"] for r in rs} == {"a", "b"}, name
        left = q - sum(ok)
        for r in refused:
            assert r.status_code == 429 and r.json()["error"]["code"] == "compute_quota_exceeded", r.text
            # the missing milli-units at 1 milli-unit a minute, less the few seconds the test has run
            assert (charge - left) * 60 - 30 <= int(r.headers["retry-after"]) <= (charge - left) * 60 + 1
        report = usage_of(lb, KEY[name])
        assert milli(report["today"]["units"]) == sum(ok) and report["today"]["requests"] == len(ok)
        assert left <= milli(report["quota"]["compute_left"]) <= left + 1
        # what each replica's access log says it answered adds up to the answers
        logs = [served(r, f"replica-{name}") for r in both.replicas]
        assert sorted(c for log in logs for c in log.values()) == sorted(ok)
    # one at a time, round robin alternates: both replicas admitted some of the small key's requests
    assert [r.headers["x-replica"] for r in small[:2]] in (["a", "b"], ["b", "a"])
    assert all(served(r, "replica-small") for r in both.replicas)


def test_a_key_revoked_through_the_store_is_refused_by_every_replica(both: Cluster) -> None:
    """`headbudget keys revoke` on the fail-closed replica's config, and no SIGHUP anywhere: every replica refuses
    the key, the two whose own file still lists it as active included (they learn it from the state store)."""
    replicas = [*both.replicas, both.closed]

    def answer(r: Replica) -> httpx.Response:
        return httpx.post(f"{r.url}/classify", json={"text": TEXT}, headers={"X-API-Key": KEY["revoked"]}, timeout=30)

    assert [answer(r).status_code for r in replicas] == [200, 200, 200]
    done = subprocess.run([sys.executable, "-m", "headbudget.cli", "keys", "revoke", "--config",
                           str(both.closed_config), "--name", "replica-revoked"],
                          capture_output=True, text=True, env=service_env(), timeout=60)
    assert done.returncode == 0 and "every replica that shares the state store refuses it now" in done.stderr, \
        done.stderr
    for r in replicas:
        deadline = time.monotonic() + 10
        while (refused := answer(r)).status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert refused.status_code == 401 and "revoked" in refused.json()["error"]["message"], (r.name, refused.text)
    assert "revoked = true" not in both.config.read_text()  # a and b were told by the store, not by their file


# -- (2) usage ---------------------------------------------------------------------------------------------------
def test_usage_equals_the_charges_and_the_export(both: Cluster) -> None:
    """Two keys of two tiers over /classify and the TEI routes: the sum of the charges in the answers equals
    GET /v1/usage, the `headbudget usage` export and the replicas' counters together."""

    def tier_units() -> dict[str, float]:
        texts = [httpx.get(f"{r.url}/metrics", timeout=10).text for r in both.replicas]
        return {t: sum(sample(m, "headbudget_compute_units_total", tier=t) for m in texts)
                for t in ("cheap", "quality")}

    before = tier_units()
    spent = {"cheap": 0, "quality": 0}
    counts = {"cheap": 0, "quality": 0}
    replicas: set[str] = set()

    for tier, r in asyncio.run(two_tier_traffic(both.lb.url, 6)):
        spent[tier] += milli(charge_of(r))
        counts[tier] += 1
        replicas.add(r.headers["x-replica"])
    assert replicas == {"a", "b"}
    after = tier_units()
    for tier in ("cheap", "quality"):
        report = usage_of(both.lb.url, KEYS[tier])
        assert milli(report["today"]["units"]) == spent[tier] and report["today"]["requests"] == counts[tier]
        assert milli(after[tier] - before[tier]) == spent[tier], tier
        export = subprocess.run([sys.executable, "-m", "headbudget.cli", "usage", "--config", str(both.config),
                                 "--format", "jsonl", "--key", f"test-{tier}"], capture_output=True, text=True,
                                timeout=60, env=service_env())
        assert export.returncode == 0, export.stderr
        rows = [json.loads(line) for line in export.stdout.splitlines()]
        assert [(milli(r["units"]), r["requests"]) for r in rows] == [(spent[tier], counts[tier])], rows


# -- load with a client that retries -------------------------------------------------------------------------
@dataclass
class Sent:
    status: int
    charge: int  # milli-units; 0 unless answered
    replica: str
    request_id: str
    started: float  # when its last attempt was sent (monotonic)
    failed_attempts: int  # connection errors, 502 and 503 before it


async def send(c: httpx.AsyncClient, key: str, attempts: int = 8) -> Sent:
    """One /classify request as a careful client sends it: connection errors, 502 and 503 are tried again after a
    short wait (a 503's Retry-After, at most 1 s), at most ``attempts`` times."""
    failed = 0
    while True:
        started = time.monotonic()
        try:
            r = await c.post("/classify", json={"text": TEXT}, headers={"X-API-Key": key})
        except httpx.TransportError:
            r = None
        if r is not None and (r.status_code not in (502, 503) or failed + 1 >= attempts):
            charge = milli(r.json()["charge"]) if r.status_code == 200 else 0
            return Sent(r.status_code, charge, r.headers.get("x-replica", ""), r.headers.get("x-request-id", ""),
                        started, failed)
        failed += 1
        if failed >= attempts:
            return Sent(0, 0, "", "", started, failed)
        wait = float(r.headers.get("retry-after", 0)) if r is not None else 0.0
        await asyncio.sleep(min(1.0, wait) or 0.05 * failed)


async def load(url: str, key: str, clients: int, stop: asyncio.Event) -> list[Sent]:
    """``clients`` loops sending one request after another until ``stop`` is set."""
    out: list[Sent] = []

    async def loop() -> None:
        async with httpx.AsyncClient(base_url=url, timeout=30) as c:
            while not stop.is_set():
                out.append(await send(c, key))

    await asyncio.gather(*[loop() for _ in range(clients)])
    return out


async def burst(url: str, key: str, n: int) -> list[Sent]:
    """``n`` requests at once."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as c:
        return list(await asyncio.gather(*[send(c, key) for _ in range(n)]))


async def until(check: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await asyncio.to_thread(check):
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


# -- (4) Redis restarted mid-load ------------------------------------------------------------------------------
def test_the_store_uses_no_connection_of_a_redis_that_went_away(tmp_path: Path) -> None:
    """Every pooled connection to a Redis that restarted is closed: the next write on each must still be
    recorded once Redis is back, not fail (a lost usage record) nor count twice."""
    redis = RedisServer(tmp_path)
    row = UsageRow("2026-01-01", "owner", "name", "bulk", Usage(1000, 1, 1, 1, 0))

    async def writes(store: RedisState, n: int) -> list[str]:
        async def one() -> str:
            try:
                await store.record_usage(row, cid())
            except StateUnavailable as e:
                return str(e)
            return "ok"
        return list(await asyncio.gather(*[one() for _ in range(n)]))

    async def scenario() -> tuple[list[str], list[str], Usage]:
        store = RedisState(StateConfig(redis_url=redis.url))
        try:
            first = await writes(store, 8)  # eight connections in the pool
            await asyncio.to_thread(redis.stop)
            await asyncio.to_thread(redis.start)
            again = await writes(store, 8)
            return first, again, (await store.usage_of("owner", "2026-01-01"))[0]
        finally:
            await store.close()

    try:
        redis.start()
        first, again, usage = asyncio.run(scenario())
    finally:
        redis.stop()
    assert first == again == ["ok"] * 8
    assert usage.requests == 16 and usage.units == 16_000  # the append-only file kept the first eight


def journal_lines(c: Cluster) -> int:
    """Usage lines waiting in the replicas' shared journal folder."""
    return UsageJournal(c.config.parent / "journal", 1 << 20).pending()


def test_a_redis_restart_mid_load(both: Cluster) -> None:
    """Redis stopped mid-load: replicas that fail open keep answering and say in /readyz that the store is down
    and they fail open; the replica that fails closed answers 503 with Retry-After. What was answered while Redis
    was away waits in the journal and reaches the store once it is back: the usage equals the answers' charges,
    to the milli-unit."""
    lb, redis = both.lb.url, both.redis
    probes: dict[str, Any] = {}
    back = [math.inf]

    def ready(r: Replica) -> tuple[int, dict[str, Any]]:
        got = httpx.get(f"{r.url}/readyz", timeout=5)
        return got.status_code, dict(got.json())

    async def scenario() -> list[Sent]:
        stop = asyncio.Event()
        sent = await burst(lb, KEY["redis"], 16)  # connections to Redis enough for 16 requests at once
        running = asyncio.create_task(load(lb, KEY["redis"], 2, stop))
        await asyncio.sleep(0.5)
        await asyncio.to_thread(redis.stop)
        await asyncio.sleep(0.3)  # answers while Redis is down
        probes["open"] = [await asyncio.to_thread(ready, r) for r in both.replicas]
        probes["closed_ready"] = await asyncio.to_thread(ready, both.closed)
        probes["closed"] = await asyncio.to_thread(
            httpx.post, f"{both.closed.url}/classify", json={"text": TEXT}, headers={"X-API-Key": KEY["redis"]},
            timeout=10)
        # down until an answer has gone to a journal (a busy machine may answer nothing in a fixed window)
        await until(lambda: journal_lines(both) > 0, 60, "an answer goes to the journal")
        await asyncio.to_thread(redis.start)
        await until(lambda: all("redis ok" in ready(r)[1]["checks"]["state"] for r in both.replicas), 10,
                    "the replicas see Redis again")
        back[0] = time.time()
        await asyncio.sleep(0.3)
        stop.set()
        return sent + await running

    sent = asyncio.run(scenario())
    # fail open: every request answered, the store's state and the mode said by /readyz
    assert [s.status for s in sent] == [200] * len(sent), {s.status for s in sent}
    for status, body in probes["open"]:
        assert status == 200 and body["checks"]["state"] == "redis down (failing open)", body
    status, body = probes["closed_ready"]
    assert status == 503 and body["checks"]["state"] == "redis down (failing closed)", body
    closed = probes["closed"]
    assert closed.status_code == 503 and closed.json()["error"]["code"] == "unavailable", closed.text
    assert int(closed.headers["retry-after"]) >= 1
    # every answer is in the usage once (Redis keeps its append-only file over the restart): those answered while it
    # was away through the journal, which empties; none is logged as lost
    asyncio.run(until(lambda: journal_lines(both) == 0, 10, "the journal empties"))
    # any process on the shared folder may replay it, the replica that fails closed too
    replayed = [r for replica in (*both.replicas, both.closed) for r in replica.records()
                if "sent to the state store" in str(r.get("msg", ""))]
    assert replayed, "no answer went through the journal"
    report = usage_of(lb, KEY["redis"])["today"]
    assert [lost_usage(r, "replica-redis") for r in both.replicas] == [[], []]
    assert report["requests"] == len(sent) and milli(report["units"]) == sum(s.charge for s in sent), \
        (len(sent), report)
    # usage resumes: every answer after the restart is counted, 16 at once as before it, and no operation on the
    # store fails once it is back (no connection to the Redis that went away is used again)
    more = asyncio.run(burst(lb, KEY["redis"], 16))
    assert [m.status for m in more] == [200] * 16 and {m.replica for m in more} == {"a", "b"}
    now = usage_of(lb, KEY["redis"])["today"]
    assert milli(now["units"]) - milli(report["units"]) == sum(m.charge for m in more)
    assert now["requests"] == report["requests"] + 16
    assert store_errors_since(both.replicas, back[0]) == []


def stall(redis: RedisServer, seconds: float) -> None:
    """Keep Redis from answering anyone for ``seconds`` (DEBUG SLEEP)."""
    with socket.create_connection(("127.0.0.1", redis.port), timeout=seconds + 10) as sock:
        sock.sendall(f"DEBUG SLEEP {seconds}\r\n".encode())
        assert sock.recv(16).startswith(b"+OK")


def test_a_redis_too_busy_to_answer_in_time(both: Cluster) -> None:
    """Redis stalls past the replicas' 0.25 s timeout mid-load (DEBUG SLEEP 0.6 s, three times): the writes whose
    replies were lost are sent again under their charge ids, so every answer is counted once, exactly: none lost,
    none twice, no admission let through unchecked."""
    lb = both.lb.url
    before = usage_of(lb, KEY["busy"])["today"]
    errors = state_errors(both.replicas)
    started = time.time()

    async def scenario() -> list[Sent]:
        stop = asyncio.Event()
        running = asyncio.create_task(load(lb, KEY["busy"], 4, stop))
        await asyncio.sleep(0.5)
        for _ in range(3):
            await asyncio.to_thread(stall, both.redis, 0.6)
            await asyncio.sleep(0.3)
        stop.set()
        return await running

    sent = asyncio.run(scenario())
    assert [s.status for s in sent] == [200] * len(sent), {s.status for s in sent}
    again = [r for replica in both.replicas for r in replica.records()
             if "sending the write again" in str(r.get("msg", "")) and str(r.get("ts")) >= time.strftime(
                 "%Y-%m-%dT%H:%M:%S", time.gmtime(started))]
    assert again, "no write timed out: the stall did not reach the replicas"
    assert store_errors_since(both.replicas, started) == []  # nothing lost, no settlement missed
    assert state_errors(both.replicas) == errors  # no admission let through unchecked
    assert journal_lines(both) == 0
    now = usage_of(lb, KEY["busy"])["today"]
    assert now["requests"] - before["requests"] == len(sent)
    assert milli(now["units"]) - milli(before["units"]) == sum(s.charge for s in sent)


# -- (3) a replica killed mid-load -----------------------------------------------------------------------------
def test_a_replica_killed_mid_load(both: Cluster) -> None:
    """SIGKILL one replica under load: the client's retries land on the other, which keeps answering, and every
    answered request's charge is in the usage (a request the dead replica ran but could not answer may be in it
    too: at most one per failed attempt)."""
    lb = both.lb.url
    a, b = both.replicas
    killed_at = [math.inf]

    async def scenario() -> list[Sent]:
        stop = asyncio.Event()
        running = asyncio.create_task(load(lb, KEY["kill"], 4, stop))
        await until(lambda: bool(served(b, "replica-kill")) and bool(served(a, "replica-kill")), 10,
                    "both replicas answer")
        await asyncio.sleep(0.3)
        # timed once it is dead: the load goes on while the kill's thread starts, and b may answer meanwhile
        await asyncio.to_thread(b.kill)
        killed_at[0] = time.monotonic()
        await asyncio.sleep(1.5)
        stop.set()
        return await running

    sent = asyncio.run(scenario())
    answered = [s for s in sent if s.status == 200]
    assert len(answered) == len(sent), sorted({(s.status, s.failed_attempts) for s in sent if s.status != 200})
    before = [s for s in answered if s.started < killed_at[0]]
    after = [s for s in answered if s.started > killed_at[0]]
    assert {s.replica for s in before} == {"a", "b"}
    assert len(after) >= 10 and {s.replica for s in after} == {"a"}  # the survivor answers
    # the replicas' access logs hold what the client saw answered (the killed one may have died between an answer
    # and its log line: one per client at most)
    for replica, slack in ((a, 0), (b, 4)):
        log = served(replica, "replica-kill")
        mine = {s.request_id: s.charge for s in answered if s.replica == replica.name}
        assert len(mine.items() - log.items()) <= slack, replica.name
    assert [lost_usage(r, "replica-kill") for r in both.replicas] == [[], []]  # Redis is up: all recorded
    report = usage_of(lb, KEY["kill"])["today"]
    failed = sum(s.failed_attempts for s in sent)
    charge = max(s.charge for s in answered)
    assert sum(s.charge for s in answered) <= milli(report["units"]) <= sum(s.charge for s in answered) + \
        failed * charge
    assert len(answered) <= report["requests"] <= len(answered) + failed
