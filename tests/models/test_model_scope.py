"""The whole-model budget (docs/method.md §4): unit costs, the cost-prefix policy over heads and feed-forward
groups, nestedness of both unit kinds at every budget, the gates the reference model takes, and C(b)."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from headbudget.models.budget import BUDGET_GRID, GateParams, cost_prefix, head_order
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import TINY, GateConfig, ModelConfig
from headbudget.models.plan import BudgetPolicy, ExecutionPlan, Shape, attention_macs, ffn_macs, unit_costs

CFG = ModelConfig(**TINY, gate=GateConfig(scope="model", ffn_group=32))  # 2 layers, 4 heads + 8 groups each


def random_policy(cfg: ModelConfig, seed: int) -> BudgetPolicy:
    rng = np.random.default_rng(seed)
    shape = (cfg.n_layers, cfg.units_per_layer)
    return BudgetPolicy(cfg, head_order(GateParams(a=rng.normal(size=shape), beta=rng.uniform(0.05, 2, shape))))


def test_unit_costs_are_the_published_formulas() -> None:
    costs = unit_costs(CFG)  # (L, U)
    n, d, dh, g = 128, 64, 16, 32
    assert costs.shape == (2, 4 + 8)
    assert costs[0, 0] == 4 * d * dh * n + 2 * n * n * dh == attention_macs(Shape.of(CFG), 1, n)
    assert costs[1, 4] == 2 * d * g * n == ffn_macs(Shape.of(CFG), n, g)
    # Every unit together is the dense layers' work: the prunable MACs are everything but the classifier.
    assert costs.sum() == 2 * (attention_macs(Shape.of(CFG), 4, n) + ffn_macs(Shape.of(CFG), n))


def test_config_refuses_what_the_scope_cannot_mean() -> None:
    with pytest.raises(ValueError, match="scope"):
        GateConfig(scope="layers")
    with pytest.raises(ValueError, match="structural"):
        GateConfig(scope="model", structural=True)
    with pytest.raises(ValueError, match="does not divide"):
        replace(CFG, intermediate_size=250)
    assert replace(CFG, gate=GateConfig()).units_per_layer == 4  # attention scope: heads only


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_budget_is_the_longest_affordable_prefix_and_nested_in_both_kinds(seed: int) -> None:
    policy = random_policy(CFG, seed)
    costs = unit_costs(CFG).reshape(-1)
    total = costs.sum()
    previous: ExecutionPlan | None = None
    for b in BUDGET_GRID:
        mask = policy.mask(b).reshape(-1)
        k = int(mask.sum())
        kept = policy.order[:k]
        assert set(np.flatnonzero(mask)) == set(kept.tolist())  # a prefix of the fixed ranking
        spent = costs[kept].sum()
        assert spent <= b * total * (1 + 1e-12)  # never over the budget ...
        if k < costs.size:  # ... and the next unit in line would be
            assert spent + costs[policy.order[k]] > b * total
        assert policy.hard_cost(b) == pytest.approx(spent / total)
        plan = policy.plan(b)
        assert plan.ffn is not None and sum(plan.heads) + sum(plan.ffn) // 32 == k
        if previous is not None:  # a higher budget never loses a head or a neuron, layer by layer
            assert previous.ffn is not None
            assert all(x >= y for x, y in zip(plan.heads, previous.heads, strict=True))
            assert all(x >= y for x, y in zip(plan.ffn, previous.ffn, strict=True))
        previous = plan
    assert previous is not None and previous.heads == (4, 4) and previous.ffn == (256, 256)  # b = 1: dense


def test_layer_orders_put_each_budgets_units_first() -> None:
    policy = random_policy(CFG, 4)
    neurons = policy.neuron_perms
    assert neurons.shape == (2, 256) and all(sorted(row) == list(range(256)) for row in neurons.tolist())
    for b in BUDGET_GRID:
        mask, plan = policy.mask(b), policy.plan(b)
        assert plan.ffn is not None
        for layer in range(2):
            groups = mask[layer, 4:]
            # The kept neurons are exactly the first ffn[l] of the layer's neuron order.
            kept = set(np.flatnonzero(np.repeat(groups, 32)).tolist())
            assert kept == set(neurons[layer, : plan.ffn[layer]].tolist())


def test_cost_prefix_keeps_one_unit_and_everything_at_one() -> None:
    order = np.arange(4)
    costs = np.array([5.0, 1.0, 1.0, 1.0])
    assert cost_prefix(order, 0.0, costs) == 1  # at least one unit, even if it alone is over the budget
    assert cost_prefix(order, 1.0, costs) == 4
    assert cost_prefix(order, 0.75, costs) == 2  # 5 + 1 = 6 = 0.75 * 8: a boundary budget keeps its unit


def test_plan_cost_counts_the_neurons_it_runs() -> None:
    shape = Shape.of(CFG)
    plan = ExecutionPlan(heads=(2, 0), n_heads=4, ffn=(64, 0))
    cost = plan.cost(shape, 10)
    attention = attention_macs(shape, 2, 10)
    assert cost.total_macs == attention + 2 * 10 * 64 * 64 + 64 * 2
    assert cost.total_macs_dense == 2 * (attention_macs(shape, 4, 10) + 2 * 10 * 64 * 256) + 64 * 2
    assert (cost.neurons_active, cost.neurons_total) == (64, 512)
    assert cost.ratio == pytest.approx(cost.total_macs / cost.total_macs_dense)
    assert plan.key != ExecutionPlan(heads=(2, 0), n_heads=4, ffn=(32, 32)).key
    # Attention-scope plans keep their old key: the head counts.
    assert ExecutionPlan(heads=(2, 0), n_heads=4).key == (2, 0)


def test_a_zero_group_gate_is_the_model_without_those_neurons() -> None:
    torch.manual_seed(0)
    model = BudgetedClassifier(replace(CFG, dropout=0.0)).eval()
    ids, mask = torch.randint(5, 1000, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    gate = torch.ones(2, 12)
    gate[0, 4 + 3] = 0.0  # layer 0, neuron group 3
    with torch.no_grad():
        gated = model(ids, mask, gate)
        w1, b1 = model.encoder.layers[0].intermediate.weight, model.encoder.layers[0].intermediate.bias
        w2 = model.encoder.layers[0].ffn_out.weight
        w1[96:128] = 0.0  # group 3's neurons contribute nothing once their outgoing weights are zero
        b1[96:128] = 0.0
        w2[:, 96:128] = 0.0
        removed = model(ids, mask)
    assert torch.allclose(gated, removed, atol=1e-6)


def test_soft_cost_is_mac_weighted_over_all_units_and_plain_mean_for_attention() -> None:
    torch.manual_seed(1)
    model = BudgetedClassifier(CFG)
    with torch.no_grad():
        model.gates.logit.copy_(torch.randn(2, 12))
    g = model.soft_gates(torch.tensor([0.3, 0.8]))  # (2, L, U)
    w = torch.as_tensor(unit_costs(CFG) / unit_costs(CFG).sum(), dtype=g.dtype)
    assert torch.allclose(model.soft_cost(g), (g * w).sum(dim=(1, 2)))
    attention = BudgetedClassifier(replace(CFG, gate=GateConfig()))
    ga = attention.soft_gates(torch.tensor([0.5]))
    assert ga.shape == (1, 2, 4) and torch.equal(attention.soft_cost(ga), ga.mean(dim=(1, 2)))


def test_exits_reorder_the_keep_sequence_but_not_any_layers_own_order() -> None:
    """With exits the budget fills the layers below the first exit first; each layer's unit order (what the
    engine's weight layout follows) is the ranking's, exactly as without exits."""
    base = replace(ModelConfig(**TINY), n_layers=4, gate=GateConfig(scope="model", ffn_group=32))
    with_exits = replace(base, gate=replace(base.gate, exits=(2,)))
    plain, exits = random_policy(base, 3), random_policy(with_exits, 3)
    upl = base.units_per_layer
    first = exits.order[: 2 * upl]
    assert set((first // upl).tolist()) == {0, 1}  # every unit of layers 0-1 before any of layers 2-3
    np.testing.assert_array_equal(exits.perms, plain.perms)
    np.testing.assert_array_equal(exits.ffn_perms, plain.ffn_perms)
    # Without exits nothing changes: the same ranking, no plan stops early, plan keys as before.
    assert all(plain.plan(b).depth is None for b in BUDGET_GRID)
    assert plain.plan(0.5).key == (plain.plan(0.5).heads, plain.plan(0.5).ffn)
    assert {exits.plan(b).depth for b in BUDGET_GRID} == {2, None}


def test_exits_survive_the_config_round_trip_and_old_configs_load() -> None:
    cfg = replace(ModelConfig(**TINY), gate=GateConfig(scope="model", ffn_group=32, exits=(1,)))
    d = cfg.to_dict()
    assert ModelConfig.from_dict(json.loads(json.dumps(d))) == cfg  # as config.json stores it: a list
    old = cfg.to_dict()
    del old["gate"]["exits"]  # a checkpoint written before layer skipping
    assert ModelConfig.from_dict(old).gate.exits == ()
    with pytest.raises(ValueError, match="below n_layers"):
        replace(cfg, gate=replace(cfg.gate, exits=(TINY["n_layers"],)))
    with pytest.raises(ValueError, match="increasing"):
        GateConfig(scope="model", exits=(2, 1))


@pytest.mark.parametrize("seed", [0, 3])
def test_off_grid_budgets_keep_plans_nested_and_costs_in_order(seed: int) -> None:
    """Any budget a request can name, not only the grid's: a larger budget's plan holds every unit of a smaller
    one's, so its multiply-adds at any length are at least as many, and none spends more than it was given."""
    policy, shape = random_policy(CFG, seed), Shape.of(CFG)
    budgets = sorted({*np.random.default_rng(seed).uniform(0.05, 1.0, 60).round(4).tolist(), 0.37, 0.62, 0.88, 1.0})
    plans = [policy.plan(b) for b in budgets]
    for b, small, large in zip(budgets[1:], plans[:-1], plans[1:], strict=True):
        assert small.ffn is not None and large.ffn is not None
        assert all(x <= y for x, y in zip(small.heads, large.heads, strict=True)), b
        assert all(x <= y for x, y in zip(small.ffn, large.ffn, strict=True)), b
        for n in (8, 41, 128):
            assert small.cost(shape, n).total_macs <= large.cost(shape, n).total_macs
        assert policy.hard_cost(b) <= b + 1e-12
