"""Smoke-sized training of each adaptive type through the real CLI, and what its report shows."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from headbudget.models.budgetformer import budget_cap_heads
from headbudget.models.checkpoint import load_checkpoint
from tests.conftest import run_cli, train_adaptive_smoke


def _report(folder: Path) -> dict:  # type: ignore[type-arg]
    assert (folder / "adaptive.png").stat().st_size > 10_000
    return json.loads((folder / "adaptive_sweep.json").read_text())  # type: ignore[no-any-return]


def _check_checkpoint(folder: Path, kind: str) -> None:
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == kind and config["model"]["model_type"] == kind
    for stage in ("dense", "adapt"):
        assert (folder / "stages" / stage / "done.json").is_file()
    model, _ = load_checkpoint(folder)
    assert model.cfg.model_type == kind


def test_budgetformer_trains_and_reports_predicted_budgets(budgetformer_smoke: Path) -> None:
    _check_checkpoint(budgetformer_smoke, "budgetformer")
    rep = _report(budgetformer_smoke)
    assert rep["n_examples"] == 500 and 0.0 < rep["mean_cost"] <= 1.0
    assert sum(rep["histogram"]["counts"]) == 500 and len(rep["predicted_budgets"]) == 500
    caps = rep["caps"]
    assert len(caps) == 19
    # A cap never lets an input run more heads than it buys, and lower caps never cost more.
    for c in caps:
        assert c["max_cost"] <= budget_cap_heads(c["budget"], 4) / 4 + 1e-9  # tiny base: 4 heads per layer
    costs = [c["mean_cost"] for c in caps]
    assert costs == sorted(costs)
    assert caps[-1]["mean_cost"] == pytest.approx(rep["mean_cost"])


def test_resume_skips_the_finished_stages(budgetformer_smoke: Path, tmp_path: Path) -> None:
    run = shutil.copytree(budgetformer_smoke, tmp_path / "run")  # a resume rewrites the folder others read
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--recipe", "smoke", "--model", "budgetformer",
                   "--out", str(run), "--device", "cpu", "--no-sweep",
                   "--set", "dense_epochs=3", "--set", "adapt_epochs=1", "--set", "synthetic_size=1500")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stderr.count("already done") == 2


def test_span_trains_and_reports_spans(tmp_path: Path) -> None:
    folder = train_adaptive_smoke(tmp_path / "span", "span")
    _check_checkpoint(folder, "span")
    rep = _report(folder)
    assert len(rep["spans"]) == 2 and len(rep["spans"][0]) == 4  # tiny base: 2 layers x 4 heads
    assert all(w >= rep["ramp"] for row in rep["windows"] for w in row)
    spans = [p["mean_span"] for p in rep["scaled"]]
    assert spans == sorted(spans) and rep["scaled"][-1]["accuracy"] == rep["accuracy"]
    assert rep["long_examples"] > 0 and rep["accuracy_long"] is not None


def test_adaattention_trains_and_reports_dimensions(tmp_path: Path) -> None:
    folder = train_adaptive_smoke(tmp_path / "ada", "adaattention")
    _check_checkpoint(folder, "adaattention")
    rep = _report(folder)
    assert 0.0 <= rep["full_head_fraction"] <= 1.0 and 0.0 < rep["mean_dim_fraction"] <= 1.0
    assert len(rep["dim_fraction_per_layer"]) == 2


def test_unknown_model_type_is_one_line(tmp_path: Path) -> None:
    proc = run_cli("train", "--base", "tiny", "--data", "synthetic", "--model", "nope", "--out", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "invalid choice" in proc.stderr


def test_eval_and_predict_on_an_adaptive_checkpoint(budgetformer_smoke: Path, tmp_path: Path) -> None:
    proc = run_cli("eval", "--model", str(budgetformer_smoke), "--data", "synthetic", "--out", str(tmp_path),
                   "--limit", "100")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "adaptive_sweep.json").read_text())["n_examples"] == 100
    assert json.loads(proc.stdout.splitlines()[0])["model_type"] == "budgetformer"
    bad = run_cli("eval", "--model", str(budgetformer_smoke), "--data", "synthetic", "--out", str(tmp_path), "--int8")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "fp32" in bad.stderr
    pred = run_cli("predict", "--model", str(budgetformer_smoke), "--budget", "0.25", "marker one a b marker one a b")
    assert pred.returncode == 0, pred.stderr[-2000:]
    heads = int(pred.stdout.split("heads: ")[1].split("/")[0])
    assert 1 <= heads <= 2  # cap round(0.25 * 4) = 1 head in each of 2 layers

