"""A real `headbudget serve` on the ONNX engine runs with torch made unimportable (~200 MB less per worker)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import without_torch
from tests.service.conftest import KEYS, config_dict, engine_factory_available, start_server, toml_of

pytestmark = pytest.mark.slow
if (_why := engine_factory_available()) is not None:
    pytest.skip(_why, allow_module_level=True)

@pytest.mark.parametrize("workers", [1, 2])
def test_serve_answers_with_torch_unimportable(tiny_checkpoint: Path, tmp_path: Path, workers: int) -> None:
    with start_server(tiny_checkpoint, toml_of(config_dict()), tmp_path / "srv", workers=workers,
                      env=without_torch(tmp_path / "blocker")) as server:
        r = httpx.post(f"{server.url}/classify?budget=0.5", json={"texts": ["one", "two three"]},
                       headers={"X-API-Key": KEYS["quality"]}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["results"][0]["label"] in ("negative", "positive")
        for path in ("/v1/models", "/metrics", "/info"):
            assert httpx.get(f"{server.url}{path}", headers={"X-API-Key": KEYS["quality"]},
                             timeout=30).status_code == 200, path
        assert "torch is blocked" not in server.logs()
