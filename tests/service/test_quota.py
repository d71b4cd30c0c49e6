"""Compute quotas per key: the weighted GCRA in memory and in Redis (exact, both checks in one atomic step), the
per-request cap (422 before any work), 429 with Retry-After in the service's and TEI's shapes, degraded answers
charged what ran, bad quota settings refused at load and at reload, and two workers sharing a quota exactly."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.service.accounting.auth import hash_key
from headbudget.service.accounting.compute import ComputeUnit, quote
from headbudget.service.app import create_app
from headbudget.service.settings import ConfigError, StateConfig, parse_config
from headbudget.service.state.redis_store import RedisState
from headbudget.service.state.store import PER_MINUTE_MS, ComputeLimit, MemoryState, StateStore
from tests.service.conftest import (
    KEYS,
    cid,
    config_dict,
    first_then_queued,
    headers,
    redis_process,
    running_app,
    start_server,
    toml_of,
)
from tests.service.fakes import FakeEngine

pytestmark = pytest.mark.anyio
QUOTA = {"q1": "hb_test_quota_one_key_000000000000000", "q64": "hb_test_quota_64_key_0000000000000000",
         "t1": "hb_test_quota_tei_one_key_00000000000", "t64": "hb_test_quota_tei_64_key_000000000000"}


SLOW = ComputeLimit(per_minute=1, burst=10_000)  # refills one milli-unit a minute: nothing during a test


async def test_admits_exactly_up_to_the_quota(store: StateStore) -> None:
    got = [await store.admit("k", 6000, 100, SLOW, 3000, cid()) for _ in range(4)]
    assert [a.allowed for a in got] == [True, True, True, False]
    refused = got[-1]
    # 12,000 asked of 10,000: the 2,000 milli-units over refill in 2,000 minutes
    assert refused.refused_by == "compute" and refused.retry_after_s == pytest.approx(2000 * 60, abs=1)
    assert (await store.admit("k", 6000, 100, SLOW, 1000, cid())).allowed  # what is left still fits, to the milli-unit
    assert not (await store.admit("k", 6000, 100, SLOW, 1, cid())).allowed
    assert (await store.admit("other", 6000, 100, SLOW, 10_000, cid())).allowed  # keys do not share a quota
    assert (await store.quota_left("k", 6000, 100, SLOW)).compute == 0


async def test_a_refused_request_spends_neither_the_rate_nor_the_quota(store: StateStore) -> None:
    assert (await store.admit("k", 60, 2, SLOW, 9000, cid())).allowed
    over = await store.admit("k", 60, 2, SLOW, 2000, cid())  # the rate would pass; the quota does not
    assert not over.allowed and over.refused_by == "compute"
    assert (await store.quota_left("k", 60, 2, SLOW)).requests == 1  # the refused request used no rate
    assert (await store.admit("k", 60, 2, SLOW, 500, cid())).allowed
    rate = await store.admit("k", 60, 2, SLOW, 100, cid())  # the quota would pass; the rate (burst 2) does not
    assert not rate.allowed and rate.refused_by == "rate" and 0 < rate.retry_after_s <= 1.01
    assert (await store.quota_left("k", 60, 2, SLOW)).compute == 500  # the refused request used no compute


async def test_settling_corrects_the_charge_down_to_an_empty_quota(store: StateStore) -> None:
    assert (await store.admit("k", 6000, 100, SLOW, 8000, cid())).allowed
    await store.settle("k", SLOW, -5000, cid())  # a degraded answer ran 3,000 of the 8,000 reserved
    assert (await store.quota_left("k", 6000, 100, SLOW)).compute == 7000
    await store.settle("k", SLOW, -50_000, cid())
    assert (await store.quota_left("k", 6000, 100, SLOW)).compute == 10_000
    await store.settle("k", SLOW, 4000, cid())  # ran more than reserved: charged
    assert (await store.quota_left("k", 6000, 100, SLOW)).compute == 6000


async def test_the_quota_refills_at_its_rate() -> None:
    now = [1000.0]
    s = MemoryState(StateConfig(), clock=lambda: now[0])
    limit = ComputeLimit(per_minute=60_000, burst=3000)  # 1,000 milli-units a second
    assert (await s.admit("k", 6000, 100, limit, 3000, cid())).allowed
    refused = await s.admit("k", 6000, 100, limit, 2000, cid())
    assert not refused.allowed and refused.retry_after_s == pytest.approx(2.0)
    now[0] += 1.999
    assert not (await s.admit("k", 6000, 100, limit, 2000, cid())).allowed
    now[0] += 0.001
    assert (await s.admit("k", 6000, 100, limit, 2000, cid())).allowed
    assert PER_MINUTE_MS == 60_000


async def test_redis_admission_is_exact_between_clients(redis_url: str) -> None:
    a, b = (RedisState(StateConfig(redis_url=redis_url)) for _ in range(2))
    await a._redis.flushdb()
    got = await asyncio.gather(*[(a if i % 2 else b).admit("shared", 6000, 100, SLOW, 700, cid()) for i in range(30)])
    assert [g.allowed for g in got].count(True) == 10_000 // 700  # 14, and 14 x 700 = 9,800 <= 10,000 < 10,500
    await a.close()
    await b.close()


# -- configuration ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "message"), [
    ({"compute_per_minute": -5}, "compute_per_minute: Input should be greater than or equal to 0.001"),
    ({"compute_per_minute": 0}, "compute_per_minute: Input should be greater than or equal to 0.001"),
    ({"compute_per_minute": math.nan}, "compute_per_minute: Value error, expected a finite number of compute units, "
                                       "not nan"),
    ({"compute_burst": math.inf, "compute_per_minute": 1}, "compute_burst: Value error, expected a finite number"),
    ({"compute_per_minute": 1e12}, "compute_per_minute: Input should be less than or equal to 100000000"),
    ({"compute_per_minute": True}, "compute_per_minute: Value error, expected a number of compute units"),
    ({"compute_per_minute": "lots"}, "compute_per_minute: Input should be a valid number"),
    ({"compute_per_minute": 100, "compute_burst": 1e9}, "compute_burst: Input should be less than or equal to"),
    ({"compute_burst": 100}, "compute_burst is set but compute_per_minute is not"),
    ({"max_request_compute": -1}, "max_request_compute: Input should be greater than or equal to 0.001"),
    ({"compute_per_minute": 100, "max_request_compute": 500}, "max_request_compute 500 is above compute_burst 100"),
])
async def test_bad_quota_settings_get_one_clear_error(fields: dict[str, Any], message: str) -> None:
    d = config_dict()
    d["tiers"]["cheap"].update(fields)
    with pytest.raises(ConfigError) as e:
        parse_config(d)
    assert str(e.value).startswith("tiers.cheap") and message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


async def test_a_bad_quota_at_reload_keeps_the_running_config(tmp_path: Path) -> None:
    d = config_dict()
    d["tiers"]["cheap"].update(compute_per_minute=100)
    path = tmp_path / "service.toml"
    path.write_text(toml_of(d))
    app = create_app(parse_config(d), FakeEngine, config_path=path)
    async with app.router.lifespan_context(app):
        runtime = app.state.runtime
        d["tiers"]["cheap"].update(compute_per_minute=-1)
        path.write_text(toml_of(d))
        assert runtime.reload() is False and runtime.config.tiers["cheap"].compute_per_minute == 100
        d["tiers"]["cheap"].update(compute_per_minute=200)
        path.write_text(toml_of(d))
        assert runtime.reload() is True and runtime.config.tiers["cheap"].compute_per_minute == 200


# -- the service over the fake engine ----------------------------------------------------------------------------
def quota_config(**cheap: Any) -> dict[str, Any]:
    d = config_dict()
    d["tiers"]["cheap"].update(cheap)
    return d


async def test_over_quota_is_429_with_retry_after_in_both_shapes() -> None:
    # The fake at budget 0.25 (2 of 8 heads): 2,250 multiply-adds a token = 750 milli-units; "a b c" is 5 tokens.
    d = quota_config(compute_per_minute=60, compute_burst=7.5)  # 1 unit a second; 2 requests of 3.75 units
    async with running_app(parse_config(d)) as (client, _, engine):
        ok = [await client.post("/classify", json={"text": "a b c"}, headers=headers("cheap")) for _ in range(2)]
        assert [r.json()["charge"] for r in ok] == [3.75, 3.75]
        over = await client.post("/classify", json={"text": "a b c"}, headers=headers("cheap"))
        tei = await client.post("/predict", json={"inputs": "a b c"}, headers=headers("cheap"))
        other = await client.post("/classify", json={"text": "a b c"}, headers=headers("balanced"))
    assert over.status_code == 429 and over.json()["error"]["code"] == "compute_quota_exceeded"
    assert over.headers["retry-after"] == "4"  # 3.75 units at 1 unit a second (rounded up)
    message = over.json()["error"]["message"]
    assert "3.75 compute units" in message and "60 per minute" in message and "7.5 at once" in message
    assert tei.status_code == 429 and tei.json()["error_type"] == "Overloaded" and tei.headers["retry-after"] == "4"
    assert "compute quota" in tei.json()["error"]
    assert other.status_code == 200  # another tier's key is not touched
    assert len(engine.calls) == 3


async def test_a_request_over_the_cap_is_refused_before_any_work() -> None:
    d = quota_config(compute_per_minute=6000, max_request_compute=20)
    texts = ["one two three four five six"] * 4  # 8 tokens each, 6 units each at budget 0.25: 24 units
    async with running_app(parse_config(d)) as (client, _, engine):
        r = await client.post("/classify", json={"texts": texts}, headers=headers("cheap"))
        tei = await client.post("/predict", json={"inputs": [[t] for t in texts]}, headers=headers("cheap"))
        fits = await client.post("/classify", json={"texts": texts[:3]}, headers=headers("cheap"))
        left = await client.post("/classify", json={"texts": texts}, headers=headers("cheap"))
    assert r.status_code == 422 and r.json()["error"]["code"] == "compute_cap_exceeded"
    assert r.json()["error"]["message"] == (
        "this request would be charged at least 24 compute units (4 texts, at least 32 tokens at budget 0.25), over tier "
        "'cheap''s max_request_compute of 20 units per request; send fewer or shorter texts, or a lower budget")
    assert tei.status_code == 422 and tei.json()["error_type"] == "Validation" and "max_request_compute" in \
        tei.json()["error"]
    assert fits.status_code == 200 and fits.json()["charge"] == 18
    assert left.status_code == 422  # and refusals spent nothing: only the one that fitted ran
    assert engine.calls == [(texts[:3], 0.25)]


async def test_refusals_tokenize_nothing() -> None:
    """Refused by the request rate, the compute quota or the cap, a request is refused on its floor price
    (Meter.fewest_tokens): the meter tokenizes only what is admitted, once."""
    d = quota_config(compute_per_minute=60, compute_burst=7.5, max_request_compute=5, rate_limit=6000, burst=100)
    d["tiers"]["balanced"].update(rate_limit=1, burst=1, compute_per_minute=6000)
    async with running_app(parse_config(d)) as (client, _, engine):
        capped = await client.post("/classify", json={"texts": ["a b c"] * 2}, headers=headers("cheap"))
        ok = [await client.post("/classify", json={"text": "a b c"}, headers=headers("cheap")) for _ in range(2)]
        over_quota = await client.post("/classify", json={"text": "a b c"}, headers=headers("cheap"))
        first = await client.post("/classify", json={"text": "a b c"}, headers=headers("balanced"))
        over_rate = await client.post("/classify", json={"text": "a b c"}, headers=headers("balanced"))
    assert capped.status_code == 422 and "at least 7.5 compute units" in capped.json()["error"]["message"]
    assert [r.status_code for r in ok] == [200, 200] and first.status_code == 200
    assert over_quota.json()["error"]["code"] == "compute_quota_exceeded"
    assert over_rate.json()["error"]["code"] == "rate_limited"
    assert engine.metered == [1, 1, 1]  # the three answered requests, each tokenized once; no refusal


async def test_an_exact_price_over_the_cap_is_refused_and_gives_its_floor_back() -> None:
    """Where the words undercount the tokens, a request admitted on its floor is priced exactly before it queues:
    over the cap it is refused (422) and the quota gets back what the floor reserved."""
    d = quota_config(compute_per_minute=0.001, compute_burst=100, max_request_compute=5)
    engine = FakeEngine()
    engine.floor_gap = 2  # 5 tokens counted as 3: 2.25 units at the floor, 3.75 exact
    async with running_app(parse_config(d), engine=engine) as (client, app, _):
        r = await client.post("/classify", json={"texts": ["a b c"] * 2}, headers=headers("cheap"))
        fits = await client.post("/classify", json={"text": "a b c"}, headers=headers("cheap"))
        tier = app.state.runtime.config.tiers["cheap"]
        left = await app.state.runtime.state.quota_left(hash_key(KEYS["cheap"])[:16], tier.rate_limit, tier.burst,
                                                        ComputeLimit.of(tier))
    assert r.status_code == 422 and "up to 7.5 compute units" in r.json()["error"]["message"]
    assert engine.metered == [2, 1] and fits.json()["charge"] == 3.75
    assert left.compute == 100_000 - 3_750  # milli-units: the refused request's floor came back; the answer is charged exactly


async def test_the_burst_caps_a_request_when_it_is_lower() -> None:
    d = quota_config(compute_per_minute=6, compute_burst=10)
    async with running_app(parse_config(d)) as (client, _, _):
        r = await client.post("/classify", json={"texts": ["one two three four five six"] * 2},
                              headers=headers("cheap"))
    assert r.status_code == 422 and "compute_burst of 10 units" in r.json()["error"]["message"]


async def test_a_degraded_answer_is_charged_what_ran() -> None:
    """Admission reserves the requested budget's charge; a degraded answer gives back what did not run."""
    bench = {"seq_len": 10, "batch_size": 1, "rows": [{"budget": 0.1, "latency_ms": 0.1},
                                                       {"budget": 1.0, "latency_ms": 1.0}]}
    engine = FakeEngine(per_token_s=0.0005, bench=bench, max_length=512)
    engine.gate.clear()
    d = config_dict(max_wait_ms=0, max_batch_size=1)
    d["tiers"]["flex"].update(latency_target_ms=300, compute_per_minute=0.001, compute_burst=5000)
    async with running_app(parse_config(d), engine=engine) as (client, app, _):
        runtime = app.state.runtime
        runtime.batcher.latency.observe(1.0, 100, 50.0)
        runtime.batcher.latency.observe(0.1, 100, 9.5)
        text = " ".join(["w"] * 98)  # 100 tokens: 100 units each at the requested budget 1.0
        tasks = await first_then_queued(engine, 12, lambda: client.post(
            "/classify", json={"text": text}, headers=headers("flex")))
        engine.gate.set()
        rs = await asyncio.gather(*tasks)
        owner = hash_key(KEYS["flex"])[:16]
        tier = runtime.config.tiers["flex"]
        left = await runtime.state.quota_left(owner, tier.rate_limit, tier.burst, ComputeLimit.of(tier))
    assert [r.status_code for r in rs] == [200] * 12
    charges = [r.json()["charge"] for r in rs]
    assert any(r.json()["degraded"] for r in rs) and min(charges) < 100 == max(charges)
    assert left.compute == 5_000_000 - round(sum(charges) * 1000)


# -- two workers sharing Redis ---------------------------------------------------------------------------------
WORDS = " ".join(["word"] * 20)  # 22 tokens on the real tokenizer


def test_two_workers_share_a_compute_quota_exactly(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A key with a quota of Q units is answered up to Q within the window and refused after, whether it sends 1
    text or 64 per request, through /classify and the TEI routes, with the requests spread over 2 workers."""
    meter = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path / "onnx")).meter()
    unit = ComputeUnit.of(meter)
    one, many = (quote(meter, unit, [WORDS] * n, 0.5).total for n in (1, 64))
    quotas = {"q1": 7 * one + one // 2, "q64": 2 * many + many // 2}  # milli-units: 7.5 and 2.5 requests' worth
    d = config_dict(max_batch_size=64)
    for name, q in quotas.items():
        d["tiers"][name] = {"default_budget": 0.5, "rate_limit": 6000, "burst": 100,
                            "compute_per_minute": 0.001, "compute_burst": q / 1000}
    d["keys"] += [{"sha256": hash_key(k), "tier": name[0].replace("t", "q") + name[1:], "name": name}
                  for name, k in QUOTA.items()]
    with redis_process(tmp_path / "redis") as (url, _):
        # Redis answering late is another test's subject (a busy machine took over the default 0.25 s and the
        # request went through unmetered): here it has time to answer.
        d["state"] = {"redis_url": url, "redis_timeout_s": 10}
        with start_server(tiny_checkpoint, toml_of(d), tmp_path / "srv", workers=2) as s:
            results = asyncio.run(_spend(s.url))
    for name, (ok, refused) in results.items():
        per_request = one if name.endswith("1") else many
        quota = quotas["q" + name[1:]]
        assert ok == [per_request] * (quota // per_request), name  # 7 and 2 answered, each charged the quote
        assert sum(ok) <= quota < sum(ok) + per_request
        assert refused and all(code == 429 for code, _ in refused), name
        assert all(int(retry) > 0 for _, retry in refused)


async def _spend(url: str) -> dict[str, tuple[list[int], list[tuple[int, str]]]]:
    """Each quota key sends its requests all at once: (charges of the answers in milli-units, refusals)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        def send(name: str) -> Any:
            n = 1 if name.endswith("1") else 64
            h = {"X-API-Key": QUOTA[name]}
            if name.startswith("q"):
                return c.post("/classify?budget=0.5", json={"texts": [WORDS] * n}, headers=h)
            return c.post("/predict?budget=0.5", json={"inputs": [[WORDS]] * n}, headers=h)

        sends = {name: 12 if name.endswith("1") else 5 for name in QUOTA}
        rs = await asyncio.gather(*[send(name) for name, k in sends.items() for _ in range(k)])
    out: dict[str, tuple[list[int], list[tuple[int, str]]]] = {}
    i = 0
    for name, k in sends.items():
        mine, i = rs[i:i + k], i + k
        ok = [round(float(r.headers["x-charge"] if name.startswith("t") else r.json()["charge"]) * 1000)
              for r in mine if r.status_code == 200]
        out[name] = (ok, [(r.status_code, r.headers.get("retry-after", "0")) for r in mine if r.status_code != 200])
        for r in mine:
            if r.status_code != 200:
                body = r.json()
                assert (body["error"]["code"] if name.startswith("q") else body["error_type"]) in \
                    ("compute_quota_exceeded", "Overloaded"), body
    return out
