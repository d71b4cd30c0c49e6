"""The books under faults, against real Redis and real servers (smoke checkpoint): every case's usage equals what
its clients were answered, to the milli-unit, and what went through the journal is counted once."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import httpx
import pytest

from headbudget.loadtest import faults
from headbudget.loadtest.faults import main


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed (make system-deps)")
def test_usage_equals_the_answers_through_a_stall_and_a_killed_server(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    rc = main(["--model", str(smoke_checkpoint), "--out", str(out), "--case", "redis_stall", "--case",
               "server_killed_with_journal", "--users", "2", "--down-seconds", "1", "--precision", "fp32"])
    doc = json.loads(out.read_text())
    assert rc == 0, doc
    stall, killed = doc["cases"]
    assert [stall["case"], killed["case"]] == ["redis_stall", "server_killed_with_journal"]
    for row in (stall, killed):
        assert row["answered"] > 0 and row["diff_units"] == 0 and row["usage_units"] == row["answered_units"], row
    assert killed["journal_replayed"] > 0  # answered while Redis was away, replayed by the next server
    assert {"machine", "date", "commit", "command"} <= set(doc)


def test_a_folder_that_is_no_checkpoint_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "f.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a checkpoint folder" in err


def test_the_usage_query_waits_out_the_rate_limit_the_load_left(monkeypatch: pytest.MonkeyPatch) -> None:
    # The load spends the key's request rate; the query after it must not fail on that 429.
    answers = [httpx.Response(429, headers={"retry-after": "0"}), httpx.Response(429, headers={"retry-after": "0"}),
               httpx.Response(200, json={"today": {"units": 12.345}})]
    asked: list[str] = []

    def get(url: str, **kwargs: object) -> httpx.Response:
        asked.append(url)
        r = answers.pop(0)
        r.request = httpx.Request("GET", url)
        return r

    monkeypatch.setattr(faults.httpx, "get", get)
    assert faults._usage_units("http://h", "k") == 12345 and asked == ["http://h/v1/usage"] * 3
    answers[:] = [httpx.Response(429, headers={"retry-after": "0"})] * 2 + [httpx.Response(503)]
    with pytest.raises(httpx.HTTPStatusError):  # what is not a 429 is still an error
        faults._usage_units("http://h", "k")
