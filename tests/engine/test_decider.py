"""budget=auto through a decider (engine/decider.py): the ceiling holds for every text, per-text budgets in one
batch are honoured, every pass is counted, and decider.json is loaded only when it fits the weights."""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from headbudget.engine.base import EngineBase
from headbudget.engine.decider import (
    DECIDER_FILE,
    CascadePoint,
    Decider,
    DeciderKind,
    Predictor,
    PredictorPoint,
    ceiling_levels,
    max_prob,
    read_decider,
    save_decider,
)
from headbudget.engine.errors import BudgetError
from headbudget.engine.factory import load_engine, model_info
from headbudget.engine.types import Auto, EngineOptions, Fixed, LatencyTarget, ModelInfo
from headbudget.models.budget import BUDGET_GRID

WORDS = ("red", "blue", "marker", "one", "two", "the", "news", "market", "game", "plain", "words", "green")
TEXTS = [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(1 + (i * 5) % 23)) for i in range(24)]


def cascade(checksum: str, stages: tuple[float, ...] = (0.25, 1.0), thresholds: tuple[float, ...] = (0.9,),
            labels: tuple[str, ...] = ("negative", "positive")) -> Decider:
    point = CascadePoint(0.5, 0.5, 0.9, stages=stages, thresholds=thresholds)
    return Decider(DeciderKind.CASCADE, (point,), 0, checksum, labels)


def predictor(checksum: str, n_features: int, levels: tuple[float, ...] = BUDGET_GRID, seed: int = 0,
              tau: float = 0.5, features: np.ndarray | None = None) -> Decider:
    """Random weights; standardized on ``features`` when given (so that texts differ in what they choose)."""
    rng = np.random.default_rng(seed)
    mean = features.mean(axis=0) if features is not None else rng.normal(size=n_features)
    scale = features.std(axis=0) + 1e-3 if features is not None else np.ones(n_features)
    pred = Predictor(levels, mean, scale,
                     rng.normal(size=(n_features, len(levels))) * 3.0, rng.normal(size=len(levels)))
    return Decider(DeciderKind.PREDICTOR, (PredictorPoint(0.5, 0.5, 0.9, tau=tau),), 0, checksum,
                   ("negative", "positive"), predictor=pred)


def serve(engine: EngineBase, decider: Decider) -> EngineBase:
    engine.info = replace(engine.info, decider=decider, supports_auto=True)
    return engine


@pytest.fixture(scope="module", params=["attention", "model"])
def engine(request: pytest.FixtureRequest, tiny_checkpoint: Path, tiny_model_scope_checkpoint: Path) -> EngineBase:
    folder = tiny_checkpoint if request.param == "attention" else tiny_model_scope_checkpoint
    e = load_engine(folder, EngineOptions(cache_dir=Path(str(folder) + "-decider-onnx")))
    assert isinstance(e, EngineBase)
    return e


def assert_within_ceiling(e: EngineBase, texts: list[str], ceiling: float) -> None:
    result = e.run(texts, Auto(ceiling))
    assert result.budget == ceiling and len(result.predictions) == len(texts)
    for p in result.predictions:
        limit = e.plan(ceiling).cost(e.shape, p.n_tokens).total_macs
        passes = [e.plan(b).cost(e.shape, p.n_tokens) for b in p.passes]
        assert p.passes and all(b <= ceiling + 1e-9 for b in p.passes)
        assert list(p.passes) == sorted(set(p.passes))  # each pass escalates
        assert p.budget_chosen == p.passes[-1]
        assert p.cost.total_macs == sum(c.total_macs for c in passes) <= limit
        assert p.cost.attention_macs == sum(c.attention_macs for c in passes)
        assert p.cost.total_macs_dense == passes[-1].total_macs_dense
        assert p.cost.heads_active == passes[-1].heads_active


ceilings = st.one_of(st.sampled_from(BUDGET_GRID), st.floats(0.1, 1.0, allow_nan=False))
stage_sets = st.lists(st.sampled_from(BUDGET_GRID), min_size=1, max_size=3, unique=True).map(lambda s: tuple(sorted(s)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ceiling=ceilings, stages=stage_sets, data=st.data())
def test_a_cascade_never_spends_more_than_the_ceiling(engine: EngineBase, ceiling: float, stages: tuple[float, ...],
                                                     data: st.DataObject) -> None:
    thresholds = tuple(data.draw(st.lists(st.floats(0.5, 1.0), min_size=len(stages) - 1,
                                          max_size=len(stages) - 1)))
    texts = data.draw(st.lists(st.sampled_from(TEXTS), min_size=1, max_size=12))
    serve(engine, cascade(engine.info.checksum, stages, thresholds))
    assert_within_ceiling(engine, texts, ceiling)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ceiling=ceilings, seed=st.integers(0, 1000), tau=st.floats(0.0, 1.0))
def test_a_predictor_never_spends_more_than_the_ceiling(engine: EngineBase, ceiling: float, seed: int,
                                                       tau: float) -> None:
    feats = engine.features(engine.encoder.encode(TEXTS).ids)
    serve(engine, predictor(engine.info.checksum, engine.cfg.hidden_size + 1, seed=seed, tau=tau, features=feats))
    assert_within_ceiling(engine, TEXTS, ceiling)


def escalation(e: EngineBase, cheap: float, want: float, ceiling: float, n_tokens: int) -> tuple[float, ...]:
    """The passes of a text that escalates from ``cheap`` towards ``want``: the highest budget the cheap pass
    leaves room for under ``ceiling``, if any."""
    spent = e.plan(cheap).cost(e.shape, n_tokens).total_macs
    limit = e.plan(ceiling).cost(e.shape, n_tokens).total_macs
    fits = [b for b in ceiling_levels(ceiling)
            if cheap < b <= want and spent + e.plan(b).cost(e.shape, n_tokens).total_macs <= limit]
    return (cheap, max(fits)) if fits else (cheap,)


def test_always_escalating_fills_the_ceiling_and_no_more(engine: EngineBase) -> None:
    """Threshold 1.01: every text escalates, to the highest budget its cheap pass leaves room for (under a
    ceiling of 1.0 too: the cheap pass and the escalated one together cost at most one dense pass)."""
    serve(engine, cascade(engine.info.checksum, (0.1, 1.0), (1.01,)))
    for ceiling in (1.0, 0.5, 0.3):
        result = engine.run(TEXTS, Auto(ceiling))
        for p in result.predictions:
            assert p.passes == escalation(engine, 0.1, 1.0, ceiling, p.n_tokens)
            assert p.passes[-1] < ceiling
    serve(engine, cascade(engine.info.checksum, (0.5, 1.0), (1.01,)))
    low = engine.run(TEXTS, Auto(0.25))  # the first stage is above the ceiling: one pass at the ceiling
    assert {p.passes for p in low.predictions} == {(0.25,)}


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_per_text_budgets_in_one_batch_are_honoured(tiny_model_scope_checkpoint: Path, tmp_path: Path,
                                                    precision: str) -> None:
    e = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision=precision, cache_dir=tmp_path))  # type: ignore[arg-type]
    assert isinstance(e, EngineBase)
    cheap = e.predict(TEXTS, 0.25).predictions
    conf = sorted(max(p.scores.values()) for p in cheap)
    threshold = (conf[len(conf) // 2 - 1] + conf[len(conf) // 2]) / 2  # half the texts are unsure
    serve(e, cascade(e.info.checksum, (0.25, 1.0), (threshold,)))
    result = e.run(TEXTS, Auto(1.0))
    passes = [p.passes for p in result.predictions]
    assert {len(x) for x in passes} == {1, 2}  # different texts escalated differently in one call
    for text, p, c in zip(TEXTS, result.predictions, cheap, strict=True):
        unsure = max(c.scores.values()) < threshold
        assert p.passes == (escalation(e, 0.25, 1.0, 1.0, p.n_tokens) if unsure else (0.25,))
        alone = e.predict([text], p.passes[-1]).predictions[0]  # the answer of its last pass, run alone
        # int8 quantizes activations per batch: a text's logits move a little with its batch's company
        np.testing.assert_allclose(p.logits, alone.logits, atol=1e-4 if precision == "fp32" else 5e-3)
        assert p.cost.total_macs == sum(e.plan(b).cost(e.shape, p.n_tokens).total_macs for b in p.passes)
    assert result.heads_total == e.cfg.total_heads


def test_a_predictor_runs_each_text_once_at_its_level(engine: EngineBase) -> None:
    enc = engine.encoder.encode(TEXTS)
    d = serve(engine, predictor(engine.info.checksum, engine.cfg.hidden_size + 1, seed=3,
                                features=engine.features(enc.ids))).info.decider
    assert d is not None and d.predictor is not None
    chosen = d.predictor.choose(engine.features(enc.ids), d.default_point.tau)
    result = engine.run(TEXTS, Auto(1.0))
    assert [p.passes for p in result.predictions] == [(float(b),) for b in chosen]
    assert len(set(chosen.tolist())) > 1
    capped = engine.run(TEXTS, Auto(0.3))
    assert [p.passes for p in capped.predictions] == [(min(float(b), 0.3),) for b in chosen]


def test_predictor_levels_are_cumulative() -> None:
    d = predictor("x", 4, levels=(0.1, 0.5, 1.0), seed=1)
    assert d.predictor is not None
    x = np.random.default_rng(0).normal(size=(50, 4))
    probs = d.predictor.level_probs(x)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0)
    assert set(d.predictor.choose(x, 0.0).tolist()) == {0.1}  # tau 0: the smallest level always qualifies
    assert set(d.predictor.choose(x, 1.0).tolist()) <= {1.0, 0.5, 0.1}
    low, high = d.predictor.choose(x, 0.3), d.predictor.choose(x, 0.9)
    assert np.all(low <= high)  # a higher tau never picks a smaller budget


def test_features_are_the_embedding_layer_on_every_backend(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    onnx = load_engine(tiny_model_scope_checkpoint, EngineOptions(cache_dir=tmp_path))
    int8 = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path))
    torch_ = load_engine(tiny_model_scope_checkpoint, EngineOptions(backend="torch"))
    assert isinstance(onnx, EngineBase) and isinstance(int8, EngineBase) and isinstance(torch_, EngineBase)
    rows = onnx.encoder.encode(TEXTS[:5]).ids
    f = onnx.features(rows)
    assert f.shape == (5, onnx.cfg.hidden_size + 1)
    np.testing.assert_allclose(f, torch_.features(rows), atol=1e-5)
    np.testing.assert_allclose(f, int8.features(rows), atol=0.05)  # int8 word rows
    np.testing.assert_allclose(f[:, -1], np.log([len(r) for r in rows]))


def test_without_a_decider_auto_is_a_budget_error(engine: EngineBase) -> None:
    serve(engine, cascade(engine.info.checksum))
    engine.info = replace(engine.info, decider=None, supports_auto=False)
    with pytest.raises(BudgetError, match=r"no decider \(decider.json"):
        engine.run(["a text"], Auto(1.0))


def test_run_with_a_fixed_budget_is_predict(engine: EngineBase) -> None:
    serve(engine, cascade(engine.info.checksum))  # a decider changes nothing for a fixed budget
    for b in (0.1, 0.5, 1.0):
        ran, predicted = engine.run(TEXTS[:6], Fixed(b)), engine.predict(TEXTS[:6], b)
        assert ran.predictions == predicted.predictions and ran.budget == predicted.budget == b
        assert ran.heads_active == predicted.heads_active


def test_resolve_says_how_a_checkpoint_serves_each_request() -> None:
    plain = ModelInfo("m", "0" * 64, ("negative", "positive"), 2, 4, 32)
    own = replace(plain, supports_auto=True)  # predicts its own budget (BudgetFormer): every budget is a cap
    decided = replace(plain, supports_auto=True, decider=cascade("0" * 64))
    for info in (plain, own, decided):
        assert info.resolve(Fixed(0.3)) == Fixed(0.3)
        assert info.resolve(LatencyTarget(50.0)) == LatencyTarget(50.0)
    assert own.resolve(Auto(0.6, 0.4)) == Fixed(0.6)
    assert decided.resolve(Auto(0.6, 0.4)) == Auto(0.6, 0.4)
    with pytest.raises(BudgetError, match=r"no decider \(decider.json"):
        plain.resolve(Auto())
    assert Auto(1.0, 0.4).at(0.5) == Auto(0.5, 0.4) and LatencyTarget(50.0).at(0.5) == Fixed(0.5)


def test_decider_json_round_trips_and_is_checked(tiny_checkpoint: Path, tmp_path: Path,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder, ignore=shutil.ignore_patterns("onnx"))
    info = model_info(folder, EngineOptions())
    assert info.decider is None and not info.supports_auto
    for d in (cascade(info.checksum, (0.1, 0.3, 1.0), (0.8, 0.95)), predictor(info.checksum, 65)):
        save_decider(d, folder)
        back = read_decider(folder, info.checksum, info.labels)
        assert back is not None and back.to_dict() == d.to_dict()
        served = model_info(folder, EngineOptions())
        assert served.supports_auto and served.decider is not None and served.decider.kind == d.kind
    doc = json.loads((folder / DECIDER_FILE).read_text())
    with caplog.at_level(logging.WARNING):
        assert read_decider(folder, "f" * 64, info.labels) is None  # other weights
        assert "checksum differs" in caplog.text
        assert read_decider(folder, info.checksum, ("a", "b")) is None
        (folder / DECIDER_FILE).write_text(json.dumps({**doc, "points": []}))
        assert read_decider(folder, info.checksum, info.labels) is None
        (folder / DECIDER_FILE).write_text(json.dumps({**doc, "kind": "oracle"}))
        assert read_decider(folder, info.checksum, info.labels) is None
        (folder / DECIDER_FILE).write_text("{not json")
        assert read_decider(folder, info.checksum, info.labels) is None
    assert model_info(folder, EngineOptions()).supports_auto is False  # a broken decider serves no auto


def test_the_default_points_budgets_get_prepacked_sessions(tiny_checkpoint: Path, tmp_path: Path) -> None:
    # An attention-scope int8 checkpoint: no packed levels, so the budgets auto runs most get sessions of their own.
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, folder, ignore=shutil.ignore_patterns("onnx"))
    checksum = model_info(folder, EngineOptions()).checksum
    save_decider(cascade(checksum, (0.15, 0.75), (0.9,)), folder)
    e = load_engine(folder, EngineOptions(precision="int8", prepacked_budgets=(0.5,)))
    bare = load_engine(folder, EngineOptions(precision="int8", prepacked_budgets=()))
    keys = {e.plan(b).key for b in (0.15, 0.5, 0.75)}
    assert keys <= e._prepacked and not bare._prepacked  # type: ignore[attr-defined]
    assert e.run(TEXTS[:3], Auto()).predictions[0].passes[0] == 0.15


def test_max_prob_and_levels() -> None:
    assert max_prob(np.array([0.0, 0.0])) == pytest.approx(0.5)
    assert ceiling_levels(0.33) == [0.1, 0.15, 0.2, 0.25, 0.3, 0.33]
    assert ceiling_levels(0.1) == [0.1]
