"""A checkpoint's files beside its weights: config.json and the weights' digest, and sweep.json and bench.json
parsed once (where the engine's model info is built) into typed records.

sweep.json and bench.json are optional, written by ``headbudget eval`` and ``headbudget bench``; the service reads
only these records. A file that is missing, unreadable or holds no usable point gives None
(logged by the caller), never a failed start: they improve the service's estimates and /v1/models, nothing
depends on them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headbudget.engine.errors import ModelLoadError

if TYPE_CHECKING:
    from headbudget.models.config import ModelConfig



def checkpoint_config(folder: Path) -> tuple[dict[str, Any], ModelConfig]:
    """config.json of a checkpoint and its ModelConfig (models.checkpoint_meta), errors as ModelLoadError."""
    # Imported here: the service imports this module for its records, and models/ only where a checkpoint loads.
    from headbudget.models.checkpoint_meta import CONFIG, CheckpointError, model_config, read_config

    try:
        config = read_config(Path(folder))
        return config, model_config(config, Path(folder) / CONFIG)
    except CheckpointError as e:
        raise ModelLoadError(str(e)) from e


def checkpoint_digest(folder: Path) -> str:
    """SHA-256 of model.safetensors (models.checkpoint_meta.weights_digest), errors as ModelLoadError."""
    from headbudget.models.checkpoint_meta import WEIGHTS, weights_digest

    try:
        return weights_digest(Path(folder))
    except OSError as e:
        raise ModelLoadError(f"{Path(folder) / WEIGHTS}: unreadable ({e})") from e


def _number(v: Any) -> float | None:
    """A finite int or float as float (bool is not a number here), else None."""
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        return None
    return float(v)


@dataclass(frozen=True)
class SweepRecord:
    """The hard-mask accuracy of each swept budget, and the dense model's (sweep.json)."""

    accuracy: dict[float, float]  # budget (rounded to 4 places) -> accuracy_hard
    dense_accuracy: float | None

    @property
    def budgets(self) -> list[float]:
        return sorted(self.accuracy)

    @classmethod
    def parse(cls, doc: Any) -> SweepRecord | None:
        """From sweep.json's document: ``points`` of ``budget`` and ``accuracy_hard``; unusable points dropped."""
        if not isinstance(doc, dict) or not isinstance(doc.get("points"), list):
            return None
        accuracy = {}
        for p in doc["points"]:
            b, acc = (_number(p.get("budget")), _number(p.get("accuracy_hard"))) if isinstance(p, dict) else (None, None)
            if b is not None and acc is not None:
                accuracy[round(b, 4)] = acc
        return cls(accuracy=accuracy, dense_accuracy=_number(doc.get("dense_accuracy"))) if accuracy else None


@dataclass(frozen=True)
class BenchRecord:
    """Measured latency per budget (bench.json): (padded tokens per call, ms) points, sorted by tokens."""

    table: dict[float, list[tuple[float, float]]]  # budget (rounded to 4 places) -> points
    reference_tokens: float  # tokens per text the table was measured at (``seq_len`` or ``median_tokens``)

    @classmethod
    def parse(cls, doc: Any) -> BenchRecord | None:
        """From bench.json's document: ``rows`` of ``budget`` and ``latency_ms`` (``headbudget bench``'s median),
        each at the document's (or the row's) ``seq_len`` and ``batch_size``; unusable rows dropped."""
        if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
            return None
        ref = next((v for v in (_number(doc.get("seq_len")), _number(doc.get("median_tokens"))) if v and v > 0),
                   128.0)
        batch_default = _number(doc.get("batch_size")) or 1.0
        table: dict[float, list[tuple[float, float]]] = {}
        for row in doc["rows"]:
            if not isinstance(row, dict):
                continue
            b, ms = _number(row.get("budget")), _number(row.get("latency_ms"))
            seq = _number(row.get("seq_len", ref))
            batch = _number(row.get("batch_size", batch_default))
            if b is None or ms is None or ms <= 0 or seq is None or batch is None:
                continue
            table.setdefault(round(b, 4), []).append((seq * batch, ms))
        if not table:
            return None
        return cls(table={b: sorted(points) for b, points in sorted(table.items())}, reference_tokens=ref)
