"""The text-embeddings-inference (TEI) routes on a real `headbudget serve`: Hugging Face's InferenceClient gets
the model's labels back, TEI's request and response shapes, raw scores equal to the engine's logits, the budget
from the tier, a header or the query, and TEI-shaped errors with TEI's status codes."""

from __future__ import annotations

import asyncio
import json
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.engine.errors import EngineError
from headbudget.engine.types import BatchResult
from headbudget.service.settings import parse_config
from tests.service.conftest import (
    KEYS,
    Server,
    config_dict,
    engine_factory_available,
    running_app,
    start_server,
    toml_of,
)
from tests.service.fakes import FakeEngine
from tests.service.test_api import sample

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

LABELS = {"negative", "positive"}  # tests/conftest.py's random checkpoints
TEXT = "Stocks rallied after the earnings report"
LONG = "word " * 400  # over the tiny checkpoint's 128 tokens


def key(tier: str = "balanced") -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[tier]}"}


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with start_server(tiny_checkpoint, toml_of(config_dict(max_wait_ms=1.0)), tmp_path_factory.mktemp("tei"),
                      extra=("--precision", "fp32")) as s:
        yield s


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> Iterator[Any]:
    """The engine the server runs (same checkpoint and options), in this process: the logits to compare."""
    from headbudget.engine.factory import load_engine
    from headbudget.engine.types import EngineOptions

    e = load_engine(tiny_checkpoint, EngineOptions(precision="fp32"))
    yield e
    e.close()


def post(server: Server, body: Any, path: str = "/predict", headers: dict[str, str] | None = None,
         **kw: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers=key() if headers is None else headers, timeout=30,
                      **kw)


def tei_error(r: httpx.Response, status: int, error_type: str) -> str:
    """Assert TEI's error shape and status; the message."""
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert set(body) == {"error", "error_type"} and body["error_type"] == error_type, body
    assert isinstance(body["error"], str) and body["error"]
    return str(body["error"])


def by_label(answer: list[dict[str, Any]]) -> dict[str, float]:
    assert [a["score"] for a in answer] == sorted((a["score"] for a in answer), reverse=True)  # highest first
    return {a["label"]: a["score"] for a in answer}


def test_inference_client_text_classification(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a TEI user's code calls: InferenceClient(model=URL, token=KEY).text_classification(text)."""
    import huggingface_hub
    import huggingface_hub.constants

    # huggingface_hub refuses every URL in offline mode, loopback included; the server is on 127.0.0.1
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    client = huggingface_hub.InferenceClient(model=server.url, token=KEYS["balanced"])
    out = client.text_classification(TEXT)
    assert {o.label for o in out} == LABELS
    assert out[0].score >= out[1].score and math.isclose(sum(o.score for o in out), 1.0, abs_tol=1e-6)
    reference = by_label(post(server, {"inputs": TEXT}).json())
    assert {o.label: o.score for o in out} == pytest.approx(reference, abs=1e-9)
    top = client.text_classification(TEXT, top_k=1)
    assert [o.label for o in top] == [out[0].label]
    with pytest.raises(huggingface_hub.errors.HfHubHTTPError) as err:  # a wrong key is a 401
        huggingface_hub.InferenceClient(model=server.url, token="hb_wrong").text_classification(TEXT)
    assert err.value.response.status_code == 401


def test_shapes_and_scores_match_classify(server: Server) -> None:
    """A string or a one-string list: one flat answer; a batch: one answer per input, equal to one by one; the
    probabilities are /classify's at the same budget, every label, highest first."""
    single = post(server, {"inputs": TEXT})
    assert single.status_code == 200, single.text
    scores = by_label(single.json())
    assert set(scores) == LABELS and math.isclose(sum(scores.values()), 1.0, abs_tol=1e-6)
    assert by_label(post(server, {"inputs": [TEXT]}).json()) == scores
    classify = httpx.post(f"{server.url}/classify", json={"text": TEXT}, headers=key(), timeout=30).json()
    assert scores == pytest.approx(classify["results"][0]["scores"], abs=1e-9)
    assert single.headers["x-budget-applied"] == "0.5"  # the balanced tier's default

    texts = [TEXT, "The match ended in a draw", "A new chip doubles battery life"]
    batch = post(server, {"inputs": [[t] for t in texts]}, path="/")
    assert batch.status_code == 200, batch.text
    answers = batch.json()
    assert len(answers) == 3
    for t, answer in zip(texts, answers, strict=True):
        assert by_label(answer) == pytest.approx(by_label(post(server, {"inputs": t}).json()), abs=1e-5)


def test_inference_api_parameters(server: Server) -> None:
    """`parameters` (the Inference API's convention): a single input answered as [[...]], top_k, and
    function_to_apply; unknown fields are ignored as TEI ignores them."""
    full = post(server, {"inputs": TEXT, "parameters": {}, "options": {"wait_for_model": True}}, path="/").json()
    assert len(full) == 1 and set(by_label(full[0])) == LABELS
    top = post(server, {"inputs": TEXT, "parameters": {"top_k": 1}}).json()
    assert top == [full[0][:1]]
    raw = by_label(post(server, {"inputs": TEXT, "raw_scores": True}).json())
    none = by_label(post(server, {"inputs": TEXT, "parameters": {"function_to_apply": "none"}}).json()[0])
    assert none == pytest.approx(raw, abs=1e-9)
    sig = by_label(post(server, {"inputs": TEXT, "parameters": {"function_to_apply": "sigmoid"}}).json()[0])
    assert sig == pytest.approx({k: 1 / (1 + math.exp(-v)) for k, v in raw.items()}, abs=1e-9)


def test_raw_scores_are_the_engines_logits(server: Server, engine: Any) -> None:
    """raw_scores: the logits the engine computes at the applied budget (not log-probabilities); the budget
    from X-Budget or the query changes them."""
    labels = engine.info.labels
    for headers, path, budget in [({}, "/predict", 0.5), ({"X-Budget": "0.25"}, "/predict", 0.25),
                                  ({}, "/predict?budget=1.0", 1.0)]:
        r = post(server, {"inputs": TEXT, "raw_scores": True}, path=path, headers={**key(), **headers})
        assert r.status_code == 200, r.text
        assert r.headers["x-budget-applied"] == f"{budget:g}"
        logits = engine.predict([TEXT], budget).predictions[0].logits
        assert by_label(r.json()) == pytest.approx(dict(zip(labels, logits, strict=True)), abs=1e-4)
    raw = by_label(post(server, {"inputs": TEXT, "raw_scores": True}).json())
    assert abs(math.log(sum(math.exp(v) for v in raw.values()))) > 1e-3  # logits, not log-probabilities
    probs = by_label(post(server, {"inputs": TEXT}).json())
    z = sum(math.exp(v) for v in raw.values())
    assert probs == pytest.approx({k: math.exp(v) / z for k, v in raw.items()}, abs=1e-6)
    quarter = post(server, {"inputs": TEXT, "raw_scores": True}, headers={**key(), "X-Budget": "0.25"}).json()
    assert by_label(quarter) != pytest.approx(raw, abs=1e-6)  # the budget reached the engine


def test_truncation(server: Server) -> None:
    """Over-long input: cut by default (TEI 1.9's auto_truncate) and with truncate=true, refused with 422
    `Validation` for truncate=false, and for Left truncation (this engine keeps a text's start)."""
    assert post(server, {"inputs": LONG}).status_code == 200
    assert post(server, {"inputs": LONG, "truncate": True}).status_code == 200
    assert "128 tokens" in tei_error(post(server, {"inputs": LONG, "truncate": False}), 422, "Validation")
    tei_error(post(server, {"inputs": [[TEXT], [LONG]], "truncate": False}), 422, "Validation")
    assert post(server, {"inputs": TEXT, "truncate": False}).status_code == 200
    tei_error(post(server, {"inputs": LONG, "truncation_direction": "left"}), 422, "Validation")
    assert post(server, {"inputs": TEXT, "truncation_direction": "Left"}).status_code == 200
    huge = "x" * 100_001  # TEI's character limit (ours: /classify's 100,000)
    assert "characters" in tei_error(post(server, {"inputs": huge, "truncate": False}), 422, "Validation")
    assert post(server, {"inputs": huge}).status_code == 200


# name -> (request keyword arguments for httpx.post, status, TEI error_type)
BAD: dict[str, tuple[dict[str, Any], int, str]] = {
    "malformed JSON": ({"content": b'{"inputs": "a', "headers": {**key(), "Content-Type": "application/json"}},
                       400, "Validation"),
    "deeply nested JSON": ({"content": b'{"inputs": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
                            "headers": {**key(), "Content-Type": "application/json"}}, 400, "Validation"),
    "not JSON": ({"content": b"inputs=a", "headers": {**key(), "Content-Type": "text/plain"}}, 415, "Validation"),
    "no inputs": ({"json": {"raw_scores": True}}, 422, "Validation"),
    "inputs a number": ({"json": {"inputs": 5}}, 422, "Validation"),
    "raw_scores a string": ({"json": {"inputs": "a", "raw_scores": "yes"}}, 422, "Validation"),
    "mixed batch": ({"json": {"inputs": [["a"], "b"]}}, 422, "Validation"),
    "sentence pair": ({"json": {"inputs": ["a", "b"]}}, 422, "Validation"),
    "pair in a batch": ({"json": {"inputs": [["a", "b"]]}}, 422, "Validation"),
    "three strings": ({"json": {"inputs": ["a", "b", "c"]}}, 422, "Validation"),
    "empty list": ({"json": {"inputs": []}}, 422, "Validation"),
    "empty string": ({"json": {"inputs": ""}}, 400, "Empty"),
    "whitespace in a batch": ({"json": {"inputs": [["a"], ["  "]]}}, 400, "Empty"),
    "65 inputs": ({"json": {"inputs": [["t"]] * 65}}, 422, "Validation"),
    "top_k 0": ({"json": {"inputs": "a", "parameters": {"top_k": 0}}}, 422, "Validation"),
    "unknown function": ({"json": {"inputs": "a", "parameters": {"function_to_apply": "relu"}}}, 422,
                         "Validation"),
    "raw_scores and softmax": ({"json": {"inputs": "a", "raw_scores": True,
                                         "parameters": {"function_to_apply": "softmax"}}}, 422, "Validation"),
    "no key": ({"json": {"inputs": "a"}, "headers": {}}, 401, "Unauthorized"),
    "wrong key": ({"json": {"inputs": "a"}, "headers": {"Authorization": "Bearer hb_wrong"}}, 401,
                  "Unauthorized"),
    "over the tier's max": ({"json": {"inputs": "a"}, "headers": {**key("cheap"), "X-Budget": "0.9"}}, 403,
                            "Forbidden"),
    "query over the max": ({"json": {"inputs": "a"}, "params": {"budget": "0.9"}, "headers": key("cheap")}, 403,
                           "Forbidden"),
    "budget not a number": ({"json": {"inputs": "a"}, "headers": {**key(), "X-Budget": "lots"}}, 422,
                            "Validation"),
    "budget out of range": ({"json": {"inputs": "a"}, "params": {"budget": "1.5"}}, 422, "Validation"),
    "header and query": ({"json": {"inputs": "a"}, "params": {"budget": "0.5"},
                          "headers": {**key(), "X-Budget": "0.5"}}, 422, "Validation"),
    "misspelt budget": ({"json": {"inputs": "a"}, "params": {"budgte": "0.3"}}, 422, "Validation"),
    "budget twice": ({"json": {"inputs": "a"}, "params": [("budget", "0.3"), ("budget", "0.5")]}, 422,
                     "Validation"),
    "auto on a budgeted checkpoint": ({"json": {"inputs": "a"}, "headers": {**key(), "X-Budget": "auto"}}, 422,
                                      "Validation"),
}


@pytest.mark.parametrize("path", ["/predict", "/"])
def test_bad_requests_get_tei_errors(server: Server, path: str) -> None:
    """Each bad request: TEI's {"error", "error_type"} with TEI's status, never a 5xx; the server still answers."""
    for name, (kw, status, error_type) in BAD.items():
        kw = {"headers": key(), **kw}
        r = httpx.post(f"{server.url}{path}", timeout=30, **kw)
        try:
            tei_error(r, status, error_type)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        if status == 401:
            assert r.headers["www-authenticate"].startswith("Bearer")
    assert post(server, {"inputs": TEXT}, path=path).status_code == 200
    assert "Traceback" not in server.logs()


def test_body_over_the_limit(server: Server) -> None:
    """Over 1 MiB: a chunked body is refused while it is read, in TEI's shape; one whose Content-Length announces
    it is refused before any route runs, in the /classify shape (documented in the OpenAPI)."""
    body = json.dumps({"inputs": [["word " * 40_000]] * 8}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(body), 65_536):
            yield body[i:i + 65_536]

    chunked = httpx.post(f"{server.url}/predict", content=chunks(),
                         headers={**key(), "Content-Type": "application/json"}, timeout=30)
    tei_error(chunked, 413, "Validation")
    announced = httpx.post(f"{server.url}/predict", content=body,
                           headers={**key(), "Content-Type": "application/json"}, timeout=30)
    assert announced.status_code == 413 and announced.json()["error"]["code"] == "payload_too_large"


def test_info_and_health(server: Server) -> None:
    """/info in TEI's shape from the checkpoint; /health 200 with no body; both without a key (TEI's /health
    is public, and /info shows what /v1/models already shows to anyone)."""
    info = httpx.get(f"{server.url}/info", timeout=10).json()
    models = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
    labels = models["labels"]
    assert info["model_type"] == {"classifier": {"id2label": {str(i): lab for i, lab in enumerate(labels)},
                                                 "label2id": {lab: i for i, lab in enumerate(labels)}}}
    assert (info["model_id"], info["model_sha"], info["max_input_length"]) == (models["id"], models["checksum"], 128)
    assert info["model_dtype"] == "float32" and info["max_client_batch_size"] == 64 and info["auto_truncate"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", info["version"])
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.content == b""


def test_metrics_and_feedback_see_tei_requests(server: Server) -> None:
    """A TEI answer is counted like a /classify one and can receive feedback by its X-Request-ID."""
    before = httpx.get(f"{server.url}/metrics", timeout=10).text
    n = sample(before, "headbudget_requests_total", tier="quality", status="200")
    r = post(server, {"inputs": TEXT}, headers=key("quality"))
    assert r.status_code == 200
    label = r.json()[0]["label"]
    feedback = httpx.post(f"{server.url}/feedback", json={"request_id": r.headers["x-request-id"], "label": label},
                          headers=key("quality"), timeout=10)
    assert feedback.status_code == 200 and feedback.json()["correct"] is True, feedback.text
    other = httpx.post(f"{server.url}/feedback", json={"request_id": r.headers["x-request-id"], "label": label},
                       headers=key("balanced"), timeout=10)
    assert other.status_code == 404  # another key cannot see this answer
    after = httpx.get(f"{server.url}/metrics", timeout=10).text
    assert sample(after, "headbudget_requests_total", tier="quality", status="200") == n + 2


# -- in process, over the fake engine: the statuses a real tiny model cannot be made to produce on demand --------
class FailingEngine(FakeEngine):
    """A fake engine whose forward pass fails on one text (an EngineError, as a backend raises)."""

    def predict(self, texts: Sequence[str], budget: float) -> BatchResult:
        if "explode" in texts:
            raise EngineError("the backend failed")
        return super().predict(texts, budget)


@pytest.mark.anyio
async def test_overload_and_failures_in_tei_shape() -> None:
    """Over the rate and a full queue: 429 `Overloaded` with Retry-After (TEI's status for an overloaded model,
    where /classify answers a full queue with 503); an engine failure: 424 `Backend`; draining: 503
    `Unhealthy` from /health and /predict."""
    d = config_dict(queue_size=64)
    d["tiers"]["cheap"].update(rate_limit=60, burst=2)
    d["tiers"]["quality"]["max_queue"] = 1
    engine = FailingEngine()
    async with running_app(parse_config(d), engine=engine) as (client, app, _):
        limited = [await client.post("/predict", json={"inputs": "x"}, headers=key("cheap")) for _ in range(3)]
        assert [r.status_code for r in limited[:2]] == [200, 200]
        tei_error(limited[2], 429, "Overloaded")
        assert int(limited[2].headers["retry-after"]) >= 1

        engine.gate.clear()  # hold one batch in flight, fill the quality tier's queue of one, then one more
        held = asyncio.create_task(client.post("/predict", json={"inputs": "held"}, headers=key("quality")))
        await asyncio.sleep(0.1)
        queued = asyncio.create_task(client.post("/predict", json={"inputs": "queued"}, headers=key("quality")))
        await asyncio.sleep(0.1)
        refused = await client.post("/predict", json={"inputs": "refused"}, headers=key("quality"))
        engine.gate.set()
        assert [(await t).status_code for t in (held, queued)] == [200, 200]
        tei_error(refused, 429, "Overloaded")
        assert int(refused.headers["retry-after"]) >= 1

        tei_error(await client.post("/", json={"inputs": [["fine"], ["explode"]]}, headers=key()), 424, "Backend")
        assert (await client.get("/health")).status_code == 200
        app.state.runtime.draining = True
        assert tei_error(await client.get("/health"), 503, "Unhealthy") == "unhealthy"
        app.state.runtime.draining = False


@pytest.mark.anyio
async def test_auto_while_the_decider_is_made_is_503_on_every_route() -> None:
    """One pipeline: TEI's auto waits for the decider as /classify's does (503 with Retry-After, TEI's
    `Unhealthy`), and both answer auto once it is loaded."""
    async with running_app() as (client, app, _):
        runtime = app.state.runtime
        runtime.decider_pending = True
        classify = await client.post("/classify?budget=auto", json={"text": "x"}, headers=key())
        assert classify.status_code == 503 and classify.json()["error"]["code"] == "unavailable"
        predict = await client.post("/predict?budget=auto", json={"inputs": "x"}, headers=key())
        assert "decider" in tei_error(predict, 503, "Unhealthy")
        assert int(predict.headers["retry-after"]) >= 1
        runtime.decider_pending = False  # no decider after all: auto is a bad request on both
        assert (await client.post("/classify?budget=auto", json={"text": "x"}, headers=key())).status_code == 400
        tei_error(await client.post("/predict?budget=auto", json={"inputs": "x"}, headers=key()), 422, "Validation")
