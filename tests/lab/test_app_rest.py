"""The in-process cost of the app around the engine (tiny checkpoint): every request answered as its case expects,
and the parts add up (values, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.loadtest.fairness import to_toml
from lab.app_rest import main


def _folder(tmp_path: Path) -> tuple[Path, Path]:
    data = tmp_path / "data"
    data.mkdir()
    (data / "test.csv").write_text("text,label\n" + "".join(f"text number {i} about things,a\n" for i in range(8)))
    config = tmp_path / "service.toml"
    config.write_text(to_toml({"server": {"max_wait_ms": 1},
                               "tiers": {"cheap": {"default_budget": 0.25, "max_budget": 1.0, "rate_limit": 60000,
                                                   "burst": 1000, "compute_per_minute": 1e8}}}))
    return data, config


def test_answered_requests_cost_the_loop_and_the_engine(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    data, config = _folder(tmp_path)
    out = tmp_path / "rest.json"
    assert main(["--model", str(tiny_model_scope_checkpoint), "--data", str(data), "--config", str(config),
                 "--tier", "cheap", "--budgets", "0.5", "1", "--requests", "8", "--rounds", "2", "--precision", "fp32",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["command"].startswith("python -m lab.app_rest") and doc["mode"] == "answered"
    assert [r["case"] for r in doc["rows"]] == ["answered b=0.5", "answered b=1"]
    for row in doc["rows"]:
        assert row["status"] == 200 and row["engine_ms"] > 0 and row["loop_ms"] > 0
        assert row["process_ms"] >= row["loop_ms"] and row["rest_ms"] == pytest.approx(
            row["process_ms"] - row["engine_ms"], abs=0.002)


def test_refusals_are_refused_as_named(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "refusals.json"
    assert main(["--model", str(tiny_model_scope_checkpoint), "--mode", "refusals", "--requests", "3", "--rounds", "1",
                 "--precision", "fp32", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["case"], r["status"]) for r in rows] == [("quota", 429), ("cap", 422), ("unknown_key", 401)]
    assert all(r["engine_ms"] == 0 for r in rows)  # nothing refused reaches the engine


@pytest.mark.parametrize("args, says", [(["--tier", "nosuch"], "tier 'nosuch'"), (["--data", "/nonexistent"], "test.csv")])
def test_bad_arguments_are_one_line(tiny_model_scope_checkpoint: Path, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str], args: list[str], says: str) -> None:
    data, config = _folder(tmp_path)
    argv = ["--model", str(tiny_model_scope_checkpoint), "--data", str(data), "--config", str(config),
            "--out", str(tmp_path / "x.json"), *args]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1
