"""The HTTP floor server: under real uvicorn it answers any POST, large bodies read to their end, with an answer a
client reads as a real `/classify` answer (so a load tool measures it as it measures headbudget)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from headbudget.loadtest import wire
from headbudget.service.http.schemas import ClassifyResponse
from lab.asgi_floor import ANSWER
from tests.service.conftest import HOST, free_port, stop_process, wait_until


def _answers(port: int) -> bool:
    with wire.Connection(port) as conn:
        return conn.send(wire.post("/", {}, b"{}"))[0] == 200


def test_the_floor_answers_each_request_as_classify_would(tmp_path: Path) -> None:
    assert ClassifyResponse.model_validate_json(ANSWER).results[0].label == "Business"
    port, log = free_port(), tmp_path / "uvicorn.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "lab.asgi_floor:app", "--host", HOST, "--port",
                                 str(port), "--log-level", "warning", "--no-access-log"], stdout=f,
                                stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parents[2],
                                start_new_session=True)
    try:
        wait_until(lambda: _answers(port), 60, "uvicorn", proc, log)
        with wire.Connection(port) as conn:  # keep-alive: a small and a 300 KB body on one connection, in order
            for body in (json.dumps({"text": "a"}).encode(), json.dumps({"texts": ["word " * 1000] * 60}).encode()):
                status, answer = conn.send(wire.post("/classify", {"X-API-Key": "k"}, body))
                assert (status, answer) == (200, ANSWER)
    finally:
        stop_process(proc)
