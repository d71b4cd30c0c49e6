"""The engine's weight store as typed records, and the one place that knows their ONNX names.

``weights.pack`` builds a ``WeightStore`` from a checkpoint (the layouts are described there). Every budget's
graph binds views of these arrays by name (``graph.bind``), so all sessions share one copy. A record's
field name is the array's ONNX name, under ``l{layer}.`` for a layer's; ``layer_names`` and ``input_names`` add
the suffixes of prefix slices and the all-budget graph's per-call inputs. The on-disk cache stores
``WeightStore.arrays()`` under the same names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np

from headbudget.engine.types import Precision
from headbudget.models.config import ModelConfig

Arrays = dict[str, np.ndarray]  # ONNX name -> array: a graph's initializers or a call's feeds


@dataclass(frozen=True, eq=False)
class LayerWeights:
    """One encoder layer; heads (and, whole-model, neurons) in rank order, so that a budget's are a prefix.

    fp32 stores hold the residual biases folded (``weights.fold_residual_biases``); int8 ones hold plain
    biases and one scale per output column (per neuron for W1 stored as rows).
    """

    wqkv: np.ndarray  # fp32 (H*3*dh, D): per head its [q; k; v] rows; int8 (D, H*3*dh)
    bqkv: np.ndarray  # (H*3*dh,)
    wo: np.ndarray  # (H*dh, D): head inputs as rows
    bo: np.ndarray  # (D,)
    w1: np.ndarray  # (I, D), neurons as rows (whole-model scope); else (D, I)
    b1: np.ndarray  # (I,)
    w2: np.ndarray  # (I, D)
    b2: np.ndarray  # (D,)
    ln1_g: np.ndarray  # (D,)
    ln1_b: np.ndarray  # (D,)
    ln2_g: np.ndarray  # (D,)
    ln2_b: np.ndarray  # (D,)
    ln2_bf: np.ndarray | None = None  # folded stores, all but the last layer: ln2_b + the next layer's bo
    wqkv_s: np.ndarray | None = None  # int8 scales: (H*3*dh,)
    wo_s: np.ndarray | None = None  # (D,)
    w1_s: np.ndarray | None = None  # (I,)
    w2_s: np.ndarray | None = None  # (D,)


@dataclass(frozen=True, eq=False)
class Head:
    """A linear layer over the pooled vector (classifier, exit or pooler): x W^T + b."""

    w: np.ndarray  # (C, D)
    b: np.ndarray  # (C,)


@dataclass(frozen=True, eq=False)
class Embeddings:
    """The embedding layer: LN(word + pos_tt) with the norm's gamma and beta."""

    word: np.ndarray  # (V, D): fp32, or int8 rows with one scale each in word_s
    pos_tt: np.ndarray  # (P, D): position table plus token type 0 (always 0: one Add fewer per call)
    emb_g: np.ndarray  # (D,)
    emb_b: np.ndarray  # (D,)
    word_s: np.ndarray | None = None  # int8: (V, 1)
    emb_bf: np.ndarray | None = None  # folded stores: emb_b + layer 0's bo


@dataclass(frozen=True, eq=False)
class WeightStore:
    """Every array all budgets of one checkpoint share, at one precision."""

    precision: Precision
    embeddings: Embeddings
    layers: tuple[LayerWeights, ...]
    classifier: Head
    pooler: Head | None = None
    exits: Mapping[int, Head] = field(default_factory=dict)  # exit depth -> its head (fp32, as the classifier)
    w1_z: np.ndarray | None = None  # int8 W1 as rows: QGemm's per-neuron zero points (all 0), (I,)

    def heads(self) -> dict[str, Head]:
        """The linear heads by ONNX prefix (see ``head_names``)."""
        out = {CLASSIFIER: self.classifier} | {exit_head(d): h for d, h in self.exits.items()}
        return out | ({POOLER: self.pooler} if self.pooler is not None else {})

    def arrays(self) -> Arrays:
        """Every array under its ONNX name (the on-disk cache's layout)."""
        out = _present(self.embeddings)
        for prefix, head in self.heads().items():
            out.update(zip(head_names(prefix), (head.w, head.b), strict=True))
        if self.w1_z is not None:
            out[W1_Z] = self.w1_z
        for layer, weights in enumerate(self.layers):
            names = layer_names(layer)
            out.update({getattr(names, n): a for n, a in _present(weights).items()})
        return out

    @classmethod
    def from_arrays(cls, arrays: Mapping[str, np.ndarray], cfg: ModelConfig, precision: Precision) -> WeightStore:
        """The store ``arrays()`` wrote (no copies), for ``cfg``'s layers, exits and pooler."""

        def head(prefix: str) -> Head:
            w, b = head_names(prefix)
            return Head(arrays[w], arrays[b])

        def layer(i: int) -> LayerWeights:
            names = layer_names(i)
            return LayerWeights(**{f.name: arrays[n] for f in fields(LayerWeights)
                                   if (n := getattr(names, f.name)) in arrays})

        embeddings = Embeddings(**{f.name: arrays[f.name] for f in fields(Embeddings) if f.name in arrays})
        return cls(precision=precision, embeddings=embeddings, layers=tuple(map(layer, range(cfg.n_layers))),
                   classifier=head(CLASSIFIER), pooler=head(POOLER) if cfg.pooler != "none" else None,
                   exits={d: head(exit_head(d)) for d in cfg.gate.exits}, w1_z=arrays.get(W1_Z))

    def contiguous(self) -> WeightStore:
        """The store with every array C-contiguous (the ones that are already stay the same objects)."""

        def c(record: Any) -> Any:
            return replace(record, **{n: np.ascontiguousarray(a) for n, a in _present(record).items()})

        return replace(self, embeddings=c(self.embeddings), layers=tuple(map(c, self.layers)),
                       classifier=c(self.classifier), pooler=None if self.pooler is None else c(self.pooler),
                       exits={d: c(h) for d, h in self.exits.items()},
                       w1_z=None if self.w1_z is None else np.ascontiguousarray(self.w1_z))


def _present(record: Any) -> Arrays:
    """A record's arrays by field name, absent (None) ones left out."""
    return {f.name: a for f in fields(record) if (a := getattr(record, f.name)) is not None}


# -- names --------------------------------------------------------------------------------------------
CLASSIFIER, POOLER = "cls", "pool"
W1_Z = "w1_z"  # one vector of zero points for the whole store, sliced with each layer's neurons
_HEAD_SLICED = frozenset({"wqkv", "bqkv", "wo", "wqkv_s"})
_NEURON_SLICED = frozenset({"w1", "b1", "w2", "w1_s", W1_Z})


@dataclass(frozen=True)
class EmbeddingNames:
    """ONNX names of the embedding arrays (``Embeddings``' fields)."""

    word: str
    pos_tt: str
    emb_g: str
    emb_b: str
    word_s: str
    emb_bf: str


EMBEDDINGS = EmbeddingNames(**{f.name: f.name for f in fields(Embeddings)})


def exit_head(depth: int) -> str:
    """The ONNX prefix of the exit head after layer ``depth``."""
    return f"exit{depth}"


def head_names(prefix: str) -> tuple[str, str]:
    """The weight and bias names of a head (``CLASSIFIER``, ``POOLER`` or ``exit_head(d)``)."""
    return f"{prefix}_w", f"{prefix}_b"


@dataclass(frozen=True)
class LayerNames:
    """ONNX names of one layer's arrays (``LayerWeights``' fields), of the zero points it uses, and of its
    attention shape constants ``heads`` ([k, 3, dh]) and ``flat`` ([-1, k*dh])."""

    wqkv: str
    bqkv: str
    wo: str
    bo: str
    w1: str
    b1: str
    w2: str
    b2: str
    ln1_g: str
    ln1_b: str
    ln2_g: str
    ln2_b: str
    ln2_bf: str
    wqkv_s: str
    wo_s: str
    w1_s: str
    w2_s: str
    w1_z: str


def layer_names(layer: int, heads: int | None = None, neurons: int | None = None) -> LayerNames:
    """Names of layer ``layer``'s arrays: the store's, or with ``heads`` (``neurons``) given, those of the prefix
    slices a plan binds, suffixed ``.k{heads}`` (``.n{neurons}``). Unsuffixed head names are also the
    all-budget graph's per-call inputs (``input_names``)."""

    def name(part: str) -> str:
        base = part if part == W1_Z else f"l{layer}.{part}"
        if heads is not None and part in _HEAD_SLICED:
            return f"{base}.k{heads}"
        if neurons is not None and part in _NEURON_SLICED:
            return f"{base}.n{neurons}"
        return base

    return LayerNames(**{f.name: name(f.name) for f in fields(LayerNames)})


@dataclass(frozen=True)
class InputNames:
    """The all-budget graph's per-call inputs for one layer (``graph.build_dynamic``): whether the layer
    runs all its heads (neurons), the If branch with prepacked weights, else the prefix slices."""

    full: str
    wqkv: str
    bqkv: str
    wo: str
    wqkv_s: str
    ffn_full: str
    w1: str
    b1: str
    w2: str
    w1_s: str
    w1_z: str


def input_names(layer: int) -> InputNames:
    """The per-call input names of layer ``layer`` in the all-budget graph."""
    p, own = f"l{layer}.", layer_names(layer)
    return InputNames(full=p + "full", wqkv=own.wqkv, bqkv=own.bqkv, wo=own.wo, wqkv_s=own.wqkv_s,
                      ffn_full=p + "ffn_full", w1=p + "ffn_w1", b1=p + "ffn_b1",
                      w2=p + "ffn_w2", w1_s=p + "ffn_w1_s", w1_z=p + "ffn_w1_z")


def level_input(layer: int, units: int, heads: bool = False) -> str:
    """The all-budget graph's per-call flag that layer ``layer`` runs the packed prefix of ``units`` feed-forward
    neurons (attention ``heads``) plus the rest of the plan's (``PrecisionSpec.ffn_levels``, ``attention_levels``);
    0: the plan's units all fed per call."""
    return f"l{layer}.{'att' if heads else 'ffn'}_level.{'k' if heads else 'n'}{units}"
