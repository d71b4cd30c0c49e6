"""Whole-model baselines: neuron-group importance against finite differences, rankings over heads
and feed-forward groups encoded in gates, the layer-drop and half-width conversions, and the latency placement."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from headbudget.experiments.baselines import (
    drop_top_layers,
    keep_neurons,
    ranking_gates,
    top_neurons,
    with_ranking,
)
from headbudget.experiments.importance import (
    Importance,
    ffn_importance,
    group_sums,
    head_gradients,
    head_importance,
    unit_gradients,
)
from headbudget.experiments.latency_placement import at_latency, placement
from headbudget.models.budget import cost_prefix
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import GateConfig
from headbudget.models.plan import BudgetPolicy, unit_costs
from tests.experiments.test_importance import _data, _padded


@pytest.fixture(scope="module")
def model_scope64(tiny_model_scope_checkpoint: Path) -> BudgetedClassifier:
    """The tiny model-scope checkpoint (4 heads, 8 groups of 32 neurons per layer) in float64."""
    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    return model.double().eval()


def test_group_gradients_match_finite_differences(model_scope64: BudgetedClassifier) -> None:
    """dL/dxi_g from the per-neuron hook summed over a group equals the derivative of the model's own group gate."""
    m = model_scope64
    c = m.cfg
    L, H, G, U = c.n_layers, c.n_heads, c.ffn_groups, c.units_per_layer
    ids, mask, y = _padded(_data(3))
    grad_h, grad_n = unit_gradients(m, ids, mask, y)
    assert grad_n.shape == (3, L, c.intermediate_size)
    torch.testing.assert_close(grad_h, head_gradients(m, ids, mask, y), rtol=1e-10, atol=1e-12)
    grad_g = group_sums(grad_n, c.gate.ffn_group)  # (B, L, G)
    assert grad_g.shape == (3, L, G) and grad_g.abs().max() > 1e-6
    eps = 1e-5
    with torch.no_grad():
        for b in range(3):
            for layer in range(L):
                for group in range(G):
                    gate = torch.ones(1, L, U, dtype=torch.float64)
                    losses = []
                    for sign in (1.0, -1.0):
                        gate[0, layer, H + group] = 1.0 + sign * eps
                        logits = m(ids[b : b + 1], mask[b : b + 1], gate)
                        losses.append(float(F.cross_entropy(logits, y[b : b + 1])))
                    fd = (losses[0] - losses[1]) / (2 * eps)
                    assert abs(fd - float(grad_g[b, layer, group])) < 1e-7 + 1e-5 * abs(fd)


def test_unit_importance_scores_and_ranking(model_scope64: BudgetedClassifier) -> None:
    m = model_scope64
    c = m.cfg
    data = _data(10, seed=1)
    heads, neurons, groups = ffn_importance(m, data, c.gate.ffn_group, batch_size=4)
    singles = []
    for i in range(len(data)):  # E|dL/dxi_g|: |.| of each example's own group gradient, then the mean
        ids, mask, y = _padded(data.__class__(data.ids[i : i + 1], data.labels[i : i + 1], 0))
        singles.append(group_sums(unit_gradients(m, ids, mask, y)[1], c.gate.ffn_group)[0].abs().numpy())
    np.testing.assert_allclose(groups, np.mean(singles, axis=0), rtol=1e-9, atol=1e-12)
    assert neurons.shape == (c.n_layers, c.intermediate_size) and np.all(neurons >= 0)
    imp = head_importance(m, data, None, batch_size=4, ffn_group=c.gate.ffn_group)
    np.testing.assert_allclose(imp.gradient_raw, heads, rtol=1e-12)
    units = imp.units
    assert units.shape == (c.n_layers, c.units_per_layer)
    np.testing.assert_allclose(np.linalg.norm(units, axis=1), 1.0)  # one l2 norm per layer, heads and groups
    np.testing.assert_allclose(units[:, c.n_heads:] / units[:, :c.n_heads].sum(1, keepdims=True),
                               groups / heads.sum(1, keepdims=True))  # the kinds keep their raw ratio
    r = imp.unit_ranking()
    assert sorted(r.tolist()) == list(range(units.size)) and np.all(np.diff(units.ravel()[r]) <= 0)
    back = Importance.from_dict(imp.to_dict())  # importance.json round trip
    assert back.unit_ranking().tolist() == r.tolist() and back.ffn_group == c.gate.ffn_group


def test_unit_ranking_encoded_in_gates(tiny_model_scope_checkpoint: Path) -> None:
    """ranking_gates over (L, U) reproduces a given ranking of heads and groups through BudgetPolicy."""
    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    c = model.cfg
    n = c.n_layers * c.units_per_layer
    ranking = np.random.default_rng(3).permutation(n)
    pruned = with_ranking(model, ranking)
    assert pruned.gates.logit.shape == (c.n_layers, c.units_per_layer)
    assert pruned.gates.order().tolist() == ranking.tolist()
    for name, p in model.state_dict().items():
        if not name.startswith("gates."):
            assert torch.equal(p, pruned.state_dict()[name])
    policy = BudgetPolicy(c, pruned.gates.order())
    costs = unit_costs(c)
    for b in (0.1, 0.25, 0.5, 0.75, 1.0):
        want = np.zeros(n, dtype=bool)
        want[ranking[: cost_prefix(ranking, b, costs)]] = True
        np.testing.assert_array_equal(policy.mask(b), want.reshape(c.n_layers, c.units_per_layer))
        np.testing.assert_array_equal(pruned.gates.hard_mask(b), policy.mask(b))
    with pytest.raises(ValueError, match="permutation"):
        ranking_gates(np.arange(n - 1), c.n_layers, c.units_per_layer)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask, _ = _padded(_data(5, seed=4))
    return ids, mask


def test_layer_drop_is_the_first_layers(tiny_model_scope_checkpoint: Path) -> None:
    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    small = drop_top_layers(model, 1)
    assert small.cfg.n_layers == 1 and small.cfg.gate.scope == "attention"
    ids, mask = _inputs()
    with torch.no_grad():
        got = small(ids, mask, small.hard_gates(1.0))
        # The original with its top layer skipped: embeddings, layer 0, pooling, head.
        x = model.encoder.embeddings(ids)
        bias = (1.0 - mask[:, None, None, :].float()) * torch.finfo(x.dtype).min
        h = model.encoder.layers[0](x, bias, None)
        m = mask.float()[:, :, None]
        want = model.head((h * m).sum(1) / m.sum(1))
    assert small.hard_gates(1.0).min() == 1.0  # every head of the small model runs at b = 1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        assert (got - model(ids, mask)).abs().max() > 1e-4  # the dropped layer mattered
    with pytest.raises(ValueError, match="n_keep"):
        drop_top_layers(model, 3)


def test_half_width_keeps_the_most_important_neurons(tiny_checkpoint: Path) -> None:
    model, _ = load_checkpoint(tiny_checkpoint)
    c = model.cfg
    scores = np.random.default_rng(5).random((c.n_layers, c.intermediate_size))
    keep = top_neurons(scores, c.intermediate_size // 2)
    assert keep.shape == (c.n_layers, c.intermediate_size // 2)
    for layer in range(c.n_layers):  # the kept scores are the top half
        assert scores[layer, keep[layer]].min() > np.delete(scores[layer], keep[layer]).max()
    small = keep_neurons(model, keep)
    assert small.cfg.intermediate_size == c.intermediate_size // 2
    # The original with the other neurons masked out through its own gates: a model-scope copy with groups of 1.
    masked = BudgetedClassifier(replace(c, gate=GateConfig(scope="model", ffn_group=1)))
    masked.load_state_dict({k: v for k, v in model.state_dict().items() if not k.startswith("gates.")}, strict=False)
    masked.eval()
    gate = torch.zeros(c.n_layers, c.n_heads + c.intermediate_size)
    gate[:, : c.n_heads] = 1.0
    for layer in range(c.n_layers):
        gate[layer, c.n_heads + torch.as_tensor(keep[layer])] = 1.0
    ids, mask = _inputs()
    with torch.no_grad():
        got = small(ids, mask, small.hard_gates(1.0))
        torch.testing.assert_close(got, masked(ids, mask, gate), rtol=0, atol=1e-5)
        assert (got - model(ids, mask)).abs().max() > 1e-4  # the dropped neurons mattered
    with pytest.raises(ValueError, match="distinct neuron indices"):
        keep_neurons(model, np.zeros((c.n_layers, 2), dtype=np.int64))


def test_accuracy_at_latency_is_interpolated_between_bracketing_budgets() -> None:
    curve = [(0.25, 1.0, 0.70), (1.0, 3.0, 0.90), (0.5, 2.0, 0.80)]  # (budget, latency ms, accuracy)
    hit = at_latency(curve, 1.5)
    assert hit is not None and hit["bracket_budgets"] == [0.25, 0.5] and hit["accuracy"] == pytest.approx(0.75)
    assert at_latency(curve, 3.0)["accuracy"] == pytest.approx(0.90)  # type: ignore[index]
    assert at_latency(curve, 0.5) is None and at_latency(curve, 3.5) is None  # no extrapolation
    results = {f"budgeted@{b:.2f}": {"method": "budgeted", "budget": b, "latency_ms": lat, "accuracy": acc}
               for b, lat, acc in curve}
    results["layerdrop@1.00"] = {"method": "layerdrop", "budget": 1.0, "latency_ms": 2.5, "accuracy": 0.86}
    results["attention-only@0.25"] = {"method": "attention-only", "budget": 0.25, "latency_ms": 0.5, "accuracy": 0.6}
    rows = {p["method"]: p for p in placement({"per_seed": {"7": {"results": results}}})}
    assert rows["layerdrop"]["difference_mean"] == pytest.approx(-0.01) and rows["layerdrop"]["met"] is False
    assert rows["attention-only"]["n_reached"] == 0 and rows["attention-only"]["met"] is None
