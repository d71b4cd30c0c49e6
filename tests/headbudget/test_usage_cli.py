"""`headbudget usage`: usage per key and UTC day from Redis as CSV or JSON lines, filtered by day and key; bad
input (no Redis configured, Redis unreachable, malformed dates, unknown key names) is one line and exit 2."""

from __future__ import annotations

import asyncio
import csv
import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from headbudget.cli import main
from headbudget.service.accounting.auth import hash_key
from headbudget.service.settings import StateConfig
from headbudget.service.state.redis_store import RedisState
from headbudget.service.state.store import Usage, UsageRow
from tests.service.conftest import KEYS, cid, config_dict, redis_process, toml_of

ALICE, BOB = hash_key(KEYS["cheap"])[:16], hash_key(KEYS["quality"])[:16]


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A service config whose Redis holds three days of usage of two keys (and of a key no longer configured)."""
    tmp = tmp_path_factory.mktemp("usage")
    with redis_process(tmp / "redis") as (url, _):
        d = config_dict()
        d["state"] = {"redis_url": url}
        path = tmp / "service.toml"
        path.write_text(toml_of(d))

        async def fill() -> None:
            s = RedisState(StateConfig(redis_url=url))
            await s._redis.flushdb()
            for day in ("2026-03-01", "2026-03-02", "2026-03-03"):
                await s.record_usage(UsageRow(day, ALICE, "test-cheap", "cheap", Usage(1234, 2, 3, 40, 567)), cid())
                await s.record_usage(UsageRow(day, BOB, "test-quality", "quality", Usage(1000, 1, 1, 10, 0)), cid())
            await s.record_usage(UsageRow("2026-03-02", "0" * 16, "gone", "cheap", Usage(1, 1, 1, 1, 0)), cid())
            await s.close()

        asyncio.run(fill())
        yield path


def usage(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["usage", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_csv_lists_every_key_and_day(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = usage(capsys, "--config", str(config))
    assert code == 0 and err == ""
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [(r["day"], r["key"]) for r in rows] == [
        ("2026-03-01", "test-cheap"), ("2026-03-01", "test-quality"), ("2026-03-02", "gone"),
        ("2026-03-02", "test-cheap"), ("2026-03-02", "test-quality"), ("2026-03-03", "test-cheap"),
        ("2026-03-03", "test-quality")]
    assert rows[0] == {"day": "2026-03-01", "key": "test-cheap", "owner": ALICE, "tier": "cheap", "units": "1.234",
                       "requests": "2", "texts": "3", "tokens": "40", "saved_units": "0.567"}


def test_jsonl_by_day_and_key(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = usage(capsys, "--config", str(config), "--since", "2026-03-02", "--until", "2026-03-02",
                         "--key", "test-quality", "--key", "gone", "--format", "jsonl")
    assert code == 0
    rows = [json.loads(line) for line in out.splitlines()]
    assert rows == [{"day": "2026-03-02", "key": "gone", "owner": "0" * 16, "tier": "cheap", "units": 0.001,
                     "requests": 1, "texts": 1, "tokens": 1, "saved_units": 0.0},
                    {"day": "2026-03-02", "key": "test-quality", "owner": BOB, "tier": "quality", "units": 1.0,
                     "requests": 1, "texts": 1, "tokens": 10, "saved_units": 0.0}]
    code, out, _ = usage(capsys, "--config", str(config), "--since", "2026-03-03", "--format", "jsonl")
    assert code == 0 and len(out.splitlines()) == 2
    code, out, _ = usage(capsys, "--config", str(config), "--since", "2030-01-01")
    assert code == 0 and out.splitlines() == ["day,key,owner,tier,units,requests,texts,tokens,saved_units"]


@pytest.mark.parametrize(("args", "message"), [
    (["--key", "mallory"], "no key named 'mallory' in "),
    (["--since", "2026-3-1"], "--since '2026-3-1': give a date as YYYY-MM-DD (UTC)"),
    (["--until", "2026-02-30"], "--until '2026-02-30': give a date as YYYY-MM-DD"),
    (["--since", "yesterday"], "--since 'yesterday': give a date"),
    (["--since", "20260301"], "--since '20260301': give a date"),
    (["--since", "2026-03-03", "--until", "2026-03-01"], "--since 2026-03-03 is after --until 2026-03-01"),
    (["--format", "xml"], "invalid choice: 'xml'"),
])
def test_bad_input_is_one_line_and_exit_2(config: Path, capsys: pytest.CaptureFixture[str], args: list[str],
                                          message: str) -> None:
    try:
        code, out, err = usage(capsys, "--config", str(config), *args)
    except SystemExit as e:  # argparse's own refusal (a choice): one line too
        code, (out, err) = int(str(e.code)), capsys.readouterr()
    assert code == 2 and out == "" and message in err and len(err.strip().splitlines()) == 1, err


def test_without_redis_or_with_redis_down(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plain = tmp_path / "plain.toml"
    plain.write_text(toml_of(config_dict()))
    code, out, err = usage(capsys, "--config", str(plain))
    assert code == 2 and out == "" and "has no [state] redis_url" in err and len(err.splitlines()) == 1
    d = config_dict()
    d["state"] = {"redis_url": "redis://:secret@127.0.0.1:1/0", "redis_timeout_s": 0.3}
    down = tmp_path / "down.toml"
    down.write_text(toml_of(d))
    code, out, err = usage(capsys, "--config", str(down))
    assert code == 2 and "cannot read usage from redis://***@127.0.0.1:1/0" in err and "secret" not in err
    code, _, err = usage(capsys, "--config", str(tmp_path / "missing.toml"))
    assert code == 2 and "does not exist" in err


def test_reconcile_reads_only_the_answers_a_server_logged(tmp_path: Path) -> None:
    """Answered requests with a charge id count; refusals, other lines and lines with a charge that is no number
    are skipped, never a traceback."""
    from headbudget.commands.usage import _answers

    log = tmp_path / "access.log"
    rows = [{"status": 200, "charge_id": "a1", "key_name": "alice", "charge": 1.5, "ts": "2026-03-01T10:00:00Z"},
            {"status": 429, "charge_id": "a2", "key_name": "alice", "charge": 0, "ts": "2026-03-01T10:00:01Z"},
            {"status": 200, "charge_id": "a3", "key_name": "alice", "charge": "x", "ts": "2026-03-01T10:00:02Z"},
            {"status": 200, "key_name": "alice", "charge": 2.0},
            {"status": 200, "charge_id": "b1", "key_name": "bob", "charge": 0.25, "ts": "2026-03-02T00:00:00Z"}]
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\nnot json\n" + '{"status": 200, "charge_id": "z", "charge": 1e999}\n')
    found = _answers([log])
    assert {k: a.charges for k, a in found.items()} == {"alice": {"a1": 1500}, "bob": {"b1": 250}}
    assert found["alice"].days == {"2026-03-01"}
