"""Fairness inside a tier: the keys of a priority share the model by compute (start-time fair queueing), tiers keep
their priority, and one key alone is served in arrival order. The order itself (FairShare over jobs), then the
queue over the fake engine."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest

from headbudget.engine.types import Fixed
from headbudget.service.accounting.auth import hash_key
from headbudget.service.scheduling.jobs import Job
from headbudget.service.scheduling.planner import FairShare
from headbudget.service.settings import ServiceConfig, parse_config
from tests.service.conftest import config_dict, headers, running_app
from tests.service.fakes import FakeEngine

KEYS = {"heavy": "hb_test_fair_heavy_key_00000000000000", "light": "hb_test_fair_light_key_00000000000000",
        "other": "hb_test_fair_other_key_00000000000000"}


def fair_config(tier: str = "cheap", **tier_settings: Any) -> ServiceConfig:
    """The service tests' tiers, one request per batch, no batch window, and three more keys of ``tier``."""
    d = config_dict(max_wait_ms=0, max_batch_size=1)
    d["tiers"][tier].update(tier_settings)
    d["keys"] += [{"sha256": hash_key(k), "tier": tier, "name": name} for name, k in KEYS.items()]
    return parse_config(d)


def key(name: str) -> dict[str, str]:
    return {"X-API-Key": KEYS[name]}


# -- the order --------------------------------------------------------------------------------------------------
def _job(config: ServiceConfig, tier: str, owner: str, charge: int) -> Job:
    loop = asyncio.new_event_loop()
    try:
        return Job(["t"], config.tier(tier), Fixed(0.5), 10, loop.create_future(), loop, owner=owner, charge=charge)
    finally:
        loop.close()


def _serve_all(fair: FairShare, queue: list[Job]) -> list[Job]:
    """Serve ``queue`` one job at a time in service order, as the engine thread does."""
    served = []
    while queue:
        head = min(queue, key=Job.order)
        queue.remove(head)
        fair.served([head])
        served.append(head)
    return served


def test_a_light_key_is_served_between_a_heavy_backlog_in_equal_compute() -> None:
    config, fair = fair_config(), FairShare()
    heavy = [_job(config, "cheap", "heavy", 8000) for _ in range(6)]
    light = [_job(config, "cheap", "light", 1000) for _ in range(12)]
    queue: list[Job] = []
    for job in heavy + light:  # the whole heavy backlog arrives first
        fair.admit(job)
        queue.append(job)
    order = "".join("H" if j.owner == "heavy" else "L" for j in _serve_all(fair, queue))
    # One heavy request's compute buys eight light ones: the light key is done before a third of the backlog ran.
    assert order == "H" + "L" * 8 + "H" + "L" * 4 + "H" * 4


def test_two_keys_with_equal_charges_alternate() -> None:
    config, fair = fair_config(), FairShare()
    queue = []
    for owner in ("a", "b"):  # a's four arrive before b's four
        for _ in range(4):
            job = _job(config, "cheap", owner, 500)
            fair.admit(job)
            queue.append(job)
    assert [j.owner for j in _serve_all(fair, queue)] == ["a", "b"] * 4


def test_one_key_alone_is_served_in_arrival_order() -> None:
    config, fair = fair_config(), FairShare()
    queue = [_job(config, "cheap", "solo", c) for c in (9000, 10, 4000, 10, 70000, 1)]
    for job in queue:
        fair.admit(job)
    arrived = list(queue)
    assert _serve_all(fair, queue) == arrived


def test_a_higher_priority_tier_goes_first_whatever_its_charges() -> None:
    config, fair = fair_config(), FairShare()
    queue = []
    for tier, owner, charge in [("cheap", "light", 1), ("cheap", "heavy", 5000), ("quality", "big", 10 ** 9),
                                ("balanced", "mid", 10 ** 6), ("quality", "big", 10 ** 9)]:
        job = _job(config, tier, owner, charge)
        fair.admit(job)
        queue.append(job)
    assert [j.owner for j in _serve_all(fair, queue)] == ["big", "big", "mid", "light", "heavy"]


def test_backlogged_keys_stay_within_one_largest_request_of_each_other() -> None:
    """The SFQ bound: while two keys both have requests waiting, the compute each was served differs by at most
    the largest request of each, with random request sizes and arrivals."""
    config, fair, rng = fair_config(), FairShare(), random.Random(3)
    queue: list[Job] = []
    largest = {"a": 0, "b": 0}
    served = {"a": 0, "b": 0}
    for _ in range(400):
        for owner in ("a", "b"):  # arrivals keep both keys backlogged
            while sum(j.owner == owner for j in queue) < 3:
                charge = rng.randint(1, 64) * (1000 if owner == "a" else 100)
                largest[owner] = max(largest[owner], charge)
                job = _job(config, "cheap", owner, charge)
                fair.admit(job)
                queue.append(job)
        head = min(queue, key=Job.order)
        queue.remove(head)
        fair.served([head])
        served[head.owner] += head.charge
        assert abs(served["a"] - served["b"]) <= largest["a"] + largest["b"]
    assert min(served.values()) > 0


def test_an_idle_key_banks_nothing() -> None:
    """A key that waited while another was served starts at the present, not at the beginning of time."""
    config, fair = fair_config(), FairShare()
    queue = []
    for _ in range(10):  # a is served alone for a while
        job = _job(config, "cheap", "a", 1000)
        fair.admit(job)
        queue.append(job)
    _serve_all(fair, queue)
    queue = []
    for owner in ("a", "b", "a", "b", "a", "b"):
        job = _job(config, "cheap", owner, 1000)
        fair.admit(job)
        queue.append(job)
    # b starts at the present, one request ahead of a (whose last one ends later), then they take turns
    assert [j.owner for j in _serve_all(fair, queue)] == ["b", "a"] * 3


def test_a_withdrawn_request_gives_its_key_its_time_back() -> None:
    config, fair = fair_config(), FairShare()
    first, gone = _job(config, "cheap", "a", 1000), _job(config, "cheap", "a", 50000)
    fair.admit(first)
    fair.admit(gone)
    fair.withdraw(gone)  # its client left while it waited
    later = _job(config, "cheap", "a", 1000)
    fair.admit(later)
    assert later.start_tag == first.start_tag + first.charge


# -- the queue over the fake engine ----------------------------------------------------------------------------
async def _held_behind_blocker(engine: FakeEngine, config: ServiceConfig,
                               sends: list[tuple[str, str, int, float]]) -> list[Any]:
    """A blocking request whose pass the engine holds, then ``sends`` (key, tier for headers or "", texts, budget)
    queued in that order, then the engine released: the answers."""
    engine.gate.clear()
    async with running_app(config, engine=engine) as (client, _, _):
        blocker = asyncio.create_task(client.post("/classify", json={"text": "blocker"}, headers=headers("quality")))
        await asyncio.sleep(0.1)
        tasks = []
        for i, (name, tier, n, budget) in enumerate(sends):
            body = {"texts": [f"{name:.5} {i:02d} {j:02d}" for j in range(n)], "budget": budget}  # equal lengths
            tasks.append(asyncio.create_task(client.post("/classify", json=body,
                                                         headers=headers(tier) if tier else key(name))))
            await asyncio.sleep(0.01)  # arrive in this order
        await asyncio.sleep(0.1)
        engine.gate.set()
        rs = await asyncio.gather(blocker, *tasks)
    assert [r.status_code for r in rs] == [200] * len(rs), [r.text for r in rs if r.status_code != 200]
    return rs


def _owners(engine: FakeEngine) -> str:
    """Who each pass after the blocker served: H(eavy), L(ight), O(ther), Q(uality), C(heap)."""
    return "".join(texts[0].split()[0][0].upper() for texts, _ in engine.calls[1:])


@pytest.mark.anyio
@pytest.mark.parametrize("quota", [None, 10 ** 6], ids=["estimated", "priced-by-admission"])
async def test_a_light_key_is_not_held_behind_another_keys_backlog(quota: int | None) -> None:
    # Charges are estimated by the queue, or priced by admission where the tier has a compute quota.
    config = fair_config(**({"compute_per_minute": quota} if quota else {}))
    sends = [("heavy", "", 8, 0.25)] * 6 + [("light", "", 1, 0.25)] * 12
    engine = FakeEngine()
    await _held_behind_blocker(engine, config, sends)
    assert _owners(engine) == "H" + "L" * 8 + "H" + "L" * 4 + "H" * 4


@pytest.mark.anyio
async def test_keys_with_equal_requests_take_turns() -> None:
    engine = FakeEngine()
    await _held_behind_blocker(engine, fair_config(), [("heavy", "", 2, 0.25)] * 4 + [("other", "", 2, 0.25)] * 4)
    assert _owners(engine) == "HO" * 4


@pytest.mark.anyio
async def test_tiers_keep_their_priority_over_the_fair_share() -> None:
    engine = FakeEngine()
    sends = [("heavy", "", 8, 0.25)] * 3 + [("light", "", 1, 0.25)] * 2 + [("quality", "quality", 8, 1.0)] * 2
    await _held_behind_blocker(engine, fair_config(), sends)
    assert _owners(engine) == "QQ" + "HLL" + "HH"


@pytest.mark.anyio
async def test_one_key_is_served_in_arrival_order() -> None:
    engine = FakeEngine()
    sends = [("heavy", "", n, 0.25) for n in (8, 1, 4, 1, 16)]
    await _held_behind_blocker(engine, fair_config(), sends)
    assert [len(texts) for texts, _ in engine.calls[1:]] == [8, 1, 4, 1, 16]


@pytest.mark.anyio
async def test_another_keys_long_pass_does_not_refuse_a_short_request() -> None:
    """On a tier with a latency target, short requests are admitted while a pass longer than the target runs: the
    running pass delays a retry as much. Long work queued ahead (or its own) still makes the target refuse."""
    engine = FakeEngine(max_length=512)
    engine.gate.clear()
    config = fair_config("flex", latency_target_ms=50, min_budget=0.1)
    long_text = " ".join(["w"] * 400)
    async with running_app(config, engine=engine) as (client, app, _):
        app.state.runtime.batcher.latency.observe(0.1, 64 * 202, 1900.0)  # 64 long texts: ~2 s even at 0.1
        heavy = asyncio.create_task(client.post("/classify", json={"texts": [long_text] * 64}, headers=key("heavy")))
        await asyncio.sleep(0.1)  # its pass runs (held)
        light = asyncio.create_task(client.post("/classify", json={"text": "short"}, headers=key("light")))
        await asyncio.sleep(0.05)
        # queued behind the first short one: what is ahead of it is short, the running pass is no one's to skip
        light2 = asyncio.create_task(client.post("/classify", json={"text": "short too"}, headers=key("light")))
        await asyncio.sleep(0.05)
        queued = await client.post("/classify", json={"texts": [long_text] * 64}, headers=key("other"))
        engine.gate.set()
        r_heavy, r_light, r_light2 = await asyncio.gather(heavy, light, light2)
    assert r_heavy.status_code == 200 and r_light.status_code == 200, r_light.text
    assert r_light2.status_code == 200, r_light2.text
    assert queued.status_code == 503 and "min_budget" in queued.json()["error"]["message"]


@pytest.mark.anyio
async def test_a_request_the_latency_target_refuses_is_refused_before_it_is_tokenized(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A metered request that cannot meet its tier's target even at its floor price is answered 503 without being
    tokenized for its exact price; one that can is tokenized once."""
    from headbudget.service import pipeline

    quoted: list[int] = []
    original = pipeline.quote

    def counting(meter: Any, unit: Any, texts: list[str], budget: float) -> Any:
        quoted.append(len(texts))
        return original(meter, unit, texts, budget)

    monkeypatch.setattr(pipeline, "quote", counting)
    engine = FakeEngine(max_length=512)
    engine.gate.clear()
    config = fair_config("flex", latency_target_ms=50, min_budget=0.1, compute_per_minute=1e8,
                        compute_burst=1e8)
    long_text = " ".join(["w"] * 400)
    async with running_app(config, engine=engine) as (client, app, _):
        app.state.runtime.batcher.latency.observe(0.1, 64 * 202, 1900.0)  # 64 long texts: ~2 s even at 0.1
        held = asyncio.create_task(client.post("/classify", json={"text": "short"}, headers=key("light")))
        await asyncio.sleep(0.1)  # its pass runs (held)
        first = asyncio.create_task(client.post("/classify", json={"texts": [long_text] * 64}, headers=key("heavy")))
        await asyncio.sleep(0.1)  # queued: ~2 s of work ahead of anything that comes next
        refused = await client.post("/classify", json={"texts": [long_text] * 64}, headers=key("other"))
        engine.gate.set()
        assert [r.status_code for r in await asyncio.gather(held, first)] == [200, 200]
    assert refused.status_code == 503 and "min_budget" in refused.json()["error"]["message"]
    assert quoted == [1, 64]  # the short one and the first long one; the refused one never reached the tokenizer


# -- a request over one pass runs as parts ---------------------------------------------------------------------
BENCH = {"seq_len": 10, "batch_size": 1, "rows": [{"budget": 0.1, "latency_ms": 0.1}, {"budget": 1.0, "latency_ms": 1.0}]}


def pass_config(**server: Any) -> ServiceConfig:
    """Batches of up to 32 texts, no batch window, passes of at most 1.2 ms as the fake's bench estimates them
    (1 ms per 10 tokens at b = 1: one or two of the texts below at b = 0.5), and the three keys of the cheap
    tier."""
    d = config_dict(max_wait_ms=0, max_batch_size=32, **{"max_pass_ms": 1.2, **server})
    d["keys"] += [{"sha256": hash_key(k), "tier": "cheap", "name": name} for name, k in KEYS.items()]
    return parse_config(d)


def heavy_texts(n: int) -> list[str]:
    return [f"heavy {i:02d} " + "word " * 7 for i in range(n)]


async def _heavy_behind_blocker(client: Any, light_first: bool = False) -> tuple[asyncio.Task[Any], ...]:
    """A quality request whose pass the engine holds, then the heavy key's eight texts queued behind it (after a
    light key's one text with ``light_first``): the tasks in that order."""
    blocker = asyncio.create_task(client.post("/classify", json={"text": "blocker"}, headers=headers("quality")))
    await asyncio.sleep(0.1)
    light = []
    if light_first:
        light.append(asyncio.create_task(client.post("/classify?budget=0.5", json={"text": "light one"},
                                                     headers=key("light"))))
        await asyncio.sleep(0.05)
    heavy = asyncio.create_task(client.post("/classify?budget=0.5", json={"texts": heavy_texts(8)},
                                            headers=key("heavy")))
    await asyncio.sleep(0.1)
    return (blocker, *light, heavy)


@pytest.mark.anyio
async def test_a_request_over_one_pass_runs_in_parts_and_another_key_runs_between_them() -> None:
    """Eight texts of about 13 tokens run as passes of at most two; a light key's request that arrives behind them
    runs in the first or the second pass, not after the whole request; the heavy answer is the same as in one
    pass."""
    engine = FakeEngine(bench=BENCH)
    engine.gate.clear()
    async with running_app(pass_config(), engine=engine) as (client, _, _):
        blocker, heavy = await _heavy_behind_blocker(client)
        light = asyncio.create_task(client.post("/classify?budget=0.5", json={"text": "light one"},
                                                headers=key("light")))
        await asyncio.sleep(0.05)
        engine.gate.set()
        rs = await asyncio.gather(blocker, heavy, light)
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    passes = [texts for texts, _ in engine.calls[1:]]
    heavy_passes = [[t for t in p if t.startswith("heavy")] for p in passes]
    assert len(passes) >= 4 and all(len(h) <= 2 for h in heavy_passes), passes
    assert passes[0][0].startswith("heavy 00") and any("light one" in p for p in passes[:2]), passes
    assert [t for h in heavy_passes for t in h] == heavy_texts(8)  # in order, each once
    alone = FakeEngine(bench=BENCH)
    async with running_app(pass_config(max_pass_ms=1000), engine=alone) as (client, _, _):
        whole = await client.post("/classify?budget=0.5", json={"texts": heavy_texts(8)}, headers=key("heavy"))
    assert len(alone.calls) == 1
    fields = ("label", "scores", "budget_applied", "cost", "n_tokens", "charge")
    assert [{f: r[f] for f in fields} for r in rs[1].json()["results"]] == \
        [{f: r[f] for f in fields} for r in whole.json()["results"]]
    assert rs[1].json()["charge"] == whole.json()["charge"]


@pytest.mark.anyio
async def test_a_whole_request_ahead_of_the_parts_runs_without_them() -> None:
    """A light request served before a heavy key's parts runs in a pass of its own: a part in its batch would make
    it wait for the part's pass (here the heavy request's second part, of one text, fitted beside it, and ran
    before the first). Behind a part, whole requests may join the part's pass (they would wait for it)."""
    engine = FakeEngine(bench=BENCH)
    engine.gate.clear()
    async with running_app(pass_config(max_pass_ms=4), engine=engine) as (client, _, _):
        queued = await _heavy_behind_blocker(client, light_first=True)
        engine.gate.set()
        rs = await asyncio.gather(*queued)
    assert [r.status_code for r in rs] == [200] * 3, [r.text for r in rs]
    passes = [texts for texts, _ in engine.calls[1:]]
    assert passes[0] == ["light one"], passes
    assert [t for p in passes[1:] for t in p] == heavy_texts(8)


@pytest.mark.anyio
async def test_the_queue_bound_counts_requests_not_their_parts() -> None:
    engine = FakeEngine(bench=BENCH)
    engine.gate.clear()
    async with running_app(pass_config(queue_size=2), engine=engine) as (client, app, _):
        blocker, heavy = await _heavy_behind_blocker(client)
        light = asyncio.create_task(client.post("/classify", json={"text": "light one"}, headers=key("light")))
        await asyncio.sleep(0.05)
        assert app.state.runtime.batcher.depth == 2
        third = await client.post("/classify", json={"text": "one too many"}, headers=key("other"))
        engine.gate.set()
        rs = await asyncio.gather(blocker, heavy, light)
    assert third.status_code == 503 and third.json()["error"]["code"] == "overloaded", third.text
    assert [r.status_code for r in rs] == [200] * 3


@pytest.mark.anyio
async def test_a_client_gone_takes_every_part_of_its_request_out_of_the_queue() -> None:
    engine = FakeEngine(bench=BENCH)
    engine.gate.clear()
    async with running_app(pass_config(), engine=engine) as (client, app, _):
        blocker, gone = await _heavy_behind_blocker(client)
        batcher = app.state.runtime.batcher
        assert batcher.depth == 1 and len(batcher._pending) >= 4  # one request, queued as its parts
        gone.cancel()
        with pytest.raises(asyncio.CancelledError):
            await gone
        await asyncio.sleep(0.1)
        assert batcher.depth == 0 and not batcher._pending
        engine.gate.set()
        assert (await blocker).status_code == 200
    assert [t for t, _ in engine.calls] == [["blocker"]]


def _counts_by_scan(batcher: Any) -> tuple[int, dict[str, int]]:
    requests = {id(j.request_job): j.tier.name for j in batcher._pending}
    tiers: dict[str, int] = {}
    for name in requests.values():
        tiers[name] = tiers.get(name, 0) + 1
    return len(requests), tiers


@pytest.mark.anyio
async def test_the_queue_counts_follow_the_queue_through_parts_cancels_and_batches() -> None:
    """Admission reads counts kept as jobs enter and leave, not a scan of the queue: after requests of two tiers,
    one of them in parts, a client gone and the batches served, the counts are the scan's at every step."""
    engine = FakeEngine(bench=BENCH)
    engine.gate.clear()
    async with running_app(pass_config(), engine=engine) as (client, app, _):
        batcher = app.state.runtime.batcher

        def check() -> None:
            depth, tiers = _counts_by_scan(batcher)
            assert batcher.depth == depth
            assert {t: n for t, n in batcher._tier_waiting.items() if n} == tiers

        blocker, heavy = await _heavy_behind_blocker(client)
        light = [asyncio.create_task(client.post("/classify", json={"text": f"light {i}"}, headers=key("light")))
                 for i in range(3)]
        await asyncio.sleep(0.1)
        check()
        assert batcher.depth == 4 and len(batcher._pending) >= 6  # the heavy request in parts, three light ones
        light[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await light[0]
        await asyncio.sleep(0.05)
        check()
        assert batcher.depth == 3
        engine.gate.set()
        assert [r.status_code for r in await asyncio.gather(blocker, heavy, *light[1:])] == [200] * 4
        check()
        assert batcher.depth == 0 and not batcher._parts_waiting
