"""The outermost ASGI layer: request ids, the body size limit, request metrics and the access log."""

from __future__ import annotations

import itertools
import json
import os
import re
import time
from typing import Any

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from headbudget.service.errors import error_body
from headbudget.service.logs import access_logged, log_access
from headbudget.service.metrics import Metrics

_QUIET = frozenset({"/healthz", "/readyz", "/health", "/metrics"})  # probes and scrapes (/health: TEI's)
_UNCOUNTED = _QUIET | {"/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect", "/playground"}
_UNCOUNTED_PREFIXES = ("/docs/static/", "/playground/assets/")  # the pages' scripts and styles
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
_ID_RE = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# Request ids are 32 hex digits, as a UUID's: 64 random bits drawn once per process (each worker imports this
# module anew), then a counter: no request reads the system's random source or builds a UUID.
_ID_PREFIX = os.urandom(8).hex()
_ID_COUNTER = itertools.count()


def new_request_id() -> str:
    """A request id unique across processes and replicas (their random halves differ)."""
    return f"{_ID_PREFIX}{next(_ID_COUNTER) & 0xFFFF_FFFF_FFFF_FFFF:016x}"


class _TooLarge(StarletteHTTPException):
    """Raised while reading an over-long body; FastAPI lets HTTP exceptions through to the error mapping."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over {limit} bytes")


class _Encoded(Exception):
    """A body in a content coding the service does not decode (gzip, br, ...): 415, not a JSON error about bytes
    it never read as JSON."""

    def __init__(self, coding: str) -> None:
        super().__init__(coding)
        self.coding = coding


class RequestContextMiddleware:
    """Gives each request an id (X-Request-ID, kept when the client sends a sane one), enforces the body limit
    (413), refuses a compressed body (415), and records metrics and one JSON access line per request. Never sees
    or logs a key."""

    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        given, length, coding = "", b"", b""
        for name, value in scope.get("headers", []):  # the last of a repeated header counts
            name = name.lower()
            if name == b"x-request-id":
                given = value.decode("latin-1")
            elif name == b"content-length":
                length = value
            elif name == b"content-encoding":
                coding = value.strip().lower()
        request_id = given if _ID_RE.match(given) else new_request_id()
        state: dict[str, Any] = scope.setdefault("state", {})
        state["request_id"] = request_id
        status = [500]
        response_started = [False]

        async def send_wrapped(message: Message) -> None:
            if message["type"] == "http.response.start":
                response_started[0] = True
                status[0] = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", request_id.encode())]
            await send(message)

        received = [0]

        async def receive_limited() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                received[0] += len(message.get("body", b""))
                if received[0] > self.max_body_bytes:
                    raise _TooLarge(self.max_body_bytes)
            return message

        try:
            declared = int(length or 0)
        except ValueError:
            declared = 0
        try:
            if declared > self.max_body_bytes:
                raise _TooLarge(self.max_body_bytes)
            if coding not in (b"", b"identity") and scope.get("method") in _WITH_BODY:
                raise _Encoded(coding.decode("latin-1")[:32])
            await self.app(scope, receive_limited, send_wrapped)
        except _TooLarge:
            if response_started[0]:
                raise
            await self._send_error(send_wrapped, 413, "payload_too_large",
                                   f"the request body is over {self.max_body_bytes} bytes", [(b"connection", b"close")])
        except _Encoded as e:
            state["error_code"] = "unsupported_media_type"
            await self._send_error(send_wrapped, 415, "unsupported_media_type",
                                   f"Content-Encoding {e.coding!r} is not supported: send the body uncompressed",
                                   [(b"accept-encoding", b"identity")])
        finally:
            self._record(scope, state, status[0], time.perf_counter() - started)

    @staticmethod
    async def _send_error(send: Send, status: int, code: str, message: str,
                          headers: list[tuple[bytes, bytes]]) -> None:
        body = json.dumps(error_body(code, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                *headers]})
        await send({"type": "http.response.body", "body": body})

    def _record(self, scope: Scope, state: dict[str, Any], status: int, seconds: float) -> None:
        path = scope.get("path", "")
        tier = str(state.get("tier", "none"))
        if path not in _UNCOUNTED and not path.startswith(_UNCOUNTED_PREFIXES):
            self.metrics.observe_request(tier, status, seconds)
        quiet = path in _QUIET
        if not access_logged(quiet):  # the fields would be built for nothing
            return
        client = scope.get("client")
        fields: dict[str, Any] = {
            "request_id": state.get("request_id"), "method": scope.get("method"), "path": path,
            "status": status, "tier": tier, "key_name": state.get("key_name"),
            "latency_ms": round(seconds * 1000, 3), "client": client[0] if client else None,
        }
        for extra in ("budget_requested", "budget_applied", "budget_source", "degraded", "n_texts", "queue_ms",
                      "charge", "charge_id", "error_code"):
            if extra in state:
                fields[extra] = state[extra]
        log_access(fields, quiet=quiet)
