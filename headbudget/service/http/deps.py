"""FastAPI dependencies as ``Annotated`` aliases: the runtime and the authenticated, rate-limited caller."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from headbudget.service.accounting.auth import Caller, enforce_rate, identify, presented_key
from headbudget.service.http.middleware import new_request_id
from headbudget.service.runtime import Runtime

# Declared for the OpenAPI document; the raw headers are parsed in ``get_caller`` (a bad scheme is a 401).
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="An API key")
_bearer = HTTPBearer(auto_error=False, description="The same key as a bearer token")


async def get_runtime(request: Request) -> Runtime:
    """The process's runtime."""
    # async on purpose: FastAPI runs a plain `def` dependency in its thread pool, a thread hop per request against
    # a serving rest of about half a millisecond (docs/results.md, 'The serving limit').
    runtime: Runtime = request.app.state.runtime
    return runtime


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


def identify_caller(request: Request, runtime: Runtime) -> Caller:
    """Authenticate (401) and note the tier and key name for logs and metrics; no limit is applied."""
    key = presented_key(request.headers.getlist("x-api-key"), request.headers.getlist("authorization"))
    client = request.client.host if request.client else "unknown"
    caller = identify(runtime.config, runtime.extra_key_hashes, key, client, revoked=runtime.revoked)
    request.state.tier = caller.tier.name
    request.state.key_name = caller.name
    return caller


async def authenticate(request: Request, runtime: Runtime) -> Caller:
    """Authenticate (401), note the tier for logs and metrics, and apply the rate limit (429)."""
    caller = identify_caller(request, runtime)
    await enforce_rate(runtime.state, runtime.config.state, runtime.metrics, caller, new_request_id(),
                       runtime.rate_memo)
    return caller


async def get_caller(request: Request, runtime: RuntimeDep,
                     _key: Annotated[str | None, Depends(_api_key)] = None,
                     _token: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None) -> Caller:
    """The authenticated, rate-limited caller (the two unused parameters put the schemes in the OpenAPI)."""
    return await authenticate(request, runtime)


CallerDep = Annotated[Caller, Depends(get_caller)]


async def get_metered_caller(request: Request, runtime: RuntimeDep,
                             _key: Annotated[str | None, Depends(_api_key)] = None,
                             _token: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)] = None) -> Caller:
    """The authenticated caller of a route that runs the model: its rate limit is checked with its compute quota
    once the request is priced (``auth.admit``), in one step."""
    return identify_caller(request, runtime)


MeteredCallerDep = Annotated[Caller, Depends(get_metered_caller)]
