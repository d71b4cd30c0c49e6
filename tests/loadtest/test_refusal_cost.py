"""The refusal-cost tool against a real server (smoke checkpoint): every case is refused the way it names, and its
CPU is read from the server's own clocks (values, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.loadtest.refusal_cost import main


def test_every_case_is_refused_as_it_names(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "refusal-cost.json"
    assert main(["--model", str(smoke_checkpoint), "--requests", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert {"cpu", "date", "commit", "command", "workers"} <= set(doc)
    codes = {r["case"]: r["status"] for r in doc["rows"]}
    assert codes == {"rate": {"429": 2}, "quota": {"429": 2}, "cap": {"422": 2}, "unknown_key": {"401": 2}}
    assert all(r["cpu_ms"] > 0 for r in doc["rows"])


@pytest.mark.parametrize("flags", [["--requests", "0"], ["--out", "/nonexistent/x.json"]])
def test_bad_input_is_one_line(smoke_checkpoint: Path, tmp_path: Path, flags: list[str],
                               capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--model": str(smoke_checkpoint), "--out": str(tmp_path / "x.json"), flags[0]: flags[1]}
    assert main([x for kv in args.items() for x in kv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refusal_cost: error:") and err.count("\n") == 1
