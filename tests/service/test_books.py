"""Books that balance under faults: every write that counts compute carries its charge id and counts once (in
memory and in Redis, also when a reply is lost and the write is sent again), and usage that Redis could not take
waits in a local journal that any later process replays, once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.exceptions import TimeoutError as RedisTimeoutError

from headbudget.service.accounting.journal import Entry, UsageJournal
from headbudget.service.settings import StateConfig
from headbudget.service.state.redis_store import RedisState
from headbudget.service.state.store import (
    ComputeLimit,
    MemoryState,
    StateStore,
    StateUnavailable,
    Usage,
    UsageRow,
)
from tests.service.conftest import cid, config_dict, headers, start_server, toml_of
from tests.service.replicas import RedisServer

pytestmark = pytest.mark.anyio

ROW = UsageRow("2026-01-01", "owner", "alice", "cheap", Usage(1234, 1, 2, 30, 5))
LIMIT = ComputeLimit(per_minute=1, burst=10_000)


async def test_a_charge_id_counts_once(store: StateStore) -> None:
    """The same usage, settlement or admission sent twice under one id counts once; another id counts again."""
    one, other = cid(), cid()
    assert await store.record_usage(ROW, one)
    assert not await store.record_usage(ROW, one)
    assert await store.record_usage(ROW, other)
    today, total = await store.usage_of("owner", "2026-01-01")
    assert today == total == ROW.usage.plus(ROW.usage)
    assert await store.counted([one, other, cid()]) == [True, True, False]

    first = await store.admit("k", 600, 10, LIMIT, 4000, one)
    again = await store.admit("k", 600, 10, LIMIT, 4000, one)  # the reply was lost: the same decision, no spend
    assert first == again and first.allowed
    assert (await store.quota_left("k", 600, 10, LIMIT)).compute == 6000
    refused = await store.admit("k", 600, 10, LIMIT, 7000, other)
    assert not refused.allowed and await store.admit("k", 600, 10, LIMIT, 7000, other) == refused

    await store.settle("k", LIMIT, -1000, one)
    await store.settle("k", LIMIT, -1000, one)
    assert (await store.quota_left("k", 600, 10, LIMIT)).compute == 7000


class LostReply:
    """A Redis script whose first ``n`` calls run and then time out on the way back, as a busy Redis does."""

    def __init__(self, script: Any, n: int) -> None:
        self.script, self.left = script, n

    async def __call__(self, **kw: Any) -> Any:
        out = await self.script(**kw)
        if self.left:
            self.left -= 1
            raise RedisTimeoutError("Timeout reading from socket")
        return out


async def test_redis_sends_a_write_again_when_its_reply_is_lost(redis_url: str) -> None:
    """Writes whose replies time out are sent again under their ids: counted once, not reported lost; a write
    that never gets a reply is reported (StateUnavailable) so that it goes to the journal."""
    s = RedisState(StateConfig(redis_url=redis_url))
    await s._redis.flushdb()
    try:
        s._usage = LostReply(s._usage, 2)
        assert await s.record_usage(ROW, "u1") is False  # the first try landed; the third finds it counted
        assert (await s.usage_of("owner", "2026-01-01"))[0] == ROW.usage
        s._admit = LostReply(s._admit, 1)
        assert (await s.admit("k", 600, 10, LIMIT, 4000, "a1")).allowed
        assert (await s.quota_left("k", 600, 10, LIMIT)).compute == 6000  # spent once
        s._settle = LostReply(s._settle, 1)
        await s.settle("k", LIMIT, -4000, "a1")
        assert (await s.quota_left("k", 600, 10, LIMIT)).compute == 10_000
        s._usage = LostReply(s._usage, 3)
        with pytest.raises(StateUnavailable):
            await s.record_usage(ROW, "u2")
        assert await s.counted(["u1", "u2"]) == [True, True]  # it landed: a replay of u2 will not count it again
    finally:
        await s.close()


class FailingAfter:
    """A store that takes ``n`` usage records, then is unreachable."""

    def __init__(self, inner: StateStore, n: int) -> None:
        self.inner, self.left = inner, n

    async def record_usage(self, row: UsageRow, charge_id: str) -> bool:
        if not self.left:
            raise StateUnavailable("redis: connection refused")
        self.left -= 1
        return await self.inner.record_usage(row, charge_id)


async def test_the_journal_replays_each_line_once(tmp_path: Path) -> None:
    """Lines replayed into a store that goes away midway stay for the next replay, which sends the rest; a
    second process's file in the same folder is replayed too; an unreadable line is skipped, not fatal."""
    journal = UsageJournal(tmp_path, 1 << 20)
    rows = [UsageRow("2026-01-01", "owner", "alice", "cheap", Usage(1000 + i, 1, 1, 10, 0)) for i in range(5)]
    for i, row in enumerate(rows):
        assert await asyncio.to_thread(journal.append, Entry(f"c{i}", row))
    other = tmp_path / "usage-~dead-1.jsonl"  # a replica that died with a line in its journal (read last)
    late = UsageRow("2026-01-01", "owner", "alice", "quality", Usage(7, 1, 1, 1, 0))
    other.write_text(Entry("c-other", late).line() + "not json\n")
    assert journal.pending() == 7 and journal.waiting()

    store = MemoryState(StateConfig())
    with pytest.raises(StateUnavailable):
        await journal.replay(FailingAfter(store, 2))  # type: ignore[arg-type]
    assert journal.pending() == 5
    assert await journal.replay(store) == 5  # this file's last three, then the other's two (one unreadable)
    assert journal.pending() == 0 and not journal.waiting() and await journal.replay(store) == 0
    today, _ = await store.usage_of("owner", "2026-01-01")
    assert today == Usage(sum(r.usage.units for r in rows) + 7, 6, 6, 51, 0)


def test_a_full_journal_takes_no_more(tmp_path: Path) -> None:
    line = Entry("c0", ROW).line()
    journal = UsageJournal(tmp_path, len(line.encode()) * 2)
    assert journal.append(Entry("c0", ROW)) and journal.append(Entry("c1", ROW))
    assert not journal.append(Entry("c2", ROW))
    assert journal.pending() == 2


def journaled_config(redis_url: str, journal: Path) -> str:
    d = config_dict()
    d["state"] = {"redis_url": redis_url, "on_error": "open", "journal_dir": str(journal)}
    return toml_of(d)


def test_a_replica_killed_with_a_full_journal_replays_it_when_it_starts(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Redis away: a server failing open answers and journals the usage; SIGKILLed before Redis is back, its lines
    stay on disk; a new server on the same folder replays them once Redis answers. The usage then equals the
    charges of every answer, to the milli-unit, and the journal is empty."""
    redis = RedisServer(tmp_path / "redis")
    journal = tmp_path / "journal"
    config = journaled_config(redis.url, journal)
    redis.start()
    charges: list[int] = []
    try:
        with start_server(tiny_checkpoint, config, tmp_path / "first") as first:
            redis.stop()
            with httpx.Client(base_url=first.url, timeout=30) as c:
                for i in range(8):
                    r = c.post("/classify", json={"texts": ["a short text"] * (1 + i % 3)}, headers=headers("cheap"))
                    assert r.status_code == 200, r.text
                    charges.append(round(r.json()["charge"] * 1000))
            assert UsageJournal(journal, 1 << 20).pending() == 8
            # the access line follows the answer: wait for the last one, so that the log holds all eight
            assert asyncio.run(_until(lambda: first.logs().count('"charge_id"') == 8)), first.logs()[-2000:]
            os.killpg(first.proc.pid, signal.SIGKILL)  # no drain: the journal is all that is left
            first.proc.wait(10)
        redis.start()
        with start_server(tiny_checkpoint, config, tmp_path / "second") as second:
            assert asyncio.run(_until(lambda: UsageJournal(journal, 1 << 20).pending() == 0)), "not replayed"
            r = httpx.get(f"{second.url}/v1/usage", headers=headers("cheap"), timeout=30)
            assert r.status_code == 200, r.text
            today = r.json()["today"]
            assert today["requests"] == 8 and round(today["units"] * 1000) == sum(charges), (today, charges)
            replayed = [json.loads(line) for line in (tmp_path / "second" / "server.log").read_text().splitlines()
                        if "sent to the state store" in line]
            assert replayed
        # the access logs and the store agree answer by answer; an answer the store lacks is named, exit 1
        logs = [str(tmp_path / "first" / "server.log"), str(tmp_path / "second" / "server.log")]
        config_file = str(tmp_path / "first" / "service.toml")
        ok = reconcile(config_file, logs)
        assert ok.returncode == 0, ok.stderr
        (row,) = [json.loads(line) for line in ok.stdout.splitlines()]
        assert row["answered"] == 8 and row["missing"] == 0 and row["store_minus_log_units"] == 0, row
        forged = tmp_path / "forged.log"
        forged.write_text(json.dumps({"status": 200, "key_name": row["key"], "charge": 1.5,
                                      "charge_id": "f" * 32, "ts": "2026-01-01T00:00:00Z"}) + "\n")
        bad = reconcile(config_file, [*logs, str(forged)])
        assert bad.returncode == 1 and f"charge {'f' * 32}, 1.5 compute units" in bad.stderr, bad.stderr
    finally:
        redis.stop()


def reconcile(config: str, logs: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "headbudget.cli", "usage", "--config", config, "--format", "jsonl",
                           "--reconcile", *logs], capture_output=True, text=True, timeout=60)


async def _until(check: Callable[[], bool], timeout_s: float = 20) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.1)
    return True

