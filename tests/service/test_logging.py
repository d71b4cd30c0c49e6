"""`serve --log-level` (and HEADBUDGET_LOG_LEVEL) reach the server process: at warning no request is logged."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import KEYS, config_dict, start_server, toml_of


def _access_lines(log: str) -> list[dict[str, object]]:
    return [rec for rec in (json.loads(ln) for ln in log.splitlines() if ln.startswith("{"))
            if rec.get("logger") == "headbudget.access"]


@pytest.mark.parametrize(("flags", "env", "logged"), [
    ((), {}, True),  # the default, info: every request
    (("--log-level", "warning"), {}, False),
    ((), {"HEADBUDGET_LOG_LEVEL": "warning"}, False),
    (("--log-level", "info"), {"HEADBUDGET_LOG_LEVEL": "warning"}, True),  # the flag wins over its variable
])
def test_the_log_level_decides_whether_requests_are_logged(
        tiny_checkpoint: Path, tmp_path: Path, flags: tuple[str, ...], env: dict[str, str], logged: bool) -> None:
    with start_server(tiny_checkpoint, toml_of(config_dict()), tmp_path, extra=flags, env=env) as server:
        r = httpx.post(f"{server.url}/classify?budget=0.5", json={"text": "log me or not"},
                       headers={"X-API-Key": KEYS["balanced"]}, timeout=30)
        assert r.status_code == 200, r.text
    log = server.logs()  # read once the server has exited: every line it wrote is in
    mine = [rec for rec in _access_lines(log) if rec.get("request_id") == r.headers["x-request-id"]]
    assert bool(mine) is logged, log[-2000:]
    if not logged:
        assert not [ln for ln in log.splitlines() if '"level": "info"' in ln], log[-2000:]


def test_access_records_go_to_their_file_as_the_json_formatter_writes_them(tmp_path: Path) -> None:
    import logging

    from headbudget.service import logs

    fields = {"request_id": "r1", "status": 200, "latency_ms": 1.5, "degraded": False, "tier": "cheap"}
    path = tmp_path / "logs" / "access.log"
    try:
        logs.configure_logging("INFO", path)
        logs.log_access(fields)
        logs.log_access({**fields, "request_id": "probe"}, quiet=True)  # probes and scrapes only at debug
        logs.configure_logging("DEBUG", path)  # reconfigured (a reload): the same file, appended
        logs.log_access({**fields, "request_id": "probe"}, quiet=True)
    finally:
        logs.configure_logging("WARNING")
    lines = path.read_text().splitlines()
    written = [json.loads(ln) for ln in lines]
    assert [r["request_id"] for r in written] == ["r1", "probe"] and [r["level"] for r in written] == ["info", "debug"]
    record = logging.LogRecord(logs.ACCESS.name, logging.INFO, "", 0, "request", (), None)
    record.__dict__.update(fields)
    formatted = json.loads(logs.JsonFormatter().format(record))
    assert written[0].keys() == formatted.keys()
    assert {k: v for k, v in written[0].items() if k != "ts"} == {k: v for k, v in formatted.items() if k != "ts"}
    assert len(written[0]["ts"]) == len(formatted["ts"]) and written[0]["ts"].endswith("Z")
    logs.log_access({**fields, "request_id": "after"})  # no file configured any more: nothing is appended
    assert path.read_text().splitlines() == lines


def test_an_access_log_file_is_written_at_any_log_level(tmp_path: Path) -> None:
    from headbudget.service import logs

    path = tmp_path / "access.log"
    try:
        logs.configure_logging("WARNING", path)  # quiet on stderr; the file asked for still gets every request
        assert logs.access_logged() and not logs.access_logged(quiet=True)
        logs.log_access({"request_id": "r1"})
        logs.log_access({"request_id": "probe"}, quiet=True)
        logs.configure_logging("WARNING")  # no file: the level decides again
        assert not logs.access_logged()
    finally:
        logs.configure_logging("WARNING")
    assert [json.loads(ln)["request_id"] for ln in path.read_text().splitlines()] == ["r1"]


def test_an_access_log_that_cannot_be_written_fails_no_request(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import os

    from headbudget.service import logs

    try:
        logs.configure_logging("INFO", tmp_path / "access.log")
        assert logs._access_file is not None  # noqa: SLF001
        os.close(logs._access_file.fd)  # noqa: SLF001 - as a full disk would, every write now fails
        logs._access_file.fd = os.open(os.devnull, os.O_RDONLY)  # noqa: SLF001
        logs.log_access({"request_id": "a"})  # no exception reaches the request
        logs.log_access({"request_id": "b"})
    finally:
        logs.configure_logging("WARNING")
    errors = [json.loads(ln) for ln in capsys.readouterr().err.splitlines() if ln.startswith("{")]
    assert [e["msg"].startswith("cannot write the access log") for e in errors] == [True]  # said once, not per request
