"""The concurrency comparison against a real server (smoke checkpoint): the file's shape, the order of its steps,
and its figures read from the server's own counters (values, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.loadtest.concurrency import headbudget_target, main, plan
from headbudget.loadtest.service_bench import Server
from tests.loadtest.conftest import assert_one_line_error, data_folder


def test_rows_for_every_budget_concurrency_and_run(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "serving-concurrency.json"
    with Server(smoke_checkpoint, 1, precision="int8") as srv:
        rc = main(["--url", srv.url, "--pid", str(srv.proc.pid), "--data", str(data_folder(tmp_path / "data")),
                   "--budgets", "1.0", "0.25", "--conc", "1", "3", "--seconds", "0.5", "--runs", "2",
                   "--checkpoint", "smoke", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {"cpu", "date", "commit", "command"} <= set(doc) and doc["workers"] == 1 and "peer" not in doc
    rows = doc["rows"]
    assert sorted((r["budget"], r["conc"], r["run"]) for r in rows) == sorted(
        (b, c, r) for b in (1.0, 0.25) for c in (1, 3) for r in (1, 2))
    for r in rows:
        assert set(r) >= {"server", "budget", "conc", "run", "rps", "p50_ms", "p99_ms", "cpu_ms_per_answer",
                          "engine_cpu_ms_per_answer"}
        assert r["server"] == "headbudget" and r["non_200"] == 0 and r["rps"] > 0
        # the engine's passes are part of the server's CPU, both read around the same window
        assert 0 < r["engine_cpu_ms_per_answer"] < r["cpu_ms_per_answer"]
        assert r["p50_ms"] <= r["p99_ms"]


def test_the_wire_client_answers_as_httpx_does(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "serving-concurrency.json"
    with Server(smoke_checkpoint, 1, precision="int8") as srv:
        rc = main(["--url", srv.url, "--pid", str(srv.proc.pid), "--data", str(data_folder(tmp_path / "data")),
                   "--budgets", "0.25", "--conc", "1", "3", "--seconds", "0.5", "--runs", "1", "--client", "wire",
                   "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["client"] == "wire" and [r["conc"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        assert r["non_200"] == 0 and r["rps"] > 0 and 0 < r["engine_cpu_ms_per_answer"] < r["cpu_ms_per_answer"]


def test_each_run_rotates_the_order_of_its_steps() -> None:
    targets = [headbudget_target("http://x", 1, b, None) for b in (1.0, 0.5)]
    steps = [(t.budget, c, run) for t, c, run in plan(targets, [1, 8], 3)]
    assert steps[:4] == [(1.0, 1, 1), (1.0, 8, 1), (0.5, 1, 1), (0.5, 8, 1)]
    assert steps[4:8] == [(1.0, 8, 2), (0.5, 1, 2), (0.5, 8, 2), (1.0, 1, 2)]
    assert len(steps) == 12 and len(set(steps)) == 12


@pytest.mark.parametrize("flags", [["--budgets", "0.05"], ["--conc", "0"], ["--peer-url", "http://x"],
                                   ["--pid", "999999999"], ["--out", "/nonexistent/x.json"]])
def test_bad_input_is_one_line(flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--url": "http://127.0.0.1:9", "--pid": "1", "--data": str(data_folder(tmp_path / "d")),
            "--out": str(tmp_path / "x.json"), flags[0]: flags[1]}
    assert_one_line_error(main, [x for kv in args.items() for x in kv], "concurrency", capsys)
