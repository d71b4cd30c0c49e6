"""The refusal-cost tool against a real server (smoke checkpoint): every case is refused the way it names, and its
CPU is read from the server's own clocks (values, not speed)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from headbudget.loadtest.refusal_cost import main


def test_every_case_is_refused_as_it_names(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "refusal-cost.json"
    cpus = os.sched_getaffinity(0)
    assert main(["--model", str(smoke_checkpoint), "--requests", "3", "--conc", "1,2", "--rounds", "1",
                 "--pause-ms", "0,1", "--warmup", "1", "--out", str(out)]) == 0
    assert os.sched_getaffinity(0) == cpus  # the client's pinning ends with the run
    doc = json.loads(out.read_text())
    assert {"cpu", "date", "commit", "command", "workers", "pinned"} <= set(doc)
    assert doc["pinned"] == ({"server_cpu": 1, "client_cpu": 0} if {0, 1} <= cpus else None)
    assert [(r["case"], r["conc"], r["pause_ms"]) for r in doc["rows"]] == [
        (case, conc, pause) for pause in (0, 1) for conc in (1, 2)
        for case in ("rate", "quota", "cap", "unknown_key", "tiny_401")]
    codes = {r["case"]: r["status"] for r in doc["rows"]}
    assert codes == {"rate": {"429": 3}, "quota": {"429": 3}, "cap": {"422": 3}, "unknown_key": {"401": 3},
                     "tiny_401": {"401": 3}}
    assert all(r["cpu_ms"] > 0 and r["per_s"] > 0 for r in doc["rows"])


@pytest.mark.parametrize("flags", [["--requests", "0"], ["--out", "/nonexistent/x.json"], ["--conc", "1,x"],
                                   ["--conc", "0"], ["--pause-ms", "nan"], ["--pause-ms", "-1"]])
def test_bad_input_is_one_line(smoke_checkpoint: Path, tmp_path: Path, flags: list[str],
                               capsys: pytest.CaptureFixture[str]) -> None:
    args = {"--model": str(smoke_checkpoint), "--out": str(tmp_path / "x.json"), flags[0]: flags[1]}
    assert main([x for kv in args.items() for x in kv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("refusal_cost: error:") and err.count("\n") == 1
