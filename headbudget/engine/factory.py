"""The one call the service makes at start-up: a checkpoint folder and options in, an Engine out."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from headbudget.engine.artifacts import BenchRecord, SweepRecord, checkpoint_config, checkpoint_digest
from headbudget.engine.decider import read_decider
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.protocol import TokenEngine
from headbudget.engine.types import EngineOptions, ModelInfo
from headbudget.models.model_types import model_type

log = logging.getLogger(__name__)
T = TypeVar("T")


def _artifact(path: Path, parse: Callable[[Any], T | None]) -> T | None:
    """sweep.json / bench.json beside the weights as a typed record, if present and usable (else logged)."""
    if not path.is_file():
        return None
    try:
        record = parse(json.loads(path.read_text()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        log.warning("%s: ignored (%s)", path, e)
        return None
    if record is None:
        log.warning("%s: ignored (no usable point)", path)
    return record


def model_info(model_dir: Path, options: EngineOptions) -> ModelInfo:
    """What the service shows about a checkpoint, read without loading any weights into a runtime."""
    model_dir = Path(model_dir)
    config, cfg = checkpoint_config(model_dir)
    kind = model_type(cfg.model_type)  # the architecture's own field (model.model_type), not the meta copy
    backend = options.backend if kind.static_plans else "torch-adaptive"
    checksum = checkpoint_digest(model_dir)
    # A decider (decider.json, engine/decider.py) serves budget=auto on a type with static, nested plans.
    decider = read_decider(model_dir, checksum, cfg.labels) if kind.static_plans else None
    return ModelInfo(
        name=str(config.get("name") or model_dir.name),
        checksum=checksum,
        labels=cfg.labels,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        max_length=options.max_length or cfg.max_position,
        model_type=kind.name,
        supports_auto=kind.supports_auto or decider is not None,
        decider=decider,
        sweep=_artifact(model_dir / "sweep.json", SweepRecord.parse),
        bench=_artifact(model_dir / "bench.json", BenchRecord.parse),
        extra={"backend": backend, "precision": options.precision, "prepack": options.prepack,
               "structural": cfg.gate.structural, "hidden_size": cfg.hidden_size},
    )


def load_engine(model_dir: Path, options: EngineOptions) -> TokenEngine:
    """Load ``model_dir`` with the backend and precision ``options`` name; raises ModelLoadError."""
    if options.threads < 1:
        raise ModelLoadError(f"threads must be >= 1, got {options.threads}")
    info = model_info(Path(model_dir), options)
    load = _BACKENDS.get(options.backend)
    if load is None:
        raise ModelLoadError(f"unknown backend {options.backend!r} (onnxruntime or torch)")
    if not model_type(info.model_type).static_plans:
        return _load_adaptive(Path(model_dir), options, info)
    return load(Path(model_dir), options, info)


def _onnxruntime(model_dir: Path, options: EngineOptions, info: ModelInfo) -> TokenEngine:
    from headbudget.engine.onnx.backend import OnnxEngine

    return OnnxEngine(model_dir, options, info)


def _torch(model_dir: Path, options: EngineOptions, info: ModelInfo) -> TokenEngine:
    from headbudget.engine.reference.backend import TorchEngine

    return TorchEngine(model_dir, options, info)


# The backends of budgeted checkpoints by name, each imported when chosen (a serving process imports only its own).
_BACKENDS: dict[str, Callable[[Path, EngineOptions, ModelInfo], TokenEngine]] = {
    "onnxruntime": _onnxruntime, "torch": _torch}


def _load_adaptive(model_dir: Path, options: EngineOptions, info: ModelInfo) -> TokenEngine:
    """Adaptive types always run the fp32 PyTorch fast path: their head choice is per input, which the static
    ONNX graphs (one per head mask) cannot express. fp32 onnxruntime is served by it with a log line; int8 fails."""
    spec = PRECISIONS.get(options.precision)
    if spec is None or not spec.torch_engines:
        raise ModelLoadError(f"{model_dir}: {info.model_type} checkpoints have no {options.precision} path; "
                             "use precision fp32 (they run on the adaptive PyTorch engine)")
    if options.backend == "onnxruntime":
        log.info("%s: %s checkpoint, served by the adaptive PyTorch engine instead of onnxruntime",
                 model_dir, info.model_type)
    from headbudget.engine.adaptive.backend import AdaptiveEngine

    return AdaptiveEngine(model_dir, options, info)
