"""A fixed set of requests answered the same by every version of the data plane: each budget kind through
/classify (fast path and FastAPI route), TEI's /predict and /, and their errors, against answers recorded in
``answers_fixed.json`` (ids and timings left out). The fake engine's answers depend on nothing but the text and
the budget, so the file holds on any CPU. After a change that means to change an answer, rewrite it with
``HEADBUDGET_WRITE_ANSWERS=1 pytest tests/service/test_answers_fixed.py`` and read the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import KEYS, make_config, running_app
from tests.service.fakes import FakeEngine

pytestmark = pytest.mark.anyio
FILE = Path(__file__).with_name("answers_fixed.json")
TIMINGS = {"request_id", "latency_ms", "queue_ms"}
HEADERS = ("content-type", "retry-after", "www-authenticate", "x-budget-applied", "x-degraded", "x-charge",
           "x-charge-per-input", "x-compute-tokens", "x-compute-characters")
LONG = "word " * 40

# (name, method, path, tier or None, query, body: JSON value or raw bytes, extra headers)
REQUESTS: list[tuple[str, str, str, str | None, str, Any, dict[str, str]]] = [
    ("budget in the body", "POST", "/classify", "balanced", "", {"text": "a fine film", "budget": 0.5}, {}),
    ("budget in the query", "POST", "/classify", "balanced", "budget=0.25", {"text": "a dull film"}, {}),
    ("tier default", "POST", "/classify", "cheap", "", {"texts": ["one", "two words", LONG]}, {}),
    ("off-grid budget", "POST", "/classify", "quality", "", {"text": "odd budget", "budget": 0.37}, {}),
    ("latency target", "POST", "/classify", "balanced", "max_latency_ms=500", {"text": "fast please"}, {}),
    ("auto", "POST", "/classify", "balanced", "budget=auto", {"text": "choose for me"}, {}),
    ("auto under a ceiling", "POST", "/classify", "quality", "", {"text": "x", "budget": "auto", "max_budget": 0.5},
     {}),
    ("64 texts", "POST", "/classify", "quality", "budget=1", {"texts": [f"text {i} " * (i % 7 + 1) for i in range(64)]},
     {}),
    ("over the tier's maximum", "POST", "/classify", "cheap", "budget=1", {"text": "too much"}, {}),
    ("budget twice", "POST", "/classify", "balanced", "budget=0.5", {"text": "x", "budget": 0.5}, {}),
    ("budget and latency", "POST", "/classify", "balanced", "", {"text": "x", "budget": 0.5, "max_latency_ms": 9}, {}),
    ("budget out of range", "POST", "/classify", "balanced", "budget=2", {"text": "x"}, {}),
    ("unknown parameter", "POST", "/classify", "balanced", "budjet=0.5", {"text": "x"}, {}),
    ("no key", "POST", "/classify", None, "", {"text": "x"}, {}),
    ("unknown key", "POST", "/classify", None, "", {"text": "x"}, {"X-API-Key": "hb_nobody_000000000000000000000000"}),
    ("malformed JSON", "POST", "/classify", "balanced", "", b'{"text": ', {}),
    ("empty text", "POST", "/classify", "balanced", "", {"text": "   "}, {}),
    ("no text", "POST", "/classify", "balanced", "", {}, {}),
    ("65 texts", "POST", "/classify", "balanced", "", {"texts": ["x"] * 65}, {}),
    ("not JSON", "POST", "/classify", "balanced", "", b"text=x", {"Content-Type": "text/plain"}),
    ("TEI one input", "POST", "/predict", "balanced", "", {"inputs": "a fine film"}, {}),
    ("TEI batch", "POST", "/predict", "quality", "", {"inputs": [["one"], ["two words"]], "raw_scores": True}, {}),
    ("TEI X-Budget", "POST", "/predict", "balanced", "", {"inputs": "header budget"}, {"X-Budget": "0.25"}),
    ("TEI auto", "POST", "/predict", "balanced", "budget=auto", {"inputs": "auto here"}, {}),
    ("TEI top_k", "POST", "/", "balanced", "", {"inputs": "root", "parameters": {"top_k": 1}}, {}),
    ("TEI sigmoid", "POST", "/predict", "balanced", "",
     {"inputs": "s", "parameters": {"function_to_apply": "sigmoid"}}, {}),
    ("TEI not truncated", "POST", "/predict", "balanced", "", {"inputs": LONG * 3, "truncate": False}, {}),
    ("TEI empty", "POST", "/predict", "balanced", "", {"inputs": " "}, {}),
    ("TEI pair", "POST", "/predict", "balanced", "", {"inputs": ["a", "b"]}, {}),
    ("TEI over the tier's maximum", "POST", "/predict", "cheap", "", {"inputs": "x"}, {"X-Budget": "1"}),
    ("TEI no key", "POST", "/predict", None, "", {"inputs": "x"}, {}),
    ("TEI malformed JSON", "POST", "/predict", "balanced", "", b"[", {}),
]


def _without_timings(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k not in TIMINGS}
    if isinstance(value, list):
        return [_without_timings(v) for v in value]
    return value


async def _answers(fast_path: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = FakeEngine(supports_auto=True)
    async with running_app(make_config(fast_path=fast_path), engine) as (client, _, _):
        for name, method, path, tier, query, body, extra in REQUESTS:
            headers = {"X-API-Key": KEYS[tier]} if tier else {}
            headers.update(extra)
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            headers.setdefault("Content-Type", "application/json")
            r = await client.request(method, path + (f"?{query}" if query else ""), content=raw, headers=headers)
            try:
                payload: Any = _without_timings(r.json())
            except ValueError:
                payload = r.text
            out[name] = {"status": r.status_code, "body": payload,
                         "headers": {h: r.headers[h] for h in HEADERS if h in r.headers}}
    return out


@pytest.mark.parametrize("fast_path", [True, False])
async def test_the_fixed_requests_are_answered_as_recorded(fast_path: bool) -> None:
    got = await _answers(fast_path)
    if os.environ.get("HEADBUDGET_WRITE_ANSWERS") == "1" and fast_path:
        FILE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(FILE.read_text())
    assert sorted(got) == sorted(recorded)
    for name in recorded:
        assert got[name] == recorded[name], name


async def test_a_changed_answer_is_caught() -> None:
    """The comparison sees a change in one charge (the check is not vacuous)."""
    recorded = json.loads(FILE.read_text())
    changed = json.loads(json.dumps(recorded))
    changed["budget in the body"]["body"]["charge"] += 0.001
    assert changed != recorded
    assert {r[0] for r in REQUESTS} == set(recorded)
    assert {v["status"] for v in recorded.values()} >= {200, 400, 401, 403, 415, 422}
