"""A real `headbudget serve` on a whole-model-budget checkpoint: every answer's cost is the fraction of the whole
forward pass it spent, /v1/models shows the heads and neurons each budget keeps, and the metrics count
whole-forward multiply-adds spent and saved; an attention-only checkpoint's answers keep both figures apart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.plan import Shape
from tests.service.conftest import KEYS, Server, config_dict, engine_factory_available, start_server, toml_of
from tests.service.test_api import sample

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)


@pytest.fixture(scope="module")
def server(tiny_model_scope_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tiny_model_scope_checkpoint, toml_of(config_dict()), tmp_path_factory.mktemp("scope")) as s:
        yield s


def classify(server: Server, budget: float, text: str = "a film about nothing much") -> dict:
    r = httpx.post(f"{server.url}/classify?budget={budget}", json={"text": text},
                   headers={"X-API-Key": KEYS["quality"]}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["results"][0]  # type: ignore[no-any-return]


def test_cost_is_the_whole_forward_fraction_of_the_plan(server: Server, tiny_model_scope_checkpoint: Path,
                                                         tmp_path: Path) -> None:
    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(cache_dir=tmp_path))
    shape = Shape.of(engine.cfg)
    costs = {}
    for b in (1.0, 0.5, 0.25, 0.1):
        res = classify(server, b)
        plan = engine.plan(b)
        expected = plan.cost(shape, res["n_tokens"])
        assert plan.ffn is not None and res["neurons_active"] == sum(plan.ffn) and res["neurons_total"] == 512
        assert res["heads_active"] == plan.heads_active
        assert res["cost"] == pytest.approx(expected.ratio, abs=1e-6)
        assert res["attention_cost"] == pytest.approx(expected.attention_ratio, abs=1e-6)
        # The budget buys multiply-adds at 128 tokens; the answer reports them at its own length, close to b.
        assert res["cost"] <= b + 0.05
        costs[b] = res["cost"]
    assert costs[1.0] == pytest.approx(1.0) and costs[0.1] < costs[0.25] < costs[0.5] < costs[1.0]


def test_models_list_shows_heads_and_neurons_per_budget(server: Server, tiny_model_scope_checkpoint: Path,
                                                        tmp_path: Path) -> None:
    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(cache_dir=tmp_path))
    card = httpx.get(f"{server.url}/v1/models", headers={"X-API-Key": KEYS["quality"]}).json()["data"][0]
    points = {p["budget"]: p for p in card["budgets"]}
    for b in (0.1, 0.5, 1.0):
        plan = engine.plan(b)
        assert points[b]["heads_active"] == plan.heads_active and points[b]["neurons_active"] == sum(plan.ffn or ())
    assert points[1.0]["neurons_active"] == 512 > points[0.1]["neurons_active"]


def test_metrics_count_whole_forward_macs_spent_and_saved(server: Server) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    a, b = classify(server, 1.0), classify(server, 0.25)
    after = httpx.get(f"{server.url}/metrics").text

    def delta(name: str) -> float:
        return sample(after, name, tier="quality") - sample(before, name, tier="quality")

    spent, saved = delta("headbudget_macs_total"), delta("headbudget_macs_saved_total")
    assert spent > 0 and saved > 0
    # Spent + saved is the dense model's work for both texts; the b = 1 answer saved nothing.
    assert a["cost"] == pytest.approx(1.0)
    assert saved / (spent + saved) == pytest.approx((1 - b["cost"]) / 2, rel=1e-3)
    assert delta("headbudget_cost_ratio_count") == 2
