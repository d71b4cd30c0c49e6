"""The one call the service makes at start-up: a checkpoint folder and options in, an Engine out."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from headbudget.engine.errors import ModelLoadError
from headbudget.engine.protocol import Engine
from headbudget.engine.types import EngineOptions, ModelInfo
from headbudget.engine.weights import checkpoint_config, checkpoint_digest

log = logging.getLogger(__name__)


def _optional_json(path: Path) -> dict[str, Any] | None:
    """sweep.json / bench.json beside the weights, if present and readable (a bad one is logged, not fatal)."""
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("%s: ignored (%s)", path, e)
        return None
    return value if isinstance(value, dict) else {"value": value}


def model_info(model_dir: Path, options: EngineOptions) -> ModelInfo:
    """What the service shows about a checkpoint, read without loading any weights into a runtime."""
    model_dir = Path(model_dir)
    config, cfg = checkpoint_config(model_dir)
    model_type = str(config.get("model_type", "budgeted"))
    if model_type != "budgeted":
        raise ModelLoadError(f"{model_dir}: model_type {model_type!r} is not served by this engine (budgeted only)")
    return ModelInfo(
        name=str(config.get("name") or model_dir.name),
        checksum=checkpoint_digest(model_dir),
        labels=cfg.labels,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_length=options.max_length or cfg.max_position,
        model_type=model_type,
        sweep=_optional_json(model_dir / "sweep.json"),
        bench=_optional_json(model_dir / "bench.json"),
        extra={"backend": options.backend, "precision": options.precision, "prepack": options.prepack,
               "structural": cfg.gate.structural, "hidden_size": cfg.hidden_size},
    )


def load_engine(model_dir: Path, options: EngineOptions) -> Engine:
    """Load ``model_dir`` with the backend and precision ``options`` name; raises ModelLoadError."""
    if options.threads < 1:
        raise ModelLoadError(f"threads must be >= 1, got {options.threads}")
    info = model_info(Path(model_dir), options)
    if options.backend == "onnxruntime":
        from headbudget.engine.onnx_backend import OnnxEngine

        return OnnxEngine(Path(model_dir), options, info)
    if options.backend == "torch":
        from headbudget.engine.torch_backend import TorchEngine

        return TorchEngine(Path(model_dir), options, info)
    raise ModelLoadError(f"unknown backend {options.backend!r} (onnxruntime or torch)")
