"""POST /classify without FastAPI's per-request machinery: the service's hot path.

FastAPI still declares the route (its OpenAPI schema and docs) and still serves every request this layer does
not take. The fast path takes only a JSON body that validates against ``ClassifyRequest`` with known, valid,
unrepeated query parameters; anything else is handed on to FastAPI with its body replayed, so every error keeps
exactly the status, code and message FastAPI's validation gives it. A request it takes runs the same code as the
route (``identify_caller``, ``answer``) and maps errors with the same function (``known_error_response``); only
the layers between are skipped. One thing it does before the body: a key its request rate refuses at the moment
(``auth.RateMemo``) is answered 429 from its headers, its body never read (the route reads the body first, so a
malformed body from such a key is a 400 there). Why: FastAPI's routing, dependency solving and response
re-validation take a large share of the event loop's time on every request (docs/results.md, 'Findings and
decisions').
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl

from pydantic import TypeAdapter, ValidationError
from pydantic_core import to_json
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from headbudget.service.accounting.auth import Caller, rate_limited
from headbudget.service.errors import ApiError, InvalidRequest, known_error_response
from headbudget.service.http.deps import identify_caller
from headbudget.service.http.schemas import BudgetParam, BudgetValue, ClassifyRequest, LatencyLimit
from headbudget.service.pipeline import BudgetParams, answer, check_query
from headbudget.service.runtime import Runtime

# BudgetParams' fields (CLASSIFY_QUERY), each validated as the route declares it
_QUERY: dict[str, TypeAdapter[Any]] = {"budget": TypeAdapter(BudgetParam), "max_latency_ms": TypeAdapter(LatencyLimit),
                                       "max_budget": TypeAdapter(BudgetValue)}
_JSON = b"application/json"
_NO_PARAMS = BudgetParams()


class ClassifyFastPath:
    """ASGI layer in front of FastAPI's router that serves well-formed ``POST /classify`` requests itself."""

    def __init__(self, app: ASGIApp, runtime: Runtime) -> None:
        self.app = app
        self.runtime = runtime

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["path"] != "/classify" or scope["method"] != "POST"
                or not self.runtime.config.server.fast_path or not _is_json(scope)):
            await self.app(scope, receive, send)
            return
        caller = None  # known from the headers where the rate memo asked for it
        if self.runtime.rate_memo:
            answered, caller = await self._refused_unread(scope, receive, send)
            if answered:
                return
        messages: list[Message] = []
        while True:
            message = await receive()  # the caller's receive enforces the body limit (413)
            messages.append(message)
            if message["type"] != "http.request" or not message.get("more_body", False):
                break
        body = b"".join(m.get("body", b"") for m in messages)  # one message: its body itself, not a copy
        parsed = _parse(scope, body) if messages[-1]["type"] == "http.request" else None
        if parsed is None:
            await self.app(scope, _replay(messages, receive), send)
            return
        request_body, query = parsed
        request = Request(scope, receive)
        try:
            if caller is None:
                caller = identify_caller(request, self.runtime)  # limits: in answer, once the request is priced
            result = await answer(self.runtime, caller, request_body, query, request)
        except Exception as exc:
            response = known_error_response(request, exc)
            if response is None:
                raise  # a bug: ServerErrorMiddleware answers 500, as it does for the route
            await response(scope, receive, send)
            return
        content = to_json(result)  # ClassifyResponse, byte for byte as its model_dump_json writes it
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", _JSON), (b"content-length", str(len(content)).encode())]})
        await send({"type": "http.response.body", "body": content})

    async def _refused_unread(self, scope: Scope, receive: Receive, send: Send) -> tuple[bool, Caller | None]:
        """Answer 429 from the headers alone when the caller's key is still refused by its request rate
        (``RateMemo``): the body is neither read nor parsed nor priced. (Whether it answered, the caller to go on
        with: None for an unknown key, answered as before, after its body.)"""
        request = Request(scope, receive)
        try:
            caller = identify_caller(request, self.runtime)
        except ApiError:
            return False, None
        left = self.runtime.rate_memo.refused_for(caller.owner)
        if left is None:
            return False, caller
        response = known_error_response(request, rate_limited(caller.tier, left))
        assert response is not None
        await response(scope, receive, send)
        return True, caller


def _is_json(scope: Scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            media: bytes = value.split(b";", 1)[0].strip().lower()
            return media == _JSON
    return False  # FastAPI reads a body without a content type as JSON; that rare case goes through it


def _parse(scope: Scope, body: bytes) -> tuple[ClassifyRequest, BudgetParams] | None:
    """The validated body and query parameters, or None for anything FastAPI should answer (errors)."""
    raw = scope.get("query_string", b"")
    pairs = parse_qsl(raw.decode("latin-1"), keep_blank_values=True) if raw else []
    try:
        check_query(pairs, _QUERY)  # the route answers the 422
        query = BudgetParams(**{k: _QUERY[k].validate_python(v) for k, v in pairs}) if pairs else _NO_PARAMS
        # pydantic-core parses and validates the bytes in one pass (no intermediate dicts; its parser caps
        # nesting, so a 50,000-deep body is a plain failure here, not a RecursionError). Whatever it refuses
        # goes to FastAPI, whose json.loads + validation then decide the exact error, as with the path off.
        return ClassifyRequest.model_validate_json(body), query
    except (InvalidRequest, ValueError, ValidationError, RecursionError):
        return None


def _replay(messages: list[Message], receive: Receive) -> Receive:
    """A receive that yields the messages already read, then the client's own."""
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
