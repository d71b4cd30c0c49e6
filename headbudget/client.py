"""A small typed client for the headbudget HTTP API (httpx; ``Client`` sync, ``AsyncClient`` async).

    with Client("http://127.0.0.1:8000", api_key="hb_...") as hb:
        answer = hb.classify("a great movie", budget=0.5)
        print(answer.results[0].label, answer.results[0].budget_applied)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from headbudget.service.schemas import ClassifyResponse, FeedbackResponse, ModelList, Readiness

__all__ = ["AsyncClient", "Client", "HeadbudgetError"]


class HeadbudgetError(Exception):
    """An error answer: HTTP status, the API's error code and message, Retry-After and request id if given."""

    def __init__(self, status: int, code: str, message: str, retry_after_s: float | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message = status, code, message
        self.retry_after_s, self.request_id = retry_after_s, request_id

    @classmethod
    def from_response(cls, r: httpx.Response) -> HeadbudgetError:
        try:
            err = r.json()["error"]
            code, message = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, message = "http_error", r.text[:200]
        retry = r.headers.get("retry-after")
        return cls(r.status_code, code, message, float(retry) if retry and retry.isdigit() else None,
                   r.headers.get("x-request-id"))


def _headers(api_key: str | None) -> dict[str, str]:
    return {"X-API-Key": api_key} if api_key else {}


def _classify_body(text: str | Sequence[str], budget: float | str | None,
                   max_latency_ms: float | None) -> dict[str, Any]:
    body: dict[str, Any] = {"text": text} if isinstance(text, str) else {"texts": list(text)}
    if budget is not None:
        body["budget"] = budget
    if max_latency_ms is not None:
        body["max_latency_ms"] = max_latency_ms
    return body


def _checked(r: httpx.Response) -> httpx.Response:
    if r.status_code >= 400:
        raise HeadbudgetError.from_response(r)
    return r


class Client:
    """Synchronous client; one connection pool, close it (or use ``with``)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self._http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                                  transport=transport)

    def classify(self, text: str | Sequence[str], budget: float | str | None = None,
                 max_latency_ms: float | None = None, request_id: str | None = None) -> ClassifyResponse:
        """Classify one text or several; ``budget`` or ``max_latency_ms`` (or neither: the tier's default)."""
        headers = {"X-Request-ID": request_id} if request_id else None
        r = self._http.post("/classify", json=_classify_body(text, budget, max_latency_ms), headers=headers)
        return ClassifyResponse.model_validate(_checked(r).json())

    def feedback(self, request_id: str, label: str, index: int = 0) -> FeedbackResponse:
        """Report the true label of text ``index`` of an earlier answer."""
        r = self._http.post("/feedback", json={"request_id": request_id, "label": label, "index": index})
        return FeedbackResponse.model_validate(_checked(r).json())

    def models(self) -> ModelList:
        """The loaded checkpoint and its budget grid."""
        return ModelList.model_validate(_checked(self._http.get("/v1/models")).json())

    def ready(self) -> Readiness:
        """Readiness with its checks (does not raise on 503)."""
        return Readiness.model_validate(self._http.get("/readyz").json())

    def metrics(self) -> str:
        """The Prometheus exposition text."""
        return _checked(self._http.get("/metrics")).text

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """Asynchronous client with the same methods as ``Client``."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 30.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                                       transport=transport)

    async def classify(self, text: str | Sequence[str], budget: float | str | None = None,
                       max_latency_ms: float | None = None, request_id: str | None = None) -> ClassifyResponse:
        """Classify one text or several; ``budget`` or ``max_latency_ms`` (or neither: the tier's default)."""
        headers = {"X-Request-ID": request_id} if request_id else None
        r = await self._http.post("/classify", json=_classify_body(text, budget, max_latency_ms), headers=headers)
        return ClassifyResponse.model_validate(_checked(r).json())

    async def feedback(self, request_id: str, label: str, index: int = 0) -> FeedbackResponse:
        """Report the true label of text ``index`` of an earlier answer."""
        r = await self._http.post("/feedback", json={"request_id": request_id, "label": label, "index": index})
        return FeedbackResponse.model_validate(_checked(r).json())

    async def models(self) -> ModelList:
        """The loaded checkpoint and its budget grid."""
        return ModelList.model_validate(_checked(await self._http.get("/v1/models")).json())

    async def ready(self) -> Readiness:
        """Readiness with its checks (does not raise on 503)."""
        return Readiness.model_validate((await self._http.get("/readyz")).json())

    async def metrics(self) -> str:
        """The Prometheus exposition text."""
        return _checked(await self._http.get("/metrics")).text

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
