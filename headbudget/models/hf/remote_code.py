"""The Hugging Face model class for checkpoints no standard class computes (mean pooling, or no pooler).

``headbudget export --format hf`` copies this file beside the weights as ``modeling_headbudget.py`` and names it
in config.json's ``auto_map``, so that ``AutoModelForSequenceClassification.from_pretrained(folder,
trust_remote_code=True)`` loads the dense model with no headbudget code installed. It depends on transformers
and torch only; headbudget itself never imports it.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import BertConfig, BertModel, BertPreTrainedModel
from transformers.modeling_outputs import SequenceClassifierOutput


class HeadbudgetConfig(BertConfig):
    """A BERT config plus how the classifier reads the encoder: ``pooling`` and ``pooler``."""

    model_type = "headbudget"

    def __init__(self, pooling: str = "mean", pooler: str = "none", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pooling = pooling  # "mean" over real tokens, or "cls" (the first token)
        self.pooler = pooler  # "none", or a dense layer with "tanh" / "relu" before the classifier


class HeadbudgetForSequenceClassification(BertPreTrainedModel):
    """BERT encoder, mean (or first-token) pooling, optional dense pooler, linear classifier."""

    config_class = HeadbudgetConfig

    def __init__(self, config: HeadbudgetConfig) -> None:
        super().__init__(config)
        self.num_labels = config.num_labels
        self.bert = BertModel(config, add_pooling_layer=False)
        self.pooler = torch.nn.Linear(config.hidden_size, config.hidden_size) if config.pooler != "none" else None
        self.dropout = torch.nn.Dropout(config.hidden_dropout_prob)
        self.classifier = torch.nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
                **kwargs: Any) -> SequenceClassifierOutput:
        """input_ids, attention_mask (B, N) -> logits (B, C); a loss when labels (B,) are given."""
        h = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                      **kwargs).last_hidden_state  # (B, N, D)
        if self.config.pooling == "cls":
            pooled = h[:, 0]
        else:
            mask = torch.ones(h.shape[:2], device=h.device) if attention_mask is None else attention_mask
            m = mask.to(h.dtype)[:, :, None]  # (B, N, 1)
            pooled = (h * m).sum(1) / m.sum(1).clamp_min(1.0)
        if self.pooler is not None:
            pooled = self.pooler(pooled)
            pooled = torch.tanh(pooled) if self.config.pooler == "tanh" else torch.relu(pooled)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)
