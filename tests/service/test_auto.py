"""budget=auto over a fake BudgetFormer-like engine (each text predicts its own budget; a number is a cap): per-text
budgets, caps, tier defaults, degradation, metrics and feedback, and the refusals on checkpoints that cannot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from headbudget.service.accounting.auth import hash_key
from headbudget.service.server import curl_command
from headbudget.service.settings import ConfigError, ServiceConfig, parse_config
from headbudget.service.state.store import AnswerRecord
from tests.service.conftest import (
    auto_burst_under_load,
    config_dict,
    headers,
    queued_behind_first,
    running_app,
    toml_of,
)
from tests.service.fakes import FakeBudgetFormer, FakeEngine
from tests.service.test_api import error_of, sample
from tests.service.test_scheduling import BENCH

pytestmark = pytest.mark.anyio

TEXTS = ["a", "ab", "abc", "abcd"]  # predicted heads per layer 2, 3, 4, 1 of 4: budgets 0.5, 0.75, 1.0, 0.25
AUTO_KEY = "hb_test_auto_key_00000000000000000000"
AUTO_HEADERS = {"X-API-Key": AUTO_KEY}


def auto_dict(**tier: Any) -> dict[str, Any]:
    """The test tiers plus tier "auto", whose default budget is auto."""
    d = config_dict()
    d["tiers"]["auto"] = {"default_budget": "auto", "max_budget": 1.0, "rate_limit": 6000, "burst": 100, **tier}
    d["keys"].append({"sha256": hash_key(AUTO_KEY), "tier": "auto", "name": "test-auto"})
    return d


def auto_config(**tier: Any) -> ServiceConfig:
    return parse_config(auto_dict(**tier))


def applied(r: Any) -> list[float]:
    return [x["budget_applied"] for x in r.json()["results"]]


def chosen(r: Any) -> list[float]:
    return [x["budget_chosen"] for x in r.json()["results"]]


async def test_auto_runs_each_text_at_its_own_budget() -> None:
    engine = FakeBudgetFormer()
    async with running_app(engine=engine) as (client, _, _):
        query = await client.post("/classify?budget=auto", json={"texts": TEXTS}, headers=headers())
        body = await client.post("/classify", json={"texts": TEXTS, "budget": "auto"}, headers=headers())
    for r in (query, body):
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["budget_source"] == "request" and out["degraded"] is False
        assert chosen(r) == [0.5, 0.75, 1.0, 0.25] == [engine.predicted_budget(t) for t in TEXTS]
        assert applied(r) == [1.0] * 4  # the budget that ran: the cap, the tier's max_budget
        for text, res in zip(TEXTS, out["results"], strict=True):
            assert res["budget_requested"] == "auto" and res["degraded"] is False
            assert (res["heads_active"], res["heads_total"]) == (2 * engine.predicted_heads(text), 8)
            assert res["attention_cost"] == pytest.approx(res["budget_chosen"])
    assert [b for _, b in engine.calls] == [1.0, 1.0]  # auto = no cap


async def test_numeric_budget_on_an_auto_checkpoint_is_a_cap() -> None:
    engine = FakeBudgetFormer()
    async with running_app(engine=engine) as (client, _, _):
        half = await client.post("/classify?budget=0.5", json={"texts": TEXTS}, headers=headers())
        full = await client.post("/classify?budget=1.0", json={"texts": TEXTS}, headers=headers())
        over = await client.post("/classify?budget=0.9", json={"text": "x"}, headers=headers("cheap"))
    assert half.status_code == full.status_code == 200
    assert chosen(half) == [0.5, 0.5, 0.5, 0.25]  # min(own budget, cap)
    assert applied(half) == [0.5] * 4  # the cap it ran under
    assert [x["heads_active"] for x in half.json()["results"]] == [4, 4, 4, 2]
    assert chosen(full) == [0.5, 0.75, 1.0, 0.25] and applied(full) == [1.0] * 4
    assert {x["budget_requested"] for x in half.json()["results"]} == {0.5}
    assert {x["budget_requested"] for x in full.json()["results"]} == {1.0}
    assert half.json()["degraded"] is False and half.json()["budget_source"] == "request"
    assert [b for _, b in engine.calls] == [0.5, 1.0]
    assert over.status_code == 403  # a cap above the tier's maximum is still refused


async def test_auto_is_capped_at_the_tier_maximum() -> None:
    engine = FakeBudgetFormer()
    async with running_app(engine=engine) as (client, _, _):
        r = await client.post("/classify?budget=auto", json={"texts": TEXTS}, headers=headers("cheap"))
        metrics = (await client.get("/metrics")).text
    assert r.status_code == 200, r.text
    assert chosen(r) == [0.5, 0.5, 0.5, 0.25] and applied(r) == [0.5] * 4  # cheap: max_budget 0.5
    assert {x["budget_requested"] for x in r.json()["results"]} == {"auto"} and r.json()["degraded"] is False
    assert [b for _, b in engine.calls] == [0.5]
    assert sample(metrics, "headbudget_inference_duration_seconds_count", budget="0.5") == 1  # it ran as 0.5


async def test_tier_default_auto() -> None:
    engine = FakeBudgetFormer()
    async with running_app(auto_config(), engine=engine) as (client, _, _):
        r = await client.post("/classify", json={"texts": TEXTS}, headers=AUTO_HEADERS)
        explicit = await client.post("/classify?budget=0.25", json={"texts": TEXTS}, headers=AUTO_HEADERS)
    assert r.status_code == 200, r.text
    assert r.json()["budget_source"] == "tier_default" and r.json()["tier"] == "auto"
    assert {x["budget_requested"] for x in r.json()["results"]} == {"auto"}
    assert chosen(r) == [engine.predicted_budget(t) for t in TEXTS] and applied(r) == [1.0] * 4
    assert explicit.status_code == 200 and applied(explicit) == chosen(explicit) == [0.25] * 4
    assert [b for _, b in engine.calls] == [1.0, 0.25]


async def test_auto_bucket_in_metrics_and_feedback() -> None:
    sweep = {"points": [{"budget": 0.5, "accuracy_hard": 0.8}, {"budget": 1.0, "accuracy_hard": 0.9}]}
    async with running_app(engine=FakeBudgetFormer(sweep=sweep)) as (client, _, _):
        auto = await client.post("/classify?budget=auto", json={"texts": TEXTS}, headers=headers())
        capped = await client.post("/classify?budget=0.5", json={"texts": TEXTS}, headers=headers())
        fb_auto = await client.post("/feedback", json={"request_id": auto.json()["request_id"], "index": 1,
                                                       "label": auto.json()["results"][1]["label"]},
                                    headers=headers())
        fb_capped = await client.post("/feedback", json={"request_id": capped.json()["request_id"], "index": 3,
                                                         "label": capped.json()["results"][3]["label"]},
                                      headers=headers())
        metrics = (await client.get("/metrics")).text
    assert fb_auto.status_code == fb_capped.status_code == 200
    assert fb_auto.json()["budget_applied"] == 1.0 and fb_capped.json()["budget_applied"] == 0.5  # what ran: the cap
    assert sample(metrics, "headbudget_inference_duration_seconds_count", budget="auto") == 1
    assert sample(metrics, "headbudget_inference_duration_seconds_count", budget="0.5") == 1
    assert 'budget="1.0"' not in metrics  # on this checkpoint an uncapped run is "auto"
    assert sample(metrics, "headbudget_feedback_total", budget="auto", correct="true") == 1
    assert sample(metrics, "headbudget_online_accuracy", budget="auto") == 1.0
    assert sample(metrics, "headbudget_feedback_total", budget="0.5", correct="true") == 1  # the cap, not 0.25
    assert sample(metrics, "headbudget_offline_accuracy", budget="auto") == 0.9
    assert sample(metrics, "headbudget_offline_accuracy", budget="0.5") == 0.8


async def test_auto_and_an_uncapped_budget_share_a_batch() -> None:
    engine = FakeBudgetFormer()
    results = await queued_behind_first(engine, 0.5, ["auto", 1.0, 0.5, "auto", 0.6])
    assert all(r.status_code == 200 for r in results)
    batches = sorted(sorted(texts) for texts, _ in engine.calls)
    assert batches == [["first"], ["t0", "t1", "t3"], ["t2", "t4"]]  # caps 4 and 2 heads per layer


async def test_auto_degrades_to_a_lower_cap_under_load() -> None:
    engine = FakeBudgetFormer(per_token_s=0.0005, bench=BENCH, max_length=512)
    # The burst's 100-token text predicts all 4 heads per layer, so a cap bites.
    assert engine.predicted_budget(" ".join(["w"] * 98)) == 1.0
    results = await auto_burst_under_load(engine)
    degraded = [x for x in results if x["degraded"]]
    assert degraded and all(x["budget_applied"] < 1.0 for x in degraded)
    assert all(x["budget_chosen"] <= engine.run_fraction(x["budget_applied"]) for x in results)  # within the cap
    assert all(x["budget_chosen"] >= 0.25 for x in results)  # one head per layer at the lowest cap
    assert all(x["budget_applied"] >= 0.1 for x in results)  # never below the tier's min_budget
    assert min(b for _, b in engine.calls) < 1.0


@pytest.mark.parametrize("where", ["query", "body"])
async def test_auto_on_a_plain_checkpoint_is_400_json(where: str) -> None:
    async with running_app() as (client, _, engine):
        if where == "query":
            r = await client.post("/classify?budget=auto", json={"text": "x"}, headers=headers())
        else:
            r = await client.post("/classify", json={"text": "x", "budget": "auto"}, headers=headers())
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"
    err = error_of(r)
    assert err["code"] == "bad_request" and "predicts its own budget" in err["message"]
    assert engine.calls == []


async def test_tier_default_auto_on_a_plain_checkpoint_refuses_to_start() -> None:
    engine = FakeEngine()
    with pytest.raises(ConfigError, match=r"tier 'auto': default_budget = \"auto\".*'fake'"):
        async with running_app(auto_config(), engine=engine):
            pass
    assert engine.closed  # the engine thread was stopped, not left behind


async def test_reload_refuses_an_auto_default_the_checkpoint_cannot_serve(tmp_path: Path) -> None:
    path = tmp_path / "service.toml"
    async with running_app(engine=FakeEngine()) as (_, app, _):
        runtime = app.state.runtime
        runtime.config_path = path
        path.write_text(toml_of(auto_dict()))
        assert runtime.reload() is False and "auto" not in runtime.config.tiers  # the old config stays
    async with running_app(engine=FakeBudgetFormer()) as (_, app, _):
        app.state.runtime.config_path = path
        assert app.state.runtime.reload() is True and "auto" in app.state.runtime.config.tiers


async def test_openapi_documents_auto() -> None:
    async with running_app(engine=FakeBudgetFormer()) as (client, _, _):
        spec = (await client.get("/openapi.json")).json()
        card = (await client.get("/v1/models")).json()["data"][0]
    schemas = spec["components"]["schemas"]
    requested = schemas["TextResult"]["properties"]["budget_requested"]
    assert {"type": "number"} in requested["anyOf"] and any(s.get("const") == "auto" for s in requested["anyOf"])
    assert schemas["ClassifyResponse"]["properties"]["budget_source"]["enum"] == \
        ["request", "tier_default", "max_latency_ms"]
    assert card["supports_auto"] is True


def test_tier_config_accepts_auto() -> None:
    config = auto_config(max_budget=0.75, min_budget=0.5)
    tier = config.tier("auto")
    assert tier.default_budget == "auto" and tier.default_cap == 0.75 and config.auto_tiers() == ["auto"]
    config.check_model("m", supports_auto=True)
    with pytest.raises(ConfigError, match="tier 'auto'"):
        config.check_model("m", supports_auto=False)
    with pytest.raises(ConfigError, match="min_budget 0.8 is above max_budget"):
        auto_config(max_budget=0.75, min_budget=0.8)
    with pytest.raises(ConfigError, match="default_budget"):
        auto_config(default_budget="half")
    assert "budget=auto" in curl_command("0.0.0.0", 8000, "hb_x", "auto")


def test_answer_records_keep_the_bucket_and_read_old_ones() -> None:
    record = AnswerRecord("o", "t", ["x", "y"], [0.75, 0.25], bucket="auto")
    assert AnswerRecord.from_dict(record.to_dict()) == record and record.budget_label(1) == "auto"
    old = AnswerRecord.from_dict({"owner": "o", "tier": "t", "labels": ["x"], "budgets": [0.5]})
    assert old.bucket == "" and old.budget_label(0) == "0.5"
