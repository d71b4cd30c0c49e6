"""Checkpoint metadata without torch: config.json validation and the weights digest."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from headbudget.models.config import ModelConfig

FORMAT = "headbudget-checkpoint"
FORMAT_VERSION = 1
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
# config.json key of a timing stand-in (lab/standin.py in the repository): the sweep it was rebuilt from. Its
# weights are the base's, so nothing may answer with it as if it were the checkpoint.
STANDIN = "standin"


class CheckpointError(ValueError):
    """A checkpoint folder that is missing, truncated, mismatched or not ours; the message names the file."""


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


def standin_of(config: dict[str, Any]) -> dict[str, Any] | None:
    """What a timing stand-in's config says it stands for; None for a trained checkpoint."""
    return config.get(STANDIN)


def model_config(config: dict[str, Any], path: Path) -> ModelConfig:
    """The ModelConfig stored in a checkpoint's config.json."""
    try:
        return ModelConfig.from_dict(config["model"])
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad model config ({e})") from e


def weights_digest(folder: Path) -> str:
    """SHA-256 of model.safetensors: the checkpoint's identity for caches and the service."""
    h = hashlib.sha256()
    with open(Path(folder) / WEIGHTS, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
