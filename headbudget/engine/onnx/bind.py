"""The arrays the engine's ONNX graphs name, as views of one weight store: initializers and per-call inputs.

``bind`` gives a plan's own graph (``graph.build_graph``) its initializers, ``dynamic_arrays`` and
``dynamic_feeds`` the all-budget graph's (``graph.build_dynamic``) initializers and a plan's per-call
inputs. A plan keeps the first heads (neurons) of each layer's rank order, so its arrays are row prefixes of
the store's: numpy views, one copy of every weight for all budgets. The exception is int8 Q/K/V, stored
(D, H*3*dh): a head prefix is a column copy, made once per (layer, heads) in the engine's ``SliceCache``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import Precision
from headbudget.engine.weights.store import (
    CLASSIFIER,
    EMBEDDINGS,
    POOLER,
    W1_Z,
    Arrays,
    LayerWeights,
    WeightStore,
    exit_head,
    head_names,
    input_names,
    layer_names,
    level_input,
)
from headbudget.models.config import ModelConfig
from headbudget.models.plan import ExecutionPlan


@dataclass(frozen=True, eq=False)
class _Idle:
    """Per-call inputs for one zero unit: what a layer is fed when its prefix branch runs no slice of its own."""

    w_in: np.ndarray  # one zero head's Q/K/V, (3*dh, D) or by columns (D, 3*dh); or one zero W1 row, (1, D)
    bias: np.ndarray  # zeros: (3*dh,), or (1,)
    w_out: np.ndarray  # one zero head's W_O rows, (dh, D); or one zero W2 row, (1, D)
    scale: np.ndarray  # ones: quantized w_in's scales
    zero: np.ndarray  # int8 W1's zero point, (1,) (feed-forward only)


@dataclass
class SliceCache:
    """Arrays an engine makes once and shares between all its sessions."""

    # (layer, first head, end head) -> int8 Q/K/V columns of those heads (a prefix, or the rest above a level)
    qkv: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    # (layer, first neuron, end neuron) -> int8 W1 of those neurons as (D, w) columns, fed per call
    # (PrecisionSpec.w1_fed_by_columns). Bounded by the policy's plans: the widths they give each layer.
    w1_columns: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)
    idle_heads: _Idle | None = None
    idle_neurons: _Idle | None = None


@dataclass(frozen=True)
class Levels:
    """The packed prefix widths of the all-budget graph (``PrecisionSpec.ffn_levels``, ``attention_levels``) in
    units, ascending, each above 0 and below the block's full width."""

    heads: tuple[int, ...] = ()
    neurons: tuple[int, ...] = ()

    @classmethod
    def of(cls, cfg: ModelConfig, precision: Precision) -> Levels:
        spec = PRECISIONS[precision]

        def units(fractions: tuple[float, ...], total: int, step: int) -> tuple[int, ...]:
            return tuple(sorted({round(f * total / step) * step for f in fractions} - {0, total}))

        neurons = units(spec.ffn_levels, cfg.intermediate_size, cfg.gate.ffn_group) if cfg.ffn_groups else ()
        return cls(units(spec.attention_levels, cfg.n_heads, 1), neurons)


def floor_level(width: int, levels: tuple[int, ...]) -> int:
    """The largest packed width at most ``width`` (0: none), where a block of ``width`` units starts."""
    return max((lv for lv in levels if lv <= width), default=0)


def run_layers(cfg: ModelConfig, plan: ExecutionPlan) -> list[tuple[int, int]]:
    """(heads, neurons) of each layer the plan runs: every layer, or those below its exit."""
    pairs = zip(plan.heads, plan.ffn_widths(cfg.intermediate_size), strict=True)
    return list(pairs)[: plan.layers_run]


def weight_share(cfg: ModelConfig, plan: ExecutionPlan) -> float:
    """The share of all layers' block weights that ``plan`` multiplies by."""
    head, neuron = 4 * cfg.head_dim * cfg.hidden_size, 2 * cfg.hidden_size  # Q, K, V and W_O; W1 and W2
    used = sum(k * head + w * neuron for k, w in run_layers(cfg, plan))
    return used / (cfg.n_layers * (cfg.n_heads * head + cfg.intermediate_size * neuron))


def runs_fed(cfg: ModelConfig, plan: ExecutionPlan, up_to: float) -> bool:
    """Whether ``plan`` runs the all-budget graph without branches (``build_dynamic(fed=True)``): it multiplies by
    at most ``up_to`` of the weights and has no block at all its units, which the graph with branches runs
    packed. (An attention-scope plan's feed-forward blocks are initializers in both.)"""
    full = any(k == cfg.n_heads or (cfg.ffn_groups and w == cfg.intermediate_size) for k, w in run_layers(cfg, plan))
    return not full and weight_share(cfg, plan) <= up_to


def _put(out: Arrays, name: str, array: np.ndarray | None) -> None:
    """``out[name] = array`` where the store holds that array (int8 scales, folded biases)."""
    if array is not None:
        out[name] = array


def _shared(store: WeightStore, head: str) -> Arrays:
    """Initializers outside the layers: embeddings (int8 adds the word table's scales), the answering head
    (``CLASSIFIER`` or an exit's), a pooler's layer."""
    emb, e = store.embeddings, EMBEDDINGS
    beta = (e.emb_bf, emb.emb_bf) if PRECISIONS[store.precision].folds_residual_biases else (e.emb_b, emb.emb_b)
    out: Arrays = {e.word: emb.word, e.pos_tt: emb.pos_tt, e.emb_g: emb.emb_g}
    _put(out, *beta)
    for prefix in (head, POOLER):
        h = store.heads().get(prefix)
        if h is not None:
            out.update(zip(head_names(prefix), (h.w, h.b), strict=True))
    _put(out, e.word_s, emb.word_s)
    return out


def _norms(lw: LayerWeights, layer: int, folded: bool, last: bool) -> Arrays:
    """A layer's bias and norm arrays: folded stores carry the block biases in the norms, plain ones add them.
    A folded layer whose output is not pooled norms with ``ln2_bf`` (the next layer's b_O added)."""
    n = layer_names(layer)
    out: Arrays = {} if folded else {n.bo: lw.bo, n.b2: lw.b2}
    out |= {n.ln1_g: lw.ln1_g, n.ln1_b: lw.ln1_b, n.ln2_g: lw.ln2_g}
    _put(out, *((n.ln2_bf, lw.ln2_bf) if folded and not last else (n.ln2_b, lw.ln2_b)))
    return out


def _full_ffn(store: WeightStore, layer: int) -> Arrays:
    """The feed-forward block at all its neurons: the store's matrices (int8: their scales, the zero points)."""
    lw, n = store.layers[layer], layer_names(layer)
    out: Arrays = {n.w1: lw.w1, n.b1: lw.b1, n.w2: lw.w2}
    _put(out, n.w1_s, lw.w1_s)
    _put(out, n.w2_s, lw.w2_s)
    _put(out, W1_Z, store.w1_z)
    return out


def _sliced(store: WeightStore, layer: int, k: int, dh: int, cache: SliceCache, lo: int = 0) -> Arrays:
    """The arrays of one attention block's heads ``lo`` to k (a prefix, or the rest above a packed level); fp32
    ones are views, int8 Q/K/V column slices copies."""
    lw, n, a, w = store.layers[layer], layer_names(layer, heads=k), lo * dh, k * dh
    out: Arrays = {n.bqkv: lw.bqkv[3 * a : 3 * w], n.wo: lw.wo[a:w]}
    if PRECISIONS[store.precision].qkv_by_columns:
        # (D, 3*H*dh) columns are not contiguous: one copy per (layer, lo, k), shared by every session.
        if (layer, lo, k) not in cache.qkv:
            cache.qkv[layer, lo, k] = np.ascontiguousarray(lw.wqkv[:, 3 * a : 3 * w])
        out[n.wqkv] = cache.qkv[layer, lo, k]
    else:
        out[n.wqkv] = lw.wqkv[3 * a : 3 * w]  # (3*(k-lo)*dh, D) rows: a view
    _put(out, n.wqkv_s, None if lw.wqkv_s is None else lw.wqkv_s[3 * a : 3 * w])
    return out


def _ffn_sliced(store: WeightStore, layer: int, w: int, lo: int = 0) -> Arrays:
    """The arrays of one feed-forward block's neurons ``lo`` to w (0 < w < I): views of the store."""
    lw, n = store.layers[layer], layer_names(layer, neurons=w)
    # W1 (w, D) and W2 (w, D): row ranges of the (I, D) store (weights.w1_by_rows).
    out: Arrays = {n.b1: lw.b1[lo:w], n.w2: lw.w2[lo:w], n.w1: lw.w1[lo:w]}
    if lw.w1_s is not None and store.w1_z is not None:
        out[n.w1_s], out[n.w1_z] = lw.w1_s[lo:w], store.w1_z[lo:w]
    return out


def _w1_columns(store: WeightStore, layer: int, lo: int, w: int, cache: SliceCache) -> np.ndarray:
    """W1 of neurons ``lo`` to w as (D, w - lo) columns: one copy per (layer, lo, w), shared by every plan."""
    if (layer, lo, w) not in cache.w1_columns:
        cache.w1_columns[layer, lo, w] = np.ascontiguousarray(store.layers[layer].w1[lo:w].T)
    return cache.w1_columns[layer, lo, w]


def bind(store: WeightStore, cfg: ModelConfig, plan: ExecutionPlan, cache: SliceCache) -> Arrays:
    """Every initializer the graph for ``plan`` names, as arrays backed by ``store`` (or ``cache``)."""
    # A plan that stops at an exit answers with that exit's head.
    out = _shared(store, CLASSIFIER if plan.depth is None else exit_head(plan.depth))
    folded, run = PRECISIONS[store.precision].folds_residual_biases, run_layers(cfg, plan)
    for layer, (k, w) in enumerate(run):
        lw, n = store.layers[layer], layer_names(layer)
        out.update(_norms(lw, layer, folded, last=layer == len(run) - 1))
        if w == cfg.intermediate_size:
            out.update(_full_ffn(store, layer))
        elif w:
            _put(out, n.w2_s, lw.w2_s)
            out.update(_ffn_sliced(store, layer, w))
        if k:
            _put(out, n.wo_s, lw.wo_s)
            out.update(_sliced(store, layer, k, cfg.head_dim, cache))
    return out


def dynamic_arrays(store: WeightStore, cfg: ModelConfig, cache: SliceCache, levels: Levels,
                   depth: int | None = None, fed: bool = False) -> Arrays:
    """The initializers of ``build_dynamic`` (``depth``: its graph for the plans that stop at that exit): all but
    the per-call slices.

    The full-width attention weights (``l{l}.wqkv.k{H}`` ...) are initializers of the If branch that runs a
    layer at all its heads: views of the store (int8 Q/K/V: a copy), prepacked by that branch's kernels. The
    full feed-forward matrices (``l{l}.w1`` ...) likewise, and each packed level's prefix (``.k{L}``, ``.n{L}``)
    in the branch that runs that level and the rest. ``fed`` (the graph without branches): none of those, only
    what every plan shares (embeddings, norms, the answering head, the output scales; attention scope: the full
    feed-forward block).
    """
    n_layers = cfg.n_layers if depth is None else depth
    out = _shared(store, CLASSIFIER if depth is None else exit_head(depth))
    folded = PRECISIONS[store.precision].folds_residual_biases
    for layer, lw in enumerate(store.layers[:n_layers]):
        n = layer_names(layer)
        out.update(_norms(lw, layer, folded, last=layer == n_layers - 1))
        _put(out, n.wo_s, lw.wo_s)
        if fed and cfg.ffn_groups:
            _put(out, n.w2_s, lw.w2_s)
            continue
        out.update(_full_ffn(store, layer))
        if fed:
            continue
        for k in (*levels.heads, cfg.n_heads):
            out.update(_sliced(store, layer, k, cfg.head_dim, cache))
        for w in levels.neurons:
            out.update(_ffn_sliced(store, layer, w))
    return out


def _idle(cfg: ModelConfig, store: WeightStore, cache: SliceCache) -> tuple[_Idle, _Idle]:
    """The zero head and the zero neuron (made once per engine)."""
    d, dh, spec = cfg.hidden_size, cfg.head_dim, PRECISIONS[store.precision]
    wtype = spec.weight_dtype
    if cache.idle_heads is None:
        cache.idle_heads = _Idle(w_in=np.zeros((d, 3 * dh) if spec.qkv_by_columns else (3 * dh, d), wtype),
                                 w_out=np.zeros((dh, d), wtype), bias=np.zeros(3 * dh, np.float32),
                                 scale=np.ones(3 * dh, np.float32), zero=np.zeros(1, np.int8))
    if cache.idle_neurons is None:  # W1 is (I, D) wherever there are feed-forward budgets (weights.w1_by_rows)
        cache.idle_neurons = _Idle(w_in=np.zeros((1, d), wtype), w_out=np.zeros((1, d), wtype),
                                   bias=np.zeros(1, np.float32), scale=np.ones(1, np.float32),
                                   zero=np.zeros(1, np.int8))
    return cache.idle_heads, cache.idle_neurons


def dynamic_feeds(store: WeightStore, cfg: ModelConfig, plan: ExecutionPlan, cache: SliceCache,
                  levels: Levels, fed: bool = False) -> Arrays:
    """The per-call inputs of ``build_dynamic`` for ``plan`` (views of ``store`` or ``cache``); ``fed``: of its
    graph without If nodes, where every block, at any width, runs its units from these inputs.

    A block below all its units runs the largest packed level within its width (``levels``, none: 0) from
    initializers and the rest of its units from these inputs. A block with no such unit (none at all, or none
    above its level) gets one all-zero unit instead: a zero head (Q = K = V = 0 and zero W_O rows) or a zero
    neuron (GELU(0) = 0 times a zero W2 row) adds exactly nothing, which is what the reference computes (one
    unit's worth of wasted work). A block at all its units takes the full branch and ignores them.
    """
    idle_heads, idle_neurons = _idle(cfg, store, cache)
    if fed:  # no branches: every block's units come from these inputs, a full block's included
        levels = Levels()
    widths = plan.ffn_widths(cfg.intermediate_size)
    out: Arrays = {}
    for layer, k in enumerate(plan.heads[: plan.layers_run]):
        n = input_names(layer)
        lo = _branch(out, n.full, layer, k, cfg.n_heads, levels.heads, fed, heads=True)
        out |= _head_feeds(store, layer, k, lo, cfg.head_dim, cache, idle_heads)
        if cfg.ffn_groups:
            w = widths[layer]
            lo = _branch(out, n.ffn_full, layer, w, cfg.intermediate_size, levels.neurons, fed, heads=False)
            out |= _neuron_feeds(store, layer, w, lo, cache, idle_neurons)
    return out


def _branch(out: Arrays, full_flag: str, layer: int, units: int, total: int, levels: tuple[int, ...], fed: bool,
            heads: bool) -> int | None:
    """Set the flags that pick one block's branch (``graph._Graph.choose``) in ``out``; the packed level its fed
    units start above, or None where it runs at all ``total`` units (the full branch ignores the fed inputs)."""
    full = units == total and not fed
    if not fed:
        out[full_flag] = np.array(full)
    lo = 0 if full else floor_level(units, levels)
    if levels:  # one flag per packed level (0: none), set for the level that runs
        for lv in (0, *levels):
            out[level_input(layer, lv, heads=heads)] = np.array(not full and lv == lo)
    return None if full else lo


def _head_feeds(store: WeightStore, layer: int, k: int, lo: int | None, dh: int, cache: SliceCache,
                idle: _Idle) -> Arrays:
    """Heads ``lo`` to k of one layer as its attention block's inputs, or one zero head where there are none."""
    n, quantized = input_names(layer), PRECISIONS[store.precision].quantized
    if lo is not None and lo < k:
        own = layer_names(layer, heads=k)
        sliced = _sliced(store, layer, k, dh, cache, lo)
        out = {n.wqkv: sliced[own.wqkv], n.bqkv: sliced[own.bqkv], n.wo: sliced[own.wo]}
        if quantized:
            out[n.wqkv_s] = sliced[own.wqkv_s]
    else:
        out = {n.wqkv: idle.w_in, n.bqkv: idle.bias, n.wo: idle.w_out}
        if quantized:
            out[n.wqkv_s] = idle.scale
    return out


def _neuron_feeds(store: WeightStore, layer: int, w: int, lo: int | None, cache: SliceCache,
                  idle: _Idle) -> Arrays:
    """Neurons ``lo`` to w of one layer as its feed-forward block's inputs, or one zero neuron where there are
    none. W1 is fed as (D, w) columns where the precision says so (``w1_fed_by_columns``, no zero points)."""
    n, spec = input_names(layer), PRECISIONS[store.precision]
    columns = spec.w1_fed_by_columns
    out: Arrays = {}
    if lo is not None and lo < w:
        own = layer_names(layer, neurons=w)
        sliced = _ffn_sliced(store, layer, w, lo)
        out |= {n.w1: _w1_columns(store, layer, lo, w, cache) if columns else sliced[own.w1], n.b1: sliced[own.b1],
                n.w2: sliced[own.w2]}
        if spec.quantized:
            out[n.w1_s] = sliced[own.w1_s]
            _put(out, n.w1_z, None if columns else sliced[own.w1_z])
    else:  # one zero row of W1 (1, D) is, reshaped, one zero column (D, 1)
        out |= {n.w1: idle.w_in.reshape(-1, 1) if columns else idle.w_in, n.b1: idle.bias, n.w2: idle.w_out}
        if spec.quantized:
            out[n.w1_s] = idle.scale
            _put(out, n.w1_z, None if columns else idle.zero)
    return out
