"""The /classify fast path answers exactly as the FastAPI route does, and takes only well-formed requests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from headbudget.service.http import fastpath
from headbudget.service.http.routes import classify as classify_route
from headbudget.service.http.schemas import ClassifyResponse
from headbudget.service.settings import parse_config
from tests.service.conftest import KEYS, config_dict, headers, make_config, running_app, toml_of

pytestmark = pytest.mark.anyio

JSON = {"Content-Type": "application/json"}
# (query string, raw body, headers): valid requests, then every kind of error the route answers.
CASES: list[tuple[str, bytes, dict[str, str]]] = [
    ("", b'{"text": "a fine film"}', headers()),
    ("?budget=0.25", b'{"texts": ["one", "two words", "three more words"]}', headers()),
    ("", b'{"text": "x", "budget": 0.75}', headers("quality")),
    ("?max_latency_ms=500", b'{"text": "with a latency limit"}', headers()),
    ("", b'{"text": "bearer key"}', {"Authorization": f"Bearer {KEYS['cheap']}"}),
    ("", b'{"text": "x", "budget": "0.5"}', headers()),  # a numeric string, as pydantic's lax mode allows
    ("", b'{"text": "x"', headers()),  # malformed JSON
    ("", b'{"text": "x"}', {**headers(), "Content-Type": "text/plain"}),  # not JSON
    ("", b"", headers()),  # empty body
    ("", b'{"text": "x", "colour": "red"}', headers()),  # unknown field
    ("", b'{"text": "   "}', headers()),  # blank text
    ("", json.dumps({"texts": ["a", " \u3000\n"]}).encode(), headers()),  # a blank text among others (Unicode space)
    ("", b'{"texts": ["a", ""]}', headers()),  # an empty one
    ("", b'{"text": "x", "texts": ["y"]}', headers()),  # both
    ("", json.dumps({"texts": ["t"] * 65}).encode(), headers()),  # too many texts
    ("", b'{"text": "x", "budget": true}', headers()),  # a boolean is not a budget (pydantic would read 1)
    ("", b'{"text": "x", "max_latency_ms": true}', headers()),
    ("", b'{"text": "x"}', {**headers(), "Content-Encoding": "gzip"}),  # a coding the service does not decode
    ("?budget=NaN", b'{"text": "x"}', headers()),
    ("?budget=2", b'{"text": "x"}', headers()),
    ("?budget=", b'{"text": "x"}', headers()),
    ("?budget=0.5&budget=0.25", b'{"text": "x"}', headers()),  # repeated
    ("?budget=0.5", b'{"text": "x", "budget": 0.5}', headers()),  # in both places
    ("?colour=red", b'{"text": "x"}', headers()),  # unknown query parameter
    ("", b'{"text": "x"}', {}),  # no key
    ("", b'{"text": "x"}', {"X-API-Key": "hb_not_a_key"}),
    ("", b'{"text": "x"}', {"Authorization": "Basic abc"}),
    ("?budget=1.0", b'{"text": "x"}', headers("cheap")),  # above the tier's maximum: 403
    ("?budget=auto", b'{"text": "x"}', headers()),  # auto on a checkpoint without it: 400
]
VOLATILE = {"request_id", "latency_ms", "queue_ms"}


def _stable(body: Any) -> Any:
    """The answer without what differs between two runs of the same request (ids, timings)."""
    if isinstance(body, dict):
        return {k: _stable(v) for k, v in body.items() if k not in VOLATILE}
    if isinstance(body, list):
        return [_stable(v) for v in body]
    return body


async def _answers(fast_path: bool) -> list[tuple[int, Any, dict[str, str]]]:
    out = []
    async with running_app(make_config(fast_path=fast_path)) as (client, _, _):
        for query, body, extra in CASES:
            r = await client.post(f"/classify{query}", content=body, headers={**JSON, **extra})
            kept = {k: r.headers[k] for k in ("content-type", "www-authenticate", "retry-after") if k in r.headers}
            out.append((r.status_code, _stable(r.json()), kept))
            assert r.headers["x-request-id"]
    return out


async def test_fast_path_answers_as_the_route_does() -> None:
    fast, route = await _answers(True), await _answers(False)
    for case, a, b in zip(CASES, fast, route, strict=True):
        assert a == b, case
    statuses = [s for s, _, _ in fast]
    assert statuses[:6] == [200] * 6  # the valid ones were valid
    assert {400, 401, 403, 415, 422} <= set(statuses[6:])


async def test_fast_path_writes_the_answer_model_byte_for_byte() -> None:
    """The fast path writes the answer as plain data; its bytes are those of the ClassifyResponse they validate
    into (every field, in order, numbers as the model writes them), also with passes, a latency limit and texts
    at several budgets."""
    async with running_app(make_config()) as (client, _, _):
        for query, body, extra in [c for c in CASES[:6]] + [("?budget=0.3", b'{"texts": ["a", "b c"]}', headers())]:
            r = await client.post(f"/classify{query}", content=body, headers={**JSON, **extra})
            assert r.status_code == 200
            assert ClassifyResponse.model_validate_json(r.content).model_dump_json().encode() == r.content, query


async def test_fast_path_takes_well_formed_requests_and_hands_on_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    routed: list[str] = []
    original = classify_route.answer

    async def counting(*args: Any, **kwargs: Any) -> Any:
        routed.append("route")
        return await original(*args, **kwargs)

    monkeypatch.setattr(classify_route, "answer", counting)
    async with running_app(make_config()) as (client, _, _):
        ok = await client.post("/classify?budget=0.5", json={"text": "fast"}, headers=headers())
        assert ok.status_code == 200 and routed == []  # served without the route
        # a +json media type is JSON to FastAPI; the fast path leaves that rare case to it
        handed_on = await client.post("/classify", content=b'{"text": "slow"}',
                                      headers={**headers(), "Content-Type": "application/vnd.api+json"})
        assert handed_on.status_code == 200 and routed == ["route"]
        assert _stable(handed_on.json())["results"][0]["budget_applied"] == 0.5
        # an unknown query parameter is handed on too, and refused there before anything runs
        unknown = await client.post("/classify?colour=red", json={"text": "slow"}, headers=headers())
        assert unknown.status_code == 422 and routed == ["route"]
    async with running_app(make_config(fast_path=False)) as (client, _, _):
        r = await client.post("/classify", json={"text": "off"}, headers=headers())
        assert r.status_code == 200 and routed == ["route", "route"]


def test_fast_path_validates_the_query_parameters_the_route_takes() -> None:
    from headbudget.service.pipeline import CLASSIFY_QUERY

    assert tuple(fastpath._QUERY) == CLASSIFY_QUERY  # noqa: SLF001


async def test_fast_path_keeps_the_body_limit() -> None:
    async with running_app(make_config(max_body_bytes=2048)) as (client, _, _):
        r = await client.post("/classify", content=json.dumps({"text": "x" * 4000}).encode(),
                              headers={**JSON, **headers()})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"


async def test_a_key_the_rate_refuses_is_refused_before_its_body_is_read(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    parsed: list[bytes] = []
    original = fastpath._parse

    def counting(scope: Any, body: bytes) -> Any:
        parsed.append(body)
        return original(scope, body)

    monkeypatch.setattr(fastpath, "_parse", counting)
    d = config_dict()
    d["tiers"]["cheap"].update(rate_limit=60, burst=2)
    async with running_app(parse_config(d)) as (client, app, _):
        codes = [(await client.post("/classify", json={"text": "x"}, headers=headers("cheap"))).status_code
                 for _ in range(3)]
        assert codes == [200, 200, 429] and len(parsed) == 3  # the store refused the third, after its body
        again = await client.post("/classify", content=b'{"text": "x"', headers={**JSON, **headers("cheap")})
        assert again.status_code == 429 and again.json()["error"]["code"] == "rate_limited"
        assert int(again.headers["retry-after"]) >= 1 and len(parsed) == 3  # refused from its headers alone
        other = await client.post("/classify", json={"text": "x"}, headers=headers("balanced"))
        assert other.status_code == 200 and len(parsed) == 4  # another key: as usual
        unknown = await client.post("/classify", json={"text": "x"}, headers={"X-API-Key": "hb_nobody"})
        assert unknown.status_code == 401
        runtime = app.state.runtime  # a reload that raises the tier's rate: the store decides again, and admits
        runtime.config_path = tmp_path / "service.toml"
        raised = config_dict()
        raised["tiers"]["cheap"].update(burst=1000)
        runtime.config_path.write_text(toml_of(raised))
        assert runtime.reload() is True
        after = await client.post("/classify", json={"text": "x"}, headers=headers("cheap"))
        assert after.status_code == 200 and len(parsed) == 6
