"""A headbudget checkpoint's dense (b = 1) model as a standard Hugging Face folder.

Torch-free: the tensors are renamed and written with ``safetensors.numpy``. The class is the standard one when
it computes what our model does: BertForSequenceClassification for a first-token head with a tanh pooler
(checkpoints converted from BERT, RoBERTa or XLM-R classifiers; RoBERTa's offset positions are already stored
from row 0), DistilBertForSequenceClassification for a ReLU pre-classifier, and BertForSequenceClassification with
one layer more for a mean-pooled linear head (our MiniLM checkpoints; ``mean_to_first_token`` says how). Only a
mean-pooled checkpoint with a pooler layer gets ``modeling_headbudget.py`` and an ``auto_map``, loaded with
``trust_remote_code=True``. The gates and exits are dropped: at b = 1 every head runs, and Hugging Face's BERT
has one head count for every layer, so a smaller budget is ``--format onnx``'s job.

Example::

    headbudget export --model checkpoints/ag_news-quick --budget 1 --format hf --out exported/ag_news-hf
    python -c "from transformers import AutoModelForSequenceClassification as A; A.from_pretrained('exported/ag_news-hf')"
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
# What a Hugging Face folder cannot hold: it is the dense model, one head count per layer, one classifier.
NOT_CARRIED = ("budgets", "exits")


@dataclass(frozen=True)
class HfExport:
    """What ``export_hf`` wrote."""

    folder: Path
    architecture: str  # the transformers class name in config.json
    remote_code: bool  # loading needs trust_remote_code=True
    n_parameters: int
    added_layers: int  # layers after ours that carry our head into the standard class


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
    extra_layers: int = 0  # layers the folder adds after ours (mean_to_first_token's one)


BERT = HfClass("bert", "BertForSequenceClassification", FAMILIES["bert"], "bert.pooler.dense", _bert_config)
DISTILBERT = HfClass("distilbert", "DistilBertForSequenceClassification", FAMILIES["distilbert"], "pre_classifier",
                     _distilbert_config, token_types=False)
MEAN_AS_BERT = HfClass("bert", "BertForSequenceClassification", FAMILIES["bert"], "bert.pooler.dense",
                       lambda cfg: {**_bert_config(cfg), "num_hidden_layers": cfg.n_layers + 1}, extra_layers=1)
REMOTE = HfClass("headbudget", "HeadbudgetForSequenceClassification", FAMILIES["bert"], "pooler",
                 _remote_code_config, remote_code=True)


def hf_class(cfg: ModelConfig) -> HfClass:
    """Which Hugging Face class computes this model exactly: BERT's, DistilBERT's, or our remote code."""
    if cfg.pooling == "cls" and cfg.pooler == "tanh":
        return BERT
    if cfg.pooling == "cls" and cfg.pooler == "relu" and cfg.layer_norm_eps == 1e-12:  # DistilBERT's fixed eps
        return DISTILBERT
    if cfg.pooling == "mean" and cfg.pooler == "none" and len(cfg.labels) + 1 <= cfg.hidden_size // 4:
        return MEAN_AS_BERT
    return REMOTE


# mean_to_first_token's scales, powers of two so that they are exact in fp32. The pattern's K drowns the first
# token's own state in the pattern's dimensions and fixes the layer norm's deviation (the logits' share of the
# variance is about (SIGNAL * |logit| / PATTERN)^2 / hidden_size, under 1e-7 of it); SIGNAL keeps the first token's
# own state below 1e-5 of a logit; LINEAR keeps tanh within 1e-8 of the identity for logits up to 100.
PATTERN = 2.0 ** 30
SIGNAL = 2.0 ** 17
LINEAR = 2.0 ** -17


def mean_to_first_token(state: dict[str, np.ndarray], cfg: ModelConfig, prefix: str) -> dict[str, np.ndarray]:
    """One BERT layer after ours, a pooler and a classifier that together compute our mean-pooled linear head.

    BERT classifies from the first token through tanh(dense); ours averages every real token. The added layer's
    queries and keys are zero, so each head's attention is uniform over the unmasked tokens: its output at every
    position is the mean of our last layer, exactly. The value path writes SIGNAL times our logits (without bias)
    into the first C dimensions of the first token's residual, K times a fixed +-1 pattern into most of the rest,
    and nothing into one reference dimension. The layer norm's deviation is then the pattern's, a constant to
    1e-7, and its mean shifts every dimension alike: logit i is (dim i - reference dim) * deviation / SIGNAL, which
    the pooler computes (scaled by LINEAR into tanh's linear range) and the classifier scales back. The second
    layer norm sees a normalized vector and leaves it as it is; the feed-forward part is zero.
    """
    d, c = cfg.hidden_size, len(cfg.labels)
    ref = c  # the reference dimension: the first token's state and the mean, nothing else
    pattern = np.zeros(d, np.float64)
    n = (d - c - 1) // 2 * 2
    pattern[c + 1:c + 1 + n] = np.tile([1.0, -1.0], n // 2)
    deviation = PATTERN * np.sqrt(n / d)
    layer = f"{prefix}encoder.layer.{cfg.n_layers}."
    zeros = np.zeros
    classifier = state["classifier.weight"].astype(np.float64)  # (C, D)
    out_proj = zeros((d, d))
    out_proj[:c] = SIGNAL * classifier
    pool = zeros((d, d))
    pool[np.arange(c), np.arange(c)] = LINEAR * deviation / SIGNAL
    pool[np.arange(c), ref] = -LINEAR * deviation / SIGNAL
    head = zeros((c, d))
    head[np.arange(c), np.arange(c)] = 1 / LINEAR
    i = cfg.intermediate_size
    return {
        f"{layer}attention.self.query.weight": zeros((d, d)), f"{layer}attention.self.query.bias": zeros(d),
        f"{layer}attention.self.key.weight": zeros((d, d)), f"{layer}attention.self.key.bias": zeros(d),
        f"{layer}attention.self.value.weight": np.eye(d), f"{layer}attention.self.value.bias": zeros(d),
        f"{layer}attention.output.dense.weight": out_proj, f"{layer}attention.output.dense.bias": PATTERN * pattern,
        f"{layer}attention.output.LayerNorm.weight": np.ones(d), f"{layer}attention.output.LayerNorm.bias": zeros(d),
        f"{layer}intermediate.dense.weight": zeros((i, d)), f"{layer}intermediate.dense.bias": zeros(i),
        f"{layer}output.dense.weight": zeros((d, i)), f"{layer}output.dense.bias": zeros(d),
        f"{layer}output.LayerNorm.weight": np.ones(d), f"{layer}output.LayerNorm.bias": zeros(d),
        f"{prefix}pooler.dense.weight": pool, f"{prefix}pooler.dense.bias": zeros(d),
        "classifier.weight": head, "classifier.bias": state["classifier.bias"].astype(np.float64),
    }


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
    if target.extra_layers:
        out.update(mean_to_first_token(state, cfg, prefix))
        return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
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
                             "budget": 1.0, "max_length": config.get("max_length", cfg.max_position),
                             "added_layers": target.extra_layers, "not_carried": list(NOT_CARRIED)}}
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
                    n_parameters=int(sum(v.size for v in tensors.values())), added_layers=target.extra_layers)
