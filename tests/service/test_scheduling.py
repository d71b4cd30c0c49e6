"""The queue over the fake engine: priority, queue bounds, degrade-by-compute, latency limits, dropped clients."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest

from headbudget.engine.artifacts import BenchRecord
from headbudget.engine.types import BudgetRequest, Fixed, LatencyTarget
from headbudget.service.scheduling.jobs import Job
from headbudget.service.scheduling.latency import LatencyModel
from headbudget.service.scheduling.planner import Planner
from headbudget.service.settings import parse_config
from tests.service.conftest import config_dict, headers, make_config, running_app
from tests.service.fakes import FakeEngine
from tests.service.test_api import sample

pytestmark = pytest.mark.anyio

# 1 ms per 10 tokens at budget 1.0, 0.1 ms per 10 tokens at budget 0.1 (padded tokens = batch x longest)
BENCH = {"seq_len": 10, "batch_size": 1, "rows": [{"budget": 0.1, "latency_ms": 0.1}, {"budget": 1.0, "latency_ms": 1.0}]}


async def test_engine_never_runs_on_the_event_loop_thread() -> None:
    engine = FakeEngine()
    async with running_app(make_config(), engine=engine) as (client, _, _):
        await client.post("/classify", json={"text": "x"}, headers=headers())
    assert engine.threads and threading.get_ident() not in engine.threads


async def test_a_client_sending_one_request_after_another_never_waits_the_batch_window() -> None:
    # Each request finds the model idle (nothing queued, no forward pass): it runs at once. The rule this
    # replaced ("no arrival in the last max_wait_ms") made every such request wait the window whenever the
    # client's round trip was shorter than it.
    engine = FakeEngine()
    async with running_app(make_config(max_wait_ms=300), engine=engine) as (client, _, _):
        waits = []
        for i in range(4):
            r = await client.post("/classify", json={"text": f"t{i}"}, headers=headers())
            assert r.status_code == 200
            waits.append(r.json()["queue_ms"])
    assert max(waits) < 150, waits


async def test_arrivals_during_a_forward_pass_are_batched_and_ordered_by_tier() -> None:
    engine = FakeEngine(delay_s=0.05)
    async with running_app(make_config(max_wait_ms=20, max_batch_size=8), engine=engine) as (client, _, _):
        tasks = [asyncio.create_task(client.post("/classify?budget=0.5", json={"text": f"c{i}"},
                                                 headers=headers("cheap"))) for i in range(4)]
        tasks += [asyncio.create_task(client.post("/classify", json={"text": f"q{i}"}, headers=headers("quality")))
                  for i in range(2)]
        rs = await asyncio.gather(*tasks)
    assert [r.status_code for r in rs] == [200] * 6
    batches = [texts for texts, _ in engine.calls]
    # The first to reach an idle model may run alone (c0) or, if the burst queued before the engine thread woke,
    # the burst is ordered like the rest; either way quality runs as one batch before every cheap text still
    # waiting, and the cheap ones that waited share one batch too.
    q = next(i for i, t in enumerate(batches) if "q0" in t)
    assert batches[q] == ["q0", "q1"] and len(batches) <= 3, batches
    assert all(i > q for i, t in enumerate(batches) for x in t if x.startswith("c") and i != 0), batches
    assert sorted(x for t in batches for x in t) == ["c0", "c1", "c2", "c3", "q0", "q1"]


async def test_quality_tier_is_served_first_under_contention() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    async with running_app(make_config(max_wait_ms=0, max_batch_size=1), engine=engine) as (client, _, _):
        blocker = asyncio.create_task(client.post("/classify", json={"text": "blocker"}, headers=headers("cheap")))
        await asyncio.sleep(0.1)
        cheap = [asyncio.create_task(client.post("/classify", json={"text": f"c{i}"}, headers=headers("cheap")))
                 for i in range(4)]
        await asyncio.sleep(0.05)
        quality = [asyncio.create_task(client.post("/classify", json={"text": f"q{i}"},
                                                   headers=headers("quality"))) for i in range(2)]
        await asyncio.sleep(0.05)
        engine.gate.set()
        await asyncio.gather(blocker, *cheap, *quality)
    order = [texts[0] for texts, _ in engine.calls]
    assert order[0] == "blocker" and sorted(order[1:3]) == ["q0", "q1"]  # queued later, served first
    assert sorted(order[3:]) == ["c0", "c1", "c2", "c3"]


async def test_full_queues_answer_503_with_retry_after() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    d = config_dict(queue_size=5)
    d["tiers"]["cheap"]["max_queue"] = 2
    async with running_app(parse_config(d), engine=engine) as (client, _, _):
        blocker = asyncio.create_task(client.post("/classify", json={"text": "b"}, headers=headers("quality")))
        await asyncio.sleep(0.1)
        cheap = [asyncio.create_task(client.post("/classify", json={"text": f"c{i}"}, headers=headers("cheap")))
                 for i in range(3)]
        await asyncio.sleep(0.1)
        # the cheap tier is at its own bound, but quality still gets in: cheap traffic cannot starve it
        quality = [asyncio.create_task(client.post("/classify", json={"text": f"q{i}"},
                                                   headers=headers("quality"))) for i in range(4)]
        await asyncio.sleep(0.1)
        engine.gate.set()
        rs = await asyncio.gather(blocker, *cheap, *quality)
    codes = [r.status_code for r in rs]
    assert codes[1:4].count(503) == 1 and codes[4:].count(200) == 3 and codes[4:].count(503) == 1
    for r in rs:
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "overloaded" and int(r.headers["retry-after"]) >= 1


async def test_client_gone_is_dropped_from_the_queue() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    async with running_app(make_config(max_wait_ms=0), engine=engine) as (client, app, _):
        blocker = asyncio.create_task(client.post("/classify", json={"text": "b"}, headers=headers()))
        await asyncio.sleep(0.1)
        gone = asyncio.create_task(client.post("/classify?budget=0.25", json={"text": "gone"}, headers=headers()))
        await asyncio.sleep(0.1)
        assert app.state.runtime.batcher.depth == 1
        gone.cancel()  # the client disconnects while its request waits
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.sleep(0.1)
        assert app.state.runtime.batcher.depth == 0
        engine.gate.set()
        assert (await blocker).status_code == 200
    assert [t for t, _ in engine.calls] == [["b"]]


async def test_a_disconnect_message_drops_the_request_from_the_queue() -> None:
    """The server learns that a client left from its http.disconnect message (the case above cancels the
    handler instead): the queued request is dropped and never runs."""
    engine = FakeEngine()
    engine.gate.clear()
    body = b'{"text": "gone", "budget": 0.25}'
    left = asyncio.Event()
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        if not sent:
            sent.append({})
            return {"type": "http.request", "body": body, "more_body": False}
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/classify", "raw_path": b"/classify", "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         *[(k.lower().encode(), v.encode()) for k, v in headers().items()]],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    async with running_app(make_config(max_wait_ms=0), engine=engine) as (client, app, _):
        blocker = asyncio.create_task(client.post("/classify", json={"text": "b"}, headers=headers()))
        await asyncio.sleep(0.1)
        gone = asyncio.create_task(app(scope, receive, send))
        await asyncio.sleep(0.1)
        assert app.state.runtime.batcher.depth == 1
        left.set()
        await asyncio.wait_for(gone, 5)
        assert app.state.runtime.batcher.depth == 0
        engine.gate.set()
        assert (await blocker).status_code == 200
    assert [t for t, _ in engine.calls] == [["b"]]


def _job(tier_name: str, config, texts: list[str], request: BudgetRequest, tokens: int, age_s: float = 0.0,
         at: float | None = None) -> Job:
    """A queued job; ``at``: the instant it is ``age_s`` old (default: now), so that a plan made at ``at`` does not
    depend on how long building the other jobs took."""
    loop = asyncio.new_event_loop()
    try:
        job = Job(texts, config.tier(tier_name), request, tokens, loop.create_future(), loop)
    finally:
        loop.close()
    job.enqueued = (job.enqueued if at is None else at) - age_s
    return job


def test_planner_degrades_only_when_the_queue_would_miss_the_target() -> None:
    config = make_config()  # flex: target 200 ms, min_budget 0.1
    planner = Planner(FakeEngine(), LatencyModel(BenchRecord.parse(BENCH), 512))
    # 10 jobs of 100 tokens: 10 ms each at budget 1.0, 1 ms at 0.1
    now = time.monotonic()  # every job arrives and is planned at this instant: no wall-clock in the test
    light = [_job("flex", config, ["t"], Fixed(1.0), 100, at=now) for _ in range(10)]
    _, applied, _ = planner.plan(light, now, 32)
    assert set(applied.values()) == {1.0}  # 100 ms of work fits a 200 ms target
    heavy = [_job("flex", config, ["t"], Fixed(1.0), 100, at=now) for _ in range(40)]  # 400 ms at 1.0
    batch, applied, wants = planner.plan(heavy, now, 32)
    level = applied[heavy[0].seq]
    assert 0.1 <= level < 1.0 and set(wants.values()) == {1.0}
    assert 40 * planner.cost_s(heavy[0], level) <= 0.2 + 1e-9  # the chosen level meets the target
    assert len(batch) == 32  # same mask: one batch, up to max_batch_size texts
    mixed = [_job("quality", config, ["t"], Fixed(1.0), 100, at=now) for _ in range(5)] + heavy
    _, applied, _ = planner.plan(mixed, now, 32)
    assert all(applied[j.seq] == 1.0 for j in mixed[:5])  # tiers without a target never degrade


def test_planner_max_latency_picks_lower_budgets_for_tighter_limits() -> None:
    config = make_config()
    planner = Planner(FakeEngine(), LatencyModel(BenchRecord.parse(BENCH), 512))
    chosen = {}
    for limit in (50.0, 8.0, 3.0, 0.5):
        job = _job("balanced", config, ["t"], LatencyTarget(limit), 100)
        chosen[limit] = planner.want(job, job.enqueued)  # at arrival: the whole limit is left
    assert chosen[50.0] == 1.0 and chosen[0.5] == 0.1
    assert chosen[50.0] > chosen[8.0] > chosen[3.0] >= chosen[0.5]
    capped = _job("cheap", config, ["t"], LatencyTarget(50.0), 100)
    assert planner.want(capped, capped.enqueued) == 0.5  # never above the tier's maximum


async def test_degrading_tier_answers_lower_budgets_instead_of_503() -> None:
    engine = FakeEngine(per_token_s=0.0005, bench=BENCH, max_length=512)  # 100 tokens: ~50 ms at 1.0, ~9.5 ms at 0.1
    engine.gate.clear()
    d = config_dict(max_wait_ms=0, max_batch_size=1)
    d["tiers"]["flex"].update(latency_target_ms=300)
    async with running_app(parse_config(d), engine=engine) as (client, app, _):
        app.state.runtime.batcher.latency.observe(1.0, 100, 50.0)  # calibrate: the fake is 5x the table
        app.state.runtime.batcher.latency.observe(0.1, 100, 9.5)
        text = " ".join(["w"] * 98)
        tasks = [asyncio.create_task(client.post("/classify", json={"text": text}, headers=headers("flex")))
                 for _ in range(12)]  # 600 ms of work at budget 1.0, ~115 ms at 0.1
        await asyncio.sleep(0.2)
        engine.gate.set()
        rs = await asyncio.gather(*tasks)
        metrics = (await client.get("/metrics")).text
        meter, unit = app.state.runtime.batcher.meter, app.state.runtime.unit
    assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200]
    results = [r.json() for r in rs]
    degraded = [r for r in results if r["degraded"]]
    assert degraded and all(r["results"][0]["budget_applied"] < r["results"][0]["budget_requested"] == 1.0
                            for r in degraded)
    assert all(r["results"][0]["budget_applied"] >= 0.1 for r in results)
    # The autoscaler's signal: the compute the degraded answers asked for and did not get, in compute units.
    lost = sum((meter.cost(t["budget_requested"], t["n_tokens"]).total_macs
                - meter.cost(t["budget_applied"], t["n_tokens"]).total_macs) / unit.macs
               for r in degraded for t in r["results"])
    assert lost > 0
    assert sample(metrics, "headbudget_compute_degraded_units_total", tier="flex") == \
        pytest.approx(lost, abs=1e-3 * len(degraded))
    assert 'headbudget_compute_degraded_units_total{tier="quality"} 0.0' in metrics  # at 0 before any degrading


async def test_503_when_even_min_budget_cannot_make_the_target() -> None:
    engine = FakeEngine(per_token_s=0.0005, bench=BENCH, max_length=512)
    engine.gate.clear()
    d = config_dict(max_wait_ms=0, max_batch_size=1)
    d["tiers"]["flex"].update(latency_target_ms=50)
    async with running_app(parse_config(d), engine=engine) as (client, app, _):
        app.state.runtime.batcher.latency.observe(0.1, 100, 9.5)
        text = " ".join(["w"] * 98)
        tasks = [asyncio.create_task(client.post("/classify", json={"text": text}, headers=headers("flex")))
                 for _ in range(12)]  # ~115 ms even at 0.1: some must be refused
        await asyncio.sleep(0.2)
        engine.gate.set()
        rs = await asyncio.gather(*tasks)
        metrics = (await client.get("/metrics")).text
    codes = [r.status_code for r in rs]
    assert 503 in codes and 200 in codes, [r.text for r in rs]
    refused = next(r for r in rs if r.status_code == 503)
    assert "min_budget" in refused.json()["error"]["message"] and "retry-after" in refused.headers
    assert 'headbudget_requests_total{status="503",tier="flex"}' in metrics


async def test_queue_timeout_is_503() -> None:
    engine = FakeEngine()
    engine.gate.clear()
    async with running_app(make_config(request_timeout_s=0.2, max_wait_ms=0), engine=engine) as (client, _, _):
        blocker = asyncio.create_task(client.post("/classify", json={"text": "b"}, headers=headers()))
        await asyncio.sleep(0.05)
        late = asyncio.create_task(client.post("/classify?budget=0.25", json={"text": "late"}, headers=headers()))
        await asyncio.sleep(0.4)
        engine.gate.set()
        r_block, r_late = await asyncio.gather(blocker, late)
    assert r_block.status_code == 200
    assert r_late.status_code == 503 and "timed out" in r_late.json()["error"]["message"]


def test_latency_model_table_and_observations() -> None:
    model = LatencyModel(BenchRecord.parse(BENCH), 512)
    assert BenchRecord.parse({"rows": [{"budget": "x"}, {"budget": 0.5}]}) is None
    assert model.estimate_ms(1.0, 10) == pytest.approx(1.0)
    assert model.estimate_ms(0.55, 10) == pytest.approx(0.55)
    assert model.estimate_ms(1.0, 100) == pytest.approx(1.0 * (0.2 + 0.8 * 10))
    for _ in range(50):
        model.observe(1.0, 10, 3.0)  # the machine is 3x slower than the table
    assert model.estimate_ms(1.0, 10) == pytest.approx(3.0, rel=0.01)
    prior = LatencyModel(None, 512)
    assert not prior.has_table and prior.estimate_ms(1.0, 100) > prior.estimate_ms(0.1, 100) > 0
    # Each text's own tokens (4 characters a token, plus [CLS] and [SEP]): the engine does not pad across lengths
    assert model.estimate_tokens(["abcd" * 10, "ab"]) == 12 + 3


async def test_engine_errors_map_to_http() -> None:
    class Broken(FakeEngine):
        def predict(self, texts, budget):  # type: ignore[no-untyped-def]
            raise RuntimeError("boom")

    async with running_app(engine=Broken()) as (client, _, _):
        r = await client.post("/classify", json={"text": "x"}, headers=headers())
        after = await client.post("/healthz")
    assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
    assert "boom" not in r.text and after.status_code == 405


async def test_shutdown_finishes_queued_requests() -> None:
    engine = FakeEngine(delay_s=0.05)
    config = make_config(max_wait_ms=0, max_batch_size=1)  # one batch running, the rest queued
    from headbudget.service.app import create_app

    app = create_app(config, lambda: engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        cm = app.router.lifespan_context(app)
        await cm.__aenter__()
        tasks = [asyncio.create_task(client.post("/classify", json={"text": f"t{i}"}, headers=headers()))
                 for i in range(5)]
        batcher = app.state.runtime.batcher
        while batcher.depth + len(engine.calls) < 5:  # all five accepted: one running, the rest queued
            await asyncio.sleep(0.005)
        assert batcher.depth >= 3
        await cm.__aexit__(None, None, None)  # shutdown while requests wait
        rs = await asyncio.gather(*tasks)
    assert [r.status_code for r in rs] == [200] * 5 and engine.closed
