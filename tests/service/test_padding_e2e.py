"""A real server under concurrent requests of many lengths runs about their own tokens: the engine runs a batch in
passes by length, and /metrics counts the padding (docs/method.md, 'Batches by length')."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import httpx

from headbudget.engine.passes import PAD_SHARE
from headbudget.loadtest import wire
from tests.service.conftest import KEYS, Server, config_dict, start_server, toml_of

WORDS = "the market rose as oil fell while a team won the cup and leaders met to talk".split()


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} (\S+)$", text, re.M))


def burst(server: Server, texts: list[str]) -> list[tuple[int, bytes]]:
    """Every request in the server's socket buffers before it reads any: the server is stopped while they are
    sent, so the burst reaches it at once however fast the model answers one text alone (a lone request runs
    without a batch window, and a tiny model answers it before a client on its own sends the next)."""
    port = httpx.URL(server.url).port
    assert port is not None
    conns = [wire.Connection(port) for _ in texts]
    try:
        os.killpg(server.proc.pid, signal.SIGSTOP)
        try:
            for conn, text in zip(conns, texts, strict=True):
                conn.write(wire.post("/classify", {"Authorization": f"Bearer {KEYS['quality']}"},
                                     json.dumps({"text": text}).encode()))
        finally:
            os.killpg(server.proc.pid, signal.SIGCONT)
        return [conn.read() for conn in conns]
    finally:
        for conn in conns:
            conn.close()


def test_a_burst_of_mixed_lengths_runs_little_padding(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    # A batch window long enough that the burst shares passes
    with start_server(tiny_model_scope_checkpoint, toml_of(config_dict(max_wait_ms=200.0)), tmp_path) as s:
        texts = [" ".join(WORDS[j % len(WORDS)] for j in range(n)) for n in [3, 40, 9, 90, 14, 3, 60, 25] * 4]
        answers = burst(s, texts)
        assert [status for status, _ in answers] == [200] * len(texts)
        own = sum(json.loads(body)["results"][0]["n_tokens"] for _, body in answers)
        m = httpx.get(f"{s.url}/metrics").text
    assert metric(m, 'headbudget_engine_tokens_total{kind="text"}') == own
    batches = metric(m, "headbudget_batch_size_count")
    assert batches < len(texts)  # the burst was batched...
    padding = metric(m, 'headbudget_engine_tokens_total{kind="padding"}')
    assert padding <= PAD_SHARE * own  # ...in passes of about one length (padded to the longest: over 2x its own)
