"""budget=auto on a budgeted checkpoint with a decider: the engine's Auto under a ceiling (the
tier's max_budget or the request's max_budget), per-text budgets and costs in the answer, its own metrics bucket,
batching only with other auto requests, and a clear 400 from a real engine without a decider."""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.client import AsyncClient
from headbudget.engine.base import EngineBase
from headbudget.engine.decider import CascadePoint, Decider, DeciderKind, passes_cost, save_decider
from headbudget.engine.factory import load_engine, model_info
from headbudget.engine.types import Auto, BatchResult, EngineOptions
from headbudget.service.settings import parse_config
from tests.service.conftest import (
    KEYS,
    auto_burst_under_load,
    config_dict,
    headers,
    make_config,
    queued_behind_first,
    running_app,
)
from tests.service.fakes import FakeEngine
from tests.service.test_api import error_of, sample
from tests.service.test_auto import AUTO_HEADERS, auto_config
from tests.service.test_scheduling import BENCH

pytestmark = pytest.mark.anyio

TEXTS = ["a", "ab", "abc", "abcd"]  # odd lengths are "unsure" at the cheap stage and escalate


def cascade(labels: Sequence[str], checksum: str = "0" * 64, stages: tuple[float, ...] = (0.25, 0.5),
            threshold: float = 0.9) -> Decider:
    return Decider(DeciderKind.CASCADE, (CascadePoint(0.3, 0.3, 0.9, stages=stages, thresholds=(threshold,)),), 0,
                   checksum, tuple(labels))


class FakeDecider(FakeEngine):
    """A budgeted checkpoint with a cascade decider: every text runs 0.25 first (or the ceiling, if lower); a text
    of odd length escalates to 0.5 when both passes fit the ceiling (0.25 + 0.5 <= ceiling, in budget units)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.info = replace(self.info, name="fake-decider", supports_auto=True, decider=cascade(self.info.labels))
        self.auto_calls: list[tuple[list[str], float]] = []

    def passes(self, text: str, ceiling: float) -> list[float]:
        first = min(0.25, ceiling)
        return [first, 0.5] if len(text) % 2 and first + 0.5 <= ceiling + 1e-9 else [first]

    def run_auto(self, texts: Sequence[str], request: Auto) -> BatchResult:
        ceiling = request.ceiling
        with self._one_thread():
            self.auto_calls.append((list(texts), ceiling))
            preds = []
            for text in texts:
                runs = [self._predict([text], b).predictions[0] for b in self.passes(text, ceiling)]
                last, budgets = runs[-1], tuple(self.passes(text, ceiling))
                preds.append(replace(last, cost=passes_cost([r.cost for r in runs]), budget_chosen=budgets[-1],
                                     passes=budgets))
            return BatchResult(predictions=preds, budget=ceiling, heads_active=1, heads_total=8, latency_s=0.001)


def chosen(r: Any) -> list[float]:
    return [x["budget_chosen"] for x in r.json()["results"]]


async def test_auto_runs_each_text_at_its_own_budgets_under_the_tier_ceiling() -> None:
    engine = FakeDecider()
    async with running_app(engine=engine) as (client, _, _):
        query = await client.post("/classify?budget=auto", json={"texts": TEXTS}, headers=headers())
        body = await client.post("/classify", json={"texts": TEXTS, "budget": "auto"}, headers=headers())
    assert engine.auto_calls == [(TEXTS, 1.0), (TEXTS, 1.0)]  # balanced: max_budget 1.0 is the ceiling
    for r in (query, body):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["budget_source"] == "request" and out["degraded"] is False
        assert chosen(r) == [0.5, 0.25, 0.5, 0.25]  # the budget each text ended at
        for text, res in zip(TEXTS, out["results"], strict=True):
            passes = engine.passes(text, 1.0)
            # applied: the ceiling all of the text's passes together stay within (the real engine's test below
            # checks that they do)
            assert res["budget_requested"] == "auto" and res["budget_applied"] == 1.0
            assert res["budget_chosen"] == passes[-1]
            assert res["passes"] == passes
            # the cost counts every pass: the cheap one and the escalated one
            alone = [engine._predict([text], b).predictions[0].cost for b in passes]
            assert res["cost"] == pytest.approx(sum(c.total_macs for c in alone) / alone[0].total_macs_dense,
                                                abs=1e-6)


@pytest.mark.parametrize("where", ["query", "body"])
async def test_max_budget_is_a_ceiling_for_auto(where: str) -> None:
    engine = FakeDecider()
    async with running_app(engine=engine) as (client, _, _):
        if where == "query":
            r = await client.post("/classify?budget=auto&max_budget=0.5", json={"texts": TEXTS}, headers=headers())
        else:
            r = await client.post("/classify", json={"texts": TEXTS, "budget": "auto", "max_budget": 0.5},
                                  headers=headers())
        cheap = await client.post("/classify?budget=auto", json={"texts": TEXTS}, headers=headers("cheap"))
        low = await client.post("/classify?budget=auto&max_budget=0.2", json={"texts": TEXTS}, headers=headers())
    assert r.status_code == cheap.status_code == low.status_code == 200, r.text
    assert [c for _, c in engine.auto_calls] == [0.5, 0.5, 0.2]  # the request's ceiling, then cheap's max_budget
    assert chosen(r) == chosen(cheap) == [0.25] * 4  # no room to escalate: 0.25 + 0.5 > 0.5
    assert chosen(low) == [0.2] * 4  # the cheap stage is above the ceiling: one pass at the ceiling
    assert all(x["budget_applied"] == 0.5 and x["passes"] == [0.25] for x in r.json()["results"])


async def test_max_budget_refusals() -> None:
    engine = FakeDecider()
    async with running_app(engine=engine) as (client, _, _):
        over = await client.post("/classify?budget=auto&max_budget=0.9", json={"text": "x"}, headers=headers("cheap"))
        numeric = await client.post("/classify?budget=0.5&max_budget=0.5", json={"text": "x"}, headers=headers())
        latency = await client.post("/classify", json={"text": "x", "max_latency_ms": 100, "max_budget": 0.5},
                                    headers=headers())
        twice = await client.post("/classify?budget=auto&max_budget=0.5", json={"text": "x", "max_budget": 0.4},
                                  headers=headers())
        tier_numeric = await client.post("/classify?max_budget=0.5", json={"text": "x"}, headers=headers())
        out_of_range = await client.post("/classify?budget=auto&max_budget=1.5", json={"text": "x"},
                                         headers=headers())
    assert over.status_code == 403 and "above the maximum of tier 'cheap'" in error_of(over)["message"]
    for r in (numeric, latency, twice, tier_numeric, out_of_range):
        assert r.status_code == 422, r.text
    assert "ceiling of budget=auto" in error_of(numeric)["message"]
    assert engine.auto_calls == [] and engine.calls == []


async def test_auto_has_its_own_metrics_bucket_and_feedback() -> None:
    engine = FakeDecider()
    async with running_app(engine=engine) as (client, _, _):
        auto = await client.post("/classify?budget=auto", json={"texts": TEXTS}, headers=headers())
        capped = await client.post("/classify?budget=auto&max_budget=0.5", json={"texts": TEXTS},
                                   headers=headers())
        full = await client.post("/classify?budget=1.0", json={"texts": TEXTS}, headers=headers())
        fb = await client.post("/feedback", json={"request_id": auto.json()["request_id"], "index": 0,
                                                  "label": auto.json()["results"][0]["label"]}, headers=headers())
        metrics = (await client.get("/metrics")).text
        card = (await client.get("/v1/models")).json()["data"][0]
    assert auto.status_code == capped.status_code == full.status_code == fb.status_code == 200
    assert fb.json()["budget_applied"] == 1.0  # the ceiling that text ran under
    assert sample(metrics, "headbudget_inference_duration_seconds_count", budget="auto") == 2  # any ceiling
    assert sample(metrics, "headbudget_inference_duration_seconds_count", budget="1.0") == 1  # a number is a number
    assert sample(metrics, "headbudget_feedback_total", budget="auto", correct="true") == 1
    assert card["supports_auto"] is True and card["decider"] == "cascade"


async def test_auto_batches_only_with_auto_of_the_same_ceiling() -> None:
    engine = FakeDecider()
    results = await queued_behind_first(engine, 0.5, ["auto", 0.5, "auto", 1.0, "auto"])
    assert all(r.status_code == 200 for r in results), [r.text for r in results]
    assert sorted(sorted(texts) for texts, _ in engine.auto_calls) == [["t0", "t2", "t4"]]
    assert engine.auto_calls[0][1] == 1.0
    numeric = sorted(sorted(texts) for texts, b in engine.calls if texts[0].startswith(("t", "first")))
    assert ["first"] in numeric and ["t1"] in numeric and ["t3"] in numeric


async def test_auto_degrades_to_a_lower_ceiling_under_load() -> None:
    engine = FakeDecider(per_token_s=0.0005, bench=BENCH, max_length=512)
    results = await auto_burst_under_load(engine)  # 100 tokens, odd length: it escalates where the ceiling allows
    assert any(x["degraded"] for x in results) and any(not x["degraded"] for x in results)
    ceilings = [c for _, c in engine.auto_calls]
    assert len(ceilings) == 12 and min(ceilings) < 1.0 and all(c >= 0.1 for c in ceilings)  # the tier's floor
    assert all(x["passes"] == [0.25, 0.5] for x in results if not x["degraded"])  # ceiling 1.0: room to escalate
    assert all(x["budget_applied"] <= max(ceilings) for x in results)


async def test_tier_default_auto_starts_on_a_decider_checkpoint() -> None:
    engine = FakeDecider()
    async with running_app(auto_config(), engine=engine) as (client, _, _):
        r = await client.post("/classify", json={"texts": TEXTS}, headers=AUTO_HEADERS)
    assert r.status_code == 200 and r.json()["budget_source"] == "tier_default"
    assert engine.auto_calls == [(TEXTS, 1.0)]


async def test_tei_auto_runs_through_the_decider() -> None:
    engine = FakeDecider()
    async with running_app(engine=engine) as (client, _, _):
        r = await client.post("/predict?budget=auto", json={"inputs": [["a"], ["ab"]]}, headers=headers())
    assert r.status_code == 200, r.text
    assert r.headers["x-budget-applied"] == "1,1" and engine.auto_calls == [(["a", "ab"], 1.0)]


async def test_the_client_asks_for_auto_under_a_ceiling() -> None:
    engine = FakeDecider()
    async with running_app(engine=engine) as (_, app, _):
        transport = httpx.ASGITransport(app=app)
        async with AsyncClient("http://test", api_key=KEYS["balanced"], transport=transport) as hb:
            answer = await hb.classify(TEXTS, budget="auto", max_budget=0.5)
            card = (await hb.models()).data[0]
    assert [r.budget_applied for r in answer.results] == [0.5] * 4
    assert [r.budget_chosen for r in answer.results] == [0.25] * 4
    assert [r.passes for r in answer.results] == [[0.25]] * 4 and engine.auto_calls == [(TEXTS, 0.5)]
    assert card.decider == "cascade" and card.supports_auto


# -- the real engine ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["query", "body"])
async def test_auto_without_a_decider_is_a_clear_400_from_the_real_engine(tiny_checkpoint: Path, tmp_path: Path,
                                                                         where: str) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    assert engine.info.decider is None and not engine.info.supports_auto
    async with running_app(make_config(), engine=engine) as (client, _, _):  # type: ignore[arg-type]
        if where == "query":
            r = await client.post("/classify?budget=auto", json={"text": "x"}, headers=headers())
        else:
            r = await client.post("/classify", json={"text": "x", "budget": "auto", "max_budget": 0.5},
                                  headers=headers())
        ok = await client.post("/classify?budget=0.5", json={"text": "x"}, headers=headers())
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = error_of(r)
    assert err["code"] == "bad_request"
    assert "has neither" in err["message"] and "headbudget decider" in err["message"]
    assert ok.status_code == 200


async def test_real_engine_with_a_decider_answers_auto_within_the_ceiling(tiny_model_scope_checkpoint: Path,
                                                                         tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_model_scope_checkpoint, folder, ignore=shutil.ignore_patterns("onnx"))
    info = model_info(folder, EngineOptions())
    save_decider(cascade(info.labels, info.checksum, (0.15, 1.0), threshold=1.01), folder)  # all escalate
    engine = load_engine(folder, EngineOptions())
    assert isinstance(engine, EngineBase) and engine.info.decider is not None
    texts = ["one two three", "a much longer text with many more words in it than the first", "x"]
    async with running_app(parse_config(config_dict()), engine=engine) as (client, _, _):  # type: ignore[arg-type]
        rs = {c: await client.post(f"/classify?budget=auto&max_budget={c}", json={"texts": texts},
                                   headers=headers()) for c in (1.0, 0.5, 0.2)}
    for ceiling, r in rs.items():
        assert r.status_code == 200, r.text
        for res in r.json()["results"]:
            passes, n = res["passes"], res["n_tokens"]
            costs = [engine.plan(b).cost(engine.shape, n) for b in passes]
            assert passes[0] == 0.15 and res["budget_chosen"] == passes[-1] <= res["budget_applied"] == ceiling
            assert sum(c.total_macs for c in costs) <= engine.plan(ceiling).cost(engine.shape, n).total_macs
            assert res["cost"] == pytest.approx(sum(c.total_macs for c in costs) / costs[0].total_macs_dense,
                                                abs=1e-6)
    assert any(len(res["passes"]) == 2 for res in rs[1.0].json()["results"])  # with room, texts escalated


@pytest.mark.parametrize("where", ["query", "header"])
async def test_tei_takes_autos_ceiling_as_max_budget(where: str) -> None:
    engine = FakeDecider()
    url = "/predict?budget=auto" + ("&max_budget=0.5" if where == "query" else "")
    extra = {"X-Max-Budget": "0.5"} if where == "header" else {}
    async with running_app(engine=engine) as (client, _, _):
        r = await client.post(url, json={"inputs": [["a"], ["ab"]]}, headers={**headers(), **extra})
        over = await client.post("/predict?budget=auto&max_budget=0.9", json={"inputs": "a"}, headers=headers("cheap"))
        both = await client.post("/predict?budget=auto&max_budget=0.5", json={"inputs": "a"},
                                 headers={**headers(), "X-Max-Budget": "0.4"})
        bad = await client.post("/predict?budget=auto&max_budget=lots", json={"inputs": "a"}, headers=headers())
        numeric = await client.post("/predict?budget=0.5&max_budget=0.5", json={"inputs": "a"}, headers=headers())
    assert r.status_code == 200, r.text
    assert r.headers["x-budget-applied"] == "0.5,0.5" and engine.auto_calls == [(["a", "ab"], 0.5)]
    assert over.status_code == 403 and over.json()["error_type"], over.text
    for refused in (both, bad, numeric):
        assert refused.status_code == 422 and set(refused.json()) == {"error", "error_type"}, refused.text
    assert "max_budget" in bad.json()["error"] and "ceiling of budget=auto" in numeric.json()["error"]
