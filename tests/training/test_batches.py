"""Mini-batches: evaluation batches bounded by rows and padded tokens; evaluation's answers do not depend on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from headbudget.models.config import GateConfig
from headbudget.models.pretrained import random_init
from headbudget.training import evaluation
from headbudget.training.batches import TokenizedSplit, batches, order_for_eval

CPU = torch.device("cpu")


def split(lengths: list[int]) -> TokenizedSplit:
    """Texts of these lengths; each label is the text's index, so that a batch names its texts."""
    rng = np.random.default_rng(0)
    ids = [[101, *rng.integers(1000, 2000, n - 2).tolist(), 102] for n in lengths]
    return TokenizedSplit(ids, np.arange(len(lengths), dtype=np.int64), 0)


def test_evaluation_batches_keep_within_their_rows_and_padded_tokens() -> None:
    lengths = np.random.default_rng(1).integers(3, 120, 500).tolist()
    data = split(lengths)
    seen = []
    for ids, mask, labels in batches(data, 16, CPU, max_tokens=600):
        rows, longest = ids.shape
        assert rows <= 16 and (rows == 1 or rows * longest <= 600)
        assert longest == max(lengths[i] for i in labels.tolist())  # padded to its own longest text only
        assert mask.sum().item() == sum(lengths[i] for i in labels.tolist())
        seen.extend(labels.tolist())
    assert seen == order_for_eval(data).tolist()  # every text once, in length order


def test_a_text_longer_than_the_bound_comes_alone_and_rows_bound_without_it() -> None:
    data = split([5, 6, 400, 7])
    shapes = [tuple(ids.shape) for ids, _, _ in batches(data, 128, CPU, max_tokens=100)]
    assert shapes == [(3, 7), (1, 400)]
    assert [tuple(ids.shape) for ids, _, _ in batches(data, 2, CPU)] == [(2, 6), (2, 400)]


@pytest.mark.parametrize("mode,budget", [("dense", 1.0), ("hard", 0.4), ("soft", 0.4)])
def test_evaluation_answers_alike_whatever_its_batches_hold(monkeypatch: pytest.MonkeyPatch, mode: str,
                                                            budget: float) -> None:
    model = random_init(("a", "b", "c"), GateConfig(scope="model", ffn_group=32), seed=3)
    data = split(np.random.default_rng(2).integers(3, 60, 90).tolist())
    wide = evaluation.predict_logits(model, data, mode, budget)  # type: ignore[arg-type]
    monkeypatch.setattr(evaluation, "EVAL_ACTIVATIONS", 50 * model.cfg.intermediate_size)  # 50 tokens a batch
    narrow = evaluation.predict_logits(model, data, mode, budget)  # type: ignore[arg-type]
    assert evaluation.eval_tokens(model) == 50
    np.testing.assert_allclose(narrow, wide, rtol=0, atol=1e-5)
    assert narrow.shape == (90, 3)
