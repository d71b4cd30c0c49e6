"""A headbudget checkpoint's dense (b = 1) model as a standard Hugging Face folder.

Torch-free: the tensors are renamed and written with ``safetensors.numpy``. The class is the standard one when
it computes exactly what our model does: BertForSequenceClassification for a first-token head with a tanh
pooler (checkpoints converted from BERT, RoBERTa or XLM-R classifiers; RoBERTa's offset positions are already
stored from row 0), DistilBertForSequenceClassification for a ReLU pre-classifier. Everything else (our mean-
pooled MiniLM checkpoints) gets ``modeling_headbudget.py`` and an ``auto_map``: Hugging Face's mechanism for a
custom head, loaded with ``trust_remote_code=True``. The gates are dropped: at b = 1 every head runs, and
Hugging Face's BERT has one head count for every layer, so a smaller budget is ``--format onnx``'s job.

Example::

    headbudget export --model checkpoints/ag_news-quick --budget 1 --format hf --out exported/ag_news-hf
    python -c "from transformers import AutoModelForSequenceClassification as A; \\
               A.from_pretrained('exported/ag_news-hf', trust_remote_code=True)"
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from headbudget.models.checkpoint_meta import CONFIG, WEIGHTS, model_config, read_config, weights_digest
from headbudget.models.config import ModelConfig
from headbudget.models.hf.families import FAMILIES, Family, PretrainedError, hf_key
from headbudget.models.model_types import model_type
from headbudget.models.tokenizer import TOKENIZER_FILES

REMOTE_CODE = "modeling_headbudget.py"


@dataclass(frozen=True)
class HfExport:
    """What ``export_hf`` wrote."""

    folder: Path
    architecture: str  # the transformers class name in config.json
    remote_code: bool  # loading needs trust_remote_code=True
    n_parameters: int


def _bert_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.n_layers,
            "num_attention_heads": cfg.n_heads, "intermediate_size": cfg.intermediate_size,
            "max_position_embeddings": cfg.max_position, "type_vocab_size": cfg.type_vocab_size,
            "layer_norm_eps": cfg.layer_norm_eps, "pad_token_id": cfg.pad_token_id, "hidden_act": "gelu",
            "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.dropout,
            "position_embedding_type": "absolute"}


def _distilbert_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"vocab_size": cfg.vocab_size, "dim": cfg.hidden_size, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
            "hidden_dim": cfg.intermediate_size, "max_position_embeddings": cfg.max_position, "activation": "gelu",
            "pad_token_id": cfg.pad_token_id, "sinusoidal_pos_embds": False, "dropout": cfg.dropout,
            "attention_dropout": cfg.dropout}


def _remote_code_config(cfg: ModelConfig) -> dict[str, Any]:
    return {"auto_map": {"AutoConfig": "modeling_headbudget.HeadbudgetConfig",
                         "AutoModelForSequenceClassification": "modeling_headbudget.HeadbudgetForSequenceClassification"},
            "pooling": cfg.pooling, "pooler": cfg.pooler, **_bert_config(cfg)}


@dataclass(frozen=True)
class HfClass:
    """A Hugging Face class that computes our dense model exactly, and how the folder holds the model for it."""

    model_type: str  # config.json's model_type
    architecture: str  # the transformers class
    family: Family  # the encoder's tensor names
    pooler: str  # the pooler's module name
    config: Callable[[ModelConfig], dict[str, Any]]  # the rest of config.json's model part
    remote_code: bool = False  # the class ships in the folder (modeling_headbudget.py, trust_remote_code=True)
    token_types: bool = True  # False: no token-type table, type 0 folded into the positions (DistilBERT)


BERT = HfClass("bert", "BertForSequenceClassification", FAMILIES["bert"], "bert.pooler.dense", _bert_config)
DISTILBERT = HfClass("distilbert", "DistilBertForSequenceClassification", FAMILIES["distilbert"], "pre_classifier",
                     _distilbert_config, token_types=False)
REMOTE = HfClass("headbudget", "HeadbudgetForSequenceClassification", FAMILIES["bert"], "pooler",
                 _remote_code_config, remote_code=True)


def hf_class(cfg: ModelConfig) -> HfClass:
    """Which Hugging Face class computes this model exactly: BERT's, DistilBERT's, or our remote code."""
    if cfg.pooling == "cls" and cfg.pooler == "tanh":
        return BERT
    if cfg.pooling == "cls" and cfg.pooler == "relu" and cfg.layer_norm_eps == 1e-12:  # DistilBERT's fixed eps
        return DISTILBERT
    return REMOTE


def hf_state(state: dict[str, np.ndarray], cfg: ModelConfig, target: HfClass) -> dict[str, np.ndarray]:
    """Our tensors under ``target``'s Hugging Face names (the gates dropped)."""
    prefix = target.family.prefix
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if not name.startswith("encoder."):
            continue
        if name == "encoder.embeddings.token_type.weight" and not target.token_types:
            continue  # folded into the positions below
        out[prefix + hf_key(name, target.family)] = value
    if not target.token_types:
        out[prefix + "embeddings.position_embeddings.weight"] = (
            state["encoder.embeddings.position.weight"] + state["encoder.embeddings.token_type.weight"][0])
    if cfg.pooler != "none":
        out[f"{target.pooler}.weight"], out[f"{target.pooler}.bias"] = state["pooler.weight"], state["pooler.bias"]
    out["classifier.weight"], out["classifier.bias"] = state["classifier.weight"], state["classifier.bias"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def export_hf(model_dir: Path, out: Path) -> HfExport:
    """Write the dense model of the checkpoint in ``model_dir`` as a Hugging Face folder ``out``."""
    from safetensors.numpy import load_file, save_file

    model_dir, out = Path(model_dir), Path(out)
    config = read_config(model_dir)
    cfg = model_config(config, model_dir / CONFIG)
    if not model_type(cfg.model_type).static_plans:
        raise PretrainedError(f"{model_dir}: a {cfg.model_type} checkpoint has parts no Hugging Face class runs; "
                              "only budgeted checkpoints export to the hf format")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise PretrainedError(f"{out}: exists and is not an empty folder")
    target = hf_class(cfg)
    tensors = hf_state(load_file(str(model_dir / WEIGHTS)), cfg, target)
    id2label = {str(i): label for i, label in enumerate(cfg.labels)}
    common = {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()},
              "headbudget": {"source": str(model_dir), "source_weights_sha256": weights_digest(model_dir),
                             "budget": 1.0, "max_length": config.get("max_length", cfg.max_position)}}
    hf = {"model_type": target.model_type, "architectures": [target.architecture], **target.config(cfg)}
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**hf, **common}, indent=2) + "\n")
    if target.remote_code:
        shutil.copyfile(Path(__file__).with_name("remote_code.py"), out / REMOTE_CODE)
    for name in TOKENIZER_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, out / name)
    return HfExport(folder=out, architecture=target.architecture, remote_code=target.remote_code,
                    n_parameters=int(sum(v.size for v in tensors.values())))
