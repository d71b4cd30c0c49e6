"""Head importance against finite differences, the ablation score, rankings encoded in gates, the CLI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headbudget.experiments.baselines import ranking_gates, with_ranking
from headbudget.experiments.importance import (
    ablation_importance,
    gradient_importance,
    head_gradients,
    head_importance,
    normalise_per_layer,
)
from headbudget.models.budget import head_mask
from headbudget.models.checkpoint import load_checkpoint
from headbudget.training.batches import TokenizedSplit
from tests.conftest import run_cli


def _data(n: int, seed: int = 0, vocab: int = 2000) -> TokenizedSplit:
    rng = np.random.default_rng(seed)
    ids = [[101, *rng.integers(1000, vocab, size=int(rng.integers(3, 12))).tolist(), 102] for _ in range(n)]
    return TokenizedSplit(ids, rng.integers(0, 2, size=n).astype(np.int64), 0)


@pytest.fixture(scope="module")
def model64(tiny_checkpoint: Path):  # type: ignore[no-untyped-def]
    model, _ = load_checkpoint(tiny_checkpoint)
    return model.double().eval()


def _padded(data: TokenizedSplit) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n = max(len(x) for x in data.ids)
    ids = torch.tensor([x + [0] * (n - len(x)) for x in data.ids])
    mask = torch.tensor([[1] * len(x) + [0] * (n - len(x)) for x in data.ids])
    return ids, mask, torch.from_numpy(data.labels)


def test_head_gradients_match_finite_differences(model64) -> None:  # type: ignore[no-untyped-def]
    ids, mask, y = _padded(_data(3))
    grad = head_gradients(model64, ids, mask, y)  # (B, L, H)
    L, H = model64.cfg.n_layers, model64.cfg.n_heads
    assert grad.shape == (3, L, H) and grad.abs().max() > 1e-6
    eps = 1e-5
    with torch.no_grad():
        for b in range(3):  # each example's own loss, perturbing its own xi
            for layer in range(L):
                for head in range(H):
                    xi = torch.ones(1, L, H, dtype=torch.float64)
                    losses = []
                    for sign in (1.0, -1.0):
                        xi[0, layer, head] = 1.0 + sign * eps
                        logits = model64(ids[b : b + 1], mask[b : b + 1], xi)
                        losses.append(float(F.cross_entropy(logits, y[b : b + 1])))
                    fd = (losses[0] - losses[1]) / (2 * eps)
                    assert abs(fd - float(grad[b, layer, head])) < 1e-7 + 1e-5 * abs(fd)


def test_importance_is_mean_absolute_per_example_gradient(model64) -> None:  # type: ignore[no-untyped-def]
    data = _data(10, seed=1)
    batched = gradient_importance(model64, data, batch_size=4)
    singles = []
    for i in range(len(data)):
        ids, mask, y = _padded(TokenizedSplit(data.ids[i : i + 1], data.labels[i : i + 1], 0))
        singles.append(head_gradients(model64, ids, mask, y)[0].abs().numpy())
    np.testing.assert_allclose(batched, np.mean(singles, axis=0), rtol=1e-9, atol=1e-12)
    imp = head_importance(model64, data, None)
    np.testing.assert_allclose(np.linalg.norm(imp.gradient, axis=1), 1.0)  # l2 per layer
    np.testing.assert_allclose(imp.gradient, normalise_per_layer(batched))
    assert imp.ablation is None and imp.n_examples == 10
    r = imp.ranking()
    assert sorted(r.tolist()) == list(range(8)) and np.all(np.diff(imp.gradient.ravel()[r]) <= 0)


def test_ablation_is_loss_increase_of_masking_one_head(model64) -> None:  # type: ignore[no-untyped-def]
    data = _data(6, seed=2)
    scores, base = ablation_importance(model64, data)
    ids, mask, y = _padded(data)
    with torch.no_grad():
        gate = torch.ones(2, 4, dtype=torch.float64)
        gate[1, 2] = 0.0
        masked = float(F.cross_entropy(model64(ids, mask, gate), y))
        assert base == pytest.approx(float(F.cross_entropy(model64(ids, mask), y)), rel=1e-9)
    assert scores[1, 2] == pytest.approx(masked - base, rel=1e-9, abs=1e-12)


def test_ranking_encoded_in_gates(tiny_checkpoint: Path) -> None:
    model, _ = load_checkpoint(tiny_checkpoint)
    ranking = np.array([5, 1, 7, 0, 2, 3, 6, 4])
    pruned = with_ranking(model, ranking)
    assert pruned.gates.order().tolist() == ranking.tolist()
    for name, p in model.state_dict().items():  # weights untouched, only the gates change
        if not name.startswith("gates."):
            assert torch.equal(p, pruned.state_dict()[name])
    assert pruned.gates.hard_mask(0.25).ravel().nonzero()[0].tolist() == [1, 5]
    structural = with_ranking(model, ranking, structural=True)
    # per-layer floor: best of layer 1 (head 5) and of layer 0 (head 1) first, then global order
    assert structural.gates.hard_mask(0.25).sum(1).tolist() == [1, 1]
    np.testing.assert_array_equal(structural.gates.hard_mask(0.5), head_mask(ranking, 0.5, 2, 4, True))
    soft_cost = float(pruned.soft_gates(torch.tensor([0.5])).mean().detach())
    assert abs(soft_cost - 0.5) < 0.1  # crossing budgets spread over (0, 1): C(b) ~ b
    with pytest.raises(ValueError, match="permutation"):
        ranking_gates(np.array([0, 0, 1, 2, 3, 4, 5, 6]), 2, 4)


def _sentiment_folder(folder: Path) -> Path:
    """A small csv data set with the tiny checkpoint's labels (negative, positive)."""
    rng = np.random.default_rng(0)
    words = ["good", "bad", "fine", "awful", "great", "poor", "nice", "dull"]
    rows = ["text,label"] + [" ".join(rng.choice(words, 6)) + f",{'positive' if i % 2 else 'negative'}"
                             for i in range(120)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "train.csv").write_text("\n".join(rows) + "\n")
    (folder / "test.csv").write_text("\n".join(rows[:21]) + "\n")
    return folder


def test_importance_cli(tiny_checkpoint: Path, tmp_path: Path) -> None:
    data = _sentiment_folder(tmp_path / "data")
    proc = run_cli("importance", "--model", str(tiny_checkpoint), "--data", str(data), "--examples", "64",
                   "--ablation-examples", "32", "--device", "cpu", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "importance.json").read_text())
    assert doc["dataset"] == "data"
    assert np.asarray(doc["gradient"]).shape == (2, 4) and np.asarray(doc["ablation"]).shape == (2, 4)
    assert doc["n_examples"] == 64 and sorted(doc["ranking"]) == list(range(8))
    assert (tmp_path / "importance.png").stat().st_size > 5_000
    assert "most important heads: L" in proc.stdout


@pytest.mark.parametrize(("args", "message"), [
    (["--model", "{tmp}/missing", "--data", "synthetic"], "does not exist"),
    (["--model", "{ckpt}", "--data", "{tmp}/nodata"], "does not exist"),
    (["--model", "{ckpt}", "--data", "synthetic", "--examples", "0"], "positive integer"),
    (["--model", "{ckpt}", "--data", "synthetic"], "labels in the data that the model does not know"),
])
def test_importance_bad_input(args: list[str], message: str, tiny_checkpoint: Path, tmp_path: Path) -> None:
    proc = run_cli("importance", *[a.format(tmp=tmp_path, ckpt=tiny_checkpoint) for a in args],
                   "--out", str(tmp_path / "o"), timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
