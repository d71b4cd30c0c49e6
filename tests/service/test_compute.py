"""The compute unit and the charge: the Meter prices what the engine reports, exactly and from any thread; every
answer (/classify, the TEI routes) carries its charge per text and per request; /v1/models says what a unit is."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from headbudget.engine.errors import InputError
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions, Fixed
from headbudget.service.accounting.compute import (
    MILLI,
    REFERENCE_TOKENS,
    ComputeUnit,
    bill,
    text_charge,
    unit_text,
    units,
)
from headbudget.service.settings import parse_config
from tests.service.conftest import config_dict, headers, running_app
from tests.service.fakes import FakeEngine

TEXTS = ["a fine film", "Stocks rallied after the earnings report " * 3, "word " * 300]
FAKE_UNIT = ComputeUnit(3000 * REFERENCE_TOKENS)  # the fake: 3,000 dense multiply-adds a token at every length


def fake_charge(budget_heads: int, n_tokens: int) -> int:
    """What the fake engine (2 layers x 4 heads) is charged for one text, in milli-units."""
    return FAKE_UNIT.milli(FakeEngine().text_cost(budget_heads, n_tokens).total_macs)


def test_the_unit_is_one_dense_token_at_the_reference_length() -> None:
    unit = ComputeUnit(1_000_003)  # not a multiple of the reference length: charges round up
    assert unit.milli(unit.reference_macs) == REFERENCE_TOKENS * MILLI
    assert unit.milli(0) == 0 and unit.milli(1) == 1
    assert unit.milli(unit.reference_macs // 2) == REFERENCE_TOKENS * MILLI // 2  # 64,000 milli-units, rounded up
    assert units(4167) == 4.167 and units(1) == 0.001
    # headers and messages: three decimals at most and never an exponent, however large
    assert [unit_text(x) for x in (12345.678, 1e8, 7.5, 10.0, 0.001)] == ["12345.678", "100000000", "7.5", "10",
                                                                         "0.001"]


@pytest.mark.parametrize(("backend", "precision", "checkpoint"), [
    ("onnxruntime", "fp32", "tiny_model_scope_checkpoint"), ("onnxruntime", "int8", "tiny_model_scope_checkpoint"),
    ("torch", "fp32", "tiny_model_scope_checkpoint"), ("onnxruntime", "fp32", "tiny_checkpoint")])
def test_meter_prices_what_the_engine_reports(backend: str, precision: str, checkpoint: str,
                                              request: pytest.FixtureRequest, tmp_path: Path) -> None:
    """Before the pass, the Meter's tokens and cost equal the engine's answer at every budget, so an admission
    charge is exact; a dense text of the reference length is REFERENCE_TOKENS units."""
    folder: Path = request.getfixturevalue(checkpoint)
    engine = load_engine(folder, EngineOptions(backend=backend, precision=precision, cache_dir=tmp_path))  # type: ignore[arg-type]
    meter = engine.meter()
    counts = meter.count_tokens(TEXTS)
    assert counts == engine.count_tokens(TEXTS) and counts[-1][1] is True  # the long one is truncated
    unit = ComputeUnit.of(meter)
    for budget in (0.1, 0.25, 0.37, 0.5, 0.62, 1.0):
        answer = engine.predict(TEXTS, budget)
        assert [meter.cost(budget, n) for n, _ in counts] == [p.cost for p in answer.predictions], budget
        charged = bill(unit, answer.predictions)
        assert charged.texts == tuple(unit.milli(meter.cost(budget, n).total_macs) for n, _ in counts)
    # the ids the Meter counted run as they are: the same answers as the engine tokenizing the texts itself
    tokens = meter.tokenize(TEXTS)
    assert [(len(ids), cut) for ids, cut in zip(tokens.ids, tokens.truncated, strict=True)] == counts
    assert engine.run(TEXTS, Fixed(0.5), tokens).predictions == engine.predict(TEXTS, 0.5).predictions
    with pytest.raises(InputError):
        engine.run(TEXTS[:2], Fixed(0.5), tokens)
    dense = engine.predict(["x " * (REFERENCE_TOKENS - 2)], 1.0).predictions[0]
    assert dense.n_tokens == REFERENCE_TOKENS and text_charge(unit, dense.cost) == (REFERENCE_TOKENS * MILLI, 0)
    engine.close()


def test_meter_counts_off_the_engine_thread_while_it_runs(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The Meter has a tokenizer of its own: counting from other threads during forward passes changes neither."""
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    meter, want = engine.meter(), engine.count_tokens(TEXTS)
    before = engine.predict(TEXTS, 0.5)
    seen: list[list[tuple[int, bool]]] = []

    def count() -> None:
        seen.extend(meter.count_tokens(TEXTS) for _ in range(50))

    threads = [threading.Thread(target=count) for _ in range(3)]
    for t in threads:
        t.start()
    after = [engine.predict(TEXTS, 0.5) for _ in range(5)]
    for t in threads:
        t.join()
    assert len(seen) == 150 and all(s == want for s in seen)
    assert all(a.predictions == before.predictions for a in after)
    engine.close()


pytestmark = pytest.mark.anyio


async def test_a_priced_request_runs_the_tokens_its_price_counted() -> None:
    """Admission tokenizes a metered tier's texts to price them, and the engine runs those ids; it tokenizes an
    unmetered request's texts itself, and a batch in which any request is unmetered."""
    cfg = config_dict()
    cfg["tiers"]["balanced"]["compute_per_minute"] = 1e6  # metered; quality is not
    engine = FakeEngine()
    async with running_app(parse_config(cfg), engine=engine) as (client, _, _):
        async def post(tier: str, budget: float) -> int:
            r = await client.post(f"/classify?budget={budget}", json={"text": f"a b {tier}"}, headers=headers(tier))
            return r.status_code

        assert await post("balanced", 0.5) == 200 and await post("quality", 0.5) == 200
        engine.gate.clear()  # hold a pass, so that the next two requests wait and share a batch
        blocker = asyncio.create_task(post("quality", 1.0))
        await asyncio.sleep(0.1)
        both = [asyncio.create_task(post(t, 0.5)) for t in ("balanced", "quality")]
        await asyncio.sleep(0.1)
        engine.gate.set()
        assert await asyncio.gather(blocker, *both) == [200, 200, 200]
    assert [len(texts) for texts, _ in engine.calls] == [1, 1, 1, 2]
    assert engine.runs_with_tokens == [True, False, False, False]


async def test_classify_reports_the_charge_per_text_and_per_request() -> None:
    async with running_app() as (client, app, _):
        r = await client.post("/classify?budget=0.5", json={"texts": ["a fine film", "one two three four five"]},
                              headers=headers())
    assert r.status_code == 200, r.text
    body = r.json()
    # 5 and 7 tokens at 4 of 8 heads: 2,500 + 10,000 multiply-adds and 3,500 + 14,000, a third of a milli-unit each
    want = [fake_charge(4, 5), fake_charge(4, 7)]
    assert want == [4167, 5834]
    assert [x["charge"] for x in body["results"]] == [4.167, 5.834]
    assert body["charge"] == units(sum(want)) == 10.001
    assert app.state.runtime.unit == FAKE_UNIT


async def test_models_say_what_one_unit_is() -> None:
    async with running_app() as (client, _, _):
        card = (await client.get("/v1/models")).json()["data"][0]
    unit = card["compute_unit"]
    assert unit["reference_tokens"] == REFERENCE_TOKENS and unit["reference_macs"] == 3000 * REFERENCE_TOKENS
    assert unit["macs"] == 3000 and "dense model on one token" in unit["description"]


async def test_tei_answers_carry_the_charge_in_headers() -> None:
    async with running_app() as (client, _, _):
        r = await client.post("/predict?budget=1.0", json={"inputs": [["a fine film"], ["one two three"]]},
                              headers=headers())
    assert r.status_code == 200, r.text
    assert r.headers["x-charge-per-input"] == "5,5" and r.headers["x-charge"] == "10"  # dense: one unit a token
