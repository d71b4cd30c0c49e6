"""Model and gate configuration: frozen, torch-free, saved inside every checkpoint."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any


@dataclass(frozen=True)
class GateConfig:
    """How a budget b turns into per-head gates (METHODS.md section 1)."""

    tau: float = 1.0  # temperature of g = sigmoid((a + beta * logit(b)) / tau)
    eps: float = 1e-3  # budgets are clipped to [eps, 1 - eps] before logit()
    structural: bool = False  # keep at least one head in every layer
    init_logit: float = 4.0  # a_lh at start: g ~ 1 at every budget, so training starts from the dense model
    init_raw_beta: float = -2.0  # softplus(-2) ~ 0.13: a small budget sensitivity to start from


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of the encoder classifier; enough to rebuild it without guessing."""

    vocab_size: int = 30522
    hidden_size: int = 384
    n_layers: int = 6
    n_heads: int = 12
    intermediate_size: int = 1536
    max_position: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    dropout: float = 0.1  # hidden and attention-probability dropout (training only)
    labels: tuple[str, ...] = ("negative", "positive")
    pooling: str = "mean"  # "mean" over real tokens: all-MiniLM-L6-v2 was trained with mean pooling
    gate: GateConfig = field(default_factory=GateConfig)

    def __post_init__(self) -> None:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}")
        if len(self.labels) < 2:
            raise ValueError("a classifier needs at least two labels")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"unknown pooling {self.pooling!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def n_labels(self) -> int:
        return len(self.labels)

    @property
    def total_heads(self) -> int:
        return self.n_layers * self.n_heads

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["labels"] = list(self.labels)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """Rebuild from ``to_dict`` output; unknown keys are an error, not silently dropped."""
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        d = dict(d)
        gate = d.pop("gate", {}) or {}
        gate_known = {f.name for f in fields(GateConfig)}
        if set(gate) - gate_known:
            raise ValueError(f"unknown gate config fields: {sorted(set(gate) - gate_known)}")
        if "labels" in d:
            d["labels"] = tuple(str(x) for x in d["labels"])
        return cls(**d, gate=GateConfig(**gate))


TINY = dict(vocab_size=30522, hidden_size=64, n_layers=2, n_heads=4, intermediate_size=256, max_position=128)
