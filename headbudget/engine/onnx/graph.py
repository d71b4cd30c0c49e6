"""ONNX graphs that compute only the active heads, built by our own code from the weight store.

Why onnx.helper and not torch.onnx.export of a sliced module: the graph is small and fully known (a post-LN
BERT), and writing it directly lets us (1) use the ONNX Runtime CPU kernels that run it fastest (Gemm with the bias fused,
one Q/K/V GEMM per layer, FusedMatMul for scaled scores, DynamicQuantizeMatMul for int8) without relying on
the exporter's patterns being fused, (2) reference every weight by name so that all budgets' sessions share one copy of each array
(``bind.bind`` returns numpy *views* for head prefixes), and (3) keep torch out of the serving process.

A graph is determined by an execution plan: the per-layer head counts ``plan.heads`` and, for whole-model
budgets, the per-layer feed-forward widths ``plan.ffn``; the kept heads of layer l are the first heads[l] heads
of the layer's permuted order and its kept neurons the first ffn[l] neurons of its neuron order
(engine/weights/pack.py). A layer with no head passes LN(x + b_O), one with no neuron LN(x + b_2), which is exactly
what the reference model computes with those gates at 0. Attention-scope plans (``ffn`` None) keep every layer's
feed-forward block whole.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from headbudget.engine.onnx.bind import Levels, run_layers
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import Precision
from headbudget.engine.weights.pack import w1_by_rows
from headbudget.engine.weights.store import (
    CLASSIFIER,
    EMBEDDINGS,
    POOLER,
    Arrays,
    InputNames,
    LayerNames,
    exit_head,
    head_names,
    input_names,
    layer_names,
    level_input,
)
from headbudget.models.config import ModelConfig
from headbudget.models.plan import ExecutionPlan

# Bump whenever the graph or the weight layout changes: it is part of the on-disk cache key.
# 7: whole-model budgets (neuron-ordered feed-forward store, feed-forward prefixes in the graphs).
# 8: int8 whole-model W1 stored (I, D) like fp32, run by QGemm(transB=1): no per-width copies.
# 10: fp32 residual biases folded (weights.fold_residual_biases): the residual rides in the second Gemm's C.
# 11: packed levels (PrecisionSpec.ffn_levels, attention_levels) and one all-budget graph per exit depth.
# 12: a graph without branches for small plans; one Q/K/V shape per graph (the head count inferred), no
#     per-layer shape inputs.
# 14: int8's W1 fed per call as (D, w) columns (PrecisionSpec.w1_fed_by_columns), in both all-budget graphs.
BUILDER_VERSION = 14
OPSET = 17
MS = "com.microsoft"
_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int8): TensorProto.INT8}


def _emb_beta(precision: Precision) -> str:
    """The embedding norm's beta: folded stores' carries layer 0's b_O (weights.fold_residual_biases)."""
    return EMBEDDINGS.emb_bf if PRECISIONS[precision].folds_residual_biases else EMBEDDINGS.emb_b


def _ln2_beta(names: LayerNames, precision: Precision, last: bool) -> str:
    """A layer's last norm's beta: folded stores' carries the next layer's b_O, unless the output is pooled."""
    return names.ln2_bf if PRECISIONS[precision].folds_residual_biases and not last else names.ln2_b


class _Graph:
    """Accumulates nodes; one method per building block. Hidden states are kept 2-D, (B*N, D)."""

    def __init__(self, cfg: ModelConfig, precision: Precision) -> None:
        self.cfg, self.precision, self.spec = cfg, precision, PRECISIONS[precision]
        self.fold = self.spec.folds_residual_biases  # the residual is then the second Gemm's C input
        self.nodes: list[onnx.NodeProto] = []
        self.count = 0

    def op(self, op_type: str, inputs: Sequence[str], domain: str = "", n_out: int = 1, **attrs: Any) -> str:
        self.count += 1
        outs = [f"{op_type.lower()}_{self.count}" + (f"_{i}" if n_out > 1 else "") for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain or None, **attrs))
        return outs[0] if n_out == 1 else ",".join(outs)

    def const(self, name: str, value: np.ndarray) -> str:
        dtype = _NP_TO_ONNX.get(value.dtype, TensorProto.INT64)
        tensor = helper.make_tensor(name, dtype, value.shape, value.reshape(-1).tolist())
        self.nodes.append(helper.make_node("Constant", [], [name], value=tensor))
        return name

    def linear(self, x: str, w: str, bias: str, scale: str, trans_b: bool = False) -> str:
        """x @ W + b for 2-D x; quantized W is (K, N) with one scale per column, fp32 W is (N, K) when trans_b."""
        if self.spec.quantized:
            assert not trans_b, "quantized (N, K) weights go through hidden (QGemm)"
            return self.op("DynamicQuantizeMatMul", [x, w, scale, "", bias], domain=MS)
        return self.op("Gemm", [x, w, bias], transB=int(trans_b))

    def norm(self, x: str, gamma: str, beta: str) -> str:
        return self.op("LayerNormalization", [x, gamma, beta], axis=-1, epsilon=self.cfg.layer_norm_eps)

    def residual_out(self, h: str, w: str, bias: str, scale: str, x: str) -> str:
        """x + h @ W (+ bias): fp32 as one Gemm whose C is the residual x (its bias folded into x), int8 an Add.

        The norm after it stays a plain LayerNormalization: Add + LayerNormalization runs faster than the contrib
        SkipLayerNormalization kernel (docs/results.md, 'Findings and decisions')."""
        if self.fold:
            return self.op("Gemm", [h, w, x])
        return self.op("Add", [self.linear(h, w, bias, scale), x])

    def switch(self, cond: str, then: Callable[[_Graph], str], other: Callable[[_Graph], str]) -> str:
        """An If node whose branches are built by ``then`` / ``other`` on child graphs (outer names visible)."""
        branches = []
        for i, build in enumerate((then, other)):
            child = _Graph(self.cfg, self.precision)
            child.count = self.count
            out = child.op("Identity", [build(child)])
            self.count = child.count
            vi = helper.make_tensor_value_info(out, TensorProto.FLOAT, None)
            branches.append(helper.make_graph(child.nodes, f"branch_{self.count}_{i}", [], [vi]))
        return self.op("If", [cond], then_branch=branches[0], else_branch=branches[1])

    def choose(self, packed: Sequence[tuple[str, Callable[[_Graph], str]]],
               other: tuple[str, Callable[[_Graph], str]]) -> str:
        """The block the one true flag picks: one of ``packed`` (flag, builder), or ``other``.

        Every branch that reads packed weights hangs off an If node of this graph, never a nested one: ONNX
        Runtime prepacks an outer initializer for a kernel one If deep, not two (a packed level two Ifs deep ran
        slower than no packing at all). So each packed block has an If of its own that computes it or gives no
        rows, and one Concat of them all is the chosen block's output (one copy; an Identity chain copied once
        per If, a broadcast Sum added once per If); ``other`` (weights fed per call) nests in the first.
        """

        def empty(g: _Graph) -> str:
            g.count += 1
            return g.const(f"none_{g.count}", np.zeros((0, self.cfg.hidden_size), np.float32))

        (flag, build), rest = packed[0], packed[1:]
        parts = [self.switch(flag, build, lambda g: g.switch(other[0], other[1], empty))]
        parts += [self.switch(flag, build, empty) for flag, build in rest]
        return self.op("Concat", parts, axis=0)

    def attention(self, x: str, shape: str, bias: str, layer: int, k: int | None) -> str:
        """LN(x + W_O·Attn(x) + b_O) over the first k heads; LN(x + b_O) when k = 0.  (B*N, D)

        ``shape``: ``qkv_shape``'s output. ``k=None``: the head count is decided per call; the sliced weights are
        graph inputs (``store.input_names``), not initializers.
        """
        own = layer_names(layer)
        if k == 0:  # fp32: x already carries b_O (weights.fold_residual_biases)
            return self.norm(x if self.fold else self.op("Add", [own.bo, x]), own.ln1_g, own.ln1_b)
        n = input_names(layer) if k is None else layer_names(layer, heads=k)
        qkv = self.linear(x, n.wqkv, n.bqkv, n.wqkv_s, trans_b=not self.spec.qkv_by_columns)  # (B*N, 3*k*dh)
        ctx = self.attend(qkv, shape, bias)  # (B*N, k*dh)
        o = self.residual_out(ctx, n.wo, own.bo, own.wo_s, x)  # x + W_O ctx + b_O: (B*N, D)
        return self.norm(o, own.ln1_g, own.ln1_b)

    def attention_level(self, x: str, shape: str, bias: str, layer: int, lo: int) -> str:
        """The attention block at the packed prefix of ``lo`` heads (initializers) plus the rest of the plan's
        heads (the per-call inputs): their Q/K/V side by side, one attention core, W_O split by rows.  (B*N, D)"""
        own, dh, n, lv = layer_names(layer), self.cfg.head_dim, input_names(layer), layer_names(layer, heads=lo)
        by_rows = not self.spec.qkv_by_columns
        qkv = self.op("Concat", [self.linear(x, lv.wqkv, lv.bqkv, lv.wqkv_s, trans_b=by_rows),
                                 self.linear(x, n.wqkv, n.bqkv, n.wqkv_s, trans_b=by_rows)], axis=1)
        ctx = self.attend(qkv, shape, bias)  # (B*N, (lo + rest)*dh)
        cut, axis = self.const(f"cut_k{lo}", np.array([lo * dh], np.int64)), self.const("axis_1", np.array([1], np.int64))
        first = self.op("Slice", [ctx, self.const("start_0", np.array([0], np.int64)), cut, axis])
        rest = self.op("Slice", [ctx, cut, self.const("end_max", np.array([2**62], np.int64)), axis])
        o = self.residual_out(rest, n.wo, "", own.wo_s, self.residual_out(first, lv.wo, own.bo, own.wo_s, x))
        return self.norm(o, own.ln1_g, own.ln1_b)

    def qkv_shape(self, bn: str) -> str:
        """(B, N, -1, 3, dh): Q/K/V by head, the head count left for Reshape to infer. One per graph, shared by
        every layer whatever its head count, so that no layer needs a shape of its own (a node or an input)."""
        rest = self.const("rest_3_dh", np.array([-1, 3, self.cfg.head_dim], np.int64))
        return self.op("Concat", [bn, rest], axis=0)

    def attend(self, qkv: str, shape: str, bias: str) -> str:
        """softmax(Q K^T / sqrt(dh) + mask) V per head, from Q/K/V (B*N, k*3*dh) to (B*N, k*dh)."""
        qkv = self.op("Reshape", [qkv, shape])  # (B, N, k, 3, dh)
        qkv = self.op("Transpose", [qkv], perm=[3, 0, 2, 1, 4])  # (3, B, k, N, dh)
        q, kk, v = self.op("Split", [qkv], n_out=3, axis=0).split(",")  # each (1, B, k, N, dh)
        scale = 1.0 / math.sqrt(self.cfg.head_dim)
        scores = self.op("FusedMatMul", [q, kk], domain=MS, transB=1, alpha=scale)  # (1,B,k,N,N)
        probs = self.op("Softmax", [self.op("Add", [scores, bias])], axis=-1)
        ctx = self.op("Transpose", [self.op("MatMul", [probs, v])], perm=[0, 1, 3, 2, 4])  # (1, B, N, k, dh)
        return self.op("Flatten", [ctx], axis=3)  # (B*N, k*dh)

    def ffn(self, x: str, layer: int, w: int | None, last: bool) -> str:
        """LN(x + W2·GELU(W1·x + b1) + b2) over the first w neurons, exact (erf) GELU; LN(x + b2) when w = 0.

        ``last``: the layer's output is pooled (fp32 then norms with the plain beta, not the one that carries
        the next layer's b_O).
        ``w`` = I: the store's full matrices; 0 < w < I: the ``bind`` slices (``layer_names(.., neurons=w)``);
        ``w=None``: the width is decided per call, the slices are graph inputs (``store.input_names``).  (B*N, D)
        """
        own = layer_names(layer)
        beta = _ln2_beta(own, self.precision, last)
        if w == 0:  # fp32: x already carries b2
            return self.norm(x if self.fold else self.op("Add", [own.b2, x]), own.ln2_g, beta)
        if w is None:
            fed = input_names(layer)
            h, w2 = self.fed_hidden(x, None, fed), fed.w2  # (B*N, w)
        else:
            n = layer_names(layer, neurons=None if w == self.cfg.intermediate_size else w)
            h, w2 = self.hidden(self.quantize(x), n), n.w2
        return self.norm(self.residual_out(h, w2, own.b2, own.w2_s, x), own.ln2_g, beta)

    def ffn_level(self, x: str, layer: int, lo: int, last: bool) -> str:
        """The feed-forward block at the packed prefix of ``lo`` neurons (initializers) plus the rest of the plan's
        neurons (the per-call inputs), each through GELU and W2, summed into the residual.  (B*N, D)"""
        own, n, lv = layer_names(layer), input_names(layer), layer_names(layer, neurons=lo)
        xq = self.quantize(x)
        o = self.residual_out(self.hidden(xq, lv), lv.w2, own.b2, own.w2_s, x)
        o = self.residual_out(self.fed_hidden(x, xq, n), n.w2, "", own.w2_s, o)
        return self.norm(o, own.ln2_g, _ln2_beta(own, self.precision, last))

    def quantize(self, x: str) -> str:
        """x as the int8 W1-by-rows product takes it (DynamicQuantizeLinear's three outputs), else x itself."""
        if w1_by_rows(self.cfg) and self.spec.quantized:
            return self.op("DynamicQuantizeLinear", [x], n_out=3)
        return x

    def hidden(self, xq: str, n: LayerNames | InputNames) -> str:
        """GELU(W1 x + b1) over the neurons ``n`` names, from ``quantize``'s output.  (B*N, w)"""
        rows = w1_by_rows(self.cfg)
        if rows and self.spec.quantized:  # the bias rides in BiasGelu: no Add over (B*N, w)
            # QGemm quantizing x exactly as DynamicQuantizeMatMul does: bit-identical to it over a (K, N) copy
            q = self.op("QGemm", [*xq.split(","), n.w1, n.w1_s, n.w1_z], domain=MS, transB=1)
            return self.op("BiasGelu", [q, n.b1], domain=MS)
        return self.op("Gelu", [self.linear(xq, n.w1, n.b1, n.w1_s, trans_b=rows)], domain=MS)

    def fed_hidden(self, x: str, xq: str | None, n: InputNames) -> str:
        """``hidden`` over the per-call inputs ``n``: with W1 as (D, w) columns (``PrecisionSpec.w1_fed_by_columns``)
        DynamicQuantizeMatMul quantizes x as QGemm does, so the two are bit-identical, and the bias rides in
        BiasGelu as there; else ``hidden`` over ``xq``, ``quantize(x)`` (None: made here).  (B*N, w)"""
        if self.spec.w1_fed_by_columns:
            q = self.op("DynamicQuantizeMatMul", [x, n.w1, n.w1_s, "", ""], domain=MS)
            return self.op("BiasGelu", [q, n.b1], domain=MS)
        return self.hidden(self.quantize(x) if xq is None else xq, n)

    def embed(self, ids: str) -> str:
        """(B, N) ids -> LN(word + position + token type 0), flattened to (B*N, D)."""
        n = self.op("Shape", [ids], start=1, end=2)  # (1,) = [N]
        zero = self.const("zero", np.zeros(1, np.int64))
        pos = self.op("Slice", [EMBEDDINGS.pos_tt, zero, n, zero])  # (N, D)
        x = self.op("Add", [self.word(ids), pos])  # (B, N, D)
        x = self.norm(x, EMBEDDINGS.emb_g, _emb_beta(self.precision))
        return self.op("Reshape", [x, self.const("flat_d", np.array([-1, self.cfg.hidden_size], np.int64))])

    def word(self, ids: str) -> str:
        """Word vectors (B, N, D); quantized: gathered int8 rows times their gathered scales (B, N, 1)."""
        if self.spec.quantized:
            rows = self.op("Cast", [self.op("Gather", [EMBEDDINGS.word, ids])], to=TensorProto.FLOAT)
            return self.op("Mul", [rows, self.op("Gather", [EMBEDDINGS.word_s, ids])])
        return self.op("Gather", [EMBEDDINGS.word, ids])

    def mask_bias(self, mask: str) -> str:
        """0 for real tokens, -1e9 for padding, (B, 1, 1, N): after softmax padding weighs exactly 0."""
        m = self.op("Cast", [mask], to=TensorProto.FLOAT)
        neg = self.op("Mul", [self.op("Sub", [self.const("one_f", np.ones(1, np.float32)), m]),
                              self.const("neg_big", np.array([-1e9], np.float32))])
        return self.op("Unsqueeze", [neg, self.const("axes12", np.array([1, 2], np.int64))])

    def pool(self, h: str, bn: str, mask: str) -> str:
        """Mean over real tokens (or the [CLS] vector): (B*N, D) -> (B, D)."""
        shape = self.op("Concat", [bn, self.const("minus1", np.array([-1], np.int64))], axis=0)
        h3 = self.op("Reshape", [h, shape])  # (B, N, D)
        if self.cfg.pooling == "cls":
            return self.op("Gather", [h3, self.const("first", np.array(0, np.int64))], axis=1)
        m = self.op("Cast", [mask], to=TensorProto.FLOAT)  # (B, N)
        one = self.const("axis1", np.array([1], np.int64))
        total = self.op("MatMul", [self.op("Unsqueeze", [m, one]), h3])  # (B, 1, D)
        floor = self.const("count_floor", np.ones(1, np.float32))
        count = self.op("Max", [self.op("ReduceSum", [m, one], keepdims=1), floor])  # (B, 1)
        return self.op("Div", [self.op("Squeeze", [total, one]), count])  # (B, D)

    def classify(self, h: str, bn: str, mask: str, head: str = CLASSIFIER) -> str:
        """Hidden states (B*N, D) -> logits (B, C): pool, the optional pooler layer, the classifier (``head``:
        ``CLASSIFIER``, or ``exit_head(d)`` for a plan that stops at layer d)."""
        pooled = self.pool(h, bn, mask)  # (B, D)
        if self.cfg.pooler != "none":
            act = {"tanh": "Tanh", "relu": "Relu"}[self.cfg.pooler]
            pooled = self.op(act, [self.op("Gemm", [pooled, *head_names(POOLER)], transB=1)])
        return self.op("Gemm", [pooled, *head_names(head)], transB=1)


# Initializers point at this (empty) file beside the graph; sessions receive the data in memory instead.
PLACEHOLDER_FILE = "weights.placeholder"


def placeholder(name: str, array: np.ndarray) -> TensorProto:
    """An initializer whose data the session receives in memory (SessionOptions.add_initializer).

    ONNX Runtime uses an ``add_initializer`` OrtValue without copying it, but only for a name the graph
    declares as an initializer; declaring it as external data (never read) keeps the graph file tiny.
    ``add_external_initializers`` would copy every array into every session.
    """
    t = TensorProto()
    t.name, t.data_type, t.data_location = name, _NP_TO_ONNX[array.dtype], TensorProto.EXTERNAL
    t.dims.extend(array.shape)
    for key, value in (("location", PLACEHOLDER_FILE), ("offset", "0"), ("length", str(array.nbytes))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _model(g: _Graph, inputs: list[onnx.ValueInfoProto], outputs: dict[str, str], arrays: Arrays) -> onnx.ModelProto:
    for name, value in outputs.items():
        g.nodes.append(helper.make_node("Identity", [value], [name]))
    graph = helper.make_graph(
        g.nodes, "headbudget", inputs, [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outputs],
        initializer=[placeholder(n, a) for n, a in sorted(arrays.items())],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                              producer_name="headbudget", producer_version=str(BUILDER_VERSION))
    model.ir_version = 8
    return model


_IDS = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"])
_MASK = helper.make_tensor_value_info("attention_mask", TensorProto.INT32, ["batch", "seq"])
_X = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["tokens", "hidden"])
_BIAS = helper.make_tensor_value_info("bias", TensorProto.FLOAT, ["batch", 1, 1, "seq"])


def build_graph(cfg: ModelConfig, plan: ExecutionPlan, precision: Precision, arrays: Arrays) -> onnx.ModelProto:
    """The whole classifier for ``plan`` (heads and feed-forward widths); weights are placeholders named as ``bind``."""
    g = _Graph(cfg, precision)
    bn = g.op("Shape", ["input_ids"])  # (2,) = [B, N]
    bias, shape = g.mask_bias("attention_mask"), g.qkv_shape(bn)
    x = g.embed("input_ids")
    run = run_layers(cfg, plan)
    for layer, (k, w) in enumerate(run):
        x = g.ffn(g.attention(x, shape, bias, layer, k), layer, w, last=layer == len(run) - 1)
    logits = g.classify(x, bn, "attention_mask", CLASSIFIER if plan.depth is None else exit_head(plan.depth))  # (B, C)
    return _model(g, [_IDS, _MASK], {"logits": logits}, arrays)


def build_dynamic(cfg: ModelConfig, precision: Precision, arrays: Arrays, levels: Levels,
                  depth: int | None = None, fed: bool = False) -> onnx.ModelProto:
    """The whole classifier for every budget in one graph (``depth``: the layers below that exit and its head,
    for every plan that stops there); per layer, If nodes pick each block's branch.

    All heads: weights are initializers, prepacked once. Fewer heads: the largest packed level within the plan's
    heads (``levels``) from initializers, prepacked once, and the rest of its heads as graph inputs
    (``dynamic_feeds``), never prepacked, so no budget adds a packed copy. Norms, embeddings and classifier are
    initializers used by every budget; so is the feed-forward block for attention-scope checkpoints.
    Whole-model budgets give the feed-forward block the same kinds of branch: all neurons, a packed level and
    the rest, or the plan's neurons all fed per call.

    ``fed``: the graph for small plans (``PrecisionSpec.fed_up_to``), with no If node: every block runs the
    plan's units from the per-call inputs, whatever its width. Each If runs its branch as a subgraph of its own
    and four per layer cost a small plan more than packing its few weights on every call does.
    """
    g = _Graph(cfg, precision)
    bn = g.op("Shape", ["input_ids"])  # (2,) = [B, N]
    bias, shape = g.mask_bias("attention_mask"), g.qkv_shape(bn)
    x = g.embed("input_ids")
    inputs = [_IDS, _MASK]
    n_layers = cfg.n_layers if depth is None else depth
    for layer in range(n_layers):
        n, last = input_names(layer), layer == n_layers - 1
        inputs += _attention_inputs(cfg, precision, n, fed)
        att = partial(_Graph.attention, x=x, shape=shape, bias=bias, layer=layer)
        x = att(g, k=None) if fed else _block(
            g, inputs, n.full, partial(att, k=cfg.n_heads), partial(att, k=None),
            [(level_input(layer, lv, heads=True), partial(_Graph.attention_level, x=x, shape=shape, bias=bias,
                                                          layer=layer, lo=lv)) for lv in levels.heads],
            level_input(layer, 0, heads=True))
        if not cfg.ffn_groups:  # attention scope: every neuron, every budget
            x = g.ffn(x, layer, cfg.intermediate_size, last)
            continue
        inputs += _ffn_inputs(cfg, precision, n, fed)
        ffn = partial(_Graph.ffn, x=x, layer=layer, last=last)
        x = ffn(g, w=None) if fed else _block(
            g, inputs, n.ffn_full, partial(ffn, w=cfg.intermediate_size), partial(ffn, w=None),
            [(level_input(layer, lv), partial(_Graph.ffn_level, x=x, layer=layer, lo=lv, last=last))
             for lv in levels.neurons], level_input(layer, 0))
    logits = g.classify(x, bn, "attention_mask", CLASSIFIER if depth is None else exit_head(depth))  # (B, C)
    return _model(g, inputs, {"logits": logits}, arrays)


def _attention_inputs(cfg: ModelConfig, precision: Precision, n: InputNames,
                      fed: bool) -> list[onnx.ValueInfoProto]:
    """One layer's per-call attention inputs: the flag for its full branch (none in the ``fed`` graph) and the
    heads fed per call (``dynamic_feeds``)."""
    spec, info = PRECISIONS[precision], helper.make_tensor_value_info
    wtype = _NP_TO_ONNX[np.dtype(spec.weight_dtype)]
    out = [] if fed else [info(n.full, TensorProto.BOOL, [])]
    out += [info(n.wqkv, wtype, [None, None]), info(n.bqkv, TensorProto.FLOAT, [None]),
            info(n.wo, wtype, [None, cfg.hidden_size])]
    if spec.quantized:
        out.append(info(n.wqkv_s, TensorProto.FLOAT, [None]))
    return out


def _ffn_inputs(cfg: ModelConfig, precision: Precision, n: InputNames, fed: bool) -> list[onnx.ValueInfoProto]:
    """One layer's per-call feed-forward inputs: the flag for its full branch (none in the ``fed`` graph) and the
    neurons fed per call, W1 as (D, w) columns or (w, D) rows (``PrecisionSpec.w1_fed_by_columns``)."""
    spec, info = PRECISIONS[precision], helper.make_tensor_value_info
    wtype, columns = _NP_TO_ONNX[np.dtype(spec.weight_dtype)], spec.w1_fed_by_columns
    out = [] if fed else [info(n.ffn_full, TensorProto.BOOL, [])]
    out += [info(n.w1, wtype, [cfg.hidden_size, None] if columns else [None, cfg.hidden_size]),
            info(n.b1, TensorProto.FLOAT, [None]), info(n.w2, wtype, [None, cfg.hidden_size])]
    if spec.quantized:
        out.append(info(n.w1_s, TensorProto.FLOAT, [None]))
        out += [] if columns else [info(n.w1_z, TensorProto.INT8, [None])]
    return out


Build = Callable[[_Graph], str]


def _block(g: _Graph, inputs: list[onnx.ValueInfoProto], full_flag: str, full: Build, rest: Build,
           levels: list[tuple[str, Build]], rest_flag: str) -> str:
    """One block of the all-budget graph: all its units (``full``), a packed level and the rest (``levels``), or
    the plan's units all fed per call (``rest``); without levels, one If (full or not)."""
    if not levels:
        return g.switch(full_flag, full, rest)
    inputs += [helper.make_tensor_value_info(flag, TensorProto.BOOL, []) for flag, _ in levels]
    inputs.append(helper.make_tensor_value_info(rest_flag, TensorProto.BOOL, []))
    return g.choose([(full_flag, full), *levels], (rest_flag, rest))
