"""The int8 tolerance is derived, not picked: the two simulated int8 arithmetics differ as the CPUs' kernels do,
the engine on this CPU is within them, and an engine with one matrix 50% off is outside the bound."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from headbudget.engine.base import pad
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.checkpoint import load_checkpoint
from tests.conftest import make_random_checkpoint
from tests.engine.int8_noise import Int8Noise
from tests.engine.test_exits import _reference_logits
from tests.engine.test_parity import TEXTS

BUDGETS = (0.25, 0.5, 1.0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-exits", seed=11, scope="model",
                                  ffn_group=32, exits=(1, 2), n_layers=4)


def _logits_of(engine_dir: Path, cache: Path) -> tuple[np.ndarray, np.ndarray, dict[float, np.ndarray]]:
    engine = load_engine(engine_dir, EngineOptions(precision="int8", cache_dir=cache))
    ids, mask = pad(engine.encoder.encode(TEXTS).ids, 0)
    return ids, mask, {b: engine.predict_ids(ids, mask, b) for b in BUDGETS}  # type: ignore[attr-defined]


def test_the_two_arithmetics_differ_and_the_engine_is_within_them(checkpoint: Path, tmp_path: Path) -> None:
    model = load_checkpoint(checkpoint)[0]
    ids, mask, got = _logits_of(checkpoint, tmp_path)
    noise = Int8Noise(model)
    for b in BUDGETS:
        ref = _reference_logits(model, ids, mask, b)
        exact, saturating = (np.abs(_reference_logits(sim, ids, mask, b) - ref).max() for sim in noise.sims)
        assert 0 < exact < saturating  # saturation adds to the rounding on these weights
        # This CPU's engine is one of the two arithmetics, whichever its kernels sum with.
        assert min(exact, saturating) / 2 <= np.abs(got[b] - ref).max()
        noise.check(got[b], lambda m, b=b: _reference_logits(m, ids, mask, b), f"budget {b}")


@pytest.mark.parametrize("factor", [1.5, 0.5])
def test_a_wrong_weight_is_outside_the_bound(checkpoint: Path, tmp_path: Path, factor: float) -> None:
    """One matrix of the first layer scaled by half again, or halved, in the checkpoint: the bound refuses it."""
    wrong = tmp_path / "wrong"
    shutil.copytree(checkpoint, wrong)
    weights = load_file(wrong / "model.safetensors")
    weights["encoder.layers.0.intermediate.weight"] = weights["encoder.layers.0.intermediate.weight"] * factor
    save_file(weights, wrong / "model.safetensors")
    noise = Int8Noise(load_checkpoint(checkpoint)[0])
    ids, mask, got = _logits_of(wrong, tmp_path / "cache")
    b = 0.5  # the tiny model's dense logits hardly move at all; this budget answers at an exit
    with pytest.raises(AssertionError, match="beyond what int8 arithmetic makes"):
        noise.check(got[b], lambda m: _reference_logits(m, ids, mask, b), f"budget {b}")
