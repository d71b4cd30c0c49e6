"""The server CPU tool, tiny, against real servers (smoke checkpoint): the file's shape, and its parts add up
(values, not speed)."""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

import pytest

from headbudget.loadtest.server_cpu import main


def _data(folder: Path) -> Path:
    folder.mkdir()
    with open(folder / "test.csv", "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "label"])
        w.writeheader()
        w.writerows({"text": f"red marker four pink blue {i} green marker two", "label": "0"} for i in range(8))
    return folder


def test_writes_cpu_per_request_by_budget_for_both_runs(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "server-cpu.json"
    rc = main(["--model", str(smoke_checkpoint), "--data", str(_data(tmp_path / "data")), "--precision", "int8",
               "--budgets", "1.0,0.25", "--requests", "3", "--rounds", "3", "--seconds", "0.5", "--users", "2",
               "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["precision"] == "int8" and doc["metered"] is True and doc["budgets"] == ["1.0", "0.25"]
    assert {"cpu", "date", "commit", "command"} <= set(doc) and "--budgets 1.0,0.25" in doc["command"]
    seq, load = doc["runs"]
    for key in ("workers", "cpu_ms_per_request", "engine_ms_per_request", "non_engine_ms_per_request",
                "loop_thread_ms_per_request"):
        assert doc[key] == seq[key]  # the top level: the sequential run's figures, by budget
    assert (seq["workers"], seq["clients"], seq["mode"]) == (1, 1, "sequential")
    assert (load["workers"], load["mode"]) == (2, "closed_loop") and load["clients"] == 2
    assert seq["n_requests"] == 3 * 2 * 3 and load["n_requests"] > 0
    assert doc["n_requests"] == seq["n_requests"] + load["n_requests"]
    for run in (seq, load):
        assert run["non_200"] == 0 and len(run["rounds"]) == 3
        assert [r["order"] for r in run["rounds"]] == [["1.0", "0.25"], ["0.25", "1.0"], ["1.0", "0.25"]]
        for b in ("1.0", "0.25"):
            steps = [r["steps"][b] for r in run["rounds"]]
            for s in steps:  # each step's parts add up
                assert s["cpu_ms_per_request"] == pytest.approx(s["engine_ms_per_request"] + s["non_engine_ms_per_request"])
                assert s["engine_ms_per_request"] > 0
                # the event loops' threads are part of the server's CPU, read inside the same window
                assert 0 < s["loop_thread_ms_per_request"] < s["cpu_ms_per_request"]
            assert run["non_engine_ms_per_request"][b] == statistics.median(s["non_engine_ms_per_request"] for s in steps)
            assert run["engine_ms_per_request"][b] == statistics.median(s["engine_ms_per_request"] for s in steps)
            assert run["loop_thread_ms_per_request"][b] == statistics.median(
                s["loop_thread_ms_per_request"] for s in steps)
            assert run["cpu_ms_per_request"][b] == pytest.approx(
                run["engine_ms_per_request"][b] + run["non_engine_ms_per_request"][b])
        assert run["b025_over_b1"] == pytest.approx(run["cpu_ms_per_request"]["0.25"] / run["cpu_ms_per_request"]["1.0"])


@pytest.mark.parametrize("flags", [["--budgets", "1,abc"], ["--budgets", "0.05"], ["--budgets", "1,1"],
                                   ["--rounds", "0"], ["--seconds", "0"]])
def test_bad_input_is_one_line(flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "x.json"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("server_cpu: error:") and err.count("\n") == 1


def test_missing_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--data", str(tmp_path), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("server_cpu: error:") and err.count("\n") == 1
