"""Routes compatible with Hugging Face text-embeddings-inference (TEI 1.9): POST /predict and POST /, GET /info,
GET /health. Same keys, tiers, budgets, queue, metrics and feedback store as /classify; TEI's bodies, status
codes and error shape ``{"error", "error_type"}``. The budget comes from the key's tier, or from an
``X-Budget`` header or a ``budget`` query parameter (TEI has no such field)."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

import headbudget
from headbudget.engine.errors import BudgetError, EngineError, InputError
from headbudget.engine.types import Prediction
from headbudget.service import pipeline
from headbudget.service.accounting.auth import Caller
from headbudget.service.accounting.compute import Quote, unit_text, units
from headbudget.service.errors import (
    ApiError,
    Forbidden,
    MalformedJson,
    Overloaded,
    PayloadTooLarge,
    RateLimited,
    Unauthorized,
    Unavailable,
)
from headbudget.service.http.deps import MeteredCallerDep, RuntimeDep
from headbudget.service.http.schemas import (
    MAX_TEXT_CHARS,
    MAX_TEXTS,
    BudgetParam,
    BudgetValue,
    ErrorBody,
)
from headbudget.service.http.tei_schemas import (
    ClassifierModel,
    PredictRequest,
    PredictResponse,
    TeiError,
    TeiInfo,
    TeiModelType,
)
from headbudget.service.runtime import Runtime

log = logging.getLogger("headbudget.service")
_PARSE_ERROR = "There was an error parsing the body"  # FastAPI's 400 for bodies json.loads cannot take


class TeiFailure(Exception):
    """An error answered in TEI's shape with TEI's status for its type."""

    def __init__(self, status: int, error_type: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.error_type, self.message, self.headers = status, error_type, message, headers or {}


def _validation(message: str, status: int = 422) -> TeiFailure:
    return TeiFailure(status, "Validation", message)


# Our errors as TEI's: its validation errors are 422 (since TEI 1.9; 413 before), an exhausted queue is 429
# "Overloaded", a backend failure 424. TEI's --api-key layer answers 401 without a body; here it has one.
_API_ERRORS: list[tuple[type[ApiError], int, str]] = [
    (Unauthorized, 401, "Unauthorized"), (Forbidden, 403, "Forbidden"), (RateLimited, 429, "Overloaded"),
    (Overloaded, 429, "Overloaded"), (Unavailable, 503, "Unhealthy"), (MalformedJson, 400, "Validation"),
    (PayloadTooLarge, 413, "Validation"),
]


def _as_tei(exc: Exception, content_type: str) -> TeiFailure | None:
    """The TEI error for an exception a route can raise; None for what the app's handlers answer (a bug, a
    client gone)."""
    if isinstance(exc, TeiFailure):
        return exc
    if isinstance(exc, ApiError):
        for kind, status, error_type in _API_ERRORS:
            if isinstance(exc, kind):
                return TeiFailure(status, error_type, exc.message, exc.headers())
        if exc.status < 500:  # InvalidRequest, BadRequest: what TEI calls validation
            return _validation(exc.message)
        log.error("backend error on a TEI route: %s", exc.message)
        return TeiFailure(424, "Backend", exc.message)
    if isinstance(exc, RequestValidationError):
        return _request_invalid(exc, content_type)
    if isinstance(exc, BudgetError | InputError):
        return _validation(str(exc))
    if isinstance(exc, EngineError):
        log.error("engine error: %s", exc)
        return TeiFailure(424, "Backend", "the model failed on this request")
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 413:  # body limit hit while reading
        return _validation(str(exc.detail), status=413)
    if isinstance(exc, StarletteHTTPException) and exc.status_code == 400 and exc.detail == _PARSE_ERROR:
        return _validation("Failed to parse the request body as JSON (malformed, not UTF-8, nested too deeply "
                           "or a number too long)", status=400)
    return None


_CEILINGS = {"max_budget", "x-max-budget"}  # auto's ceiling, query and header: a number, never 'auto'


def _request_invalid(exc: RequestValidationError, content_type: str) -> TeiFailure:
    """FastAPI's validation errors with the statuses axum gives TEI's JSON extractor (400 syntax, 415 media
    type, 422 data)."""
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return _validation("Failed to parse the request body as JSON", status=400)
    if "json" not in content_type and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return _validation("Expected request with `Content-Type: application/json`", status=415)
    parts: dict[str, str] = {}
    for e in errors:
        where, *rest = [str(p) for p in e.get("loc", ("body",))] or ["body"]
        loc = rest if where in ("body", "query", "header") else [where, *rest]
        if where in ("query", "header"):  # the budget and auto's ceiling are the parameters these routes take
            name = loc[0] if loc else ""
            parts[f"{where} {name}".strip()] = ("must be a finite number in [0.1, 1]" if name.lower() in _CEILINGS
                                                else "must be a finite number in [0.1, 1] or 'auto'")
        elif e.get("type") == "missing" and loc[:1] == ["inputs"]:
            parts["body"] = "missing field `inputs`"
        elif loc and loc[0] == "inputs":
            parts["inputs"] = ("expected a string, a list of one string, or a batch of single-string lists "
                               "[[string], [string], ...]")
        elif e.get("type") == "missing" and not loc:
            parts["body"] = "missing field `inputs`"
        else:  # the field and its first problem, without pydantic's union-member names
            key = ".".join(p for p in loc if "[" not in p and not p.startswith(("constrained-", "function-")))
            parts.setdefault(key or "body", str(e.get("msg", "invalid")))
    detail = "; ".join(f"{k}: {v}" for k, v in list(parts.items())[:5])
    if any(k.startswith(("query ", "header ")) for k in parts):
        return _validation(f"Invalid request: {detail}")
    return _validation(f"Failed to deserialize the JSON body into the target type: {detail}")


def tei_error_response(request: Request, failure: TeiFailure) -> JSONResponse:
    """TEI's error body with its status (and Retry-After or WWW-Authenticate where ours has them)."""
    request.state.error_code = failure.error_type.lower()
    return JSONResponse({"error": failure.message, "error_type": failure.error_type}, status_code=failure.status,
                        headers=failure.headers)


class TeiRoute(APIRoute):
    """A route whose errors, FastAPI's validation included, are answered in TEI's shape (app-wide handlers
    keep the /classify shape for every other route)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def tei_handler(request: Request) -> Response:
            try:
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - mapped below, or re-raised to the app's handlers
                failure = _as_tei(exc, request.headers.get("content-type", ""))
                if failure is None:
                    raise
                return tei_error_response(request, failure)

        return tei_handler


router = APIRouter(tags=["text-embeddings-inference"], route_class=TeiRoute)


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    text = {400: "Malformed JSON, or an empty input (`Empty`)", 401: "Missing or unknown API key",
            403: "Budget above the tier's maximum", 415: "Body not sent as JSON",
            413: "Body over the size limit (the /classify error shape when Content-Length announces it)",
            422: "Invalid input, or over the tier's compute cap (`Validation`)", 424: "The model failed (`Backend`)",
            429: "Rate limit, compute quota or queue full (`Overloaded`, see Retry-After)",
            503: "Not ready, draining, or a dependency is down (`Unhealthy`)"}
    return {c: {"model": TeiError | ErrorBody if c == 413 else TeiError, "description": text[c]} for c in codes}


def _texts(body: PredictRequest) -> tuple[list[str], bool]:
    """The texts and whether they came as a batch, by TEI's rules: ``"a"`` and ``["a"]`` are one input,
    ``[["a"], ["b"]]`` a batch; ``["a", "b"]`` is TEI's sentence pair, which a single-text model cannot take."""
    inputs = body.inputs
    if isinstance(inputs, str):
        texts, batch = [inputs], False
    elif inputs and all(isinstance(s, str) for s in inputs):
        if len(inputs) != 1:
            raise _validation(f"`inputs` as a list of {len(inputs)} strings: TEI reads two as a sentence pair, "
                              "which this single-text classifier does not take; send a batch as [[\"a\"], [\"b\"]]")
        texts, batch = [str(inputs[0])], False
    else:
        rows = [row for row in inputs if isinstance(row, list)]
        if not rows or len(rows) != len(inputs):
            raise _validation("`inputs` cannot be an empty list")
        if any(len(row) != 1 for row in rows):
            raise _validation("each batch item must be a list of one string: sentence pairs [a, b] are not "
                              "supported by this single-text classifier")
        texts, batch = [row[0] for row in rows], True
    if len(texts) > MAX_TEXTS:
        raise _validation(f"batch size {len(texts)} > maximum allowed batch size {MAX_TEXTS}")
    if any(not t.strip() for t in texts):
        raise TeiFailure(400, "Empty", "Input validation error: `inputs` cannot be empty")
    return texts, batch


def _cut_chars(texts: list[str], truncate: bool) -> list[str]:
    """TEI's character limit: refused without truncation, cut with it (the token limit cuts far earlier)."""
    for t in texts:
        if len(t) > MAX_TEXT_CHARS and not truncate:
            raise _validation(f"Input validation error: `inputs` must have less than {MAX_TEXT_CHARS} characters. "
                              f"Given: {len(t)}")
    return [t[:MAX_TEXT_CHARS] for t in texts]


def _check_cut(runtime: Runtime, cut: list[bool], truncate: bool, direction: str) -> None:
    """422 for a text over the token limit that the request does not let this server cut."""
    first = next((i for i, c in enumerate(cut) if c), None)
    if first is None:
        return
    max_len = runtime.info.max_length if runtime.info else 0
    if not truncate:
        raise _validation(f"Input validation error: `inputs` must have less than {max_len} tokens; input "
                          f"{first} has more (send truncate=true to cut it)")
    if direction.lower() == "left":
        raise _validation(f"input {first} is over {max_len} tokens and truncation_direction 'Left' is not "
                          "supported: this server keeps the start of a text (send 'Right')")


def _sigmoid(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))


def _scored(p: Prediction, labels: tuple[str, ...], how: str, top_k: int | None) -> list[dict[str, Any]]:
    """One input's labels with scores, highest first, as TEI orders them (ties: the later label first)."""
    if how == "none":
        values = list(p.logits)
    elif how == "sigmoid" or len(labels) == 1:  # TEI: sigmoid for a single-logit head
        values = [_sigmoid(z) for z in p.logits]
    else:
        values = [p.scores[label] for label in labels]
    if any(math.isnan(v) for v in values):
        raise TeiFailure(424, "Backend", "score is NaN")
    ranked = sorted(zip(values, labels, strict=True), key=lambda sl: sl[0])[::-1]
    return [{"label": label, "score": score} for score, label in ranked[:top_k]]


_QUERY = ("budget", "max_budget")  # the predict routes' query parameters (TEI itself has none)


async def _predict(body: PredictRequest, request: Request, runtime: Runtime, caller: Caller,
                   budget: float | str | None, x_budget: float | str | None,
                   max_budget: float | None = None, x_max_budget: float | None = None) -> JSONResponse:
    started = time.perf_counter()
    pipeline.check_query(request.query_params.multi_items(), _QUERY)
    texts, batch = _texts(body)
    truncate = True if body.truncate is None else body.truncate  # TEI's auto_truncate default (1.9)
    params = body.parameters
    if body.raw_scores and params is not None and params.function_to_apply not in (None, "none"):
        raise _validation("give raw_scores or parameters.function_to_apply, not both")
    if budget is not None and x_budget is not None:
        raise _validation("give the budget in the X-Budget header or the budget query parameter, not both")
    if max_budget is not None and x_max_budget is not None:
        raise _validation("give max_budget in the X-Max-Budget header or the max_budget query parameter, not both")
    texts = _cut_chars(texts, truncate)
    asked = pipeline.BudgetParams(budget=budget if budget is not None else x_budget,
                                   max_budget=max_budget if max_budget is not None else x_max_budget)
    direction = body.truncation_direction

    def refuse_cut(priced: Quote) -> None:
        _check_cut(runtime, [cut for _, cut in priced.tokens], truncate, direction)

    # refused before it runs where a text would be cut
    check = refuse_cut if not truncate or direction.lower() == "left" else None
    _, answered = await pipeline.classify_call(runtime, caller, pipeline.Call(texts, asked, check_tokens=check),
                                                request)
    info = runtime.info
    result = answered.result
    labels = info.labels if info else ()
    how = "none" if body.raw_scores else (params.function_to_apply if params and params.function_to_apply
                                          else "softmax")
    answers = [_scored(p, labels, how, params.top_k if params else None) for p in result.predictions]
    total_ms = (time.perf_counter() - started) * 1000
    headers = {  # TEI's timing headers, and what the budget bought
        "x-compute-type": "cpu", "x-compute-time": str(int(total_ms)), "x-total-time": str(int(total_ms)),
        "x-compute-characters": str(sum(len(t) for t in texts)),
        "x-compute-tokens": str(sum(p.n_tokens for p in result.predictions)),
        "x-queue-time": str(int(result.queue_s * 1000)), "x-inference-time": str(int(result.latency_s * 1000)),
        "x-budget-applied": ",".join(f"{b:g}" for b in pipeline.text_budgets(result)),
        "x-degraded": "true" if result.degraded else "false",
        # the compute units charged (/v1/models' compute_unit): the request's, and each input's in order
        "x-charge": unit_text(units(answered.bill.total)),
        "x-charge-per-input": ",".join(unit_text(units(c)) for c in answered.bill.texts),
    }
    # the Inference API's convention (`parameters` present): a single input is a batch of one, as
    # InferenceClient.text_classification reads it
    payload = answers if batch or params is not None else answers[0]
    return JSONResponse(payload, headers=headers)


BudgetQuery = Annotated[BudgetParam | None, Query(
    description="Budget in [0.1, 1], or `auto` on checkpoints that predict their own (or the X-Budget header); "
                "default: the tier's")]
BudgetHeader = Annotated[BudgetParam | None, Header(alias="X-Budget", description="The budget, as a header")]
MaxBudgetQuery = Annotated[BudgetValue | None, Query(
    description="With budget=auto: the ceiling no text spends more than (at most the tier's max_budget; or the "
                "X-Max-Budget header)")]
MaxBudgetHeader = Annotated[BudgetValue | None, Header(alias="X-Max-Budget",
                                                      description="auto's ceiling, as a header")]
_PREDICT_ERRORS = _errors(400, 401, 403, 413, 415, 422, 424, 429, 503)


@router.post("/predict", response_model=PredictResponse, response_class=JSONResponse, responses=_PREDICT_ERRORS)
async def predict(body: PredictRequest, request: Request, runtime: RuntimeDep, caller: MeteredCallerDep,
                  budget: BudgetQuery = None, x_budget: BudgetHeader = None, max_budget: MaxBudgetQuery = None,
                  x_max_budget: MaxBudgetHeader = None) -> JSONResponse:
    """Classify one text or a batch (TEI's /predict): every label with its score, highest first."""
    return await _predict(body, request, runtime, caller, budget, x_budget, max_budget, x_max_budget)


@router.post("/", response_model=PredictResponse, response_class=JSONResponse, responses=_PREDICT_ERRORS)
async def predict_root(body: PredictRequest, request: Request, runtime: RuntimeDep, caller: MeteredCallerDep,
                       budget: BudgetQuery = None, x_budget: BudgetHeader = None,
                       max_budget: MaxBudgetQuery = None, x_max_budget: MaxBudgetHeader = None) -> JSONResponse:
    """TEI's default route for a classifier (what Hugging Face's InferenceClient posts to): as /predict."""
    return await _predict(body, request, runtime, caller, budget, x_budget, max_budget, x_max_budget)


@router.get("/info", response_model=TeiInfo, responses=_errors(503))
async def info(runtime: RuntimeDep) -> TeiInfo:
    """The served model and the server's limits (TEI's /info; public, like /v1/models)."""
    model = runtime.info
    if model is None:
        raise Unavailable("the model is not loaded yet", retry_after_s=5)
    server = runtime.config.server
    int8 = model.extra.get("backend") == "onnxruntime" and model.extra.get("precision") == "int8"
    return TeiInfo(
        model_id=model.name, model_sha=model.checksum, model_dtype="int8" if int8 else "float32",
        served_model_name=model.name,
        model_type=TeiModelType(classifier=ClassifierModel(
            id2label={str(i): label for i, label in enumerate(model.labels)},
            label2id={label: i for i, label in enumerate(model.labels)})),
        max_concurrent_requests=server.queue_size, max_input_length=model.max_length,
        max_batch_tokens=server.max_batch_size * model.max_length, max_batch_requests=server.max_batch_size,
        max_client_batch_size=MAX_TEXTS, auto_truncate=True, tokenization_workers=1,
        version=headbudget.__version__)


_HEALTH: dict[int | str, dict[str, Any]] = {200: {"description": "Ready", "content": None}, 503: {"model": TeiError, "description": "Not ready"}}


# TEI answers health on GET / too; declared, so that the document lists every method a path answers
@router.get("/", response_class=Response, responses=_HEALTH, summary="Health (TEI's GET /)")
@router.get("/health", response_class=Response, responses=_HEALTH)
async def health(runtime: RuntimeDep) -> Response:
    """200 with no body when the model answers (TEI's /health; public); 503 ``Unhealthy`` otherwise."""
    ready, _ = await runtime.readiness()
    if not ready:
        raise TeiFailure(503, "Unhealthy", "unhealthy")
    return Response(status_code=200)
