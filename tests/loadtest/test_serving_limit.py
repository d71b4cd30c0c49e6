"""The serving limit: the engine alone and a real server in one run (smoke checkpoint), the file's shape, and the
checks that put its rows beside the limit and the peer (values, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.loadtest.serving_limit import checks, main
from tests.loadtest.conftest import assert_one_line_error, data_folder


def test_one_run_writes_the_engine_alone_the_rows_and_the_checks(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "serving-limit.json"
    rc = main(["--model", str(smoke_checkpoint), "--data", str(data_folder(tmp_path / "data")), "--budgets", "1.0", "0.25",
               "--conc", "1", "2", "--seconds", "0.5", "--runs", "1", "--repeats", "3", "--server-cpu", "0",
               "--client-cpu", "0", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert {"cpu", "date", "commit", "command", "engine_alone", "rows", "peers", "checks"} <= set(doc)
    assert doc["workers"] == 1 and doc["peers"] == []
    alone = {e["budget"]: e for e in doc["engine_alone"]}
    assert {1.0, 0.25} <= set(alone)
    assert all(e["ms"] > 0 and e["answers_per_core_s"] == pytest.approx(1000 / e["ms"], rel=1e-3)
               for e in alone.values())
    assert sorted((r["budget"], r["conc"]) for r in doc["rows"]) == [(0.25, 1), (0.25, 2), (1.0, 1), (1.0, 2)]
    for r in doc["rows"]:
        assert r["server"] == "headbudget" and r["non_200"] == 0 and r["rps"] > 0
        assert 0 < r["engine_cpu_ms_per_answer"] < r["cpu_ms_per_answer"]
    assert [(c["server"], c["budget"], c["conc"]) for c in doc["checks"]] == [
        ("headbudget", 1.0, 1), ("headbudget", 1.0, 2), ("headbudget", 0.25, 1), ("headbudget", 0.25, 2)]


def test_checks_are_medians_beside_the_limit_and_the_peer() -> None:
    engine = [{"budget": 1.0, "ms": 4.0, "answers_per_core_s": 250.0},
              {"budget": 0.5, "ms": 2.0, "answers_per_core_s": 500.0}]
    rows = [{"server": "headbudget", "budget": 1.0, "conc": 8, "rps": r, "cpu_ms_per_answer": c}
            for r, c in ((200, 5.0), (220, 4.6))]
    rows += [{"server": "headbudget", "budget": 0.5, "conc": 8, "rps": 400, "cpu_ms_per_answer": 2.5},
             {"server": "peer", "budget": None, "conc": 8, "rps": 100, "cpu_ms_per_answer": 9.0},
             {"server": "peer", "budget": None, "conc": 8, "rps": 140, "cpu_ms_per_answer": 7.0}]
    rows += [{"server": "headbudget-before", "budget": 1.0, "conc": 8, "rps": 200, "cpu_ms_per_answer": 5.0}]
    out = checks(engine, rows)
    b1, half = [c for c in out if c["server"] == "headbudget"]
    assert b1 == {"server": "headbudget", "budget": 1.0, "conc": 8, "rps": 210, "cpu_ms_per_answer": 4.8,
                  "share_of_engine_limit": 0.84, "rest_ms": 0.8, "rest_over_b1_pass": 0.2, "cpu_over_b1": 1.0,
                  "over_peer": 1.75, "rps_over_before": 1.05, "cpu_over_before": 0.96}
    assert "rps_over_before" not in half  # no earlier row at b = 0.5
    assert [c["server"] for c in out] == ["headbudget", "headbudget", "headbudget-before"]
    assert half["share_of_engine_limit"] == 0.8 and half["rest_ms"] == 0.5 and half["rest_over_b1_pass"] == 0.125
    assert half["cpu_over_b1"] == round(2.5 / 4.8, 3) and half["over_peer"] == round(400 / 120, 2)


@pytest.mark.parametrize("flags", [["--model", "/nonexistent"], ["--budgets", "0.05"],
                                   ["--peer-python", "/nonexistent/python"], ["--out", "/nonexistent/x.json"]])
def test_bad_input_is_one_line(flags: list[str], smoke_checkpoint: Path, tmp_path: Path,
                               capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--model": str(smoke_checkpoint), "--data": str(data_folder(tmp_path / "d")),
            "--out": str(tmp_path / "x.json"), flags[0]: flags[1]}
    assert_one_line_error(main, [x for kv in args.items() for x in kv], "serving_limit", capsys)
