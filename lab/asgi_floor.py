"""The floor of a Python HTTP server: uvicorn (uvloop, httptools, as `headbudget serve` runs it) and an ASGI app that
reads a request's body and answers one fixed JSON body of a `/classify` answer's size, nothing else.

    taskset -c 1 python -m uvicorn lab.asgi_floor:app --port 7998 --log-level warning --no-access-log
    taskset -c 0 python -m headbudget.loadtest.concurrency --url URL --pid PID --client wire \\
        --peer-url http://127.0.0.1:7998 --peer-pid FLOOR_PID --peer-name asgi-floor --data DATA --out F

Beside headbudget's serving rest (CPU per answer less the engine's), the floor's CPU per answer is what no Python
server on this stack can go under: the part of the rest that is HTTP and the event loop rather than the service.
"""

from __future__ import annotations

import json
from typing import Any

# The shape of one /classify answer at b = 1 (about 700 bytes): the floor writes as many bytes as headbudget does.
ANSWER = json.dumps({
    "model": {"name": "ag_news-quick", "checksum": "0" * 64}, "request_id": "0" * 32, "tier": "bench",
    "budget_source": "request", "max_latency_ms": None, "degraded": False, "queue_ms": 0.1, "latency_ms": 5.0,
    "charge": 40.0, "results": [{
        "label": "Business", "scores": {"Business": 0.9, "Sci/Tech": 0.05, "Sports": 0.03, "World": 0.02},
        "budget_requested": 1.0, "budget_applied": 1.0, "budget_chosen": None, "passes": None, "heads_active": 72,
        "heads_total": 72, "neurons_active": 9216, "neurons_total": 9216, "cost": 1.0, "attention_cost": 1.0,
        "truncated": False, "n_tokens": 40, "latency_ms": 5.0, "degraded": False, "charge": 40.0}]}).encode()
HEADERS = [(b"content-type", b"application/json"), (b"content-length", str(len(ANSWER)).encode())]


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":  # lifespan: nothing to start
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
            await receive()
            await send({"type": "lifespan.shutdown.complete"})
        return
    more = True
    while more:
        message = await receive()
        more = message.get("more_body", False)
    await send({"type": "http.response.start", "status": 200, "headers": HEADERS})
    await send({"type": "http.response.body", "body": ANSWER})
