"""Every error the API returns, and the one place that maps errors to HTTP status codes and JSON bodies."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from headbudget.engine.errors import BudgetError, EngineError, InputError

log = logging.getLogger("headbudget.service")
_FASTAPI_PARSE_ERROR = "There was an error parsing the body"  # fastapi/routing.py, for non-JSONDecodeErrors


class ApiError(Exception):
    """An error with an HTTP status, a stable machine-readable code and a human message."""

    status = 500
    code = "internal_error"

    def __init__(self, message: str, *, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        """Extra response headers (Retry-After, WWW-Authenticate)."""
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}


class BadRequest(ApiError):
    status, code = 400, "bad_request"


class MalformedJson(ApiError):
    status, code = 400, "malformed_json"


class Unauthorized(ApiError):
    status, code = 401, "unauthorized"

    def headers(self) -> dict[str, str]:
        return {"WWW-Authenticate": 'Bearer realm="headbudget"'}


class Forbidden(ApiError):
    status, code = 403, "forbidden"


class NotFound(ApiError):
    status, code = 404, "not_found"


class Conflict(ApiError):
    status, code = 409, "conflict"


class PayloadTooLarge(ApiError):
    status, code = 413, "payload_too_large"


class InvalidRequest(ApiError):
    status, code = 422, "invalid_request"


class ComputeCapExceeded(InvalidRequest):
    code = "compute_cap_exceeded"  # one request's charge over its tier's cap: refused before any work


class RateLimited(ApiError):
    status, code = 429, "rate_limited"


class ComputeQuotaExceeded(RateLimited):
    code = "compute_quota_exceeded"  # the key's compute units per minute are spent; Retry-After says until when


class Overloaded(ApiError):
    status, code = 503, "overloaded"


class Unavailable(ApiError):
    status, code = 503, "unavailable"


class ClientGone(Exception):
    """The client disconnected before its answer was ready (logged as 499, nothing is sent)."""


def error_body(code: str, message: str) -> dict[str, Any]:
    """The JSON body of every error: {"error": {"code", "message"}}."""
    return {"error": {"code": code, "message": message}}


def error_response(err: ApiError) -> JSONResponse:
    """The response for an ApiError."""
    return JSONResponse(error_body(err.code, err.message), status_code=err.status, headers=err.headers())


def _validation_message(exc: RequestValidationError, content_type: str) -> tuple[int, str, str]:
    errors = list(exc.errors())
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "malformed_json", "the request body is not valid JSON"
    if "json" not in content_type and any(tuple(e.get("loc", ())) == ("body",) for e in errors):
        return 415, "unsupported_media_type", "send the body as JSON with 'Content-Type: application/json'"
    parts: dict[str, str] = {}
    for e in errors:
        # drop the body prefix and pydantic's union-member names ("constrained-float", "literal['auto']")
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body" and not _is_union_tag(p)) or "body"
        if loc not in parts:
            parts[loc] = str(e.get("msg", "invalid")).removeprefix("Value error, ")
    if "budget" in parts or "query.budget" in parts:
        key = "budget" if "budget" in parts else "query.budget"
        parts[key] = "must be a finite number in [0.1, 1] or 'auto'"
    return 422, "invalid_request", "; ".join(f"{k}: {v}" for k, v in list(parts.items())[:5]) or "invalid request"


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part.startswith(("constrained-", "function-")))


def known_error_response(request: Request, exc: Exception) -> JSONResponse | None:
    """The response for an error the API expects (its own, the engine's, a client gone); None for a bug.

    The one mapping both FastAPI's handlers and the /classify fast path use."""
    if isinstance(exc, ApiError):
        request.state.error_code = exc.code
        return error_response(exc)
    if isinstance(exc, ClientGone):
        request.state.error_code = "client_closed_request"
        return JSONResponse(error_body("client_closed_request", "the client went away"), status_code=499)
    if isinstance(exc, BudgetError):
        return error_response(BadRequest(str(exc)))
    if isinstance(exc, InputError):
        return error_response(InvalidRequest(str(exc)))
    if isinstance(exc, EngineError):
        log.error("engine error: %s", exc)
        return error_response(ApiError("the model failed on this request"))
    return None


_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT")


def _allowed(request: Request) -> list[str]:
    """Every method some route of the app answers at the request's path (asked of the routes themselves, so
    routers included in routers count too)."""
    routes = request.app.router.routes
    return [m for m in _METHODS
            if any(r.matches({**request.scope, "method": m})[0] == Match.FULL for r in routes)]


def install_error_handlers(app: FastAPI) -> None:
    """Map domain, validation and framework errors to JSON error responses."""

    async def _known(request: Request, exc: Exception) -> JSONResponse:
        response = known_error_response(request, exc)
        assert response is not None  # registered only for the classes the mapping knows
        return response

    for kind in (ApiError, ClientGone, BudgetError, InputError, EngineError):
        app.add_exception_handler(kind, _known)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        status, code, message = _validation_message(exc, request.headers.get("content-type", ""))
        request.state.error_code = code
        return JSONResponse(error_body(code, message), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400 and exc.detail == _FASTAPI_PARSE_ERROR:
            # FastAPI's answer to a body json.loads cannot take but that is not a JSONDecodeError: nesting past
            # Python's recursion limit, an integer over 4,300 digits, bytes that are not UTF-8.
            request.state.error_code = "malformed_json"
            return JSONResponse(error_body("malformed_json", "the request body is not valid JSON (malformed, "
                                           "not UTF-8, nested too deeply or a number too long)"), status_code=400)
        codes = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
        code = codes.get(exc.status_code, "http_error")
        headers = getattr(exc, "headers", None)
        if exc.status_code == 405:  # Starlette names the first route of the path; the path may have several
            headers = {**(headers or {}), "Allow": ", ".join(_allowed(request))}
        return JSONResponse(error_body(code, str(exc.detail)), status_code=exc.status_code, headers=headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(ApiError("internal error"))
