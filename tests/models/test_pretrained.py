"""Fine-tuned Hugging Face classifiers of each supported family convert exactly (torch and the ONNX engine)."""

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
from headbudget.models.pretrained import PretrainedError, from_pretrained, minilm_path
from headbudget.models.tokenizer import TextEncoder, copy_tokenizer

FAMILIES = ("bert", "roberta", "xlm-roberta", "distilbert")
HF_LABELS = ("World", "Sports", "Business")  # the folder's label order
OURS = ("sports", "business", "world")  # the data's: same labels, other order and case
TEXTS = ["A short one.", "The striker scored twice in the final minutes of the match.", "Stocks fell"]


def hf_classifier(family: str, folder: Path, labels: tuple[str, ...] = HF_LABELS, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised *ForSequenceClassification of ``family``, saved as a Hugging Face folder."""
    import transformers as T

    torch.manual_seed(seed)
    id2label = dict(enumerate(labels))
    common = dict(vocab_size=30522, max_position_embeddings=64, id2label=id2label,
                  label2id={v: k for k, v in id2label.items()})
    if family == "distilbert":
        config = T.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=64, **common)
        model = T.DistilBertForSequenceClassification(config)
    else:
        bert_like = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, **common)
        kinds = {"bert": (T.BertConfig, T.BertForSequenceClassification),
                 "roberta": (T.RobertaConfig, T.RobertaForSequenceClassification),
                 "xlm-roberta": (T.XLMRobertaConfig, T.XLMRobertaForSequenceClassification)}
        config_cls, model_cls = kinds[family]
        config = config_cls(**bert_like, **({"type_vocab_size": 1} if family != "bert" else {}))
        model = model_cls(config)
    with torch.no_grad():  # larger than the 0.02 init, so that a wrong mapping shows in the logits
        for p in model.parameters():
            p.add_(torch.randn(p.shape) * 0.1)
    model.eval()
    model.save_pretrained(str(folder))
    copy_tokenizer(minilm_path(), folder)  # any WordPiece vocabulary of the right size serves these tests
    return model


def _batch(folder: Path, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    enc = TextEncoder(folder, 48).encode(TEXTS)
    ids, mask = enc.padded(pad_id)
    return ids, mask


@pytest.mark.parametrize("family", FAMILIES)
def test_converted_classifier_gives_the_hugging_face_logits(family: str, tmp_path: Path) -> None:
    hf = hf_classifier(family, tmp_path / "hf")
    base = from_pretrained(tmp_path / "hf", OURS, GateConfig())
    assert base.head_loaded and base.family == family
    model = base.model.eval()
    ids, mask = _batch(tmp_path / "hf", hf.config.pad_token_id or 0)
    with torch.no_grad():
        ref = hf(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask)).logits.numpy()
        got = model(torch.from_numpy(ids), torch.from_numpy(mask), model.hard_gates(1.0)).numpy()
    rows = [HF_LABELS.index(x.title()) for x in OURS]  # our label order, in their columns
    np.testing.assert_allclose(got, ref[:, rows], atol=1e-4, rtol=0)
    assert np.abs(ref).max() > 0.05  # the comparison is not between two near-zero outputs

    # The same checkpoint through the ONNX Runtime engine (its own tokenizer, padding and graph).
    save_checkpoint(model, tmp_path / "ckpt", {"name": family, "model_type": "budgeted"})
    copy_tokenizer(tmp_path / "hf", tmp_path / "ckpt")
    engine = load_engine(tmp_path / "ckpt", EngineOptions(cache_dir=tmp_path / "cache", max_length=48))
    try:
        served = np.array([p.logits for p in engine.predict(TEXTS, 1.0).predictions])
        assert [p.label for p in engine.predict(TEXTS, 1.0).predictions] == [OURS[i] for i in ref[:, rows].argmax(1)]
    finally:
        engine.close()
    np.testing.assert_allclose(served, ref[:, rows], atol=1e-4, rtol=0)


def test_other_labels_keep_the_encoder_and_pooler_but_not_the_classifier(tmp_path: Path) -> None:
    hf_classifier("bert", tmp_path / "hf", labels=("negative", "positive"))
    base = from_pretrained(tmp_path / "hf", OURS, GateConfig())
    assert not base.head_loaded and "classifier is new" in base.note
    assert base.model.cfg.pooling == "cls" and base.model.cfg.pooler == "tanh" and base.model.cfg.n_labels == 3


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ({"hidden_act": "relu"}, "activation 'relu' is not supported"),
    ({"position_embedding_type": "relative_key"}, "position_embedding_type 'relative_key' is not supported"),
])
def test_unsupported_bases_fail_with_one_line(tmp_path: Path, change: dict[str, str], message: str) -> None:
    hf_classifier("bert", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(PretrainedError, match=message) as e:
        from_pretrained(tmp_path / "hf", OURS, GateConfig())
    assert "\n" not in str(e.value)


def test_pickle_weights_are_refused(tmp_path: Path) -> None:
    hf_classifier("bert", tmp_path / "hf")
    (tmp_path / "hf" / "model.safetensors").rename(tmp_path / "hf" / "pytorch_model.bin")
    with pytest.raises(PretrainedError, match="only safetensors"):
        from_pretrained(tmp_path / "hf", OURS, GateConfig())
