"""Keys that end: `headbudget keys revoke` and `--expires`, the config fields behind them, and a running server
(every worker) that refuses a revoked key after SIGHUP and an expired key from the moment it expires."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.cli import main
from headbudget.service.accounting.auth import hash_key, identify
from headbudget.service.errors import Unauthorized
from headbudget.service.settings import ConfigError, load_config, parse_config
from tests.service.conftest import (
    KEYS,
    Server,
    config_dict,
    engine_factory_available,
    running_app,
    start_server,
    toml_of,
)
from tests.service.test_api import error_of

ROOT = Path(__file__).resolve().parents[2]
ALICE = "hb_test_alice_key_00000000000000000000"
OLD = "hb_test_old_key_0000000000000000000000"


def with_key(**entry: Any) -> dict[str, Any]:
    d = config_dict()
    d["keys"].append({"sha256": hash_key(ALICE), "tier": "cheap", "name": "alice", **entry})
    return d


# -- the config fields -------------------------------------------------------------------------------------
@pytest.mark.parametrize("given, instant", [
    (date(2030, 1, 2), datetime(2030, 1, 2, tzinfo=UTC)),  # a TOML date: 00:00 UTC that day
    (datetime(2030, 1, 2, 3, 4, 5), datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),  # a local datetime: UTC
    (datetime(2030, 1, 2, 5, 4, 5, tzinfo=timezone(timedelta(hours=2))), datetime(2030, 1, 2, 3, 4, 5, tzinfo=UTC)),
    ("2030-01-02", datetime(2030, 1, 2, tzinfo=UTC)),
    ("2030-01-02T12:00:00+02:00", datetime(2030, 1, 2, 10, tzinfo=UTC)),
    ("2030-01-02T12:00:00Z", datetime(2030, 1, 2, 12, tzinfo=UTC)),
])
def test_expires_is_one_utc_instant(given: object, instant: datetime) -> None:
    expires = parse_config(with_key(expires=given)).keys[-1].expires
    assert expires == instant and expires is not None and expires.utcoffset() == timedelta(0)


@pytest.mark.parametrize("entry, message", [
    ({"expires": "soon"}, "expires"),
    ({"expires": "2030-13-01"}, "expires"),
    ({"expires": 1893456000}, "expires"),  # a number is not read as Unix seconds: too easy to get wrong
    ({"revoked": "yes"}, "revoked"),
    ({"revoked_at": "2030-01-01T00:00:00Z"}, "revoked_at is set but revoked is not true"),
    ({"sha256": hash_key(KEYS["cheap"])}, "listed more than once"),
])
def test_bad_key_fields_are_refused_with_one_line(entry: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        parse_config(with_key(**entry))
    assert "\n" not in str(e.value)


def test_toml_dates_load(tmp_path: Path) -> None:
    path = tmp_path / "service.toml"
    path.write_text(toml_of(config_dict()) + f'[[keys]]\nsha256 = "{hash_key(ALICE)}"\ntier = "cheap"\n'
                    "expires = 2030-01-02\nrevoked = true\nrevoked_at = 2029-05-06T07:08:09Z\n")
    key = load_config(path).keys[-1]
    assert key.expires == datetime(2030, 1, 2, tzinfo=UTC) and key.revoked
    assert key.revoked_at == datetime(2029, 5, 6, 7, 8, 9, tzinfo=UTC)


def test_identify_refuses_revoked_and_expired_keys() -> None:
    moment = datetime(2030, 1, 2, tzinfo=UTC).timestamp()
    expiring = parse_config(with_key(expires="2030-01-02T00:00:00Z"))
    assert identify(expiring, {}, ALICE, "c", now=moment - 0.001).name == "alice"
    with pytest.raises(Unauthorized, match="expired at 2030-01-02T00:00:00Z"):
        identify(expiring, {}, ALICE, "c", now=moment)  # from the instant itself
    revoked = parse_config(with_key(revoked=True, expires="2030-01-02"))
    with pytest.raises(Unauthorized, match="revoked"):  # a revocation outranks the expiry
        identify(revoked, {}, ALICE, "c", now=moment + 1)
    assert identify(revoked, {}, KEYS["cheap"], "c").tier.name == "cheap"  # other keys unaffected
    assert [k.state(moment) for k in (expiring.keys[-1], revoked.keys[-1])] == ["expired", "revoked"]


def test_every_one_of_many_keys_is_found_as_itself() -> None:
    keys = [f"hb_test_many_{i:05d}_{'0' * 20}" for i in range(2000)]
    doc = config_dict()
    doc["keys"] = [{"sha256": hash_key(k), "tier": ("cheap", "quality")[i % 2], "name": f"k{i}"}
                   for i, k in enumerate(keys)]
    config = parse_config(doc)
    for i in (0, 1, 999, 1999):
        caller = identify(config, {}, keys[i], "c")
        assert (caller.name, caller.tier.name) == (f"k{i}", ("cheap", "quality")[i % 2])
    with pytest.raises(Unauthorized, match="unknown API key"):
        identify(config, {}, keys[0] + "x", "c")


@pytest.mark.anyio
@pytest.mark.parametrize("fast_path", [True, False])
async def test_revoked_and_expired_keys_get_401_on_both_request_paths(fast_path: bool) -> None:
    d = with_key(revoked=True)
    d["server"]["fast_path"] = fast_path
    d["keys"] += [{"sha256": hash_key(OLD), "tier": "cheap", "name": "old", "expires": "2020-01-01"},
                  {"sha256": hash_key(OLD + "x"), "tier": "cheap", "name": "later", "expires": "2999-01-01"}]
    async with running_app(parse_config(d)) as (client, _, _):
        for key, status, words in [(ALICE, 401, "revoked"), (OLD, 401, "expired at 2020-01-01T00:00:00Z"),
                                   (OLD + "x", 200, "")]:
            r = await client.post("/classify", json={"text": "x"}, headers={"X-API-Key": key})
            assert r.status_code == status, r.text
            if status == 401:
                assert error_of(r)["code"] == "unauthorized" and words in error_of(r)["message"]
                assert r.headers["www-authenticate"].startswith("Bearer")
            tei = await client.post("/predict", json={"inputs": "x"}, headers={"X-API-Key": key})
            assert tei.status_code == status, tei.text


@pytest.mark.anyio
async def test_reload_applies_a_revocation_and_refuses_bad_key_fields(tmp_path: Path) -> None:
    path = tmp_path / "service.toml"
    async with running_app(parse_config(with_key())) as (client, app, _):
        runtime = app.state.runtime
        runtime.config_path = path
        path.write_text(toml_of(with_key(revoked=True, expires="whenever")))
        assert runtime.reload() is False  # the whole file is refused, its revocation included
        assert (await client.post("/classify", json={"text": "x"}, headers={"X-API-Key": ALICE})).status_code == 200
        path.write_text(toml_of(with_key(revoked=True)))
        assert runtime.reload() is True
        assert (await client.post("/classify", json={"text": "x"}, headers={"X-API-Key": ALICE})).status_code == 401


# -- the command -------------------------------------------------------------------------------------------
def keys(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """Run `headbudget keys ...` in process: (exit code, stdout, stderr)."""
    try:
        code = main(["keys", *argv])
    except SystemExit as e:  # argparse's own refusals
        code = int(e.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "service.toml"
    path.write_text((ROOT / "service.toml").read_text())
    return path


def test_add_with_expiry_list_and_revoke(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, key, _ = keys(capsys, "add", "--tier", "cheap", "--name", "alice", "--config", str(config))
    assert code == 0
    code, later, err = keys(capsys, "add", "--tier", "balanced", "--name", "bob", "--expires", "2999-12-31",
                            "--config", str(config))
    assert code == 0 and "2999-12-31T00:00:00Z" in err
    code, _, _ = keys(capsys, "add", "--tier", "quality", "--name", "carol", "--expires",
                      "2999-06-01T12:30:00+02:00", "--config", str(config))
    assert code == 0
    loaded = load_config(config)
    assert [(k.name, k.expires) for k in loaded.keys] == [
        ("alice", None), ("bob", datetime(2999, 12, 31, tzinfo=UTC)), ("carol", datetime(2999, 6, 1, 10, 30, tzinfo=UTC))]
    assert loaded.keys[1].sha256 == hash_key(later.strip())

    code, _, err = keys(capsys, "revoke", "--name", "alice", "--config", str(config))
    assert code == 0 and "revoked" in err and "SIGHUP" in err
    code, _, _ = keys(capsys, "revoke", "--sha256", hash_key(later.strip())[:8].upper(), "--config", str(config))
    assert code == 0
    alice, bob, carol = load_config(config).keys
    assert alice.revoked and bob.revoked and not carol.revoked
    assert alice.revoked_at is not None and abs(alice.revoked_at.timestamp() - time.time()) < 60
    with pytest.raises(Unauthorized, match="revoked"):
        identify(load_config(config), {}, key.strip(), "c")

    code, out, _ = keys(capsys, "list", "--config", str(config))
    rows = {line.split()[4]: line.split() for line in out.splitlines()[1:]}
    assert code == 0 and out.splitlines()[0].split() == ["sha256", "tier", "state", "expires", "name"]
    assert rows["alice"][2:4] == ["revoked", "-"] and rows["bob"][2:4] == ["revoked", "2999-12-31T00:00:00Z"]
    assert rows["carol"][2:4] == ["active", "2999-06-01T10:30:00Z"]

    before = config.read_text()
    code, _, err = keys(capsys, "revoke", "--name", "alice", "--config", str(config))
    assert code == 0 and "already revoked" in err and config.read_text() == before  # idempotent


def test_rotating_a_key_under_the_same_name(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A second key named like a live one is allowed (rotation) with a note that --name no longer picks one."""
    assert keys(capsys, "add", "--tier", "cheap", "--name", "ci", "--config", str(config))[0] == 0
    code, new, err = keys(capsys, "add", "--tier", "cheap", "--name", "ci", "--config", str(config))
    assert code == 0 and "also named 'ci'" in err
    old = load_config(config).keys[0]
    assert keys(capsys, "revoke", "--sha256", old.sha256[:12], "--config", str(config))[0] == 0
    assert [k.revoked for k in load_config(config).keys] == [True, False]
    assert identify(load_config(config), {}, new.strip(), "c").name == "ci"


def test_list_shows_an_expired_key(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with config.open("a") as f:
        f.write(f'\n[[keys]]\nsha256 = "{hash_key(OLD)}"\ntier = "cheap"\nname = "old"\nexpires = 2020-01-01\n')
    code, out, _ = keys(capsys, "list", "--config", str(config))
    assert code == 0 and out.splitlines()[1].split() == [hash_key(OLD)[:12], "cheap", "expired",
                                                         "2020-01-01T00:00:00Z", "old"]


def test_revoke_edits_only_its_entry_and_keeps_comments(config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = config.read_text() + (
        f'\n[[keys]]  # first\nsha256 = "{hash_key(OLD)}"\ntier = "cheap"\nname = "old"   # the old one\n'
        f"revoked = false\n\n# a comment about the next key\n[[keys]]\nsha256 = \"{hash_key(ALICE)}\"\n"
        'tier = "cheap"\nname = "alice"')  # no newline at the end of the file
    config.write_text(text)
    assert keys(capsys, "revoke", "--name", "old", "--config", str(config))[0] == 0
    assert keys(capsys, "revoke", "--name", "alice", "--config", str(config))[0] == 0
    new = config.read_text()
    assert "# a comment about the next key\n[[keys]]" in new and "# the old one" in new
    assert "revoked = false" not in new and new.count("\nrevoked = true\n") == 2
    old_doc, new_doc = tomllib.loads(text), tomllib.loads(new)
    assert {k: v for k, v in new_doc.items() if k != "keys"} == {k: v for k, v in old_doc.items() if k != "keys"}
    assert [(k["name"], k["revoked"]) for k in new_doc["keys"]] == [("old", True), ("alice", True)]
    assert [k.name for k in load_config(config).keys] == ["old", "alice"]


@pytest.mark.parametrize("argv, words", [
    (["revoke", "--name", "nobody"], "no key is named 'nobody'"),
    (["revoke", "--name", "twin"], "2 keys are named 'twin'"),
    (["revoke", "--sha256", "abc"], "at least 6 hex digits"),
    (["revoke", "--sha256", "not-hex-at-all"], "at least 6 hex digits"),
    (["revoke", "--sha256", "ffffffffff"], "no key's sha256 starts with"),
    (["revoke", "--sha256", "abcdef"], "2 keys' sha256 start with 'abcdef'"),
    (["revoke", "--name", "twin", "--config", "/nonexistent/service.toml"], "does not exist"),
    (["revoke"], "one of the arguments --name --sha256 is required"),
    (["add", "--tier", "cheap", "--expires", "next tuesday"], "give a date (2026-12-31) or an ISO datetime"),
    (["add", "--tier", "cheap", "--expires", "2030-02-30"], "give a date"),
    (["add", "--tier", "cheap", "--expires", "2020-01-01"], "is not in the future"),
    (["add", "--tier", "gold"], "tier 'gold' is not defined"),
    (["list", "--config", "/nonexistent/service.toml"], "does not exist"),
])
def test_bad_input_gets_one_line_and_exit_2(config: Path, capsys: pytest.CaptureFixture[str], argv: list[str],
                                            words: str) -> None:
    # two keys named alike, and two whose hashes share their first 6 digits
    entries = [(hash_key("hb_twin_1"), "twin"), (hash_key("hb_twin_2"), "twin"),
               ("abcdef" + "0" * 58, "first"), ("abcdef" + "1" * 58, "second")]
    with config.open("a") as f:
        for h, name in entries:
            f.write(f'\n[[keys]]\nsha256 = "{h}"\ntier = "cheap"\nname = "{name}"\n')
    before = config.read_text()
    if "--config" not in argv:
        argv += ["--config", str(config)]
    code, out, err = keys(capsys, *argv)
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (out, err)
    assert words in err and config.read_text() == before
    assert not list(config.parent.glob(".*.tmp"))  # no temporary file left behind


def test_a_layout_it_cannot_edit_is_left_unchanged(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = config_dict()
    path = tmp_path / "service.toml"
    body = toml_of({k: v for k, v in d.items() if k != "keys"})
    inline = ", ".join(f'{{sha256 = "{k["sha256"]}", tier = "{k["tier"]}", name = "{k["name"]}"}}' for k in d["keys"])
    path.write_text(f"keys = [{inline}]\n" + body)
    before = path.read_text()
    code, _, err = keys(capsys, "revoke", "--name", "test-cheap", "--config", str(path))
    assert code == 2 and "edit" in err and path.read_text() == before


def test_a_symlinked_config_keeps_its_link(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    link = tmp_path / "link.toml"
    link.symlink_to(config)
    config.chmod(0o640)
    assert keys(capsys, "add", "--tier", "cheap", "--name", "via-link", "--config", str(link))[0] == 0
    assert link.is_symlink() and [k.name for k in load_config(config).keys] == ["via-link"]
    assert config.stat().st_mode & 0o777 == 0o640


# -- a real server with two workers ------------------------------------------------------------------------
def reload_lines(server: Server) -> tuple[int, int]:
    """(config reloads done, reloads refused) so far, counted over every worker's log lines."""
    msgs = [json.loads(line).get("msg", "") for line in server.logs().splitlines() if line.startswith("{")]
    return (sum(m == "config reloaded" for m in msgs),
            sum(m.startswith("config reload failed") for m in msgs))


def sighup_and_wait(server: Server, workers: int, *, refused: bool = False) -> None:
    """SIGHUP the server and wait until every worker has logged its reload (or its refusal)."""
    done, failed = reload_lines(server)
    os.kill(server.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        now = reload_lines(server)
        if (now[1] if refused else now[0]) >= (failed if refused else done) + workers:
            assert now[1 - int(refused)] == (done if refused else failed)  # no worker went the other way
            return
        time.sleep(0.1)
    raise AssertionError(f"not every worker logged its reload: {reload_lines(server)}\n{server.logs()[-2000:]}")


def worker_pids(server: Server) -> list[int]:
    """The live workers of the server (their 'ready' log lines, children of the supervisor)."""
    pids = [json.loads(line)["pid"] for line in server.logs().splitlines()
            if line.startswith("{") and json.loads(line).get("msg") == "ready"]
    return [p for p in pids if Path(f"/proc/{p}/stat").exists()
            and int(Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1]) == server.proc.pid]


@contextlib.contextmanager
def only_worker(pids: list[int], pid: int) -> Iterator[None]:
    """Every other worker stopped (SIGSTOP), so that new connections can only be accepted by ``pid``. Kept short:
    the supervisor kills a worker that misses its health check for 5 s."""
    others = [p for p in pids if p != pid]
    for p in others:
        os.kill(p, signal.SIGSTOP)
    try:
        yield
    finally:
        for p in others:
            os.kill(p, signal.SIGCONT)


def per_worker(server: Server, pids: list[int], key: str, n: int = 3) -> dict[int, list[tuple[int, str]]]:
    """``n`` requests with ``key`` answered by each worker in turn, each on a new connection:
    {pid: [(status, error message or ""), ...]}."""
    seen: dict[int, list[tuple[int, str]]] = {}
    for pid in pids:
        with only_worker(pids, pid):
            rs = [httpx.post(f"{server.url}/classify", json={"text": "x"}, headers={"X-API-Key": key}, timeout=3)
                  for _ in range(n)]
        seen[pid] = [(r.status_code, r.json()["error"]["message"] if r.status_code >= 400 else "") for r in rs]
    return seen


def statuses(seen: dict[int, list[tuple[int, str]]]) -> set[int]:
    return {status for answers in seen.values() for status, _ in answers}


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "headbudget.cli", "keys", *argv], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.slow
def test_two_workers_refuse_a_revoked_key_after_sighup_and_an_expired_key_on_time(tiny_checkpoint: Path,
                                                                                   tmp_path: Path) -> None:
    if (why := engine_factory_available()) is not None:
        pytest.skip(why)
    good = toml_of(with_key()) + (f'\n[[keys]]\nsha256 = "{hash_key(OLD)}"\ntier = "cheap"\nname = "old"\n'
                                  "expires = 2020-01-01\n")
    with start_server(tiny_checkpoint, good, tmp_path, workers=2) as s:
        deadline = time.monotonic() + 30
        while len(pids := worker_pids(s)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(pids) == 2, s.logs()[-2000:]
        assert statuses(per_worker(s, pids, ALICE)) == {200}
        assert statuses(per_worker(s, pids, OLD)) == {401}  # expired before the server started

        # A reload that the config refuses changes nothing, not even the valid revocation in the same file.
        s.config.write_text(toml_of(with_key(revoked=True)) + '\n[[keys]]\nsha256 = "' + hash_key("hb_x") +
                            '"\ntier = "cheap"\nexpires = "some day"\n')
        sighup_and_wait(s, 2, refused=True)
        assert all("expires" in m for m in (json.loads(line)["msg"] for line in s.logs().splitlines()
                                            if line.startswith("{") and "reload failed" in line))
        assert statuses(per_worker(s, pids, ALICE)) == {200}

        s.config.write_text(good)
        revoke = cli("revoke", "--name", "alice", "--config", str(s.config))
        assert revoke.returncode == 0, revoke.stderr
        assert statuses(per_worker(s, pids, ALICE)) == {200}  # nothing changes before the reload
        sighup_and_wait(s, 2)
        assert worker_pids(s) == pids  # reloaded in place, not restarted
        refused = per_worker(s, pids, ALICE)
        assert statuses(refused) == {401} and all("revoked" in m for a in refused.values() for _, m in a), refused
        assert statuses(per_worker(s, pids, KEYS["balanced"])) == {200}

        # An expiry takes effect at its instant, with no reload: a key that expires a few seconds from now.
        expires = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=12)
        add = cli("add", "--tier", "cheap", "--name", "brief", "--expires", expires.isoformat(), "--config",
                  str(s.config))
        assert add.returncode == 0, add.stderr
        brief = add.stdout.strip()
        sighup_and_wait(s, 2)
        reloads = reload_lines(s)
        assert statuses(per_worker(s, pids, brief)) == {200}
        assert time.time() < expires.timestamp(), "the machine was too slow to see the key before its expiry"
        time.sleep(max(0.0, expires.timestamp() - time.time()) + 0.2)
        expired = per_worker(s, pids, brief)
        assert statuses(expired) == {401} and all("expired" in m for a in expired.values() for _, m in a), expired
        assert reload_lines(s) == reloads and worker_pids(s) == pids
