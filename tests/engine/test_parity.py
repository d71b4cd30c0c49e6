"""fp32 engine logits equal the masked reference model at all 19 budgets; int8 mostly agrees; batching."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import load_checkpoint
from tests.engine.int8_noise import Int8Noise

TEXTS = [
    "Stocks rallied on Wall Street as oil prices fell.",
    "The striker scored twice in the final minutes of the match against the league leaders.",
    "New chip",
    "Scientists describe a distant planet whose atmosphere contains water vapour and clouds of iron, "
    "according to a study published on Tuesday.",
]
FP32 = [
    pytest.param(EngineOptions(), id="ort-dynamic"),
    pytest.param(EngineOptions(prepack=False), id="ort-whole"),
    pytest.param(EngineOptions(backend="torch"), id="torch"),
]


def reference(folder: Path, ids: np.ndarray, mask: np.ndarray, budget: float) -> np.ndarray:
    """Logits of the training-time model under the same hard mask."""
    return masked_logits(load_checkpoint(folder)[0], ids, mask, budget)


def masked_logits(model: Any, ids: np.ndarray, mask: np.ndarray, budget: float) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), model.hard_gates(budget)).numpy()


@pytest.fixture(scope="module", params=["tiny_checkpoint", "minilm_shaped_checkpoint"])
def checkpoint(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


def _inputs(engine: object) -> tuple[np.ndarray, np.ndarray]:
    from headbudget.engine.base import pad

    enc = engine.encoder.encode(TEXTS)  # type: ignore[attr-defined]
    return pad(enc.ids, 0)


@pytest.mark.parametrize("options", FP32)
def test_fp32_matches_masked_reference_at_every_budget(checkpoint: Path, options: EngineOptions,
                                                       tmp_path: Path) -> None:
    engine = load_engine(checkpoint, EngineOptions(**{**options.__dict__, "cache_dir": tmp_path}))
    ids, mask = _inputs(engine)
    model, _ = load_checkpoint(checkpoint)
    for b in BUDGET_GRID:
        with torch.no_grad():
            ref = model(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), model.hard_gates(b)).numpy()
        result = engine.predict(TEXTS, b)
        got = np.array([p.logits for p in result.predictions])
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0, err_msg=f"budget {b}")
        assert result.heads_active == int(model.gates.hard_mask(b).sum())
        assert engine.plan(b).heads_active == result.heads_active


def test_int8_runs_and_mostly_agrees(minilm_shaped_checkpoint: Path, tmp_path: Path) -> None:
    engine = load_engine(minilm_shaped_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path))
    ids, mask = _inputs(engine)
    noise, agree, total = Int8Noise(load_checkpoint(minilm_shaped_checkpoint)[0]), 0, 0
    for b in (1.0, 0.5, 0.25):
        got = engine.predict_ids(ids, mask, b)  # type: ignore[attr-defined]
        # quantization noise, not a different model
        ref = noise.check(got, lambda m, b=b: masked_logits(m, ids, mask, b), f"budget {b}")
        agree += int((got.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
    assert agree >= 0.75 * total


@pytest.mark.parametrize("options", [EngineOptions(), EngineOptions(prepack=False), EngineOptions(precision="int8")],
                         ids=["dynamic", "whole", "int8"])
def test_batch_of_mixed_lengths_equals_one_by_one(minilm_shaped_checkpoint: Path, options: EngineOptions,
                                                  tmp_path: Path) -> None:
    engine = load_engine(minilm_shaped_checkpoint, EngineOptions(**{**options.__dict__, "cache_dir": tmp_path}))
    for b in (1.0, 0.35):
        batch = engine.predict(TEXTS, b).predictions
        for text, p in zip(TEXTS, batch, strict=True):
            single = engine.predict([text], b).predictions[0]
            assert single.n_tokens == p.n_tokens and single.truncated == p.truncated
            if options.precision == "fp32":
                assert single.label == p.label
                np.testing.assert_allclose(p.logits, single.logits, atol=1e-4)
            else:
                # Dynamic int8 quantizes activations with one scale per call, so a batch's neighbours
                # (and padding) move a text's logits by quantization noise: close, not equal.
                np.testing.assert_allclose(p.logits, single.logits, atol=0.1)
