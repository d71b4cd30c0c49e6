"""The ORT seam: the C-level fast path and the public API give the same logits, in both session layouts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from headbudget.engine.factory import load_engine
from headbudget.engine.onnx import runner as ort_fast
from headbudget.engine.types import EngineOptions

TEXTS = ["Stocks rallied on Wall Street.", "The striker scored twice in the final minutes of the match.", "Chip"]


def _logits(checkpoint: Path, cache: Path, prepack: bool) -> tuple[dict[float, np.ndarray], bool]:
    engine = load_engine(checkpoint, EngineOptions(cache_dir=cache, prepack=prepack))
    try:
        out = {b: np.array([p.logits for p in engine.predict(TEXTS, b).predictions]) for b in (0.25, 0.5, 1.0)}
        private = all(r.private for r in engine._sessions.values())  # type: ignore[attr-defined]
        public = not any(r.private for r in engine._sessions.values())  # type: ignore[attr-defined]
        assert private or public
        return out, private
    finally:
        engine.close()


@pytest.mark.parametrize("prepack", [True, False], ids=["dynamic", "whole"])
def test_public_api_fallback_gives_the_fast_paths_logits(tiny_checkpoint: Path, tmp_path: Path, prepack: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    fast, was_private = _logits(tiny_checkpoint, tmp_path, prepack)
    monkeypatch.setattr(ort_fast, "PRIVATE", False)
    public, still_private = _logits(tiny_checkpoint, tmp_path, prepack)
    assert was_private and not still_private  # this ORT has the private path, and the flag turns it off
    for b in fast:
        np.testing.assert_array_equal(fast[b], public[b])
