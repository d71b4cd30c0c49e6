"""lab.serving_profile on the smoke checkpoint: a real uvicorn server in process and a client process; the loop
thread's CPU per answer split by step (values, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.serving_profile import STEPS, main
from tests.loadtest.conftest import assert_one_line_error, data_folder


def test_the_loop_cpu_is_split_by_step(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    rc = main(["--model", str(smoke_checkpoint), "--data", str(data_folder(tmp_path / "data")), "--conc", "2",
               "--seconds", "1", "--server-cpu", "0", "--client-cpu", "0", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    plain, steps = doc["unprofiled"], doc["loop_ms_per_answer_by_step"]
    assert plain["answers"] > 0 and 0 < plain["loop_ms"] < plain["process_ms"]
    assert set(STEPS) < set(steps) and all(v >= 0 for v in steps.values())
    assert sum(steps.values()) == pytest.approx(plain["loop_ms"], rel=0.01)  # the shares add up to the loop's CPU
    # a metered tier: each answer is identified, admitted, priced exactly and queued on the loop
    for step in ("identify the key", "admission (rate, quota)", "exact price (tokenizing)", "queue (submit)"):
        assert steps[step] > 0, step


def test_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert_one_line_error(main, ["--data", str(tmp_path), "--model", str(tmp_path), "--out", str(tmp_path / "x.json")],
                          "serving_profile", capsys)
