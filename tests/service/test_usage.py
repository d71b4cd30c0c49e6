"""Usage: every answered request is added to its key's UTC day in the state store; GET /v1/usage shows the calling
key its own quota and usage and nothing of another key's; Prometheus counts units spent and saved by tier (by key
only behind [metrics] per_key); the access log carries the charge; with 2 workers on Redis the sums equal the
charges in the answers and survive a restart."""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.service.accounting.auth import hash_key
from headbudget.service.settings import StateConfig, parse_config
from headbudget.service.state.redis_store import RedisState
from headbudget.service.state.store import MemoryState, StateStore, Usage, UsageRow, utc_day
from tests.service.conftest import (
    KEYS,
    charge_of,
    cid,
    config_dict,
    headers,
    redis_process,
    running_app,
    start_server,
    toml_of,
    two_tier_traffic,
)
from tests.service.test_api import sample

pytestmark = pytest.mark.anyio


async def test_usage_adds_up_per_key_and_day(store: StateStore) -> None:
    one = Usage(units=1500, requests=1, texts=2, tokens=30, saved=500)
    await store.record_usage(UsageRow("2026-01-01", "ownerA", "alice", "cheap", one), cid())
    await store.record_usage(UsageRow("2026-01-01", "ownerA", "alice", "cheap", one), cid())
    await store.record_usage(UsageRow("2026-01-02", "ownerA", "alice", "cheap", one), cid())
    await store.record_usage(UsageRow("2026-01-01", "ownerB", "bob", "quality", Usage(7, 1, 1, 3, 0)), cid())
    assert await store.usage_of("ownerA", "2026-01-01") == (one.plus(one), one.plus(one).plus(one))
    assert await store.usage_of("ownerB", "2026-01-01") == (Usage(7, 1, 1, 3, 0), Usage(7, 1, 1, 3, 0))
    assert await store.usage_of("nobody", "2026-01-01") == (Usage(), Usage())


async def test_a_key_moved_between_tiers_keeps_a_row_per_tier(store: StateStore) -> None:
    cheap, quality = Usage(1000, 1, 1, 10, 0), Usage(3000, 1, 2, 20, 0)
    await store.record_usage(UsageRow("2026-01-01", "ownerA", "alice", "cheap", cheap), cid())
    await store.record_usage(UsageRow("2026-01-01", "ownerA", "alice", "quality", quality), cid())
    await store.record_usage(UsageRow("2026-01-01", "ownerA", "alice", "cheap", cheap), cid())
    # /v1/usage: the key's whole day and all-time total, whatever its tiers
    assert await store.usage_of("ownerA", "2026-01-01") == (cheap.plus(quality).plus(cheap),) * 2
    if isinstance(store, RedisState):  # the export `headbudget usage` reads: one row per tier
        rows = [(r.tier, r.usage) for r in await store.usage_rows("2026-01-01", "2026-01-01") if r.owner == "ownerA"]
        assert rows == [("cheap", cheap.plus(cheap)), ("quality", quality)]


async def test_redis_reads_day_rows_kept_before_tiers(redis_url: str) -> None:
    """A day recorded by a server that kept one row per key and day (usage:DAY:OWNER, indexed in usage:owners:DAY)
    still counts, beside rows of the same day kept per tier."""
    s = RedisState(StateConfig(redis_url=redis_url))
    await s._redis.flushdb()
    await s._redis.hset("headbudget:usage:2026-01-05:old0", mapping={"units": 500, "requests": 1, "texts": 1,
                                                                       "tokens": 5, "saved": 0, "name": "olga",
                                                                       "tier": "cheap"})
    await s._redis.sadd("headbudget:usage:owners:2026-01-05", "old0")
    await s._redis.zadd("headbudget:usage:days", {"2026-01-05": 20260105})
    await s.record_usage(UsageRow("2026-01-05", "old0", "olga", "quality", Usage(700, 1, 1, 7, 0)), cid())
    rows = await s.usage_rows()
    assert [(r.tier, r.usage.units) for r in rows] == [("cheap", 500), ("quality", 700)]
    assert (await s.usage_of("old0", "2026-01-05"))[0] == Usage(1200, 2, 2, 12, 0)
    await s.close()


async def test_redis_lists_usage_by_day_and_key(redis_url: str) -> None:
    s = RedisState(StateConfig(redis_url=redis_url))
    await s._redis.flushdb()
    for day in ("2026-01-30", "2026-02-01", "2026-01-31"):
        await s.record_usage(UsageRow(day, "b0", "bob", "quality", Usage(2000, 1, 1, 2, 0)), cid())
        await s.record_usage(UsageRow(day, "a0", "alice", "cheap", Usage(1000, 1, 1, 1, 3000)), cid())
    rows = await s.usage_rows()
    assert [(r.day, r.name) for r in rows] == [(d, n) for d in ("2026-01-30", "2026-01-31", "2026-02-01")
                                               for n in ("alice", "bob")]
    assert [r.day for r in await s.usage_rows("2026-01-31", "2026-01-31")] == ["2026-01-31"] * 2
    assert [r.day for r in await s.usage_rows(since="2026-01-31")] == ["2026-01-31"] * 2 + ["2026-02-01"] * 2
    assert await s.usage_rows("2027-01-01") == []
    await s.close()


# -- the service over the fake engine ----------------------------------------------------------------------------
async def test_v1_usage_shows_the_calling_key_its_own_usage_only(caplog: pytest.LogCaptureFixture) -> None:
    d = config_dict()
    d["tiers"]["cheap"].update(compute_per_minute=600, compute_burst=100, max_request_compute=50)
    caplog.set_level(logging.INFO, logger="headbudget.access")
    config = parse_config(d)
    # A stopped clock: the quota does not refill while the test runs, however slow the machine.
    state = MemoryState(config.state, clock=lambda: 1_000.0)
    async with running_app(config, state=state) as (client, _, _):
        spent: dict[str, list[float]] = {"cheap": [], "quality": []}
        for i, tier in enumerate(["cheap", "quality", "cheap", "quality", "quality"]):
            r = await client.post("/classify", json={"texts": ["a b c"] * (i + 1)}, headers=headers(tier))
            spent[tier].append(r.json()["charge"])
        tei = await client.post("/predict", json={"inputs": [["one two"], ["x"]]}, headers=headers("quality"))
        spent["quality"].append(float(tei.headers["x-charge"]))
        refused = await client.post("/classify", json={"texts": ["a b c d e f g h"] * 20}, headers=headers("cheap"))
        mine = {t: (await client.get("/v1/usage", headers=headers(t))).json() for t in spent}
        anonymous = await client.get("/v1/usage")
        metrics = (await client.get("/metrics")).text
    assert refused.status_code == 422 and anonymous.status_code == 401
    for tier, report in mine.items():
        assert report["key"] == f"test-{tier}" and report["tier"] == tier and report["date"] == utc_day()
        assert report["today"] == report["total"]
        assert report["today"]["units"] == pytest.approx(sum(spent[tier]), abs=1e-9)
        assert report["today"]["requests"] == len(spent[tier])  # the refused request is not usage
    assert mine["cheap"]["today"]["texts"] == 1 + 3 and mine["quality"]["today"]["texts"] == 2 + 4 + 5 + 2
    assert mine["cheap"]["today"]["tokens"] == 5 * 4
    # quality runs dense: nothing saved; cheap at 0.25 saves three quarters of the attention third
    assert mine["quality"]["today"]["saved_units"] == 0 and mine["cheap"]["today"]["saved_units"] > 0
    cheap_quota = mine["cheap"]["quota"]
    assert cheap_quota["compute_per_minute"] == 600 and cheap_quota["compute_burst"] == 100
    assert cheap_quota["max_request_compute"] == 50
    assert cheap_quota["compute_left"] == pytest.approx(100 - sum(spent["cheap"]), abs=1e-9)
    assert mine["quality"]["quota"]["compute_left"] is None  # no compute quota in that tier
    # nothing of the other key: neither its name nor its numbers
    assert "test-quality" not in json.dumps(mine["cheap"]) and "test-cheap" not in json.dumps(mine["quality"])
    assert sample(metrics, "headbudget_compute_units_total", tier="cheap") == pytest.approx(sum(spent["cheap"]))
    assert sample(metrics, "headbudget_compute_units_total", tier="quality") == pytest.approx(sum(spent["quality"]))
    assert sample(metrics, "headbudget_compute_units_saved_total", tier="quality") == 0
    assert 'key="' not in metrics  # no key label unless [metrics] per_key
    charges = [rec.__dict__.get("charge") for rec in caplog.records if rec.__dict__.get("path") == "/classify"
               and rec.__dict__.get("status") == 200]
    assert charges == [spent["cheap"][0], spent["quality"][0], spent["cheap"][1], spent["quality"][1],
                       spent["quality"][2]]


async def test_per_key_metrics_only_when_asked() -> None:
    d = config_dict()
    d["metrics"] = {"per_key": True}
    async with running_app(parse_config(d)) as (client, _, _):
        r = await client.post("/classify?budget=1.0", json={"text": "a b c"}, headers=headers("balanced"))
        metrics = (await client.get("/metrics")).text
    assert sample(metrics, "headbudget_compute_units_total", tier="balanced", key="test-balanced") == \
        r.json()["charge"] == 5


# -- 2 workers sharing Redis, a restart, and the export ---------------------------------------------------------
async def _traffic(url: str, rounds: int) -> dict[str, float]:
    """Requests of two keys of different tiers over /classify and /predict; the charges their answers carry."""
    spent = {"cheap": 0.0, "quality": 0.0}
    for tier, r in await two_tier_traffic(url, rounds):
        spent[tier] += float(charge_of(r))
    return spent


def _usage(url: str) -> dict[str, dict[str, Any]]:
    return {t: httpx.get(f"{url}/v1/usage", headers=headers(t), timeout=30).json() for t in ("cheap", "quality")}


def test_usage_equals_the_charges_across_workers_and_a_restart(tiny_checkpoint: Path, tmp_path: Path) -> None:
    d = config_dict()
    d["tiers"]["cheap"].update(compute_per_minute=100_000)
    with redis_process(tmp_path / "redis") as (url, _):
        d["state"] = {"redis_url": url}
        config = toml_of(d)
        with start_server(tiny_checkpoint, config, tmp_path / "a", workers=2) as s:
            first = asyncio.run(_traffic(s.url, 8))
            before = _usage(s.url)
        with start_server(tiny_checkpoint, config, tmp_path / "b", workers=2) as s:  # a fresh server, same Redis
            kept = _usage(s.url)
            second = asyncio.run(_traffic(s.url, 4))
            after = _usage(s.url)
        export = subprocess.run([sys.executable, "-m", "headbudget.cli", "usage", "--config", str(s.config),
                                 "--format", "jsonl"], capture_output=True, text=True, timeout=60)
    for tier in ("cheap", "quality"):
        assert before[tier]["today"]["units"] == pytest.approx(first[tier], abs=1e-6), tier
        assert before[tier]["today"]["requests"] == 16
        assert kept[tier]["today"] == before[tier]["today"]  # the usage outlived the workers
        assert after[tier]["total"]["units"] == pytest.approx(first[tier] + second[tier], abs=1e-6)
        assert after[tier]["today"]["requests"] == 24
    assert export.returncode == 0, export.stderr
    rows = [json.loads(line) for line in export.stdout.splitlines()]
    assert {r["key"]: r["units"] for r in rows} == {
        "test-cheap": pytest.approx(first["cheap"] + second["cheap"], abs=1e-6),
        "test-quality": pytest.approx(first["quality"] + second["quality"], abs=1e-6)}
    owners = {r["key"]: r["owner"] for r in rows}
    assert owners == {f"test-{t}": hash_key(KEYS[t])[:16] for t in ("cheap", "quality")}
