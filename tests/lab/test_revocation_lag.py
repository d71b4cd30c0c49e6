"""The revocation-lag investigation on a real two-worker server (smoke checkpoint): after the reload the key is
refused, and the file says how many answers came after the signal (values, not speed)."""

from __future__ import annotations

import json
from pathlib import Path

from lab.revocation_lag import main


def test_the_key_is_refused_after_the_reload(smoke_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "revocation.json"
    assert main(["--model", str(smoke_checkpoint), "--rounds", "2", "--after-s", "1", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["workers"] == 2 and doc["command"].startswith("python -m lab.revocation_lag")
    assert len(doc["rounds"]) == 2
    for r in doc["rounds"]:
        assert r["before"] > 0 and r["refused_after"] > 0  # answered until the reload, refused after it
        assert r["lag_ms"] >= 0 and r["answered_after"] >= 0
