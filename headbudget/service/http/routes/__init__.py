"""HTTP routes, one module per resource."""

from __future__ import annotations

from typing import Any

from headbudget.service.http.schemas import ErrorBody


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer with."""
    text = {400: "Malformed JSON or a request the model cannot serve", 401: "Missing or unknown API key",
            403: "Budget above the tier's maximum", 404: "Not found", 409: "Already reported",
            413: "Body over the size limit", 415: "Body not sent as JSON", 422: "Invalid fields, or a request over its tier's compute cap", 429: "Rate limit or compute quota exceeded (see Retry-After)",
            503: "Overloaded, shutting down or a dependency is down (see Retry-After)"}
    return {c: {"model": ErrorBody, "description": text[c]} for c in codes}
