"""End to end: `headbudget serve` in a subprocess on the real engine, talked to over HTTP on loopback."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.client import Client, HeadbudgetError
from tests.conftest import make_random_checkpoint
from tests.service.conftest import (
    HOST,
    KEYS,
    Server,
    config_dict,
    engine_factory_available,
    free_port,
    redis_process,
    service_env,
    start_server,
    stop_process,
    toml_of,
)
from tests.service.test_api import sample

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

HEAVY = " ".join(["word"] * 200)  # ~200 tokens
EXTRA_KEYS = {"strict": "hb_test_strict_key_0000000000000000000", "limited": "hb_test_limited_key_00000000000000000"}


def e2e_config(**flex: Any) -> dict[str, Any]:
    d = config_dict(max_wait_ms=5.0, max_batch_size=8, queue_size=256)
    d["tiers"]["flex"].update(flex)
    d["tiers"]["strict"] = {"default_budget": 1.0, "max_budget": 1.0, "priority": 0, "max_queue": 2,
                            "rate_limit": 6000, "burst": 100}
    d["tiers"]["limited"] = {"default_budget": 0.5, "max_budget": 1.0, "rate_limit": 60, "burst": 2}
    from headbudget.service.accounting.auth import hash_key

    d["keys"] += [{"sha256": hash_key(k), "tier": t, "name": f"test-{t}"} for t, k in EXTRA_KEYS.items()]
    return d


def h(tier: str) -> dict[str, str]:
    return {"X-API-Key": {**KEYS, **EXTRA_KEYS}[tier]}


@pytest.fixture(scope="module")
def attn_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Random weights shaped so that attention dominates the compute (4 x 8 heads, width 256, narrow FFN):
    a budget changes latency a lot, which the degrade and max_latency tests need to see."""
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "attn", seed=5, hidden_size=256, n_layers=4,
                                  n_heads=8, intermediate_size=32, max_position=256)


@pytest.fixture(scope="module")
def server(attn_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(attn_checkpoint, toml_of(e2e_config()), tmp_path_factory.mktemp("e2e"),
                      extra=("--print-curl",)) as s:
        yield s


async def burst(url: str, requests: list[tuple[str, dict[str, Any], str]]) -> list[httpx.Response]:
    """Send (path, json body, tier) requests at once; answers in the same order."""
    limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as c:
        return list(await asyncio.gather(*[c.post(p, json=b, headers=h(t)) for p, b, t in requests]))


def test_classify_fields_and_status_codes(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        ok = c.post("/classify?budget=0.5", json={"text": "a fine film"}, headers=h("balanced"))
        assert ok.status_code == 200
        body = ok.json()
        assert body["request_id"] == ok.headers["x-request-id"] and body["model"]["name"] == "attn"
        assert len(body["model"]["checksum"]) == 64
        res = body["results"][0]
        assert res["budget_requested"] == res["budget_applied"] == 0.5 and res["heads_total"] == 32
        assert res["heads_active"] == 16 and 0 < res["cost"] <= 1 and res["latency_ms"] > 0
        long = c.post("/classify", json={"text": " ".join(["word"] * 400)}, headers=h("balanced"))
        assert long.json()["results"][0]["truncated"] is True
        codes = {
            400: c.post("/classify", content=b"{oops", headers={**h("balanced"), "Content-Type": "application/json"}),
            401: c.post("/classify", json={"text": "x"}),
            403: c.post("/classify?budget=1.0", json={"text": "x"}, headers=h("cheap")),
            404: c.post("/feedback", json={"request_id": "nope", "label": "positive"}, headers=h("balanced")),
            405: c.get("/classify"),
            413: c.post("/classify", content=b"x" * (1 << 20 + 1), headers={**h("balanced"),
                                                                              "Content-Type": "application/json"}),
            415: c.post("/classify", content=b'{"text": "x"}', headers={**h("balanced"), "Content-Type": "text/plain"}),
            422: c.post("/classify", json={"text": "   "}, headers=h("balanced")),
        }
        for status, r in codes.items():
            assert r.status_code == status, (status, r.text)
            assert set(r.json()["error"]) == {"code", "message"}
        fb = c.post("/feedback", json={"request_id": body["request_id"], "label": res["label"]}, headers=h("balanced"))
        again = c.post("/feedback", json={"request_id": body["request_id"], "label": res["label"]},
                       headers=h("balanced"))
        assert fb.status_code == 200 and fb.json()["correct"] is True and again.status_code == 409
        limited = [c.post("/classify", json={"text": "x"}, headers=h("limited")) for _ in range(3)]
        assert [r.status_code for r in limited] == [200, 200, 429] and int(limited[2].headers["retry-after"]) >= 1
        assert c.get("/healthz").json() == {"status": "ok"} and c.get("/readyz").json()["status"] == "ready"
        models = c.get("/v1/models").json()["data"][0]
        assert models["heads_total"] == 32 and len(models["budgets"]) >= 5


def test_lower_budget_runs_fewer_heads(server: Server) -> None:
    with Client(server.url, api_key=KEYS["quality"]) as hb:
        answers = {b: hb.classify(HEAVY, budget=b).results[0] for b in (1.0, 0.5, 0.25, 0.1)}
    heads = [answers[b].heads_active for b in (1.0, 0.5, 0.25, 0.1)]
    costs = [answers[b].cost for b in (1.0, 0.5, 0.25, 0.1)]
    assert heads == sorted(heads, reverse=True) and heads[0] == 32 and heads[-1] < heads[1] < heads[0]
    assert costs == sorted(costs, reverse=True) and costs[0] == pytest.approx(1.0)


def test_two_concurrent_budgets_are_both_honoured(server: Server) -> None:
    rs = asyncio.run(burst(server.url, [("/classify?budget=0.25", {"text": "same window"}, "quality"),
                                        ("/classify?budget=1.0", {"text": "same window"}, "quality")] * 3))
    assert all(r.status_code == 200 for r in rs)
    for r, b in zip(rs, [0.25, 1.0] * 3, strict=True):
        res = r.json()["results"][0]
        assert res["budget_applied"] == b and res["heads_active"] == (8 if b == 0.25 else 32)


def test_tighter_max_latency_picks_a_lower_budget(server: Server) -> None:
    with Client(server.url, api_key=KEYS["quality"]) as hb:
        hb.classify(HEAVY, budget=1.0)  # let the service observe this input length
        loose = hb.classify(HEAVY, max_latency_ms=10_000)
        tight = hb.classify(HEAVY, max_latency_ms=0.01)
    assert loose.budget_source == tight.budget_source == "max_latency_ms" and tight.max_latency_ms == 0.01
    assert loose.results[0].budget_applied == 1.0
    assert tight.results[0].budget_applied < loose.results[0].budget_applied
    assert tight.results[0].heads_active < loose.results[0].heads_active


def test_quality_is_served_first_under_a_burst(server: Server) -> None:
    requests = [("/classify", {"texts": [HEAVY] * 4, "budget": 0.5}, "cheap") for _ in range(16)]
    requests += [("/classify", {"texts": [HEAVY] * 4}, "quality") for _ in range(4)]
    rs = asyncio.run(burst(server.url, requests))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
    cheap_wait = statistics.mean(r.json()["queue_ms"] for r in rs[:16])
    quality_wait = statistics.mean(r.json()["queue_ms"] for r in rs[16:])
    assert quality_wait < cheap_wait, (quality_wait, cheap_wait)


def test_degrading_tier_answers_lower_budgets_instead_of_503(server: Server) -> None:
    with Client(server.url, api_key=KEYS["flex"]) as hb:  # calibrate: what one request costs here, now
        for b in (1.0, 0.1, 1.0, 0.1):
            hb.classify([HEAVY] * 4, budget=b)
        full = statistics.median(hb.classify([HEAVY] * 4, budget=1.0).results[0].latency_ms for _ in range(3))
    # The burst must take about twice the target at budget 1.0 and fit at low budgets. The target keeps a 150 ms
    # floor (scheduling noise), so on a fast machine the burst grows instead: 12 requests of 8.6 ms fitted under
    # the floor at budget 1.0 and nothing degraded.
    n = max(12, math.ceil(150.0 / (0.55 * full)))
    target = round(0.55 * n * full, 1)
    reload_config(server, e2e_config(latency_target_ms=target, min_budget=0.1))
    flex = asyncio.run(burst(server.url, [("/classify", {"texts": [HEAVY] * 4}, "flex") for _ in range(n)]))
    strict = asyncio.run(burst(server.url, [("/classify", {"texts": [HEAVY] * 4}, "strict") for _ in range(n)]))
    details = [(r.status_code, r.json().get("results", [{}])[0].get("budget_applied")) for r in flex]
    # The server refuses from its latency estimates, which follow this machine's speed as it changes under load:
    # the degrading tier answers lower budgets where the tier that cannot degrade refuses, not necessarily all.
    answered = [r for r in flex if r.status_code == 200]
    refused_strict = sum(r.status_code == 503 for r in strict)
    assert {r.status_code for r in flex} <= {200, 503} and len(answered) > n // 2, (target, full, details)
    assert n - len(answered) < refused_strict, (target, full, details, refused_strict)
    applied = [r.json()["results"][0]["budget_applied"] for r in answered]
    assert any(r.json()["degraded"] for r in answered) and min(applied) < 1.0, (target, full, details)
    assert all(b >= 0.1 for b in applied)
    assert refused_strict  # the same burst on a tier that cannot degrade
    refused = next(r for r in strict if r.status_code == 503)
    assert int(refused.headers["retry-after"]) >= 1 and refused.json()["error"]["code"] == "overloaded"
    metrics = httpx.get(f"{server.url}/metrics").text
    assert sample(metrics, "headbudget_degraded_total", tier="flex") >= 1
    assert sample(metrics, "headbudget_compute_degraded_units_total", tier="flex") > 0  # the autoscaler's signal


def reload_config(server: Server, config: dict[str, Any]) -> None:
    """Rewrite the config with a fresh probe key, SIGHUP the server, and wait until the key works."""
    from headbudget.service.accounting.auth import hash_key

    probe = f"hb_probe_{time.monotonic_ns()}"
    config["keys"].append({"sha256": hash_key(probe), "tier": "quality", "name": "probe"})
    server.config.write_text(toml_of(config))
    os.kill(server.proc.pid, signal.SIGHUP)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        r = httpx.post(f"{server.url}/classify", json={"text": "x"}, headers={"X-API-Key": probe})
        if r.status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError("the config was not reloaded after SIGHUP")


def test_metrics_move_as_requests_are_served(server: Server) -> None:
    before = httpx.get(f"{server.url}/metrics").text
    with Client(server.url, api_key=KEYS["balanced"]) as hb:
        hb.classify(["a", "b", "c"], budget=0.5)
        with pytest.raises(HeadbudgetError):
            hb.classify("x", budget=0.01)
    after = httpx.get(f"{server.url}/metrics").text
    for name, labels in [("headbudget_requests_total", {"tier": "balanced", "status": "200"}),
                         ("headbudget_requests_total", {"tier": "balanced", "status": "422"}),
                         ("headbudget_request_duration_seconds_count", {"tier": "balanced"}),
                         ("headbudget_inference_duration_seconds_count", {"budget": "0.5"}),
                         ("headbudget_attention_cost_ratio_count", {"tier": "balanced"}),
                         ("headbudget_attention_macs_total", {"tier": "balanced"}),
                         ("headbudget_attention_macs_saved_total", {"tier": "balanced"}),
                         ("headbudget_batch_size_count", {})]:
        assert sample(after, name, **labels) > sample(before, name, **labels), name
    assert "# TYPE headbudget_queue_depth gauge" in after


def test_print_curl_gives_a_working_command(server: Server) -> None:
    out = server.stdout.read_text()
    line = next(ln.strip() for ln in out.splitlines() if ln.strip().startswith("curl "))
    args = shlex.split(line)
    url = next(a for a in args if a.startswith("http://"))
    key = args[args.index("-H") + 1].split(": ", 1)[1]
    body = json.loads(args[args.index("-d") + 1])
    r = httpx.post(url, json=body, headers={"X-API-Key": key})
    assert r.status_code == 200 and r.json()["tier"] == "balanced"


def test_no_key_in_logs_and_access_lines_are_structured(server: Server) -> None:
    with Client(server.url, api_key=KEYS["balanced"]) as hb:
        rid = hb.classify("log me", budget=0.5).request_id
    httpx.post(f"{server.url}/classify", json={"text": "x"}, headers={"Authorization": f"Bearer {KEYS['cheap']}"})
    time.sleep(0.3)
    logs = server.logs()
    for key in [*KEYS.values(), *EXTRA_KEYS.values()]:
        assert key not in logs
    curl_key = re.search(r"hb_[A-Za-z0-9_-]{20,}", server.stdout.read_text())
    assert curl_key and curl_key.group(0) not in logs
    lines = [json.loads(ln) for ln in logs.splitlines() if ln.startswith("{")]
    mine = next(ln for ln in lines if ln.get("request_id") == rid)
    assert mine["tier"] == "balanced" and mine["budget_applied"] == 0.5 and mine["status"] == 200
    assert mine["latency_ms"] > 0 and mine["path"] == "/classify"


def test_graceful_shutdown_finishes_requests_in_flight(attn_checkpoint: Path, tmp_path: Path) -> None:
    with start_server(attn_checkpoint, toml_of(e2e_config()), tmp_path) as s:
        async def scenario() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                tasks = [asyncio.create_task(c.post("/classify", json={"texts": [HEAVY] * 8, "budget": 1.0},
                                                    headers=h("quality"))) for _ in range(8)]
                await asyncio.sleep(0.15)
                os.kill(s.proc.pid, signal.SIGTERM)
                return list(await asyncio.gather(*tasks))

        rs = asyncio.run(scenario())
        code = s.proc.wait(60)
    assert [r.status_code for r in rs] == [200] * 8
    # uvicorn re-raises the signal after its graceful shutdown, so the exit status is -SIGTERM
    assert code in (0, -signal.SIGTERM) and "Application shutdown complete" in s.logs()


@pytest.mark.parametrize("workers", [1, 2])
def test_tier_default_auto_on_a_plain_checkpoint_refuses_to_start(attn_checkpoint: Path, tmp_path: Path,
                                                                 workers: int) -> None:
    d = e2e_config()
    d["tiers"]["balanced"]["default_budget"] = "auto"
    config = tmp_path / "service.toml"
    config.write_text(toml_of(d))
    cmd = [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(attn_checkpoint), "--config",
           str(config), "--host", HOST, "--port", str(free_port()), "--workers", str(workers)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=service_env())
    assert r.returncode != 0, r.stderr[-2000:]
    refusals = [ln for ln in r.stderr.splitlines() if "refusing to start" in ln]
    assert refusals and all("tier 'balanced'" in ln and "auto" in ln for ln in refusals), r.stderr[-2000:]


def test_two_workers_share_limits_metrics_and_feedback(attn_checkpoint: Path, tmp_path: Path) -> None:
    with redis_process(tmp_path / "redis") as (url, _):
        d = e2e_config()
        d["state"] = {"redis_url": url}
        d["tiers"]["limited"].update(burst=5, rate_limit=1)
        with start_server(attn_checkpoint, toml_of(d), tmp_path / "srv", workers=2) as s:
            rs = asyncio.run(burst(s.url, [("/classify", {"text": f"t{i}"}, "limited") for i in range(12)]))
            assert [r.status_code for r in rs].count(200) == 5, [r.status_code for r in rs]
            ok = asyncio.run(burst(s.url, [("/classify", {"text": f"q{i}"}, "quality") for i in range(10)]))
            feedback = asyncio.run(burst(s.url, [("/feedback", {"request_id": r.json()["request_id"],
                                                                "label": r.json()["results"][0]["label"]}, "quality")
                                                 for r in ok]))
            assert [r.status_code for r in feedback] == [200] * 10  # found whichever worker answered
            metrics = httpx.get(f"{s.url}/metrics").text
            assert sample(metrics, "headbudget_requests_total", tier="quality", status="200") == 20  # 10 + 10
            assert sample(metrics, "headbudget_requests_total", tier="limited", status="429") == 7
            reload_config(s, d)  # SIGHUP reaches every worker without a restart
            stop_process(s.proc)
            assert "restarting processes" not in s.logs()


def test_schema_fuzz_no_server_errors(server: Server) -> None:
    """A few hundred schemathesis cases generated from the app's own OpenAPI document: no 5xx, answers as
    documented. The quality key is sent in both key headers (credentials that disagree are a 401), so generated
    bodies reach the model."""
    import schemathesis
    from hypothesis import HealthCheck, given, settings
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert {f"{op.method.upper()} {op.path}" for op in operations} >= {"POST /classify", "POST /feedback",
                                                                      "GET /v1/models", "GET /readyz", "POST /predict"}
    seen: list[int] = []
    for op in operations:
        examples = 120 if op.path in ("/classify", "/feedback") else 10

        @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def check(case: Any) -> None:
            response = case.call_and_validate(
                base_url=server.url, headers={**h("quality"), "Authorization": f"Bearer {KEYS['quality']}"},
                checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                        response_schema_conformance])
            seen.append(response.status_code)

        check()
    assert len(seen) >= 200 and all(code < 500 for code in seen)
    assert 200 in seen and 422 in seen, sorted(set(seen))  # valid and invalid bodies both reached the API
