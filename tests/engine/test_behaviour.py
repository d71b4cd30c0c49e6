"""Cache reuse and rebuild, truncation, budgets, errors, structural mode, model info."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from headbudget.engine import artifacts
from headbudget.engine.errors import BudgetError, InputError, ModelLoadError
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions, SweepRecord
from headbudget.engine.weights import pack as weights
from headbudget.models import checkpoint as ckpt
from headbudget.models.budget import BUDGET_GRID, head_order
from headbudget.models.checkpoint import load_checkpoint, save_checkpoint


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("onnx"))
    return dst


def test_cache_reused_then_rebuilt_when_checkpoint_changes(tiny_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint, tmp_path / "ckpt")
    first = load_engine(folder, EngineOptions())
    first.warmup()
    assert "store.safetensors" in first.cache.built  # type: ignore[attr-defined]
    again = load_engine(folder, EngineOptions())
    again.warmup()
    assert again.cache.built == []  # type: ignore[attr-defined]  # store and graphs came from disk
    before = again.predict(["some text here"], 0.5).predictions[0].logits

    model, config = load_checkpoint(folder)
    with torch.no_grad():
        model.classifier.bias.add_(1.0)
    save_checkpoint(model, folder, {k: v for k, v in config.items() if k in ("name", "model_type")})
    changed = load_engine(folder, EngineOptions())
    assert "store.safetensors" in changed.cache.built  # type: ignore[attr-defined]
    after = changed.predict(["some text here"], 0.5).predictions[0].logits
    np.testing.assert_allclose(np.array(after) - np.array(before), 1.0, atol=1e-4)
    assert len(list((folder / "onnx").glob("hb-fp32-dynamic-*"))) == 1  # the stale folder was removed


def test_damaged_cache_is_rebuilt(tiny_checkpoint: Path, tmp_path: Path) -> None:
    load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    (store,) = tmp_path.glob("hb-*/store.safetensors")
    store.write_bytes(b"garbage")
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    assert "store.safetensors" in engine.cache.built  # type: ignore[attr-defined]
    assert len(engine.predict(["fine"], 1.0).predictions) == 1


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_long_input_is_truncated_and_flagged(tiny_checkpoint: Path, tmp_path: Path, backend: str) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(backend=backend, max_length=16, cache_dir=tmp_path))  # type: ignore[arg-type]
    long, short = "word " * 100, "short text"
    assert engine.count_tokens([long, short]) == [(16, True), (4, False)]
    result = engine.predict([long, short], 0.5)
    assert [p.truncated for p in result.predictions] == [True, False]
    assert [p.n_tokens for p in result.predictions] == [16, 4]


@pytest.mark.parametrize("budget", [-0.1, 1.5, float("nan"), float("inf"), "0.5", None, True])
def test_bad_budget_raises_budget_error(tiny_checkpoint: Path, tmp_path: Path, budget: object) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    with pytest.raises(BudgetError):
        engine.predict(["text"], budget)  # type: ignore[arg-type]
    with pytest.raises(BudgetError):
        engine.plan(budget)  # type: ignore[arg-type]


@pytest.mark.parametrize("texts", [[], [""], ["ok", "  "], "a string", [3]])
def test_bad_texts_raise_input_error(tiny_checkpoint: Path, tmp_path: Path, texts: object) -> None:
    engine = load_engine(tiny_checkpoint, EngineOptions(cache_dir=tmp_path))
    with pytest.raises(InputError):
        engine.predict(texts, 0.5)  # type: ignore[arg-type]


def test_load_errors(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError):
        load_engine(tmp_path / "missing", EngineOptions())
    broken = _copy(tiny_checkpoint, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"not weights")
    with pytest.raises(ModelLoadError):
        load_engine(broken, EngineOptions(cache_dir=tmp_path / "c"))
    with pytest.raises(ModelLoadError):
        load_engine(tiny_checkpoint, EngineOptions(backend="tensorflow"))  # type: ignore[arg-type]
    with pytest.raises(ModelLoadError):
        load_engine(tiny_checkpoint, EngineOptions(max_length=10_000))


def test_structural_checkpoint_keeps_a_head_per_layer(tmp_path: Path, tiny_checkpoint: Path) -> None:
    model, config = load_checkpoint(tiny_checkpoint)
    cfg = replace(model.cfg, gate=replace(model.cfg.gate, structural=True))
    structural = type(model)(cfg)
    structural.load_state_dict(model.state_dict())
    structural.eval()
    folder = save_checkpoint(structural, tmp_path / "structural", {"name": "structural"})
    for name in ("tokenizer.json", "vocab.txt"):
        shutil.copyfile(tiny_checkpoint / name, folder / name)
    engine = load_engine(folder, EngineOptions())
    ids = np.array([[101, 2023, 2003, 1037, 3231, 102]], dtype=np.int64)
    mask = np.ones_like(ids, dtype=np.int32)
    for b in BUDGET_GRID:
        counts = engine.plan(b).heads
        assert min(counts) >= 1
        with torch.no_grad():
            ref = structural(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), structural.hard_gates(b))
        np.testing.assert_allclose(engine.predict_ids(ids, mask, b), ref.numpy(), atol=1e-4)  # type: ignore[attr-defined]


def test_model_info(tiny_checkpoint: Path, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint, tmp_path / "withsweep")
    (folder / "sweep.json").write_text(json.dumps({"dense_accuracy": 0.9, "points": [
        {"budget": 0.5, "accuracy_hard": 0.8}, {"budget": "x", "accuracy_hard": 0.7}, {"budget": 1.0}]}))
    (folder / "bench.json").write_text(json.dumps({"rows": [1, 2]}))  # no usable row: ignored, not fatal
    info = load_engine(folder, EngineOptions(cache_dir=tmp_path / "c")).info
    assert info.name == "tiny" and info.checksum == ckpt.weights_digest(folder)
    assert info.sweep == SweepRecord(accuracy={0.5: 0.8}, dense_accuracy=0.9) and info.bench is None
    assert (info.n_layers, info.n_heads, info.model_type) == (2, 4, "budgeted")


def test_torch_free_reader_agrees_with_models_checkpoint(tiny_checkpoint: Path) -> None:
    assert artifacts.checkpoint_digest(tiny_checkpoint) == ckpt.weights_digest(tiny_checkpoint)
    model, _ = load_checkpoint(tiny_checkpoint)
    _, cfg = artifacts.checkpoint_config(tiny_checkpoint)
    assert cfg == model.cfg
    assert weights.expected_shapes(cfg) == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    order = head_order(weights.gate_params(weights.load_state(tiny_checkpoint, cfg)))
    np.testing.assert_array_equal(order, model.gates.order())


def test_onnx_engine_never_imports_torch(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A serving process on the ORT backend loads, warms up and predicts without importing torch."""
    code = (
        "import sys; from pathlib import Path\n"
        "from headbudget.engine.factory import load_engine\n"
        "from headbudget.engine.types import EngineOptions\n"
        f"e = load_engine(Path({str(tiny_checkpoint)!r}), EngineOptions(cache_dir=Path({str(tmp_path)!r})))\n"
        "e.warmup(); e.predict(['some text'], 0.5)\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
