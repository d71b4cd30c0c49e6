"""`headbudget decider` end to end on a smoke-trained checkpoint: both kinds calibrated and compared, the winner
saved beside the weights, `headbudget eval` writing auto.json, a real server answering budget=auto within its
ceiling with costs that are the sum of the passes' plan costs; and the calibration's own rules."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

from headbudget.engine.base import EngineBase
from headbudget.engine.decider import KINDS, CascadePoint, Decider, DeciderKind, read_decider
from headbudget.engine.factory import load_engine
from headbudget.engine.types import Auto, EngineOptions
from headbudget.experiments.auto_report import accuracy_at, frontier, latency_at
from headbudget.models.budget import BUDGET_GRID
from headbudget.training.data import load_data
from headbudget.training.decider import Passes, collect, fit_cascade, simulate, smallest_right
from tests.conftest import run_cli
from tests.service.conftest import KEYS, config_dict, start_server, toml_of
from tests.service.test_api import sample

POINT_KEYS = {"decider", "target", "mean_cost", "mean_latency_ms", "accuracy", "fixed_accuracy_at_same_latency",
              "fixed_latency_at_same_accuracy_ms"}


@pytest.fixture(scope="module")
def decided(smoke_model_scope_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A copy of the smoke whole-model checkpoint with the decider `--kind both` kept, and its comparison folder."""
    root = tmp_path_factory.mktemp("decider")
    folder = root / "ckpt"
    shutil.copytree(smoke_model_scope_checkpoint, folder, ignore=shutil.ignore_patterns("onnx"))
    proc = run_cli("decider", "--model", str(folder), "--data", "synthetic", "--kind", "both", "--out",
                   str(root / "compare"), "--limit", "300", "--test-limit", "300", "--latency-examples", "20",
                   "--repeats", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder, root / "compare"


def test_both_kinds_are_compared_and_the_winner_is_saved(decided: tuple[Path, Path]) -> None:
    folder, compare = decided
    doc = json.loads((compare / "auto.json").read_text())
    assert [d["kind"] for d in doc["deciders"]] == list(KINDS)
    (kept,) = [d for d in doc["deciders"] if d["kept"]]
    assert doc["split"] == "test" and doc["n_examples"] == 300 and doc["latency_examples"] == 20
    assert len(doc["fixed"]) == len(BUDGET_GRID)
    assert {p["decider"] for p in doc["points"]} == set(KINDS)
    for p in doc["points"]:
        assert POINT_KEYS <= set(p) and 0 <= p["accuracy"] <= 1 and p["mean_latency_ms"] > 0
        assert p["mean_cost"] <= 1.0 + 1e-9  # under a ceiling of 1.0 no text spends more than one dense pass
    config = json.loads((folder / "config.json").read_text())
    decider = read_decider(folder, _checksum(folder), tuple(config["model"]["labels"]))
    assert decider is not None and decider.kind == kept["kind"]
    assert decider.meta["split"] == "validation" and decider.meta["dataset"] == "synthetic"
    for point in decider.points:  # each point within its target, on the calibration texts
        assert point.target in (0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.6, 0.75)


def _checksum(folder: Path) -> str:
    from headbudget.engine.artifacts import checkpoint_digest

    return checkpoint_digest(folder)


def test_the_calibration_sees_what_the_engine_does(decided: tuple[Path, Path]) -> None:
    """``simulate`` (what calibration optimizes) gives every text the passes, answer and cost ``run`` with ``Auto``
    gives it, for every point of both kinds."""
    folder, _ = decided
    engine = load_engine(folder, EngineOptions(prepacked_budgets=()))
    assert isinstance(engine, EngineBase)
    ds = load_data("synthetic", seed=7)
    test = ds.test.take(200)
    passes = collect(engine, test, progress=False)
    for kind in KINDS:
        decider = _fitted(kind, passes, engine)
        for point in decider.points:
            engine.info = replace(engine.info, decider=decider, supports_auto=True)
            cost, right, n_passes = simulate(decider, point, passes)
            served = engine.run(test.texts, Auto(1.0, point.target)).predictions
            assert [len(p.passes) for p in served] == n_passes.tolist()
            assert [p.label == ds.labels[y] for p, y in zip(served, test.labels, strict=True)] == right.tolist()
            np.testing.assert_allclose([p.cost.ratio for p in served], cost, rtol=1e-9)


def _fitted(kind: DeciderKind, passes: Passes, engine: EngineBase) -> Decider:
    from headbudget.training.decider import fit

    return fit(kind, passes, engine.info.checksum, engine.cfg.labels)


def test_eval_reports_auto_beside_the_fixed_budgets(decided: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = decided
    proc = run_cli("eval", "--model", str(folder), "--data", "synthetic", "--limit", "200", "--out",
                   str(tmp_path), "--auto-latency-examples", "20")
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads((tmp_path / "auto.json").read_text())
    assert set(doc) >= {"deciders", "points"} and len(doc["deciders"]) == 1
    assert all(POINT_KEYS <= set(p) for p in doc["points"]) and sum(p["default"] for p in doc["points"]) == 1
    assert doc["n_examples"] == 200 and (tmp_path / "pareto.png").stat().st_size > 0
    assert "mean accuracy gain over the fixed budgets" in proc.stdout
    skipped = run_cli("eval", "--model", str(folder), "--data", "synthetic", "--limit", "50", "--out",
                      str(tmp_path / "no-auto"), "--no-auto")
    assert skipped.returncode == 0 and not (tmp_path / "no-auto" / "auto.json").exists()


def test_served_auto_costs_are_the_sum_of_the_passes(decided: tuple[Path, Path], tmp_path: Path) -> None:
    folder, _ = decided
    engine = load_engine(folder, EngineOptions())
    texts = load_data("synthetic", seed=7).test.texts[:24]
    d = config_dict()
    d["tiers"]["balanced"]["default_budget"] = "auto"  # a tier may default to auto on a checkpoint with a decider
    with start_server(folder, toml_of(d), tmp_path) as s, httpx.Client(base_url=s.url, timeout=60) as c:
        answers = {ceiling: c.post(f"/classify?budget=auto&max_budget={ceiling}", json={"texts": texts},
                                   headers={"X-API-Key": KEYS["quality"]}) for ceiling in (1.0, 0.5, 0.25)}
        default = c.post("/classify", json={"texts": texts}, headers={"X-API-Key": KEYS["balanced"]})
        over = c.post("/classify?budget=auto&max_budget=0.75", json={"text": texts[0]},
                      headers={"X-API-Key": KEYS["cheap"]})
        card = c.get("/v1/models").json()["data"][0]
        metrics = c.get("/metrics").text
    assert default.status_code == 200 and default.json()["budget_source"] == "tier_default"
    assert over.status_code == 403
    assert card["supports_auto"] is True and card["decider"] in KINDS
    assert sample(metrics, "headbudget_inference_duration_seconds_count", budget="auto") == 4
    for ceiling, r in answers.items():
        assert r.status_code == 200, r.text
        for res in r.json()["results"]:
            n, passes = res["n_tokens"], res["passes"]
            costs = [engine.plan(b).cost(engine.shape, n) for b in passes]
            assert res["budget_requested"] == "auto" and res["budget_chosen"] == passes[-1] <= res["budget_applied"] == ceiling
            assert sum(x.total_macs for x in costs) <= engine.plan(ceiling).cost(engine.shape, n).total_macs
            assert res["cost"] == pytest.approx(sum(x.total_macs for x in costs) / costs[0].total_macs_dense,
                                                abs=1e-6)
            assert res["attention_cost"] == pytest.approx(
                sum(x.attention_macs for x in costs) / costs[0].attention_macs_dense, abs=1e-6)


# -- the calibration's rules, on made-up answers --------------------------------------------------------------
def _passes(correct: np.ndarray, conf: np.ndarray) -> Passes:
    """Two-label answers with the given correctness and confidence per (budget, text); cost = budget."""
    k, n = correct.shape
    p_right = np.where(correct, conf, 1.0 - conf)
    logits = np.stack([np.log(1.0 - p_right), np.log(p_right)], axis=2)  # label 1 is the truth
    budgets = np.asarray(BUDGET_GRID)[:, None] * np.ones((1, n))
    return Passes(BUDGET_GRID, logits.astype(np.float32), np.ones(n, dtype=np.int64), np.full(n, 10),
                  budgets, (budgets * 1_000_000).astype(np.int64), np.zeros((n, 3)))


def test_smallest_right_budget_labels() -> None:
    k = len(BUDGET_GRID)
    correct = np.zeros((k, 4), dtype=bool)
    correct[:, 0] = True  # right everywhere: the smallest budget
    correct[5:, 1] = True  # right from the sixth budget up
    correct[:3, 2] = True  # right only at small budgets, wrong at 1.0: the smallest (nothing buys it)
    correct[[2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18], 3] = True  # right at 2, then from 8 up: 8
    assert smallest_right(_passes(correct, np.full((k, 4), 0.9))).tolist() == [0, 5, 0, 8]


def test_a_cascade_escalates_the_unsure_texts_and_stays_within_its_targets() -> None:
    """Texts the cheapest budget gets right it is sure of; the others it is unsure of and gets wrong, and the
    whole budget gets everything right: a cascade beats every fixed budget at the same mean cost."""
    rng = np.random.default_rng(0)
    k, n = len(BUDGET_GRID), 400
    easy = rng.random(n) < 0.7
    correct = np.ones((k, n), dtype=bool)
    correct[:8, ~easy] = False  # hard texts need budget 0.5 or more
    conf = np.where(easy[None, :], 0.95, 0.6) * np.ones((k, 1))
    p = _passes(correct, conf)
    decider = fit_cascade(p, "0" * 64, ("a", "b"), targets=(0.25, 0.5))
    for point in decider.points:
        assert point.mean_cost <= p.target_cost(point.target) + 1e-9
        cost, right, _ = simulate(decider, point, p)
        assert cost.mean() == pytest.approx(point.mean_cost) and right.mean() == pytest.approx(point.accuracy)
    best = decider.point(0.5)
    assert best.stages[0] == 0.1 and len(best.stages) == 2 and 0.5 <= best.stages[1]
    assert best.accuracy == 1.0 and best.mean_cost < 0.5  # fixed 0.5 costs 0.5 for the same accuracy
    assert decider.default_point.accuracy == 1.0  # the cheapest point as right as the whole budget


def test_a_cascade_point_never_assumes_more_than_the_ceiling_allows() -> None:
    """With cost = budget, a text that ran 0.3 can escalate to 0.7 at most under a ceiling of 1.0."""
    k, n = len(BUDGET_GRID), 50
    correct = np.zeros((k, n), dtype=bool)
    correct[-1] = True  # only the whole budget is right
    p = _passes(correct, np.full((k, n), 0.6))
    point = CascadePoint(0.5, 0.0, 0.0, stages=(0.3, 1.0), thresholds=(0.9,))
    decider = Decider(DeciderKind.CASCADE, (point,), 0, "0" * 64, ("a", "b"))
    cost, right, n_passes = simulate(decider, point, p)
    assert np.allclose(cost, 0.3 + 0.7) and not right.any() and (n_passes == 2).all()


def test_the_fixed_envelope_at_equal_latency_and_accuracy() -> None:
    env = frontier([(1.0, 0.8), (2.0, 0.9), (1.5, 0.7), (3.0, 0.85), (4.0, 0.95)])
    assert env == [(1.0, 0.8), (2.0, 0.9), (4.0, 0.95)]
    assert accuracy_at(env, 1.5) == pytest.approx(0.85) and accuracy_at(env, 0.5) is None
    assert accuracy_at(env, 9.0) == 0.95
    assert latency_at(env, 0.85) == pytest.approx(1.5) and latency_at(env, 0.99) is None
    assert latency_at(env, 0.5) == 1.0
