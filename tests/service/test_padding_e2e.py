"""A real server under concurrent requests of many lengths runs about their own tokens: the engine runs a batch in
passes by length, and /metrics counts the padding (docs/method.md, 'Batches by length')."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx

from headbudget.engine.passes import PAD_SHARE
from tests.service.conftest import KEYS, config_dict, start_server, toml_of

WORDS = "the market rose as oil fell while a team won the cup and leaders met to talk".split()


def metric(text: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)} (\S+)$", text, re.M))


async def burst(url: str, texts: list[str]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=60,
                                 headers={"Authorization": f"Bearer {KEYS['quality']}"}) as client:
        return await asyncio.gather(*(client.post("/classify", json={"text": t}) for t in texts))


def test_a_burst_of_mixed_lengths_runs_little_padding(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    # A batch window long enough that the burst shares passes
    with start_server(tiny_model_scope_checkpoint, toml_of(config_dict(max_wait_ms=200.0)), tmp_path) as s:
        texts = [" ".join(WORDS[j % len(WORDS)] for j in range(n)) for n in [3, 40, 9, 90, 14, 3, 60, 25] * 4]
        answers = asyncio.run(burst(s.url, texts))
        assert [r.status_code for r in answers] == [200] * len(texts)
        own = sum(r.json()["results"][0]["n_tokens"] for r in answers)
        m = httpx.get(f"{s.url}/metrics").text
    assert metric(m, 'headbudget_engine_tokens_total{kind="text"}') == own
    batches = metric(m, "headbudget_batch_size_count")
    assert batches < len(texts)  # the burst was batched...
    padding = metric(m, 'headbudget_engine_tokens_total{kind="padding"}')
    assert padding <= PAD_SHARE * own  # ...in passes of about one length (padded to the longest: over 2x its own)
