"""Checkpoint folders: model.safetensors + config.json (+ tokenizer files, sweep.json). Never pickle."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from headbudget.models.checkpoint_meta import (  # noqa: F401 - re-exported for callers of this module
    CONFIG,
    FORMAT,
    FORMAT_VERSION,
    WEIGHTS,
    CheckpointError,
    model_config,
    read_config,
    weights_digest,
)
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import ModelConfig
from headbudget.models.factory import build_model


def package_version() -> str:
    """Installed headbudget version, or 'unknown' when running from a bare source tree."""
    try:
        from importlib.metadata import version

        return version("headbudget")
    except Exception:  # noqa: BLE001 - metadata may be absent in a source checkout
        return "unknown"


def save_checkpoint(model: BudgetedClassifier, folder: Path, meta: dict[str, Any] | None = None) -> Path:
    """Write weights and config atomically enough: weights first, config (the marker) last."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    save_file(state, str(folder / WEIGHTS), metadata={"format": FORMAT})
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "package_version": package_version(),
        "model": model.cfg.to_dict(),
        **(meta or {}),
    }
    tmp = folder / (CONFIG + ".tmp")
    tmp.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    tmp.replace(folder / CONFIG)
    return folder


def load_state(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read model.safetensors and check every tensor against the architecture in config.json."""
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated ({e})") from e
    expected = build_model(cfg).state_dict()
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(f"{path}: does not match config.json (missing {missing[:3]}, unexpected {extra[:3]})")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{path}: tensor {k} has shape {tuple(state[k].shape)}, "
                                  f"config.json implies {tuple(v.shape)}")
    return state


def load_checkpoint(folder: Path) -> tuple[BudgetedClassifier, dict[str, Any]]:
    """Load a checkpoint folder into an eval-mode model; returns (model, config dict)."""
    folder = Path(folder)
    config = read_config(folder)
    cfg = model_config(config, folder / CONFIG)
    state = load_state(folder, cfg)
    model = build_model(cfg)
    model.load_state_dict(state)
    model.eval()
    return model, config


