"""lab.hostile's short runs, part of the suite: schemathesis against a real server with a key of each tier, and the
request parser fuzzed against FastAPI's validation; and that each oracle fails when it should."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from pydantic import TypeAdapter

from lab.hostile import fuzz
from lab.hostile.checks import TIER_MAX, budget_within_tier
from lab.hostile.schema import run_schemathesis
from tests.service.conftest import KEYS, Server, config_dict, start_server, toml_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tiny_checkpoint, toml_of(config_dict(max_wait_ms=1.0)),
                      tmp_path_factory.mktemp("schemathesis")) as s:
        yield s


def test_every_route_answers_within_its_schema_for_every_tier(server: Server, tmp_path: Path) -> None:
    tier_max = {t: c["max_budget"] for t, c in config_dict()["tiers"].items()}
    report = run_schemathesis(server.url, KEYS, tier_max, tmp_path, max_examples=15, seed=7)
    assert report.failures == [] and report.server_errors == report.schema_violations == 0
    assert report.impossible_answers == 0
    assert report.routes == 12 and report.cases >= 4 * 12 * 5
    assert "Traceback" not in server.logs()


def test_the_tier_check_refuses_a_budget_above_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TIER_MAX, json.dumps({"cheap": 0.5}))
    case = SimpleNamespace(path="/classify")

    def response(budget: float, cost: float = 0.4) -> SimpleNamespace:
        body = {"tier": "cheap", "results": [{"budget_applied": budget, "cost": cost}]}
        return SimpleNamespace(status_code=200, json=lambda: body)

    assert budget_within_tier(None, response(0.5), case)
    with pytest.raises(AssertionError, match="above tier cheap's max_budget 0.5"):
        budget_within_tier(None, response(0.55), case)
    with pytest.raises(AssertionError, match="outside"):
        budget_within_tier(None, response(0.25, cost=1.5), case)


@pytest.fixture(scope="module")
def harness(tiny_checkpoint: Path) -> Iterator[fuzz.Harness]:
    h = fuzz.Harness(tiny_checkpoint)
    yield h
    h.close()


def test_every_seed_is_answered_alike_with_and_without_the_fast_path(harness: fuzz.Harness, tmp_path: Path) -> None:
    test = fuzz.one_input(harness)
    assert fuzz.seed_corpus(tmp_path) >= 100
    statuses = set()
    for seed in sorted(tmp_path.iterdir()):
        test(seed.read_bytes())
        statuses.add(harness.answer(*fuzz.decode(seed.read_bytes()), fast_path=True)[0])
    assert {200, 400, 401, 403, 422} <= statuses  # the seeds reach the answers and the refusals


def test_the_oracle_catches_a_fast_path_that_parses_otherwise(harness: fuzz.Harness,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A fast path taking any float as a budget (0.05 included) answers otherwise than FastAPI's 422."""
    from headbudget.service.http import fastpath

    test = fuzz.one_input(harness)
    data = fuzz.encode("/classify", 0, 1, b"budget=0.05", b'{"text": "a"}')
    test(data)
    monkeypatch.setitem(fastpath._QUERY, "budget", TypeAdapter(float))
    with pytest.raises(fuzz.Mismatch, match="budget=0.05"):
        test(data)


def test_a_short_fuzzing_run_finds_nothing(tiny_checkpoint: Path, tmp_path: Path) -> None:
    result = fuzz.fuzz(tiny_checkpoint, tmp_path, runs=1500)
    assert (result["crashes"], result["mismatches"], result["exit_code"]) == (0, 0, 0), \
        (tmp_path / "fuzz.log").read_text()[-3000:]
    assert result["executions"] >= 1500 and result["coverage"] > 0


def test_a_short_soak_balances_its_books(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """The soak's machinery on the tiny checkpoint: every kind of request sent, Redis restarted, SIGHUPs, slow and
    idle clients; no 5xx, and each key's usage equals the charges its answers carried."""
    from lab.hostile import soak

    row = soak.run(tiny_checkpoint, tmp_path, replicas=1, seconds=16, warmup_s=2, window_s=6, capacity_s=3,
                   hup_every_s=5)
    assert row["server_errors"] == 0 and row["tracebacks_in_logs"] == 0, row
    assert row["usage_minus_answers_units"] == 0, (row["usage_by_key_units"], row["answers_by_key_units"])
    statuses = row["statuses"]
    assert {"200", "400", "401", "413", "422", "429"} <= set(statuses), statuses  # the mix reached every answer
    assert row["answers"] > 50 and row["fds_start"] > 0 and row["rss_start_mb"] > 0
