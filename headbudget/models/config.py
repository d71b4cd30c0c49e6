"""Model and gate configuration: frozen, torch-free, saved inside every checkpoint."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Literal

from headbudget.models.model_types import REGISTRY, model_type

Scope = Literal["attention", "model"]  # GateConfig.scope, as config.json and --scope spell it


@dataclass(frozen=True)
class ScopeSpec:
    """What a budget spans, and what follows from it (docs/method.md §4)."""

    # The feed-forward neuron groups are gate units beside the heads, and b is the forward pass's share of
    # multiply-adds (plan.unit_costs) rather than the share of heads.
    gates_ffn: bool
    structural: bool  # structural mode (a head in every layer) applies
    exits: bool  # exit heads (layer skipping) apply


SCOPE_SPECS: Mapping[Scope, ScopeSpec] = MappingProxyType({
    "attention": ScopeSpec(gates_ffn=False, structural=True, exits=False),
    "model": ScopeSpec(gates_ffn=True, structural=False, exits=True),
})
SCOPES: tuple[Scope, ...] = tuple(SCOPE_SPECS)


def parse_exits(text: str) -> tuple[int, ...]:
    """``--exits 3`` or ``--exits 2,4``: the layer depths with an exit head (layer skipping); empty: none."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--exits {text!r}: expected comma-separated layer depths, e.g. 3") from None


@dataclass(frozen=True)
class GateConfig:
    """How a budget b turns into per-head gates (docs/method.md §2)."""

    tau: float = 1.0  # temperature of g = sigmoid((a + beta * logit(b)) / tau)
    eps: float = 1e-3  # budgets are clipped to [eps, 1 - eps] before logit()
    structural: bool = False  # keep at least one head in every layer
    init_logit: float = 4.0  # a_lh at start: g ~ 1 at every budget, so training starts from the dense model
    init_raw_beta: float = -2.0  # softplus(-2) ~ 0.13: a small budget sensitivity to start from
    # What a budget spans (docs/method.md §4): "attention" gates the heads only (§3, the published
    # method; b is the fraction of heads), "model" gates the heads and every group of ``ffn_group``
    # feed-forward neurons, and b is the fraction of their multiply-adds at ``ref_length`` tokens.
    scope: Scope = "attention"
    # 64 neurons: a multiple of the 16/32-wide panels MLAS's fp32 and int8 GEMM kernels pack, and about one
    # head's multiply-adds (MiniLM at 128 tokens: a head 7.3M, a group of 64 6.3M), so both unit kinds move the
    # cost in steps of the same size; 1536 / 64 = 24 groups per layer.
    ffn_group: int = 64
    ref_length: int = 128  # unit costs are taken here, so a budget's plan does not depend on the text
    # Layer skipping (whole-model scope): depths with an exit classifier. With exits (3,), budgets fill layers
    # 0-2 in crossing order before any unit of layers 3+ is kept, and a plan whose units all lie below an exit
    # stops there and answers with that exit's head, so its upper layers' LayerNorms and the rest of their
    # fixed work are not run either. Every budget is still a prefix of one keep sequence: nested in all units.
    exits: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.scope not in SCOPE_SPECS:
            raise ValueError(f"unknown gate scope {self.scope!r}; one of {', '.join(SCOPES)}")
        if self.structural and not self.scope_spec.structural:
            raise ValueError("structural mode (a head in every layer) is for the attention scope only")
        if self.ffn_group < 1 or self.ref_length < 1:
            raise ValueError(f"ffn_group and ref_length must be positive, got {self.ffn_group}, {self.ref_length}")
        if self.exits and not self.scope_spec.exits:
            raise ValueError("exits (layer skipping) are for the whole-model scope")
        if list(self.exits) != sorted(set(self.exits)) or any(e < 1 for e in self.exits):
            raise ValueError(f"exits must be increasing positive depths, got {list(self.exits)}")

    @property
    def scope_spec(self) -> ScopeSpec:
        """What this gate's scope implies (``SCOPE_SPECS``)."""
        return SCOPE_SPECS[self.scope]


MODEL_TYPES: tuple[str, ...] = tuple(REGISTRY)  # models/model_types.py: what each type is
POOLERS: tuple[str, ...] = ("none", "tanh", "relu")


@dataclass(frozen=True)
class BudgetFormerConfig:
    """Per-input budget and head relevance (docs/method.md §7.1); the published settings."""

    s_min: float = 0.1  # s outside [s_min, s_max] is penalised by alpha(s) * v(s)^2
    s_max: float = 0.9
    alpha_base: float = 0.001
    alpha_max: float = 0.05
    beta_max: float = 0.05  # entropy weight beta(t) = beta_max * (2t/T - 1)
    sigma_max: float = 0.5  # exploration noise on z, annealed to 0 over training
    tau_max: float = 2.0
    tau_min: float = 0.1
    gamma: float = 5.0
    # f's last bias starts at logit(init_s) with zero weights: s ~ 0.9 and p uniform give w_h = s * H * p_h
    # ~ 0.9 for every head, so the first steps see (almost) the dense warm-start model, not half of it.
    init_s: float = 0.9


@dataclass(frozen=True)
class SpanConfig:
    """Adaptive attention span (docs/method.md §7.2)."""

    ramp: int = 32  # R
    max_span: int | None = None  # S; None = max_position
    init_ratio: float = 1.0  # z = ratio * S at start: every head sees every token (the dense model)
    lambda_span: float = 2e-6  # L1 weight on spans, in tokens


@dataclass(frozen=True)
class AdaConfig:
    """Complexity-scored reduced attention (docs/method.md §7.3)."""

    threshold: float = 0.5  # a head whose mean score is above this runs at full dimension
    lambda_mid: float = 0.01  # lambda after the first 10% of training
    lambda_end: float = 0.05  # reached at the end, rising linearly over the last 5%
    off_fraction: float = 0.10
    ramp_fraction: float = 0.05
    # Scorer output bias at start: sigmoid(1) ~ 0.73, every head full, so training starts from the dense model,
    # yet close enough to the threshold to move (from a bias near saturation no head is ever reduced).
    init_bias: float = 1.0


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
    # A dense layer and activation between the pooled vector and the classifier, as fine-tuned Hugging Face
    # classifiers have it: BERT's pooler (tanh), RoBERTa's head (tanh), DistilBERT's pre_classifier (ReLU).
    pooler: str = "none"
    gate: GateConfig = field(default_factory=GateConfig)
    model_type: str = "budgeted"  # one of MODEL_TYPES; the adaptive types use their section below
    budgetformer: BudgetFormerConfig = field(default_factory=BudgetFormerConfig)
    span: SpanConfig = field(default_factory=SpanConfig)
    ada: AdaConfig = field(default_factory=AdaConfig)

    def __post_init__(self) -> None:
        model_type(self.model_type)  # ValueError naming the registered types
        if self.hidden_size % self.n_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not divisible by n_heads {self.n_heads}")
        if len(self.labels) < 2:
            raise ValueError("a classifier needs at least two labels")
        if self.pooling not in ("mean", "cls"):
            raise ValueError(f"unknown pooling {self.pooling!r}")
        if self.pooler not in POOLERS:
            raise ValueError(f"unknown pooler {self.pooler!r}; one of {', '.join(POOLERS)}")
        if self.gate.exits and self.gate.exits[-1] >= self.n_layers:
            raise ValueError(f"exit depths must be below n_layers {self.n_layers}, got {list(self.gate.exits)}")
        if self.gate.exits and self.pooler != "none":
            raise ValueError("exits read the pooled vector directly: a checkpoint with a pooler layer has none")
        if self.gate.scope_spec.gates_ffn and self.intermediate_size % self.gate.ffn_group:
            raise ValueError(f"ffn_group {self.gate.ffn_group} does not divide intermediate_size {self.intermediate_size}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.n_heads

    @property
    def n_labels(self) -> int:
        return len(self.labels)

    @property
    def total_heads(self) -> int:
        return self.n_layers * self.n_heads

    @property
    def ffn_groups(self) -> int:
        """Gated feed-forward neuron groups per layer: 0 unless the budget spans the whole model."""
        return self.intermediate_size // self.gate.ffn_group if self.gate.scope_spec.gates_ffn else 0

    @property
    def units_per_layer(self) -> int:
        """Gate units per layer: the heads, then the feed-forward groups (the gate tensors' last axis)."""
        return self.n_heads + self.ffn_groups

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
        sections: dict[str, Any] = {}
        for name, kind in (("gate", GateConfig), ("budgetformer", BudgetFormerConfig), ("span", SpanConfig),
                           ("ada", AdaConfig)):
            section = d.pop(name, {}) or {}
            known_here = {f.name for f in fields(kind)}
            if set(section) - known_here:
                raise ValueError(f"unknown {name} config fields: {sorted(set(section) - known_here)}")
            if name == "gate" and "exits" in section:
                section = {**section, "exits": tuple(int(e) for e in section["exits"])}
            sections[name] = kind(**section)
        if "labels" in d:
            d["labels"] = tuple(str(x) for x in d["labels"])
        return cls(**d, **sections)


TINY = dict(vocab_size=30522, hidden_size=64, n_layers=2, n_heads=4, intermediate_size=256, max_position=128)
