"""`headbudget compare --scope model` end to end on the smoke setting: the whole-model checkpoint
against the attention-only run, post-hoc pruning of heads and neurons and the dedicated small models, each
latency-measured and placed on the budgeted curve; and its cache."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.experiments.compare.run import MODEL_METHODS
from headbudget.models.checkpoint import load_checkpoint
from tests.conftest import run_cli
from tests.experiments.test_compare import run_compare

# One seed, two budgets, the smoke recipe shortened. Latency on the torch reference engine: this tests the
# pipeline, not the engine's speed (the ONNX engine's slicing has its own equivalence tests in tests/engine).
ARGS = ["compare", "--scope", "model", "--data", "synthetic", "--base", "tiny", "--recipe", "smoke", "--seeds", "7",
        "--budgets", "0.75,0.25", "--device", "cpu", "--set", "synthetic_size=600", "--set", "dense_epochs=3",
        "--set", "budget_epochs=1", "--importance-examples", "200", "--ablation-examples", "0", "--limit", "200",
        "--latency-texts", "10", "--latency-repeats", "2", "--backend", "torch"]
SHARED = ("soft-only", "attention-only", "posthoc-model")
TRAINED = {"budgeted-s7", "attention-only-s7", "layerdrop-s7", "ffn-half-s7"}


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    return run_compare(tmp_path_factory, "compare-model", ARGS)


@pytest.mark.slow
def test_every_method_is_measured_and_placed(compared: tuple[Path, str]) -> None:
    out, _ = compared
    doc = json.loads((out / "compare.json").read_text())
    assert doc["scope"] == "model" and doc["seeds"] == [7] and doc["budgets"] == [0.25, 0.75]
    assert doc["latency"]["engine"] == "torch fp32, 1 thread, batch 1"
    rows = {(r["method"], r["budget"]): r for r in doc["rows"]}
    assert {m for m, _ in rows} == set(MODEL_METHODS)
    assert set(rows) == ({("dense", 1.0), ("layerdrop", 1.0), ("ffn-half", 1.0)}
                         | {("budgeted", b) for b in (0.25, 0.75, 1.0)} | {(m, b) for m in SHARED for b in (0.25, 0.75)})
    for (method, b), r in rows.items():
        assert 0.0 <= r["accuracy_mean"] <= 1.0 and r["latency_ms_mean"] > 0 and r["speedup_mean"] > 0
        assert r["engine_max_abs_logit_diff_mean"] < 1e-4  # the engine serves every artifact
        assert 0.0 < r["macs_ratio_mean"] <= 1.0 + 1e-9
        if method in ("budgeted", "posthoc-model"):  # a share of head and feed-forward MACs, at most b
            assert 0.0 < r["cost_mean"] <= b + 1e-9
    # Whole-forward MACs at 128 tokens of the tiny base: a layer's attention and feed-forward cost the same.
    assert rows[("layerdrop", 1.0)]["macs_ratio_mean"] == pytest.approx(0.5, abs=1e-3)
    assert rows[("ffn-half", 1.0)]["macs_ratio_mean"] == pytest.approx(0.75, abs=1e-3)
    assert rows[("attention-only", 0.25)]["cost_mean"] == 0.25  # its own unit: the fraction of heads
    placed = {(p["method"], p["budget"]): p for p in doc["placement"]}
    assert set(placed) == {("layerdrop", 1.0), ("ffn-half", 1.0), ("attention-only", 0.25), ("attention-only", 0.75)}
    results = doc["per_seed"]["7"]["results"]
    for (method, _), p in placed.items():  # each point's budgeted accuracy, recomputed from its bracket
        assert p["n_seeds"] == 1 and p["met"] in (True, False, None) and "rule" in p
        s = p["per_seed"]["7"]
        assert s["latency_ms"] == p["latency_ms_mean"]
        if s["difference"] is None:  # outside the measured curve: no extrapolation
            lats = [r["latency_ms"] for r in results.values() if r["method"] == "budgeted"]
            assert not min(lats) <= s["latency_ms"] <= max(lats) and p["met"] is None
            continue
        lo, hi = (results[f"budgeted@{b:.2f}"] for b in s["bracket_budgets"])
        assert [lo["latency_ms"], hi["latency_ms"]] == s["bracket_latency_ms"]
        assert lo["latency_ms"] <= s["latency_ms"] <= hi["latency_ms"]
        w = (s["latency_ms"] - lo["latency_ms"]) / (hi["latency_ms"] - lo["latency_ms"])
        assert s["budgeted_accuracy"] == pytest.approx(lo["accuracy"] + w * (hi["accuracy"] - lo["accuracy"]))
        assert s["difference"] == pytest.approx(s["budgeted_accuracy"] - results[f"{method}@{p['budget']:.2f}"]["accuracy"])
    m = doc["methods"]
    assert (m["layerdrop"]["artifacts"], m["ffn-half"]["fine_tune_jobs"], m["posthoc-model"]["fine_tune_jobs"]) == (1, 2, 1)
    assert set(doc["trained_this_run"]) == TRAINED
    md = (out / "compare.md").read_text()
    assert "At equal measured latency" in md and "| layerdrop | 1.00 |" in md and "must meet (at equal measured latency)" in md
    assert md.index("| layerdrop | 1.00 |") > md.index("Sorted by measured latency")
    assert (out / "compare.png").stat().st_size > 20_000
    assert list((out / "artifacts").glob("importance-s7-*/importance.png"))


@pytest.mark.slow
def test_artifacts_are_the_methods(compared: tuple[Path, str]) -> None:
    out, _ = compared
    doc = json.loads((out / "compare.json").read_text())
    res = doc["per_seed"]["7"]["results"]
    budgeted, _ = load_checkpoint(Path(res["budgeted@0.25"]["folder"]))
    attention, _ = load_checkpoint(Path(res["attention-only@0.25"]["folder"]))
    assert budgeted.cfg.gate.scope == "model" and attention.cfg.gate.scope == "attention"
    assert Path(res["attention-only@0.25"]["folder"]).name.startswith("budgeted-s7-")  # an attention run's folder
    posthoc, _ = load_checkpoint(Path(res["posthoc-model@0.25"]["folder"]))
    assert posthoc.gates.order().tolist() == doc["per_seed"]["7"]["unit_ranking"]
    layerdrop, meta = load_checkpoint(Path(res["layerdrop@1.00"]["folder"]))
    assert layerdrop.cfg.n_layers == 1 and layerdrop.cfg.gate.scope == "attention" and meta["method"] == "layerdrop"
    half, _ = load_checkpoint(Path(res["ffn-half@1.00"]["folder"]))
    assert half.cfg.intermediate_size == budgeted.cfg.intermediate_size // 2 and half.cfg.n_layers == 2
    assert res["ffn-half@1.00"]["neurons_per_layer"] == [128, 128] and res["layerdrop@1.00"]["n_layers"] == 1


@pytest.mark.slow
def test_second_run_trains_nothing(compared: tuple[Path, str]) -> None:
    out, first_log = compared
    assert first_log.count(": training (") == len(TRAINED)
    before = {p: p.stat().st_mtime_ns for p in sorted(out.glob("**/model.safetensors"))}
    proc = run_cli(*ARGS, "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ": training (" not in proc.stderr and "nothing trained: every artifact was cached" in proc.stderr
    assert {p: p.stat().st_mtime_ns for p in sorted(out.glob("**/model.safetensors"))} == before
    doc = json.loads((out / "compare.json").read_text())
    assert doc["trained_this_run"] == [] and len(doc["placement"]) == 4


@pytest.mark.parametrize(("args", "message"), [
    (["--scope", "heads"], "invalid choice"),
    (["--backend", "tvm"], "invalid choice"),
])
def test_bad_scope_or_backend_one_line(args: list[str], message: str, tmp_path: Path) -> None:
    proc = run_cli("compare", "--data", "synthetic", "--base", "tiny", *args, "--out", str(tmp_path / "o"),
                   timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
    assert not (tmp_path / "o").exists()


def test_latency_probe_serves_every_compared_budget_as_served(tiny_model_scope_checkpoint: Path) -> None:
    # A compared budget is timed as it is served when it is an operating point: with feed-forward budgets, by the
    # all-budget session's packed levels, which measured no slower than a session of its own.
    import numpy as np

    from headbudget.experiments.compare.measure import engine_factory

    predict = engine_factory("onnxruntime", (0.3, 0.6))(tiny_model_scope_checkpoint)
    engine = predict.__self__  # type: ignore[attr-defined]
    ids, mask = np.full((1, 5), 7, dtype=np.int64), np.ones((1, 5), dtype=np.int32)
    for b in (0.3, 0.6, 1.0):
        assert np.isfinite(predict(ids, mask, b)).all()
    assert engine.n_sessions == 1  # the all-budget session serves them all
