"""The capacity step against a real 2-worker server (smoke checkpoint): it serves the precision asked for, and
its CPU-per-request figures are consistent with each other (values, not speed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from headbudget.loadtest.capacity import capacity, main


@pytest.mark.parametrize("precision,dtype", [("int8", "int8"), ("fp32", "float32")])
def test_capacity_serves_the_precision_asked_for(smoke_checkpoint: Path, precision: str, dtype: str) -> None:
    texts = [f"red marker four pink blue {i} green marker two" for i in range(20)]
    (row,) = capacity(smoke_checkpoint, texts, 2, [0.5], 250.0, 1.0, [1], precision)
    assert row["served_dtype"] == dtype
    assert row["sustained_rps"] > 0 and row["at_users"] == 1
    assert row["cpu_ms_per_request"] == pytest.approx(row["engine_cpu_ms_per_request"] + row["other_cpu_ms_per_request"])
    assert all(level["codes"].get("200") for level in row["levels"])


def test_capacity_bad_input_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "x.json"), "--precision", "int8"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("capacity: error:") and err.count("\n") == 1
