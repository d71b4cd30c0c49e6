"""The issue-8 summary end to end on smoke checkpoints: accuracy at the matched budget, timings, bad input."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from headbudget.experiments.adaptive.summary import main, matched_budget
from headbudget.training.data import load_data
from tests.conftest import run_cli


def _synthetic_folder(folder: Path) -> Path:
    """The built-in synthetic set written as train.csv/test.csv (the summary times texts from a folder)."""
    ds = load_data("synthetic", "text", "label", seed=7)
    folder.mkdir()
    for name in ("train", "test"):
        part = ds.split(name)
        with open(folder / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows((t, ds.labels[y]) for t, y in zip(part.texts, part.labels, strict=True))
    return folder


def test_matched_budget_buys_the_nearest_head_count() -> None:
    assert matched_budget(0.5, 6, 12) == (0.5, 36)
    b, k = matched_budget(0.71, 6, 12)
    assert k == 51 and abs(b - 51 / 72) < 1e-12
    assert matched_budget(0.0, 2, 4) == (0.125, 1)  # at least one head


def test_summary_on_smoke_checkpoints(budgetformer_smoke: Path, smoke_checkpoint: Path, tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    data = _synthetic_folder(tmp_path / "synthetic")
    out = tmp_path / "adaptive.json"
    argv = ["--data", str(data), "--budgeted", str(smoke_checkpoint), "--budgetformer", str(budgetformer_smoke),
            "--texts", "4", "--repeats", "2", "--lengths", "24", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(out.read_text())
    bf = r["types"]["budgetformer"]
    report = json.loads((budgetformer_smoke / "adaptive_sweep.json").read_text())
    matched = bf["budgeted_at_mean_cost"]
    assert matched["heads"] == max(1, round(report["mean_cost"] * 8)) and matched["n_examples"] == 1000
    assert 0.0 <= matched["accuracy_hard"] <= 1.0 and "predicted_budgets" not in bf["report"]
    timed = bf["latency_texts"]
    for key in ("adaptive_ms", "fast_dense_ms", "budgeted_dense_ort_ms", "budgeted_dense_torch_ms",
                "budgeted_matched_ort_ms", "budgeted_matched_torch_ms"):
        assert timed[key] > 0
    assert set(bf["latency_lengths"]["lengths"]) == {"24"} and r["cpu"]
    capsys.readouterr()
    for bad in (["--data", str(data), "--budgeted", str(smoke_checkpoint), "--out", str(out)],
                ["--data", str(data), "--budgeted", str(tmp_path), "--span", str(budgetformer_smoke), "--out", str(out)],
                ["--data", str(data), "--budgeted", str(smoke_checkpoint), "--span", str(smoke_checkpoint),
                 "--out", str(out)]):
        assert main(bad) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


def test_cli_subcommand_runs_the_summary(tmp_path: Path) -> None:
    proc = run_cli("compare-adaptive", "--data", str(tmp_path), "--budgeted", str(tmp_path / "missing"),
                   "--span", str(tmp_path), "--out", str(tmp_path / "a.json"))
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1
    assert "not a checkpoint folder" in proc.stderr and not (tmp_path / "a.json").exists()
