"""Layer skipping: a checkpoint with exits keeps its budgets nested over heads and neurons, a plan
whose units all lie below an exit stops there, costs only the layers it runs, and every engine gives the
reference's logits, read at the exit, at every budget."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from headbudget.engine.base import pad
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions
from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.plan import Shape, attention_macs, ffn_macs
from tests.conftest import make_random_checkpoint
from tests.engine.int8_noise import Int8Noise
from tests.engine.layouts import int8_layouts_atol
from tests.engine.test_parity import TEXTS

LAYOUTS = [
    pytest.param(EngineOptions(), id="ort-dynamic"),
    pytest.param(EngineOptions(prepack=False), id="ort-whole"),
    pytest.param(EngineOptions(backend="torch"), id="torch"),
]


@pytest.fixture(scope="module")
def exits_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Four layers with exits after layers 1 and 2: a budget stops after layer 1, after 2, or runs all four."""
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny-exits", seed=11, scope="model",
                                  ffn_group=32, exits=(1, 2), n_layers=4)


@pytest.fixture(scope="module")
def reference(exits_checkpoint: Path) -> BudgetedClassifier:
    return load_checkpoint(exits_checkpoint)[0]


def _reference_logits(model: BudgetedClassifier, ids: np.ndarray, mask: np.ndarray, budget: float) -> np.ndarray:
    """Written out apart from ``logits_and_states``: the masked layers up to the plan's depth, mean pooling, and
    the head of that depth."""
    plan = model.gates.policy().plan(budget)
    depth = plan.layers_run
    ids_t, mask_t = torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64))
    with torch.no_grad():
        states = model.encoder.layer_states(ids_t, mask_t, model.hard_gates(budget)[None].expand(len(ids), -1, -1))
        pooled = model.pool(states[depth - 1], mask_t)
        head = model.classifier if plan.depth is None else model.exits[model.cfg.gate.exits.index(depth)]
        return head(pooled).numpy()  # type: ignore[no-any-return]


def test_plans_are_nested_and_stop_below_their_exit(reference: BudgetedClassifier) -> None:
    cfg, policy = reference.cfg, reference.gates.policy()
    plans = [policy.plan(b) for b in BUDGET_GRID]
    depths = [p.layers_run for p in plans]
    assert depths == sorted(depths)  # a higher budget never stops earlier
    assert {1, 2, cfg.n_layers} <= set(depths)  # the grid reaches both exits and the top
    assert plans[-1].depth is None
    for small, big in zip(plans[:-1], plans[1:], strict=True):  # nested in heads and neurons
        assert small.ffn is not None and big.ffn is not None
        assert all(a <= b for a, b in zip(small.heads, big.heads, strict=True))
        assert all(a <= b for a, b in zip(small.ffn, big.ffn, strict=True))
    shape, n = Shape.of(cfg), 37
    for plan in plans:
        assert plan.ffn is not None
        if plan.depth is not None:  # every layer from the exit up keeps nothing, and a layer below it keeps units
            assert not any(plan.heads[plan.depth:]) and not any(plan.ffn[plan.depth:])
            # The layer just below keeps units, so no lower exit would do: the plan stops at the first that fits.
            assert plan.heads[plan.depth - 1] or plan.ffn[plan.depth - 1]
        # Cost counts the layers run, each at its own heads and neurons, plus one classifier head.
        macs = sum(attention_macs(shape, k, n) + ffn_macs(shape, n, w)
                   for k, w in zip(plan.heads[:plan.layers_run], plan.ffn[:plan.layers_run], strict=True))
        assert plan.cost(shape, n).total_macs == macs + cfg.hidden_size * cfg.n_labels
    # Layers below the first exit fill before any unit above it is kept: the cheapest plan that reaches layer 2
    # keeps every unit of layers 0 and 1.
    first_above = next(p for p in plans if p.layers_run > cfg.gate.exits[-1])
    assert first_above.ffn is not None
    assert first_above.heads[:2] == (cfg.n_heads,) * 2 and first_above.ffn[:2] == (cfg.intermediate_size,) * 2


def test_the_reference_answers_at_its_exit(exits_checkpoint: Path, reference: BudgetedClassifier) -> None:
    engine = load_engine(exits_checkpoint, EngineOptions(backend="torch"))
    ids, mask = pad(engine.encoder.encode(TEXTS).ids, 0)
    for b in BUDGET_GRID:
        depth = reference.hard_depth(b)
        with torch.no_grad():
            got = reference(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), reference.hard_gates(b),
                            depth).numpy()
        np.testing.assert_allclose(got, _reference_logits(reference, ids, mask, b), atol=1e-6, rtol=0)
    # Per-text depths (what the fused sandwich trains) give each text the answer of its own depth.
    low, high = 0.1, 1.0
    gates = torch.stack([reference.hard_gates(low), reference.hard_gates(high)]).repeat_interleave(len(ids), 0)
    depth = reference.depth_of([low, high]).repeat_interleave(len(ids))
    ids2, mask2 = np.concatenate([ids, ids]), np.concatenate([mask, mask])
    with torch.no_grad():
        both = reference(torch.from_numpy(ids2), torch.from_numpy(mask2.astype(np.int64)), gates, depth).numpy()
    want = np.concatenate([_reference_logits(reference, ids, mask, low), _reference_logits(reference, ids, mask, high)])
    np.testing.assert_allclose(both, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", LAYOUTS)
def test_engines_match_the_reference_at_every_budget(exits_checkpoint: Path, reference: BudgetedClassifier,
                                                     options: EngineOptions, tmp_path: Path) -> None:
    engine = load_engine(exits_checkpoint, EngineOptions(**{**options.__dict__, "cache_dir": tmp_path}))
    ids, mask = pad(engine.encoder.encode(TEXTS).ids, 0)
    for b in BUDGET_GRID:
        result = engine.predict(TEXTS, b)
        got = np.array([p.logits for p in result.predictions])
        np.testing.assert_allclose(got, _reference_logits(reference, ids, mask, b), atol=1e-4, rtol=0,
                                   err_msg=f"budget {b}")
        plan = engine.plan(b)
        for p in result.predictions:
            assert p.cost == plan.cost(Shape.of(reference.cfg), p.n_tokens)


def test_int8_agrees_across_layouts_and_with_the_reference(exits_checkpoint: Path, reference: BudgetedClassifier,
                                                           tmp_path: Path) -> None:
    dynamic = load_engine(exits_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path))
    whole = load_engine(exits_checkpoint, EngineOptions(precision="int8", prepack=False, cache_dir=tmp_path))
    ids, mask = pad(dynamic.encoder.encode(TEXTS).ids, 0)
    noise, agree, total = Int8Noise(reference), 0, 0
    for b in BUDGET_GRID:
        got = dynamic.predict_ids(ids, mask, b)  # type: ignore[attr-defined]
        ref = noise.check(got, lambda m, b=b: _reference_logits(m, ids, mask, b), f"budget {b}")
        np.testing.assert_allclose(whole.predict_ids(ids, mask, b), got, atol=int8_layouts_atol(dynamic, b), rtol=0)  # type: ignore[attr-defined]
        agree += int((got.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
    assert agree >= 0.75 * total


def test_a_plan_stopping_at_an_exit_adds_no_weight_copy(exits_checkpoint: Path, tmp_path: Path) -> None:
    """A non-prepacked exit plan runs its own unpacked session whose initializers are the store's arrays."""
    engine = load_engine(exits_checkpoint, EngineOptions(cache_dir=tmp_path, prepacked_budgets=()))
    plan = next(engine.plan(b) for b in BUDGET_GRID if engine.plan(b).depth is not None)
    sess, _ = engine._runner(plan)  # noqa: SLF001
    assert engine.n_sessions == 1  # type: ignore[attr-defined]
    store = engine.store.arrays()  # type: ignore[attr-defined]
    checked = 0
    for name, value in engine._values.items():  # noqa: SLF001
        if name in store and name.startswith(("l0.w1", "l0.w2", "exit")):
            assert np.shares_memory(value.numpy(), store[name]) or np.array_equal(value.numpy(), store[name])
            checked += 1
    assert checked > 0
    assert sess is not None


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_export_of_a_plan_that_stops_at_an_exit(exits_checkpoint: Path, reference: BudgetedClassifier,
                                                tmp_path: Path, precision: str) -> None:
    """`headbudget export` of such a budget holds only the layers it runs and the exit's head, and plain ONNX
    Runtime gives the engine's logits."""
    import onnx

    from tests.conftest import run_cli
    from tests.engine.test_export import bare_logits, engine_logits

    b = next(b for b in BUDGET_GRID if reference.gates.policy().plan(b).depth == 2)
    proc = run_cli("export", "--model", str(exits_checkpoint), "--budget", str(b), "--precision", precision,
                   "--out", str(tmp_path / "x"))
    assert proc.returncode == 0, proc.stderr
    names = {t.name for t in onnx.load(str(tmp_path / "x" / "model.onnx")).graph.initializer}
    assert "exit2_w" in names and "cls_w" not in names and "exit1_w" not in names
    assert not any(n.startswith(("l2.", "l3.")) for n in names)
    alone = precision == "int8"  # as in test_export: an int8 pass quantizes its activations as a whole
    np.testing.assert_allclose(bare_logits(tmp_path / "x", alone), engine_logits(
        exits_checkpoint, b, precision, tmp_path / "cache", alone), atol=1e-4, rtol=0)
