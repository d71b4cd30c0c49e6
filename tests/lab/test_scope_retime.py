"""lab/scope_retime.py: the attention-only budgets placed on the whole-model curve by measured latency."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import load_checkpoint
from lab import scope_retime
from tests.lab.sweeps import plan_sweep


@pytest.fixture()
def sweeps(tiny_checkpoint: Path, tiny_model_scope_checkpoint: Path, tmp_path: Path) -> tuple[Path, Path]:
    model, att = (tmp_path / "model.json", tmp_path / "attention.json")
    model.write_text(json.dumps(plan_sweep(load_checkpoint(tiny_model_scope_checkpoint)[0])))
    att_sweep = plan_sweep(load_checkpoint(tiny_checkpoint)[0])
    for p in att_sweep["points"]:  # the attention-only side a little better at every budget
        p["accuracy_hard"] += 0.01
    att.write_text(json.dumps(att_sweep))
    return model, att


def test_every_budget_of_both_is_timed_and_placed_by_compares_rule(sweeps: tuple[Path, Path], tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model, att = sweeps
    out = tmp_path / "retime.json"
    assert scope_retime.main(["--pair", "7", str(model), str(att), "--base", "tiny", "--out", str(out),
                              "--latency-texts", "3", "--latency-repeats", "1"]) == 0
    doc = json.loads(out.read_text())
    results = doc["per_seed"]["7"]["results"]
    assert sorted(results) == sorted(f"{m}@{b:.2f}" for m in ("budgeted", "attention-only") for b in BUDGET_GRID)
    assert all(r["latency_ms"] > 0 and r["engine_max_abs_logit_diff"] < 1e-4 for r in results.values())
    curve = sorted((r["latency_ms"], r["accuracy"]) for r in results.values() if r["method"] == "budgeted")
    rows = doc["placement"]
    assert [r["budget"] for r in rows] == list(BUDGET_GRID) and all(r["method"] == "attention-only" for r in rows)
    for row in rows:
        seed = row["per_seed"]["7"]
        assert seed["latency_ms"] == results[f"attention-only@{row['budget']:.2f}"]["latency_ms"]
        if seed["difference"] is None:  # outside the whole-model curve's measured latencies
            assert not curve[0][0] <= seed["latency_ms"] <= curve[-1][0]
            continue
        lo, hi = seed["bracket_latency_ms"]
        assert lo <= seed["latency_ms"] <= hi
        assert seed["difference"] == pytest.approx(seed["budgeted_accuracy"] - seed["accuracy"])
    assert "attention-only b=" in capsys.readouterr().out
    assert doc["command"].startswith("python -m lab.scope_retime --pair 7")


def test_pairs_that_do_not_belong_together_are_one_line(sweeps: tuple[Path, Path], tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    model, att = sweeps
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**json.loads(att.read_text()), "n_examples": 7}))
    out = str(tmp_path / "x.json")
    assert scope_retime.main(["--pair", "7", str(att), str(model), "--base", "tiny", "--out", out]) == 2
    assert scope_retime.main(["--pair", "7", str(model), str(other), "--base", "tiny", "--out", out]) == 2
    assert scope_retime.main(["--pair", "7", str(model), str(tmp_path / "none.json"), "--out", out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and "whole-model sweep then an attention-scope" in err[0] and "one test split" in err[1]
    assert not Path(out).exists()
