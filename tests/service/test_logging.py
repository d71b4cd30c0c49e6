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
