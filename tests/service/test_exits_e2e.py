"""A real `headbudget serve` on a checkpoint with exits (layer skipping): each budget answers what the
engine's plan answers, the cost counts only the layers run, and /v1/models says where each budget stops."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.plan import Shape
from tests.conftest import make_random_checkpoint
from tests.service.conftest import KEYS, Server, config_dict, engine_factory_available, start_server, toml_of

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

TEXT = "stocks rallied after the central bank held rates"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-exits", seed=11, scope="model",
                                  ffn_group=32, exits=(1, 2), n_layers=4)


@pytest.fixture(scope="module")
def server(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    # fp32, so the answers can be compared with the fp32 engine's to the last digit
    with start_server(checkpoint, toml_of(config_dict()), tmp_path_factory.mktemp("exits"),
                      extra=("--precision", "fp32")) as s:
        yield s


def test_answers_and_costs_are_the_plans(server: Server, checkpoint: Path, tmp_path: Path) -> None:
    engine = load_engine(checkpoint, EngineOptions(cache_dir=tmp_path))
    shape, depths = Shape.of(engine.cfg), set()
    for b in (0.1, 0.3, 0.5, 0.75, 1.0):
        r = httpx.post(f"{server.url}/classify?budget={b}", json={"text": TEXT},
                       headers={"X-API-Key": KEYS["quality"]}, timeout=30)
        assert r.status_code == 200, r.text
        res = r.json()["results"][0]
        plan = engine.plan(b)
        depths.add(plan.layers_run)
        want = engine.predict([TEXT], b).predictions[0]
        assert res["label"] == want.label
        np.testing.assert_allclose([res["scores"][k] for k in sorted(res["scores"])],
                                   [want.scores[k] for k in sorted(want.scores)], atol=1e-5)
        assert res["cost"] == pytest.approx(plan.cost(shape, res["n_tokens"]).ratio, abs=1e-6)
    assert len(depths) >= 2  # the budgets asked for stop at an exit and run every layer


def test_models_list_says_where_each_budget_stops(server: Server, checkpoint: Path, tmp_path: Path) -> None:
    engine = load_engine(checkpoint, EngineOptions(cache_dir=tmp_path))
    card = httpx.get(f"{server.url}/v1/models", headers={"X-API-Key": KEYS["quality"]}).json()["data"][0]
    points = {p["budget"]: p for p in card["budgets"]}
    assert points[1.0]["layers_run"] is None
    stops = [b for b, p in points.items() if p["layers_run"] is not None]
    assert stops and all(points[b]["layers_run"] == engine.plan(b).depth for b in points)
