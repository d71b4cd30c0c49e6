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


def test_mixed_traffic_alternates_budgets_and_weighs_each_alone(smoke_model_scope_checkpoint: Path) -> None:
    """Every budget of the mix is answered, and the expected cost is the same round's single-budget costs
    weighted by the mix's answers (values, not speed)."""
    from headbudget.loadtest.capacity import mixed_traffic

    texts = [f"red marker four pink blue {i} green marker two" for i in range(20)]
    doc = mixed_traffic(smoke_model_scope_checkpoint, texts, 2, [1.0, 0.25], 2, 1.0, 2)
    first, second = doc["rounds"]
    mix = str([1.0, 0.25])
    assert first["order"] == ["1.0", "0.25", mix] and second["order"] == [mix, "1.0", "0.25"]  # drift evens out
    rnd = first
    n = rnd["answered_by_budget"]
    assert set(n) == {"1.0", "0.25"} and min(n.values()) > 0
    assert abs(n["1.0"] - n["0.25"]) <= 2  # two clients, each alternating request by request
    single = {b: rnd["single"][b]["engine_cpu_ms_per_request"] for b in n}
    assert all(v > 0 for v in single.values())
    expected = (n["1.0"] * single["1.0"] + n["0.25"] * single["0.25"]) / sum(n.values())
    assert rnd["expected_engine_cpu_ms_per_request"] == pytest.approx(expected)
    assert rnd["mixed_over_expected"] == pytest.approx(rnd["mixed"]["engine_cpu_ms_per_request"] / expected)
    assert doc["median_mixed_over_expected"] in {r["mixed_over_expected"] for r in doc["rounds"]}
    for kind in ("single", "mixed"):  # the answers' own forward-pass times, and b = 1's over each budget's
        fwd = rnd["forward_ms_p50"][kind]
        assert set(fwd) == {"1.0", "0.25"} and all(v > 0 for v in fwd.values())
        assert rnd["speedup_over_top"][kind] == {b: pytest.approx(fwd["1.0"] / fwd[b]) for b in fwd}


@pytest.mark.parametrize("flags", [["--budgets", "1,abc"], ["--budgets", "0"], ["--mixed", "--mixed-users", "0"]])
def test_mixed_bad_input_is_one_line(flags: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--model", str(tmp_path), "--out", str(tmp_path / "x.json"), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("capacity: error:") and err.count("\n") == 1
