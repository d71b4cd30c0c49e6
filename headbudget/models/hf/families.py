"""The Hugging Face encoder families we convert, and how each names our encoder's tensors (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any


class PretrainedError(ValueError):
    """A base model folder that cannot be read as a BERT-shaped encoder; the message is one line."""


# Per-layer modules: ours -> Hugging Face BERT's (RoBERTa and XLM-R use the same names).
_BERT_LAYER = {
    "attention.query": "attention.self.query", "attention.key": "attention.self.key",
    "attention.value": "attention.self.value", "attention.output": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
    "ffn_out": "output.dense", "ffn_norm": "output.LayerNorm",
}
_BERT_EMBEDDINGS = {"word": "word_embeddings", "position": "position_embeddings",
                    "token_type": "token_type_embeddings", "norm": "LayerNorm"}


@dataclass(frozen=True)
class Family:
    """How one Hugging Face encoder family names and shapes what our BERT-shaped encoder holds."""

    name: str
    prefix: str  # the encoder's module name inside a *ForSequenceClassification model
    layers: str  # the layer list's module name
    layer: dict[str, str]  # our per-layer module -> theirs
    embeddings: dict[str, str]  # ours -> theirs; a missing "token_type" is one all-zero token type
    pooler: tuple[str, str] | None  # the classification head's dense layer and activation (cfg.pooler)
    classifier: str  # the classification head's output layer
    position_offset: bool = False  # positions start at pad_token_id + 1 (RoBERTa)


FAMILIES: dict[str, Family] = {
    "bert": Family("bert", "bert.", "encoder.layer", _BERT_LAYER, _BERT_EMBEDDINGS,
                   ("bert.pooler.dense", "tanh"), "classifier"),
    "roberta": Family("roberta", "roberta.", "encoder.layer", _BERT_LAYER, _BERT_EMBEDDINGS,
                      ("classifier.dense", "tanh"), "classifier.out_proj", position_offset=True),
    "distilbert": Family(
        "distilbert", "distilbert.", "transformer.layer",
        {"attention.query": "attention.q_lin", "attention.key": "attention.k_lin",
         "attention.value": "attention.v_lin", "attention.output": "attention.out_lin",
         "attn_norm": "sa_layer_norm", "intermediate": "ffn.lin1", "ffn_out": "ffn.lin2",
         "ffn_norm": "output_layer_norm"},
        {"word": "word_embeddings", "position": "position_embeddings", "norm": "LayerNorm"},
        ("pre_classifier", "relu"), "classifier"),
}
FAMILIES["xlm-roberta"] = replace(FAMILIES["roberta"], name="xlm-roberta")


def hf_key(ours: str, family: Family = FAMILIES["bert"]) -> str:
    """Map one of our encoder parameter names to the family's (BertModel's by default), without the prefix."""
    parts = ours.split(".")
    if parts[0] == "encoder" and parts[1] == "embeddings":
        return f"embeddings.{family.embeddings[parts[2]]}.{parts[3]}"
    if parts[0] == "encoder" and parts[1] == "layers":
        mod, leaf = ".".join(parts[3:]).rsplit(".", 1)
        return f"{family.layers}.{parts[2]}.{family.layer[mod]}.{leaf}"
    raise KeyError(ours)


def family_of(hf: dict[str, Any], path: Path) -> Family:
    """The family of a Hugging Face config.json, or one line naming what is unsupported."""
    kind = hf.get("model_type", "bert")  # old BERT folders (MiniLM's included) may omit it
    if kind not in FAMILIES:
        raise PretrainedError(f"{path}: model_type {kind!r} is not supported (supported: {', '.join(FAMILIES)})")
    act = hf.get("activation" if kind == "distilbert" else "hidden_act", "gelu")
    if act != "gelu":
        raise PretrainedError(f"{path}: activation {act!r} is not supported (only exact GELU)")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        raise PretrainedError(f"{path}: position_embedding_type {hf['position_embedding_type']!r} is not supported "
                              "(only absolute)")
    if kind == "distilbert" and hf.get("sinusoidal_pos_embds"):
        raise PretrainedError(f"{path}: sinusoidal position embeddings are not supported")
    return FAMILIES[kind]
