"""`headbudget compare` end to end on the smoke setting, its cache, and its bad-input paths."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from headbudget.models.checkpoint import load_checkpoint
from tests.conftest import run_cli

# The smoke recipe shortened (fewer, smaller epochs): this tests the pipeline, not the accuracy.
ARGS = ["compare", "--data", "synthetic", "--base", "tiny", "--recipe", "smoke", "--seeds", "7,13",
        "--budgets", "0.75,0.25", "--device", "cpu", "--set", "synthetic_size=600", "--set", "dense_epochs=3",
        "--set", "budget_epochs=1", "--importance-examples", "200", "--ablation-examples", "50",
        "--limit", "200", "--latency-texts", "10", "--latency-repeats", "2"]
METHODS = {"dense", "budgeted", "soft-only", "posthoc", "posthoc-structural", "posthoc+recovery", "static"}


def run_compare(tmp_path_factory: pytest.TempPathFactory, name: str, args: list[str]) -> tuple[Path, str]:
    """`headbudget compare` with ``args`` into a fresh folder: (that folder, its log)."""
    out = tmp_path_factory.mktemp(name) / "cmp"
    proc = run_cli(*args, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, proc.stderr


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return run_compare(tmp_path_factory, "compare", ARGS)


@pytest.mark.slow
def test_compare_writes_every_output(compared: tuple[Path, str]) -> None:
    out, _ = compared
    doc = json.loads((out / "compare.json").read_text())
    assert doc["seeds"] == [7, 13] and doc["budgets"] == [0.25, 0.75] and doc["n_test"] == 200
    rows = {(r["method"], r["budget"]): r for r in doc["rows"]}
    assert {m for m, _ in rows} == METHODS
    assert set(rows) == {("dense", 1.0)} | {(m, b) for m in METHODS - {"dense"} for b in (0.25, 0.75)}
    for (method, b), r in rows.items():
        assert r["n_seeds"] == 2 and 0.0 <= r["accuracy_mean"] <= 1.0 and r["accuracy_std"] >= 0.0
        assert r["cost_mean"] == (1.0 if method == "dense" else {0.25: 0.25, 0.75: 0.75}[b])
        assert r["latency_ms_mean"] > 0 and r["speedup_mean"] > 0
        assert r["engine_max_abs_logit_diff_mean"] < 1e-4  # the engine serves every baseline artifact
    assert rows[("dense", 1.0)]["speedup_mean"] == 1.0 and rows[("dense", 1.0)]["delta_vs_dense_mean"] == 0.0
    m = doc["methods"]
    assert (m["budgeted"]["artifacts"], m["static"]["artifacts"], m["posthoc+recovery"]["artifacts"]) == (1, 2, 2)
    assert (m["budgeted"]["fine_tune_jobs"], m["static"]["fine_tune_jobs"], m["posthoc"]["fine_tune_jobs"]) == (2, 3, 1)
    assert m["static"]["train_seconds_mean"] > m["posthoc"]["train_seconds_mean"] > 0
    assert set(doc["spearman"]) == {"budgeted_g_025_075", "budgeted_vs_importance", "static_025_vs_075"}
    assert -1.0 <= doc["spearman"]["budgeted_vs_importance"]["mean"] <= 1.0
    assert len(doc["trained_this_run"]) == 2 * (1 + 2 + 2)  # per seed: budgeted, 2 static, 2 recovery
    md = (out / "compare.md").read_text()
    assert "| budgeted | 0.25 |" in md and "fine-tune jobs" in md and "Spearman" in md and "±" in md
    assert (out / "compare.png").stat().st_size > 20_000
    for seed in (7, 13):
        assert list((out / "artifacts").glob(f"importance-s{seed}-*/importance.png"))


@pytest.mark.slow
def test_baseline_artifacts_keep_their_ranking(compared: tuple[Path, str]) -> None:
    out, _ = compared
    doc = json.loads((out / "compare.json").read_text())
    res = doc["per_seed"]["7"]["results"]
    ranking = doc["per_seed"]["7"]["importance_ranking"]
    posthoc, _ = load_checkpoint(Path(res["posthoc@0.25"]["folder"]))
    recovered, _ = load_checkpoint(Path(res["posthoc+recovery@0.25"]["folder"]))
    assert posthoc.gates.order().tolist() == ranking
    # recovery trains the encoder under the fixed pruning mask: gates (hence the mask) unchanged, weights moved
    assert recovered.gates.order().tolist() == ranking
    assert not np.allclose(recovered.classifier.weight.detach().numpy(), posthoc.classifier.weight.detach().numpy())
    structural, cfg = load_checkpoint(Path(res["posthoc-structural@0.25"]["folder"]))
    assert structural.cfg.gate.structural and cfg["method"] == "posthoc-structural"
    soft_only, _ = load_checkpoint(Path(res["soft-only@0.25"]["folder"]))
    stage2, _ = load_checkpoint(Path(res["budgeted@0.25"]["folder"]) / "stages" / "budget")
    assert np.array_equal(soft_only.gates.logit.detach().numpy(), stage2.gates.logit.detach().numpy())


@pytest.mark.slow
def test_second_run_trains_nothing(compared: tuple[Path, str]) -> None:
    out, first_log = compared
    assert first_log.count(": training (") == 2 * (1 + 2 + 2)
    weights = sorted(out.glob("**/model.safetensors"))
    before = {p: p.stat().st_mtime_ns for p in weights}
    proc = run_cli(*ARGS, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ": training (" not in proc.stderr and "nothing trained: every artifact was cached" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in sorted(out.glob("**/model.safetensors"))} == before
    doc = json.loads((out / "compare.json").read_text())
    assert doc["trained_this_run"] == [] and "nothing (all cached)" in (out / "compare.md").read_text()


@pytest.mark.parametrize(("args", "message"), [
    (["--seeds", "7,x"], "--seeds: expected comma-separated ints"),
    (["--seeds", "7,7"], "--seeds: duplicate values"),
    (["--seeds", ","], "--seeds: expected at least one value"),
    (["--budgets", "0.25,1.5"], "budget must be"),
    (["--budgets", "0"], "budget must be a number in [0.1, 1]"),
    (["--budgets", "1"], "budget must be below 1"),
    (["--budgets", "abc"], "budget must be a number"),
    (["--data", "{tmp}/nodata"], "does not exist"),
    (["--set", "nope=1"], "expected KEY=VALUE"),
    (["--recipe", "fast"], "invalid choice"),
])
def test_compare_bad_input_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    argv = ["compare", "--data", "synthetic", "--base", "tiny", "--recipe", "smoke",
            *[a.format(tmp=tmp_path) for a in args], "--out", str(tmp_path / "o")]
    proc = run_cli(*argv, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "o" / "runs").exists()  # nothing trained
