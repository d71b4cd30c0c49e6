"""Checkpoint folders: model.safetensors + config.json (+ tokenizer files, sweep.json). Never pickle."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import ModelConfig

FORMAT = "headbudget-checkpoint"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, truncated, mismatched or not ours; the message names the file."""


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


def read_config(folder: Path) -> dict[str, Any]:
    """Parse and validate a checkpoint's config.json."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: checkpoint folder does not exist")
    path = folder / CONFIG
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (not a headbudget checkpoint folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a headbudget checkpoint (no \"format\": \"{FORMAT}\")")
    if config.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: format_version {config.get('format_version')!r}, "
                              f"this version reads {FORMAT_VERSION}")
    return config


def model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """The ModelConfig stored in a checkpoint's config.json."""
    try:
        return ModelConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad model config ({e})") from e


def load_state(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Read model.safetensors and check every tensor against the architecture in config.json."""
    path = Path(folder) / WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError, RuntimeError) as e:
        raise CheckpointError(f"{path}: unreadable or truncated ({e})") from e
    expected = BudgetedClassifier(cfg).state_dict()
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
    model = BudgetedClassifier(cfg)
    model.load_state_dict(state)
    model.eval()
    return model, config


def weights_digest(folder: Path) -> str:
    """SHA-256 of model.safetensors: the checkpoint's identity for caches and the service."""
    h = hashlib.sha256()
    with open(Path(folder) / WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
