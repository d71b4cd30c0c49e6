"""`export_hf`: the dense model as a Hugging Face folder that transformers loads and that answers as we do."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.checkpoint import save_checkpoint
from headbudget.models.config import GateConfig
from headbudget.models.hf.export import export_hf
from headbudget.models.hf.families import PretrainedError
from headbudget.models.pretrained import from_pretrained, minilm_path, random_init
from headbudget.models.tokenizer import copy_tokenizer
from tests.models.test_pretrained import OURS, hf_classifier

TEXTS = ["A short one.", "The striker scored twice in the final minutes of the match.", "Stocks fell"]


def _engine_logits(checkpoint: Path, cache: Path) -> np.ndarray:
    engine = load_engine(checkpoint, EngineOptions(cache_dir=cache))
    try:
        return np.array([p.logits for p in engine.predict(TEXTS, 1.0).predictions])
    finally:
        engine.close()


def _hf_logits(folder: Path, remote_code: bool) -> tuple[np.ndarray, torch.nn.Module]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(str(folder), trust_remote_code=remote_code).eval()
    tokens = AutoTokenizer.from_pretrained(str(folder))(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"]).logits.numpy()
    return logits, model


def _converted(family: str, tmp_path: Path) -> Path:
    """A checkpoint converted from a fine-tuned classifier of ``family`` (first-token head with a pooler)."""
    hf_classifier(family, tmp_path / "hf")
    base = from_pretrained(tmp_path / "hf", OURS, GateConfig())
    save_checkpoint(base.model.eval(), tmp_path / "ckpt", {"name": family, "model_type": "budgeted"})
    copy_tokenizer(tmp_path / "hf", tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_mean_pooled_checkpoint_is_a_standard_bert_folder(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Our MiniLM checkpoints' head (mean pooling, linear classifier) as BertForSequenceClassification with one layer
    more: transformers loads it with no custom code (none allowed) and answers as the engine does at b = 1, in a
    padded batch of three lengths."""
    record = export_hf(tiny_checkpoint, tmp_path / "hf")
    assert not record.remote_code and record.architecture == "BertForSequenceClassification"
    assert not (tmp_path / "hf" / "modeling_headbudget.py").exists()
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "bert" and "auto_map" not in config
    assert config["headbudget"]["added_layers"] == 1 and config["headbudget"]["not_carried"] == ["budgets", "exits"]
    got, model = _hf_logits(tmp_path / "hf", remote_code=False)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.id2label == {0: "negative", 1: "positive"}
    np.testing.assert_allclose(got, _engine_logits(tiny_checkpoint, tmp_path / "cache"), atol=1e-4, rtol=0)


def test_mean_pooled_head_with_a_pooler_layer_needs_remote_code(tmp_path: Path) -> None:
    """A pooler layer after the mean is what the standard mapping cannot carry: such a folder ships its class."""
    model = random_init(("negative", "positive"), GateConfig(), seed=2, pooler="tanh").eval()
    save_checkpoint(model, tmp_path / "ckpt", {"name": "pooled", "model_type": "budgeted"})
    copy_tokenizer(minilm_path(), tmp_path / "ckpt")
    record = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert record.remote_code and (tmp_path / "hf" / "modeling_headbudget.py").is_file()
    got, model = _hf_logits(tmp_path / "hf", remote_code=True)
    assert type(model).__name__ == "HeadbudgetForSequenceClassification"
    np.testing.assert_allclose(got, _engine_logits(tmp_path / "ckpt", tmp_path / "cache"), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family, cls", [("bert", "BertForSequenceClassification"),
                                         ("roberta", "BertForSequenceClassification"),
                                         ("distilbert", "DistilBertForSequenceClassification")])
def test_converted_classifiers_export_to_standard_classes(family: str, cls: str, tmp_path: Path) -> None:
    checkpoint = _converted(family, tmp_path)
    record = export_hf(checkpoint, tmp_path / "out")
    assert not record.remote_code and record.architecture == cls
    got, model = _hf_logits(tmp_path / "out", remote_code=False)  # no custom code needed, none allowed
    assert type(model).__name__ == cls and model.config.id2label == dict(enumerate(OURS))
    np.testing.assert_allclose(got, _engine_logits(checkpoint, tmp_path / "cache"), atol=1e-4, rtol=0)


def test_refusals_are_one_line(tiny_checkpoint: Path, budgetformer_smoke: Path, tmp_path: Path) -> None:
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("taken")
    with pytest.raises(PretrainedError, match="not an empty folder"):
        export_hf(tiny_checkpoint, tmp_path / "full")
    with pytest.raises(PretrainedError, match="only budgeted checkpoints"):
        export_hf(budgetformer_smoke, tmp_path / "bf")
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["model"]["model_type"] == "budgeted"
