"""Whole-model budgets (docs/method.md §4) on the engines: a plan drops heads and feed-forward neurons, the
ONNX engine gives the masked reference model's logits at every budget in both layouts, int8 mostly agrees, and
the standalone export holds only the kept neurons."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from headbudget.engine.base import pad
from headbudget.engine.factory import load_engine
from headbudget.engine.types import EngineOptions, ExecutionPlan
from headbudget.models.budget import BUDGET_GRID
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.plan import Shape
from tests.conftest import make_random_checkpoint, run_cli
from tests.engine.int8_noise import Int8Noise
from tests.engine.layouts import int8_layouts_atol
from tests.engine.test_export import bare_logits, engine_logits
from tests.engine.test_parity import TEXTS

LAYOUTS = [
    pytest.param(EngineOptions(), id="ort-dynamic"),
    pytest.param(EngineOptions(prepack=False), id="ort-whole"),
    pytest.param(EngineOptions(backend="torch"), id="torch"),
]


@pytest.fixture(scope="module")
def reference(tiny_model_scope_checkpoint: Path) -> BudgetedClassifier:
    model, _ = load_checkpoint(tiny_model_scope_checkpoint)
    return model


@pytest.fixture(scope="module")
def minilm_model_scope_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """MiniLM's shape with a whole-model budget: 12 heads and 24 groups of 64 neurons per layer."""
    return make_random_checkpoint(tmp_path_factory.mktemp("ckpt") / "minilm-model", seed=3, scope="model",
                                  ffn_group=64, hidden_size=384, n_layers=6, n_heads=12, intermediate_size=1536,
                                  max_position=512)


def _inputs(engine: object) -> tuple[np.ndarray, np.ndarray]:
    return pad(engine.encoder.encode(TEXTS).ids, 0)  # type: ignore[attr-defined]


def _logits(model: BudgetedClassifier, ids: np.ndarray, mask: np.ndarray, budget: float) -> np.ndarray:
    with torch.no_grad():
        out = model(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), model.hard_gates(budget))
    return out.numpy()  # type: ignore[no-any-return]


def test_plans_are_nested_over_heads_and_neurons(tiny_model_scope_checkpoint: Path, reference: BudgetedClassifier,
                                                 tmp_path: Path) -> None:
    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(cache_dir=tmp_path))
    cfg, policy = reference.cfg, reference.gates.policy()
    plans = [engine.plan(b) for b in BUDGET_GRID]
    assert plans == [policy.plan(b) for b in BUDGET_GRID]  # the engine runs the model's plans
    for b, plan in zip(BUDGET_GRID, plans, strict=True):
        assert plan.ffn is not None
        mask = policy.mask(b)  # (L, U): the plan's counts are the mask's, heads and groups
        assert plan.heads == tuple(mask[:, : cfg.n_heads].sum(1)) and plan.ffn == tuple(
            mask[:, cfg.n_heads:].sum(1) * cfg.gate.ffn_group)
    for small, big in zip(plans[:-1], plans[1:], strict=True):  # kept sets never shrink as b grows, both kinds
        assert small.ffn is not None and big.ffn is not None
        assert all(a <= b for a, b in zip(small.heads, big.heads, strict=True))
        assert all(a <= b for a, b in zip(small.ffn, big.ffn, strict=True))
    assert plans[-1] == ExecutionPlan(heads=(cfg.n_heads,) * cfg.n_layers, n_heads=cfg.n_heads,
                                      ffn=(cfg.intermediate_size,) * cfg.n_layers)
    # The grid exercises what the executors special-case: layers with no head, no neuron, neither (b = 0.1 on this
    # checkpoint), and part of a layer's neurons.
    pairs = [(k, w) for p in plans for k, w in zip(p.heads, p.ffn or (), strict=True)]
    assert any(k == 0 < w for k, w in pairs) and any(w == 0 < k for k, w in pairs) and (0, 0) in pairs
    assert any(0 < w < cfg.intermediate_size for _, w in pairs)


@pytest.mark.parametrize("options", LAYOUTS)
def test_fp32_matches_masked_reference_at_every_budget(tiny_model_scope_checkpoint: Path,
                                                       reference: BudgetedClassifier, options: EngineOptions,
                                                       tmp_path: Path) -> None:
    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(**{**options.__dict__, "cache_dir": tmp_path}))
    ids, mask = _inputs(engine)
    assert len(set(mask.sum(1))) == len(TEXTS)  # a padded batch of different lengths
    for b in BUDGET_GRID:
        result = engine.predict(TEXTS, b)
        got = np.array([p.logits for p in result.predictions])
        np.testing.assert_allclose(got, _logits(reference, ids, mask, b), atol=1e-4, rtol=0, err_msg=f"budget {b}")
        plan = engine.plan(b)
        assert result.heads_active == plan.heads_active
        for p in result.predictions:  # each answer's cost counts the plan's heads and neurons at its length
            assert p.cost == plan.cost(Shape.of(reference.cfg), p.n_tokens)
            assert p.cost.neurons_active == sum(plan.ffn or ())
    if options.backend == "onnxruntime" and options.prepack:
        # The all-budget sessions served every budget (the graph with branches, and the one without for small
        # plans): with packed feed-forward levels no budget gets a session of its own.
        assert set(engine._sessions) == {"dynamic", "fed"}  # type: ignore[attr-defined]  # noqa: SLF001


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_prepacked_budgets_answer_exactly_as_the_all_budget_session(tiny_model_scope_checkpoint: Path,
                                                                    precision: str, tmp_path: Path) -> None:
    # Asking for prepacked budgets changes nothing on a checkpoint with feed-forward budgets: its all-budget
    # session has packed levels instead (docs/results.md, 'Every budget costs what it says').
    hot = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision=precision, cache_dir=tmp_path,  # type: ignore[arg-type]
                                                                 prepacked_budgets=(0.25, 0.5, 0.75, 1.0)))
    cold = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision=precision, cache_dir=tmp_path,  # type: ignore[arg-type]
                                                                  prepacked_budgets=()))
    ids, mask = _inputs(hot)
    for b in (0.25, 0.5, 0.75, 1.0, 0.3):
        atol = 1e-5 if precision == "fp32" else int8_layouts_atol(cold, b)
        np.testing.assert_allclose(hot.predict_ids(ids, mask, b), cold.predict_ids(ids, mask, b), atol=atol, rtol=0)
    # The all-budget sessions pack feed-forward levels instead of sessions per budget.
    assert "dynamic" in cold._sessions and set(cold._sessions) == set(hot._sessions) <= {"dynamic", "fed"}  # type: ignore[attr-defined]  # noqa: SLF001


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_small_plans_run_one_graph_without_branches(tiny_model_scope_checkpoint: Path, reference: BudgetedClassifier,
                                                    precision: str, tmp_path: Path) -> None:
    """Plans within ``PrecisionSpec.fed_up_to`` of the weights and with no full block run the graph with no If
    node, every weight fed; it answers as each plan's own graph does (int8 too: no block is split), and the
    larger plans keep the graph with branches."""
    from headbudget.engine.onnx.bind import runs_fed, weight_share
    from headbudget.engine.precision import PRECISIONS

    engine = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision=precision, cache_dir=tmp_path))  # type: ignore[arg-type]
    whole = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision=precision, prepack=False,  # type: ignore[arg-type]
                                                                   cache_dir=tmp_path))
    cfg, up_to = reference.cfg, PRECISIONS[precision].fed_up_to  # type: ignore[index]
    ids, mask = _inputs(engine)
    kinds = set()
    for b in (*BUDGET_GRID, 0.13, 0.37):
        plan = engine.plan(b)
        fed = runs_fed(cfg, plan, up_to)
        full = any(k == cfg.n_heads for k in plan.heads) or any(w == cfg.intermediate_size for w in plan.ffn or ())
        assert fed == (weight_share(cfg, plan) <= up_to and not full), f"budget {b}"
        kinds.add(fed)
        got = engine.predict_ids(ids, mask, b)  # type: ignore[attr-defined]
        sess, _ = engine._runner(plan)  # type: ignore[attr-defined]  # noqa: SLF001
        assert sess is engine._sessions["fed" if fed else "dynamic"], f"budget {b}"  # type: ignore[attr-defined]  # noqa: SLF001
        if fed:
            np.testing.assert_allclose(got, whole.predict_ids(ids, mask, b), atol=1e-5, rtol=0)  # type: ignore[attr-defined]
            np.testing.assert_allclose(got, _logits(reference, ids, mask, b), atol=1e-4 if precision == "fp32" else 0.25,
                                       rtol=0)
    assert kinds == {True, False}
    graph = onnx.load(str(next(tmp_path.rglob("fed.onnx"))), load_external_data=False)
    assert graph.graph.node and not any(n.op_type == "If" for n in graph.graph.node)
    # W1's fed neurons as (D, w) columns where the precision says so (one copy per layer and neuron range,
    # whatever the plans), else the store's (w, D) rows
    from headbudget.engine.weights.store import input_names

    columns = PRECISIONS[precision].w1_fed_by_columns  # type: ignore[index]
    for name in ("fed.onnx", "dynamic.onnx"):  # what either graph feeds per call
        inputs = onnx.load(str(next(tmp_path.rglob(name))), load_external_data=False).graph.input
        shapes = {i.name: [d.dim_value or None for d in i.type.tensor_type.shape.dim] for i in inputs}
        assert shapes[input_names(0).w1] == ([cfg.hidden_size, None] if columns else [None, cfg.hidden_size]), name
    copies = engine._slices.w1_columns  # type: ignore[attr-defined]  # noqa: SLF001
    assert bool(copies) == columns
    for (layer, lo, w), a in copies.items():
        assert a.shape == (cfg.hidden_size, w - lo) and a.flags.c_contiguous
        np.testing.assert_array_equal(a, engine.store.layers[layer].w1[lo:w].T)  # type: ignore[attr-defined]


def test_int8_runs_and_mostly_agrees(tiny_model_scope_checkpoint: Path, reference: BudgetedClassifier,
                                     tmp_path: Path) -> None:
    """As the attention scope's int8 test: quantization noise, not a different model; both layouts alike."""
    dynamic = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path))
    whole = load_engine(tiny_model_scope_checkpoint, EngineOptions(precision="int8", prepack=False,
                                                                   cache_dir=tmp_path))
    ids, mask = _inputs(dynamic)
    noise, agree, total = Int8Noise(reference), 0, 0
    for b in BUDGET_GRID:
        got = dynamic.predict_ids(ids, mask, b)  # type: ignore[attr-defined]
        ref = noise.check(got, lambda m, b=b: _logits(m, ids, mask, b), f"budget {b}")
        agree += int((got.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
        # The same int8 weights and the same per-call activation quantization: the layouts agree closely.
        np.testing.assert_allclose(whole.predict_ids(ids, mask, b), got, atol=int8_layouts_atol(dynamic, b), rtol=0)  # type: ignore[attr-defined]
    assert agree >= 0.75 * total


def test_minilm_shaped(minilm_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    """MiniLM's shape (groups of 64 neurons): fp32 at 1e-4 of the reference, int8 as the attention scope's test."""
    model, _ = load_checkpoint(minilm_model_scope_checkpoint)
    fp32 = load_engine(minilm_model_scope_checkpoint, EngineOptions(cache_dir=tmp_path))
    int8 = load_engine(minilm_model_scope_checkpoint, EngineOptions(precision="int8", cache_dir=tmp_path))
    ids, mask = _inputs(fp32)
    noise, agree, total = Int8Noise(model), 0, 0
    for b in (1.0, 0.5, 0.25):
        plan = fp32.plan(b)
        assert plan.ffn is not None and (b == 1.0 or sum(plan.ffn) < model.cfg.n_layers * model.cfg.intermediate_size)
        ref = _logits(model, ids, mask, b)
        np.testing.assert_allclose(fp32.predict_ids(ids, mask, b), ref, atol=1e-4, rtol=0)  # type: ignore[attr-defined]
        got = int8.predict_ids(ids, mask, b)  # type: ignore[attr-defined]
        noise.check(got, lambda m, b=b: _logits(m, ids, mask, b), f"budget {b}")
        agree += int((got.argmax(1) == ref.argmax(1)).sum())
        total += len(ids)
    assert agree >= 0.75 * total


def _ffn_weights(folder: Path, n_layers: int) -> list[dict[str, tuple[int, ...]]]:
    """Per layer, the shapes of the exported file's W1 and W2 initializers (any slice suffix)."""
    inits = {t.name: tuple(t.dims) for t in onnx.load(str(folder / "model.onnx")).graph.initializer}
    return [{n.split(".")[1]: s for n, s in inits.items() if n.split(".")[:2] in ([f"l{layer}", "w1"],
                                                                                    [f"l{layer}", "w2"])}
            for layer in range(n_layers)]


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_export_drops_the_neurons_and_gives_the_engines_logits(tiny_model_scope_checkpoint: Path,
                                                                reference: BudgetedClassifier, tmp_path: Path,
                                                                precision: str) -> None:
    cfg = reference.cfg
    for b in (0.5, 1.0):
        proc = run_cli("export", "--model", str(tiny_model_scope_checkpoint), "--budget", str(b),
                       "--precision", precision, "--out", str(tmp_path / str(b)))
        assert proc.returncode == 0, proc.stderr
    plan = reference.gates.policy().plan(0.5)
    assert plan.ffn is not None
    meta = json.loads((tmp_path / "0.5" / "headbudget-export.json").read_text())
    assert tuple(meta["heads_per_layer"]) == plan.heads and tuple(meta["neurons_per_layer"]) == plan.ffn
    assert meta["neurons_kept"] == sum(plan.ffn) < meta["neurons_total"] == cfg.n_layers * cfg.intermediate_size
    assert meta["macs_fraction"] == round(plan.cost(Shape.of(cfg), meta["max_length"]).ratio, 4) < 1.0
    # The export is the plan's own graph: int8 the same products as the engine's but where a block runs a packed
    # level and the rest (tests/engine/layouts.py).
    atol = max(1e-4, int8_layouts_atol(load_engine(tiny_model_scope_checkpoint, EngineOptions(
        precision=precision, cache_dir=tmp_path / "cache")), 0.5)) if precision == "int8" else 1e-4  # type: ignore[arg-type]
    alone = precision == "int8"  # as in test_export: an int8 pass quantizes its activations as a whole
    np.testing.assert_allclose(bare_logits(tmp_path / "0.5", alone), engine_logits(
        tiny_model_scope_checkpoint, 0.5, precision, tmp_path / "cache", alone), atol=atol, rtol=0)
    half, dense = _ffn_weights(tmp_path / "0.5", cfg.n_layers), _ffn_weights(tmp_path / "1.0", cfg.n_layers)
    d = cfg.hidden_size
    for layer, w in enumerate(plan.ffn):  # W1 (rows, both precisions) and W2 of exactly the kept neurons, or none
        assert half[layer] == ({"w1": (w, d), "w2": (w, d)} if w else {}), f"layer {layer}"
    assert sum(np.prod(s) for layer in half for s in layer.values()) < sum(
        np.prod(s) for layer in dense for s in layer.values())


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_neuron_prefixes_are_views_of_the_one_store(tiny_model_scope_checkpoint: Path, reference: BudgetedClassifier,
                                                    precision: str) -> None:
    """Every budget's W1, W2 and b1 (and int8 scales) share the store's memory: no per-width copy in either
    precision, in the per-call feeds of the all-budget session and in a prepacked budget's initializers; except
    int8's fed W1, one column copy per layer and neuron range (``PrecisionSpec.w1_fed_by_columns``)."""
    from headbudget.engine.onnx import bind as B
    from headbudget.engine.precision import PRECISIONS
    from headbudget.engine.weights.pack import gate_params, load_state, pack
    from headbudget.engine.weights.store import input_names, layer_names
    from headbudget.models.budget import head_order
    from headbudget.models.plan import BudgetPolicy

    cfg = reference.cfg
    state = load_state(tiny_model_scope_checkpoint, cfg)
    policy = BudgetPolicy(cfg, head_order(gate_params(state)))
    store = pack(state, cfg, policy, precision)  # type: ignore[arg-type]
    cache = B.SliceCache()
    all_levels = B.Levels.of(cfg, precision)  # type: ignore[arg-type]
    levels, packed = all_levels.neurons, B.dynamic_arrays(store, cfg, cache, all_levels)
    partial = 0
    for b in BUDGET_GRID:
        plan = policy.plan(b)
        feeds, bound = B.dynamic_feeds(store, cfg, plan, cache, all_levels), B.bind(store, cfg, plan, cache)
        for layer, w in enumerate(plan.ffn_widths(cfg.intermediate_size)):
            if not 0 < w < cfg.intermediate_size:
                continue
            partial += 1
            lw, fed, own = store.layers[layer], input_names(layer), layer_names(layer, neurons=w)
            lo = B.floor_level(w, levels)  # the packed level the block starts from; its prefix is a view too
            if lo:
                assert np.shares_memory(packed[layer_names(layer, neurons=lo).w1], lw.w1)
            if lo == w:  # no neuron above the level: the block is fed one zero neuron
                continue
            pairs = [(lw.w1, fed.w1, own.w1), (lw.w2, fed.w2, own.w2), (lw.b1, fed.b1, own.b1)]
            if precision == "int8":
                pairs.append((lw.w1_s, fed.w1_s, own.w1_s))
            columns = PRECISIONS[precision].w1_fed_by_columns  # type: ignore[index]
            for array, fed_name, bound_name in pairs:
                if not (columns and fed_name == fed.w1):
                    assert np.shares_memory(feeds[fed_name], array), (b, layer, fed_name)
                assert np.shares_memory(bound[bound_name], array), (b, layer, bound_name)
            if columns:  # the fed neurons' W1 as columns: the copy kept for that layer and range
                assert feeds[fed.w1] is cache.w1_columns[layer, lo, w]
                np.testing.assert_array_equal(feeds[fed.w1], lw.w1[lo:w].T)
            else:
                assert feeds[fed.w1].shape == (w - lo, cfg.hidden_size)
    # The only copies are int8's Q/K/V column prefixes (one per layer and head count) and its fed W1 columns.
    assert partial > 0 and (precision == "int8" or not (cache.qkv or cache.w1_columns))


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_fp32_graphs_carry_the_residual_in_the_gemm(tiny_model_scope_checkpoint: Path, reference: BudgetedClassifier,
                                                    precision: str) -> None:
    """fp32 folds each block's output bias into the residual stream (weights.fold_residual_biases): its graphs
    add no residual, at any budget and in the all-budget graph; int8 keeps one Add per block. The only other Adds
    are the position embeddings and the padding mask (one per attention block run)."""
    from headbudget.engine.onnx import bind as B
    from headbudget.engine.onnx import graph as G
    from headbudget.engine.weights.pack import gate_params, load_state, pack
    from headbudget.models.budget import head_order
    from headbudget.models.plan import BudgetPolicy

    cfg = reference.cfg
    state = load_state(tiny_model_scope_checkpoint, cfg)
    policy = BudgetPolicy(cfg, head_order(gate_params(state)))
    store = pack(state, cfg, policy, precision)  # type: ignore[arg-type]

    def adds(model: onnx.ModelProto) -> int:
        def count(nodes: list[onnx.NodeProto]) -> int:  # with the If branches of the all-budget graph, nested too
            return sum((n.op_type == "Add") + sum(count(list(a.g.node)) for a in n.attribute if a.g.node) for n in nodes)

        return count(list(model.graph.node))

    for b in (0.1, 0.5, 1.0):
        plan = policy.plan(b)
        arrays = B.bind(store, cfg, plan, B.SliceCache())
        blocks_with_mask = sum(1 for k in plan.heads if k)
        residual = 0 if precision == "fp32" else 2 * cfg.n_layers
        assert adds(G.build_graph(cfg, plan, precision, arrays)) == 1 + blocks_with_mask + residual, b  # type: ignore[arg-type]
    levels = B.Levels.of(cfg, precision)  # type: ignore[arg-type]
    dynamic = G.build_dynamic(cfg, precision, B.dynamic_arrays(store, cfg, B.SliceCache(), levels), levels)  # type: ignore[arg-type]
    # Every branch of each attention and feed-forward block is counted (one padding mask per attention branch);
    # a packed level's branch adds its two parts (the level, the rest) into the residual.
    h, f = len(levels.heads), len(levels.neurons)
    residual = 0 if precision == "fp32" else (2 + 2 * h + 2 + 2 * f) * cfg.n_layers
    assert adds(dynamic) == 1 + (2 + h) * cfg.n_layers + residual
    assert (store.layers[0].ln2_bf is not None) == (precision == "fp32") and store.layers[-1].ln2_bf is None


def test_fed_w1_columns_stay_within_their_cap(tiny_model_scope_checkpoint: Path, tmp_path: Path) -> None:
    """Past the cap on int8's W1 column copies the engine drops the plans least recently run, with the copies no
    kept plan feeds; the plans it dropped are made again on their next call and answer as before."""
    options = EngineOptions(precision="int8", cache_dir=tmp_path)
    free, capped = load_engine(tiny_model_scope_checkpoint, options), load_engine(tiny_model_scope_checkpoint, options)
    ids, mask = _inputs(free)
    budgets = (0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.9)
    first = {b: free.predict_ids(ids, mask, b) for b in budgets}  # type: ignore[attr-defined]
    full = sum(a.nbytes for a in free._slices.w1_columns.values())  # type: ignore[attr-defined]  # noqa: SLF001
    assert full > 0
    capped._copies_cap = cap = full // 3  # type: ignore[attr-defined]  # noqa: SLF001
    copies, runs = capped._slices.w1_columns, capped._runs  # type: ignore[attr-defined]  # noqa: SLF001
    recent: list[object] = []  # plan keys, least recently run first
    for b in (*budgets, 0.9, 0.1, *budgets[::-1], 0.5, 0.5):
        np.testing.assert_array_equal(capped.predict_ids(ids, mask, b), first[b])  # type: ignore[attr-defined]
        key = capped.plan(b).key
        recent = [k for k in recent if k != key] + [key]
        kept = list(capped._runs)  # type: ignore[attr-defined]  # noqa: SLF001
        assert kept == recent[-len(kept):], b  # the plans kept are the ones run last, in that order
        fed = {id(a) for k in kept for a in capped._keep.get(k, [])}  # type: ignore[attr-defined]  # noqa: SLF001
        assert all(id(a) in fed for a in copies.values()), b  # no copy outlives every plan that feeds it
        assert sum(a.nbytes for a in copies.values()) <= cap or len(kept) == 1, b
    assert len(runs) < len(set(recent))  # some were dropped
