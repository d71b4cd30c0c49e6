"""The HTTP API in process over the fake engine: every status code, the response fields, headers, metrics."""

from __future__ import annotations

import gzip
import json

import pytest

from headbudget.service.settings import parse_config
from tests.service.conftest import KEYS, config_dict, headers, make_config, queued_behind_first, running_app
from tests.service.fakes import FakeEngine

pytestmark = pytest.mark.anyio


def error_of(r: object) -> dict[str, str]:
    body = r.json()  # type: ignore[attr-defined]
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"}, body
    return body["error"]  # type: ignore[no-any-return]


async def test_classify_single_text_fields_and_headers() -> None:
    async with running_app() as (client, _, engine):
        r = await client.post("/classify?budget=0.5", json={"text": "a fine film"}, headers=headers())
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == {"name": "fake", "checksum": "0" * 64}
    assert body["request_id"] == r.headers["x-request-id"]
    assert body["tier"] == "balanced" and body["budget_source"] == "request" and body["degraded"] is False
    (res,) = body["results"]
    assert set(res) == {"label", "scores", "budget_requested", "budget_applied", "heads_active", "heads_total",
                        "neurons_active", "neurons_total", "cost", "attention_cost", "truncated", "n_tokens",
                        "latency_ms", "degraded", "budget_chosen", "passes", "charge"}
    assert res["label"] in ("negative", "positive") and abs(sum(res["scores"].values()) - 1) < 1e-6
    assert res["budget_requested"] == res["budget_applied"] == 0.5
    assert res["budget_chosen"] is None  # a checkpoint with one plan per budget chooses nothing per text
    assert res["passes"] is None  # only auto through a decider lists its passes
    assert (res["heads_active"], res["heads_total"]) == (4, 8) and res["attention_cost"] == pytest.approx(0.5)
    # cost is the whole forward pass's fraction: the fake's attention is a third of it, the rest always runs.
    assert res["cost"] == pytest.approx((0.5 + 2) / 3, abs=1e-6)
    assert engine.calls == [(["a fine film"], 0.5)]


async def test_texts_in_order_and_budget_in_body_and_tier_default() -> None:
    async with running_app() as (client, _, engine):
        r = await client.post("/classify", json={"texts": ["one", "two two", "three"], "budget": 0.25},
                              headers=headers())
        d = await client.post("/classify", json={"text": "x"}, headers=headers("cheap"))
    assert r.status_code == 200 and [x["n_tokens"] for x in r.json()["results"]] == [3, 4, 3]
    assert all(x["heads_active"] == 2 for x in r.json()["results"])
    assert d.json()["budget_source"] == "tier_default" and d.json()["results"][0]["budget_applied"] == 0.25


async def test_bearer_token_and_request_id_passthrough() -> None:
    async with running_app() as (client, _, _):
        r = await client.post("/classify", json={"text": "x"},
                              headers={"Authorization": f"Bearer {KEYS['quality']}", "X-Request-ID": "abc-123"})
    assert r.status_code == 200 and r.json()["tier"] == "quality"
    assert r.headers["x-request-id"] == "abc-123" == r.json()["request_id"]


@pytest.mark.parametrize("hdrs, message", [
    ({}, "API key is required"),
    ({"X-API-Key": "hb_wrong"}, "unknown API key"),
    ({"Authorization": "Basic abc"}, "Bearer"),
    ({"Authorization": "Bearer hb_wrong"}, "unknown API key"),
])
async def test_401(hdrs: dict[str, str], message: str) -> None:
    async with running_app() as (client, _, engine):
        r = await client.post("/classify", json={"text": "x"}, headers=hdrs)
    assert r.status_code == 401 and "www-authenticate" in r.headers
    err = error_of(r)
    assert err["code"] == "unauthorized" and message in err["message"]
    assert engine.calls == []


async def test_anonymous_tier_only_when_configured() -> None:
    d = config_dict()
    d["development"] = {"anonymous_tier": "cheap"}
    async with running_app(parse_config(d)) as (client, _, _):
        r = await client.post("/classify", json={"text": "x"})
        wrong = await client.post("/classify", json={"text": "x"}, headers={"X-API-Key": "nope"})
    assert r.status_code == 200 and r.json()["tier"] == "cheap"
    assert wrong.status_code == 401


async def test_403_names_the_maximum() -> None:
    async with running_app() as (client, _, engine):
        r = await client.post("/classify?budget=0.9", json={"text": "x"}, headers=headers("cheap"))
    assert r.status_code == 403
    err = error_of(r)
    assert err["code"] == "forbidden" and "0.5" in err["message"] and "cheap" in err["message"]
    assert engine.calls == []


async def test_429_with_retry_after() -> None:
    d = config_dict()
    d["tiers"]["cheap"].update(rate_limit=60, burst=2)
    async with running_app(parse_config(d)) as (client, _, _):
        codes = [(await client.post("/classify", json={"text": "x"}, headers=headers("cheap"))) for _ in range(3)]
        other = await client.post("/classify", json={"text": "x"}, headers=headers("balanced"))
    assert [r.status_code for r in codes] == [200, 200, 429]
    assert int(codes[2].headers["retry-after"]) >= 1 and error_of(codes[2])["code"] == "rate_limited"
    assert other.status_code == 200  # limits are per key


BAD_BODIES = [
    (b"{not json", 400, "malformed_json"),
    (b'{"text": 5}', 422, "invalid_request"),
    (b'{"text": ""}', 422, "invalid_request"),
    (b'{"text": "  \\n\\t "}', 422, "invalid_request"),
    (b'{"texts": []}', 422, "invalid_request"),
    (b'{"texts": ["ok", " "]}', 422, "invalid_request"),
    (json.dumps({"texts": ["t"] * 65}).encode(), 422, "invalid_request"),
    (b'{"text": "x", "budget": NaN}', 422, "invalid_request"),
    (b'{"text": "x", "budget": Infinity}', 422, "invalid_request"),
    (b'{"text": "x", "budget": 1.5}', 422, "invalid_request"),
    (b'{"text": "x", "budget": 0.05}', 422, "invalid_request"),
    (b'{"text": "x", "budget": "half"}', 422, "invalid_request"),
    (b'{"text": "x", "colour": "red"}', 422, "invalid_request"),
    (b'{"text": "x", "texts": ["y"]}', 422, "invalid_request"),
    (b'{}', 422, "invalid_request"),
    (b'[1, 2]', 422, "invalid_request"),
    (b'{"text": "x", "budget": 0.5, "max_latency_ms": 10}', 422, "invalid_request"),
    (b'{"text": "x", "max_latency_ms": -1}', 422, "invalid_request"),
    (b'{"text": "x", "budget": "auto"}', 400, "bad_request"),
]


@pytest.mark.parametrize("body, status, code", BAD_BODIES)
async def test_bad_input_gets_4xx_json(body: bytes, status: int, code: str) -> None:
    async with running_app() as (client, _, engine):
        r = await client.post("/classify", content=body,
                              headers={**headers(), "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert error_of(r)["code"] == code
    assert engine.calls == []


@pytest.mark.parametrize("query", ["budget=nan", "budget=inf", "budget=-1", "budget=2", "budget=abc",
                                   "max_latency_ms=0", "max_latency_ms=nan"])
async def test_bad_query_budget(query: str) -> None:
    async with running_app() as (client, _, _):
        r = await client.post(f"/classify?{query}", json={"text": "x"}, headers=headers())
    assert r.status_code == 422 and error_of(r)["code"] == "invalid_request"


@pytest.mark.parametrize("fast_path", [True, False])
@pytest.mark.parametrize("query, message", [
    ("budgte=0.25", "query.budgte: not a parameter of this route (it takes budget, max_latency_ms, max_budget)"),
    ("budget=0.25&budget=0.5", "query.budget: given more than once"),
    ("budget=abc&budget=0.5", "query.budget: given more than once"),  # FastAPI reads only the last
    ("max_budget=0.5&budget=auto&colour=red", "query.colour: not a parameter"),
])
async def test_a_misspelt_or_repeated_query_parameter_is_refused(fast_path: bool, query: str, message: str) -> None:
    """Not run at the tier's default (or at the last value) without a word."""
    async with running_app(make_config(fast_path=fast_path)) as (client, _, engine):
        r = await client.post(f"/classify?{query}", json={"text": "x"}, headers=headers())
    assert r.status_code == 422 and error_of(r)["code"] == "invalid_request"
    assert error_of(r)["message"].startswith(message)
    assert engine.calls == []


async def test_a_key_header_repeated_with_different_keys_is_refused() -> None:
    async with running_app() as (client, _, engine):
        two = await client.post("/classify", json={"text": "x"},
                                headers=[("X-API-Key", KEYS["cheap"]), ("X-API-Key", KEYS["quality"])])
        bearers = await client.post("/classify", json={"text": "x"}, headers=[
            ("Authorization", f"Bearer {KEYS['cheap']}"), ("Authorization", "Bearer hb_not_a_key")])
        same = await client.post("/classify", json={"text": "x"},
                                 headers=[("X-API-Key", KEYS["cheap"]), ("X-API-Key", KEYS["cheap"])])
    for r in (two, bearers):
        assert r.status_code == 401 and "more than once with different values" in error_of(r)["message"]
    assert same.status_code == 200 and same.json()["tier"] == "cheap"
    assert len(engine.calls) == 1


async def test_budget_in_query_and_body_conflict_and_wrong_content_type() -> None:
    async with running_app() as (client, _, _):
        both = await client.post("/classify?budget=0.5", json={"text": "x", "budget": 0.6}, headers=headers())
        plain = await client.post("/classify", content=b'{"text": "x"}',
                                  headers={**headers(), "Content-Type": "text/plain"})
    assert both.status_code == 422 and "not both" in error_of(both)["message"]
    assert plain.status_code == 415 and error_of(plain)["code"] == "unsupported_media_type"


async def test_booleans_are_not_numbers_and_compressed_bodies_are_415() -> None:
    async with running_app() as (client, _, engine):
        flags = [await client.post("/classify", json={"text": "x", field: True}, headers=headers())
                 for field in ("budget", "max_budget", "max_latency_ms")]
        gzipped = await client.post("/classify", content=gzip.compress(b'{"text": "x"}'),
                                    headers={**headers(), "Content-Type": "application/json",
                                             "Content-Encoding": "gzip"})
        identity = await client.post("/classify", content=b'{"text": "x"}', headers={
            **headers(), "Content-Type": "application/json", "Content-Encoding": "identity"})
    for r, field in zip(flags, ("budget", "max_budget", "max_latency_ms"), strict=True):
        assert r.status_code == 422 and error_of(r)["message"].startswith(f"{field}: "), r.text
    assert gzipped.status_code == 415 and gzipped.headers["accept-encoding"] == "identity"
    assert "'gzip' is not supported" in error_of(gzipped)["message"]
    assert identity.status_code == 200
    assert len(engine.calls) == 1  # only the uncompressed one ran


async def test_body_over_limit_is_413() -> None:
    async with running_app() as (client, _, engine):
        big = json.dumps({"text": "x" * (1 << 20)}).encode()
        r = await client.post("/classify", content=big, headers={**headers(), "Content-Type": "application/json"})

        async def chunks():  # no Content-Length: the limit is counted while reading
            for _ in range(20):
                yield b"x" * 65536

        streamed = await client.post("/classify", content=chunks(),
                                     headers={**headers(), "Content-Type": "application/json"})
    assert r.status_code == 413 and error_of(r)["code"] == "payload_too_large"
    assert streamed.status_code == 413
    assert engine.calls == []


async def test_long_text_is_truncated_not_refused() -> None:
    async with running_app(engine=FakeEngine(max_length=8)) as (client, _, _):
        r = await client.post("/classify", json={"text": "word " * 50}, headers=headers())
    assert r.status_code == 200 and r.json()["results"][0]["truncated"] is True


async def test_auto_budget_400_on_plain_checkpoint() -> None:
    async with running_app() as (client, _, engine):
        r = await client.post("/classify?budget=auto", json={"text": "x"}, headers=headers())
    assert r.status_code == 400 and error_of(r)["code"] == "bad_request"
    assert "auto" in error_of(r)["message"] and engine.calls == []  # more in test_auto.py


async def test_unknown_route_and_method() -> None:
    async with running_app() as (client, _, _):
        r404 = await client.get("/nope")
        r405 = await client.get("/classify")
    assert r404.status_code == 404 and error_of(r404)["code"] == "not_found"
    assert r405.status_code == 405 and error_of(r405)["code"] == "method_not_allowed"


async def test_health_ready_models() -> None:
    sweep = {"dense_accuracy": 0.9, "points": [{"budget": 0.5, "hard_cost": 0.5, "accuracy_hard": 0.8},
                                               {"budget": 1.0, "hard_cost": 1.0, "accuracy_hard": 0.9}]}
    bench = {"seq_len": 16, "batch_size": 1, "rows": [{"budget": 0.5, "latency_ms": 2.0},
                                                      {"budget": 1.0, "latency_ms": 4.0}]}
    async with running_app(engine=FakeEngine(sweep=sweep, bench=bench)) as (client, _, engine):
        h, rd, m = await client.get("/healthz"), await client.get("/readyz"), await client.get("/v1/models")
    assert engine.warmed and engine.closed
    assert h.json() == {"status": "ok"}
    assert rd.status_code == 200 and rd.json()["status"] == "ready" and rd.json()["checks"]["model"] == "ready"
    card = m.json()["data"][0]
    assert card["id"] == "fake" and card["heads_total"] == 8 and card["dense_accuracy"] == 0.9
    assert [(p["budget"], p["heads_active"], p["accuracy"]) for p in card["budgets"]] == [(0.5, 4, 0.8), (1.0, 8, 0.9)]
    assert card["budgets"][0]["latency_ms"] == pytest.approx(2.0)


async def test_feedback_flow_and_errors() -> None:
    async with running_app() as (client, _, _):
        r = await client.post("/classify", json={"texts": ["a", "b"], "budget": 0.5}, headers=headers())
        rid, labels = r.json()["request_id"], [x["label"] for x in r.json()["results"]]
        ok = await client.post("/feedback", json={"request_id": rid, "label": labels[0]}, headers=headers())
        wrong = await client.post("/feedback", json={"request_id": rid, "index": 1,
                                                     "label": "negative" if labels[1] == "positive" else "positive"},
                                  headers=headers())
        again = await client.post("/feedback", json={"request_id": rid, "label": labels[0]}, headers=headers())
        other_key = await client.post("/feedback", json={"request_id": rid, "label": labels[0]},
                                      headers=headers("quality"))
        unknown = await client.post("/feedback", json={"request_id": "nope", "label": "positive"},
                                    headers=headers())
        bad_label = await client.post("/feedback", json={"request_id": rid, "label": "maybe"}, headers=headers())
        bad_index = await client.post("/feedback", json={"request_id": rid, "label": "positive", "index": 2},
                                      headers=headers())
        anon = await client.post("/feedback", json={"request_id": rid, "label": "positive"})
        metrics = (await client.get("/metrics")).text
    assert ok.status_code == 200 and ok.json() == {"request_id": rid, "index": 0, "correct": True,
                                                   "budget_applied": 0.5}
    assert wrong.status_code == 200 and wrong.json()["correct"] is False
    assert again.status_code == 409 and error_of(again)["code"] == "conflict"
    assert other_key.status_code == 404 and unknown.status_code == 404
    assert bad_label.status_code == 422 and "maybe" in error_of(bad_label)["message"]
    assert bad_index.status_code == 404 and anon.status_code == 401
    assert 'headbudget_feedback_total{budget="0.5",correct="true"} 1.0' in metrics
    assert 'headbudget_feedback_total{budget="0.5",correct="false"} 1.0' in metrics
    assert 'headbudget_online_accuracy{budget="0.5"} 0.5' in metrics


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample in exposition text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, rest = head.partition("{")
        got = ",".join(sorted(rest.rstrip("}").split(","))) if rest else ""
        if metric == name and got == want:
            return float(value)
    return 0.0


async def test_metrics_move_with_requests() -> None:
    async with running_app(make_config()) as (client, _, _):
        before = (await client.get("/metrics")).text
        await client.post("/classify?budget=0.5", json={"texts": ["a", "b"]}, headers=headers())
        await client.post("/classify", json={"text": "x"}, headers={"X-API-Key": "bad"})
        after = (await client.get("/metrics")).text
    assert sample(after, "headbudget_requests_total", tier="balanced", status="200") == \
        sample(before, "headbudget_requests_total", tier="balanced", status="200") + 1
    assert sample(after, "headbudget_requests_total", tier="none", status="401") == 1
    assert sample(after, "headbudget_request_duration_seconds_count", tier="balanced") == 1
    assert sample(after, "headbudget_inference_duration_seconds_count", budget="0.5") == 1
    assert sample(after, "headbudget_batch_size_sum") == 2
    assert sample(after, "headbudget_attention_cost_ratio_count", tier="balanced") == 2
    assert sample(after, "headbudget_attention_macs_total", tier="balanced") > 0
    assert sample(after, "headbudget_attention_macs_saved_total", tier="balanced") > 0
    assert "headbudget_queue_depth 0.0" in after
    for name in ("headbudget_degraded_total", "headbudget_online_accuracy", "headbudget_offline_accuracy"):
        assert f"# TYPE {name.removesuffix('_total')}" in after
    assert KEYS["balanced"] not in after and "test-balanced" not in after  # tiers, never keys


async def test_latency_targets_are_histogram_buckets() -> None:
    async with running_app() as (client, _, _):
        await client.post("/classify", json={"text": "x"}, headers=headers("flex"))
        text = (await client.get("/metrics")).text
    assert 'headbudget_request_duration_seconds_bucket{le="0.2",tier="flex"} 1.0' in text


async def test_concurrent_requests_share_a_batch_by_mask() -> None:
    engine = FakeEngine()
    results = await queued_behind_first(engine, 1.0, [0.5, 0.25, 0.5, 0.25, 0.52])
    assert all(r.status_code == 200 for r in results)
    batches = sorted(sorted(texts) for texts, _ in engine.calls)
    assert batches == [["first"], ["t0", "t2", "t4"], ["t1", "t3"]]  # 0.5 and 0.52 keep the same 4 heads
    assert [r.json()["results"][0]["budget_applied"] for r in results] == [1.0, 0.5, 0.25, 0.5, 0.25, 0.52]


async def test_models_latency_is_monotone_and_names_its_length() -> None:
    """A bucket's correction may pull a larger budget's estimate below a smaller one's (here 0.6 looks faster than
    0.5 after the passes it saw); /v1/models lists no budget as faster than a smaller one, and says for what
    text length its figures hold."""
    sweep = {"dense_accuracy": 0.9, "points": [{"budget": b, "hard_cost": b, "accuracy_hard": 0.8}
                                               for b in (0.5, 0.6, 1.0)]}
    bench = {"seq_len": 16, "batch_size": 1, "rows": [{"budget": b, "latency_ms": 4.0 * b} for b in (0.5, 0.6, 1.0)]}
    async with running_app(engine=FakeEngine(sweep=sweep, bench=bench)) as (client, app, _):
        latency = app.state.runtime.batcher.latency
        for _ in range(20):
            latency.observe(0.5, 16, 2.0)  # 0.5 ran at its table time
            latency.observe(0.6, 16, 1.0)  # 0.6 at under half its own
        raw = [latency.estimate_ms(b, 16) for b in (0.5, 0.6, 1.0)]
        card = (await client.get("/v1/models")).json()["data"][0]
    assert raw[1] < raw[0]  # what a bucket alone would say
    shown = [p["latency_ms"] for p in card["budgets"]]
    assert shown == sorted(shown) and shown[1] == pytest.approx(shown[0])
    assert {p["latency_tokens"] for p in card["budgets"]} == {16}


async def test_openapi_says_what_a_budget_buys() -> None:
    """The budget is a share of the whole model's multiply-adds, not of the attention heads alone."""
    async with running_app() as (client, _, _):
        spec = (await client.get("/openapi.json")).json()
    text = json.dumps(spec).lower()
    assert "attention compute" not in text and "attention heads to run" not in text
    assert "only the attention heads" not in text
    budget = spec["components"]["schemas"]["ClassifyRequest"]["properties"]["budget"]["description"]
    assert "multiply-adds" in budget and "neurons" in budget
    assert "multiply-adds" in spec["info"]["description"]
    for path, method in (("/classify", "post"), ("/v1/models", "get")):
        assert "neurons" in spec["paths"][path][method]["description"], path
    # "attention" only where a text names the attention blocks' own share, or checkpoints that budget only them
    attention = [d for d in _descriptions(spec) if "attention" in d.lower()]
    assert attention and all("attention blocks" in d or "attention-scope" in d for d in attention), attention


def _descriptions(node: object) -> list[str]:
    """Every description in an OpenAPI document."""
    if isinstance(node, dict):
        own = [node["description"]] if isinstance(node.get("description"), str) else []
        return own + [d for v in node.values() for d in _descriptions(v)]
    if isinstance(node, list):
        return [d for v in node for d in _descriptions(v)]
    return []


async def test_405_allows_every_method_of_the_path_and_the_document_lists_them() -> None:
    """Found by schemathesis: GET / (TEI's health) answered but was left out of the document, and a 405 at / said
    `Allow: POST`, the first route's methods only."""
    async with running_app() as (client, _, _):
        doc = (await client.get("/openapi.json")).json()
        answers = {m: (await client.request(m, "/")).status_code for m in ("GET", "OPTIONS", "PUT")}
        wrong = await client.request("OPTIONS", "/")
        classify = await client.request("DELETE", "/classify")
    assert sorted(doc["paths"]["/"]) == ["get", "post"]
    assert answers == {"GET": 200, "OPTIONS": 405, "PUT": 405}
    assert wrong.headers["allow"] == "GET, POST" and error_of(wrong)["code"] == "method_not_allowed"
    assert classify.headers["allow"] == "POST"
