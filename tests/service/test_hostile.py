"""What a hostile client can send a real `headbudget serve`: every body gets a 4xx with the JSON error shape,
the server keeps answering, and no traceback reaches the log; one tenant can never touch another's answers."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.service.conftest import KEYS, Server, config_dict, engine_factory_available, start_server, toml_of

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

DEEP = 50_000  # levels: far past Python's recursion limit (which once answered 500)
JSON_CT = {"Content-Type": "application/json"}

# name -> (raw body, expected status, expected error code). Bodies a client can send to POST /classify.
HOSTILE: dict[str, tuple[bytes, int, str]] = {
    "nested arrays": (b'{"text": ' + b"[" * DEEP + b"]" * DEEP + b"}", 400, "malformed_json"),
    "nested objects": (b'{"text": "a", "x": ' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", 400,
                       "malformed_json"),
    "nested budget": (b'{"text": "a", "budget": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "malformed_json"),
    "integer of 5,000 digits": (b'{"text": "a", "budget": ' + b"9" * 5000 + b"}", 400, "malformed_json"),
    "float overflow": (b'{"text": "a", "budget": 1e999999}', 422, "invalid_request"),
    "NaN literal": (b'{"text": "a", "budget": NaN}', 422, "invalid_request"),
    "negative zero budget": (b'{"text": "a", "budget": -0.0}', 422, "invalid_request"),
    "lone surrogate": (b'{"text": "\\ud800 hello"}', 422, "invalid_request"),
    "invalid UTF-8": (b'{"text": "\xff\xfe\xfd"}', 400, "malformed_json"),
    "truncated": (b'{"text": "a', 400, "malformed_json"),
    "top-level array": (b"[1, 2]", 422, "invalid_request"),
    "top-level null": (b"null", 422, "invalid_request"),
    "empty body": (b"", 422, "invalid_request"),
    "text is a number": (b'{"text": 5}', 422, "invalid_request"),
    "texts is an object": (b'{"texts": {"a": 1}}', 422, "invalid_request"),
    "20,000 unknown fields": (json.dumps({f"k{i}": i for i in range(20_000)}).encode(), 422, "invalid_request"),
    "65 texts": (json.dumps({"texts": ["t"] * 65}).encode(), 422, "invalid_request"),
    "text over the character limit": (json.dumps({"text": "x" * 100_001}).encode(), 422, "invalid_request"),
    "body over 1 MiB": (json.dumps({"texts": ["word " * 40_000] * 8}).encode(), 413, "payload_too_large"),
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tiny_checkpoint, toml_of(config_dict(max_wait_ms=1.0)),
                      tmp_path_factory.mktemp("hostile")) as s:
        yield s


def _alive(server: Server) -> None:
    r = httpx.post(f"{server.url}/classify", json={"text": "still here"}, headers={"X-API-Key": KEYS["cheap"]},
                   timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("name", list(HOSTILE))
@pytest.mark.parametrize("path", ["/classify", "/classify?budget=0.25", "/feedback"])
def test_a_hostile_body_gets_a_json_4xx(server: Server, name: str, path: str) -> None:
    body, status, code = HOSTILE[name]
    r = httpx.post(server.url + path, content=body, headers={**JSON_CT, "X-API-Key": KEYS["balanced"]}, timeout=60)
    if path == "/feedback" and status == 422:
        assert r.status_code == 422  # a different schema: its own 422, never a 5xx
    else:
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text[:300]
    assert set(r.json()) == {"error"} and r.json()["error"]["message"]
    _alive(server)
    assert "Traceback" not in server.logs()


def test_hostile_headers_and_query_strings_get_4xx(server: Server) -> None:
    key = {"X-API-Key": KEYS["balanced"], **JSON_CT}
    cases: list[tuple[str, dict[str, Any], int]] = [
        ("/classify?budget=%ff%fe", key, 422),
        ("/classify?budget=1e999", key, 422),
        ("/classify?max_latency_ms=-1", key, 422),
        ("/classify?budget=" + "9" * 5000, key, 422),
        ("/classify", {**key, "X-Request-ID": "../../etc/passwd"}, 200),  # replaced, not echoed
        ("/classify", {**key, "X-Request-ID": "x" * 10_000}, 200),
        ("/classify", {**key, "X-Request-ID": "caf\u00e9".encode()}, 200),  # raw UTF-8 bytes
        ("/classify", {**JSON_CT, "X-API-Key": "x" * 8000}, 401),
        ("/classify", {**JSON_CT, "Authorization": "Bearer"}, 401),
        ("/classify", {**JSON_CT, "Authorization": "Basic " + "a" * 100}, 401),
        ("/classify", {"X-API-Key": KEYS["balanced"], "Content-Type": "application/json; charset=latin-1"}, 200),
    ]
    for path, hdrs, status in cases:
        r = httpx.post(server.url + path, content=b'{"text": "a hostile header"}', headers=hdrs, timeout=30)
        assert r.status_code == status, (path, hdrs, r.text[:200])
        if status >= 400:
            assert r.json()["error"]["code"]
        assert len(r.headers["x-request-id"]) <= 64 and "/" not in r.headers["x-request-id"]
    _alive(server)
    assert "Traceback" not in server.logs()


def test_disagreeing_credentials_are_refused(server: Server) -> None:
    both = {"X-API-Key": KEYS["cheap"], "Authorization": "Bearer hb_not_the_same_key"}
    r = httpx.post(f"{server.url}/classify", json={"text": "x"}, headers=both, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    assert "different keys" in r.json()["error"]["message"]
    two_real = {"X-API-Key": KEYS["cheap"], "Authorization": f"Bearer {KEYS['quality']}"}
    r = httpx.post(f"{server.url}/classify?budget=1.0", json={"text": "x"}, headers=two_real, timeout=30)
    assert r.status_code == 401  # never resolved to either tier
    same = {"X-API-Key": KEYS["cheap"], "Authorization": f"Bearer {KEYS['cheap']}"}
    r = httpx.post(f"{server.url}/classify", json={"text": "x"}, headers=same, timeout=30)
    assert r.status_code == 200 and r.json()["tier"] == "cheap"


def test_a_request_id_names_an_answer_of_one_key_only(server: Server) -> None:
    """Two keys of different tiers send the same client-chosen request id: each keeps its own answer."""
    cheap, quality = {"X-API-Key": KEYS["cheap"]}, {"X-API-Key": KEYS["quality"]}
    rid = {"X-Request-ID": "shared-id-42"}
    first = httpx.post(f"{server.url}/classify", json={"texts": ["a", "b"]}, headers={**cheap, **rid}, timeout=30)
    second = httpx.post(f"{server.url}/classify", json={"text": "c"}, headers={**quality, **rid}, timeout=30)
    assert first.json()["request_id"] == second.json()["request_id"] == "shared-id-42"
    label = first.json()["results"][1]["label"]

    # The second tenant cannot reach the first one's text 1 (its own answer has one text) ...
    r = httpx.post(f"{server.url}/feedback", json={"request_id": "shared-id-42", "label": label, "index": 1},
                   headers=quality, timeout=30)
    assert r.status_code == 404
    # ... and its feedback on its own answer does not consume the first tenant's text 0.
    r = httpx.post(f"{server.url}/feedback", json={"request_id": "shared-id-42", "label": label},
                   headers=quality, timeout=30)
    assert r.status_code == 200
    for index in (0, 1):
        r = httpx.post(f"{server.url}/feedback", json={"request_id": "shared-id-42", "label": label, "index": index},
                       headers=cheap, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["correct"] is (first.json()["results"][index]["label"] == label)
    # A third key that never sent the id finds nothing at all.
    r = httpx.post(f"{server.url}/feedback", json={"request_id": "shared-id-42", "label": label},
                   headers={"X-API-Key": KEYS["balanced"]}, timeout=30)
    assert r.status_code == 404
    assert "Traceback" not in server.logs()
