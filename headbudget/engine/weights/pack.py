"""Checkpoint weights as numpy arrays, laid out so that every budget is a prefix slice of every layer.

Torch-free on purpose: an ONNX Runtime serving process never imports torch (time and resident memory it would
not use). config.json and the digest come from ``models.checkpoint_meta`` (torch-free);
the tensors are read with ``safetensors.numpy`` and checked against the config here.

Layout, per layer l, with heads permuted by ``layer_head_orders`` (rank order inside the layer):
- Q/K/V weights interleaved per head, (H*3*d_h, D) in nn.Linear's (out, in) layout: the first 3*k*d_h rows
  are the k kept heads, a contiguous view; the graph multiplies with ``transB=1``.
- W_O transposed, (H*d_h, D): rows are head inputs, so the first k*d_h rows are again a contiguous view.
- FFN weights transposed to (in, out), the layout MatMul and the quantized MatMul want.
- Whole-model budgets (docs/method.md §4): the feed-forward neurons in ``BudgetPolicy.neuron_perms`` order
  (W1 rows, b1 entries, W2 input rows), so that a plan's kept neurons are the first ffn[l] of every layer:
  W2 (I, D) and b1 prefixes are row views. W1 stays in nn.Linear's (I, D) layout (the graph uses
  ``transB=1``) so that its prefix is a row view too, in fp32 and int8, see ``w1_by_rows``. Attention-scope
  stores keep the identity neuron order and W1 as (D, I).
fp32 stores fold the residual biases (``fold_residual_biases``): the graph adds each block's output to the residual
inside the second Gemm (its C input), which saves an Add over (B*N, D) per block.
int8 stores (K, N) matrices with one symmetric scale per output column (whole-model W1: (N, K), one per
row), so that slicing heads out of Q/K/V (columns) or W_O (rows), or neurons out of W1 (one scale per neuron)
or W2 (rows: one scale per output feature over all I rows), never changes a kept weight's quantized value.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from headbudget.engine.errors import ModelLoadError
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import Precision
from headbudget.engine.weights.store import Arrays, Embeddings, Head, LayerWeights, WeightStore
from headbudget.models.budget import GateParams
from headbudget.models.checkpoint_meta import WEIGHTS
from headbudget.models.config import ModelConfig
from headbudget.models.plan import BudgetPolicy


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of a BudgetedClassifier state dict and its shape."""
    d, i, c = cfg.hidden_size, cfg.intermediate_size, cfg.n_labels
    shapes: dict[str, tuple[int, ...]] = {
        "encoder.embeddings.word.weight": (cfg.vocab_size, d),
        "encoder.embeddings.position.weight": (cfg.max_position, d),
        "encoder.embeddings.token_type.weight": (cfg.type_vocab_size, d),
        "encoder.embeddings.norm.weight": (d,), "encoder.embeddings.norm.bias": (d,),
        "classifier.weight": (c, d), "classifier.bias": (c,),
        "gates.logit": (cfg.n_layers, cfg.units_per_layer), "gates.raw_beta": (cfg.n_layers, cfg.units_per_layer),
    }
    if cfg.pooler != "none":
        shapes.update({"pooler.weight": (d, d), "pooler.bias": (d,)})
    for e in range(len(cfg.gate.exits)):
        shapes.update({f"exits.{e}.weight": (c, d), f"exits.{e}.bias": (c,)})
    per_layer = {"attention.query": (d, d), "attention.key": (d, d), "attention.value": (d, d),
                 "attention.output": (d, d), "intermediate": (i, d), "ffn_out": (d, i)}
    for layer in range(cfg.n_layers):
        p = f"encoder.layers.{layer}."
        for mod, shape in per_layer.items():
            shapes[p + mod + ".weight"] = shape
            shapes[p + mod + ".bias"] = (shape[0],)
        for norm in ("attn_norm", "ffn_norm"):
            shapes[p + norm + ".weight"] = (d,)
            shapes[p + norm + ".bias"] = (d,)
    return shapes


def load_state(folder: Path, cfg: ModelConfig) -> Arrays:
    """model.safetensors as float32 numpy arrays, checked against the architecture in config.json."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    path = Path(folder) / WEIGHTS
    try:
        state = load_file(str(path))
    except (OSError, SafetensorError, RuntimeError) as e:
        raise ModelLoadError(f"{path}: missing, unreadable or truncated ({e})") from e
    expected = expected_shapes(cfg)
    if set(state) != set(expected):
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        raise ModelLoadError(f"{path}: does not match config.json (missing {missing[:3]}, unexpected {extra[:3]})")
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ModelLoadError(f"{path}: tensor {name} has shape {state[name].shape}, config implies {shape}")
    return {k: v.astype(np.float32, copy=False) for k, v in state.items()}


def gate_params(state: Arrays) -> GateParams:
    """a and beta = softplus(raw) in float64, computed as torch's softplus does (threshold 20)."""
    raw = state["gates.raw_beta"].astype(np.float64)
    beta = np.where(raw > 20.0, raw, np.log1p(np.exp(np.minimum(raw, 20.0))))
    return GateParams(a=state["gates.logit"].astype(np.float64), beta=beta)


def quantize_columns(w_kn: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output column of a (K, N) matrix: (int8 (K, N), float32 scale (N,))."""
    scale = np.abs(w_kn).max(axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w_kn / scale), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q), scale


def quantize_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per row of a (V, D) lookup table: (int8 (V, D), float32 scale (V, 1))."""
    scale = np.abs(table).max(axis=1, keepdims=True) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
    return np.ascontiguousarray(q), scale


def w1_by_rows(cfg: ModelConfig) -> bool:
    """Whether the store's W1 is (I, D), neurons as rows (whole-model budgets), rather than (D, I).

    A plan's neuron prefix is then a row view, so no budget needs a copy of W1. fp32's Gemm with ``transB=1``
    over a row view runs as fast as over a contiguous copy. int8 has no transposed DynamicQuantizeMatMul; it runs
    DynamicQuantizeLinear + QGemm(transB=1) + BiasGelu, bit-identical to DynamicQuantizeMatMul + Gelu over a
    (D, w) copy (``_Graph.ffn``), and saves the per-width copies of W1 for about the same latency where the
    weights are prepacked (docs/results.md, 'Findings and decisions'). ONNX Runtime transposes an unpacked B on
    every call, so the neurons fed per call take int8 W1 as column copies after all
    (``PrecisionSpec.w1_fed_by_columns``): the packed prefixes stay row views, and the copies cover only what is
    fed.
    """
    return cfg.gate.scope_spec.gates_ffn  # both precisions: one layout, one rule


def pack(state: Arrays, cfg: ModelConfig, policy: BudgetPolicy, precision: Precision) -> WeightStore:
    """The engine's weight store: every array all budgets share, in the layout described above.

    ``policy`` gives the per-layer head order (``perms``) and, for whole-model budgets, the neuron order
    (``neuron_perms``); attention-scope checkpoints keep their neurons in place.
    """
    e, quantized = "encoder.embeddings.", PRECISIONS[precision].quantized
    neuron_perms = policy.neuron_perms if cfg.gate.scope_spec.gates_ffn else None
    word, word_s, w1_z = state[e + "word.weight"], None, None
    if quantized:
        # The word table is most of a small model: int8 rows with one scale each, dequantized after the Gather
        # (only the B*N gathered rows), as quantize_dynamic does.
        word, word_s = quantize_rows(word)
        if w1_by_rows(cfg):  # QGemm's per-neuron zero points (all 0, symmetric), sliced per width
            w1_z = np.zeros(cfg.intermediate_size, np.int8)
    store = WeightStore(
        precision=precision,
        # Position and the (always 0) token type folded into one table: one Add fewer per call.
        embeddings=Embeddings(word=word, word_s=word_s, emb_g=state[e + "norm.weight"], emb_b=state[e + "norm.bias"],
                              pos_tt=state[e + "position.weight"] + state[e + "token_type.weight"][0]),
        layers=tuple(_pack_layer(state, cfg, layer, policy.perms[layer],
                                 None if neuron_perms is None else neuron_perms[layer], quantized)
                     for layer in range(cfg.n_layers)),
        classifier=Head(state["classifier.weight"], state["classifier.bias"]),
        pooler=Head(state["pooler.weight"], state["pooler.bias"]) if cfg.pooler != "none" else None,
        # Exit heads stay fp32, as the classifier does.
        exits={depth: Head(state[f"exits.{i}.weight"], state[f"exits.{i}.bias"])
               for i, depth in enumerate(cfg.gate.exits)},
        w1_z=w1_z)
    if PRECISIONS[precision].folds_residual_biases:
        store = fold_residual_biases(store, cfg)
    return store.contiguous()


def _pack_layer(state: Arrays, cfg: ModelConfig, layer: int, heads: np.ndarray, neurons: np.ndarray | None,
                quantized: bool) -> LayerWeights:
    """One layer of ``pack``: ``heads`` (H,) and ``neurons`` (I,) in rank order (None: in place), transposed,
    maybe quantized."""
    p, dh, h = f"encoder.layers.{layer}.", cfg.head_dim, cfg.n_heads
    # Feature indices of the heads in rank order: (H*dh,).
    cols = (heads[:, None] * dh + np.arange(dh)[None, :]).reshape(-1)
    # Q/K/V rows interleaved per head, [q_h; k_h; v_h] for h in rank order: (H*3*dh, D) out x in, so that
    # the first 3*k*dh rows are the k kept heads and one GEMM computes all three projections.
    qkv = np.stack([state[p + f"attention.{m}.weight"][cols].reshape(h, dh, -1)
                    for m in ("query", "key", "value")], axis=1).reshape(3 * h * dh, -1)
    bqkv = np.stack([state[p + f"attention.{m}.bias"][cols].reshape(h, dh)
                     for m in ("query", "key", "value")], axis=1).reshape(-1)
    wo = np.ascontiguousarray(state[p + "attention.output.weight"][:, cols].T)  # (H*dh, D) in x out
    w1, b1, w2 = state[p + "intermediate.weight"], state[p + "intermediate.bias"], state[p + "ffn_out.weight"]
    if neurons is not None:  # neurons in rank order: (I, D) rows, (I,) entries, (D, I) columns
        w1, b1, w2 = w1[neurons], b1[neurons], w2[:, neurons]
    # W1 (D, I), or (I, D) where a neuron prefix must be a row view (w1_by_rows); W2 (I, D).
    rows = w1_by_rows(cfg)
    w1 = np.ascontiguousarray(w1 if rows else w1.T)
    w2 = np.ascontiguousarray(w2.T)
    fp32 = LayerWeights(wqkv=np.ascontiguousarray(qkv), bqkv=bqkv, wo=wo, bo=state[p + "attention.output.bias"],
                        w1=w1, b1=b1, w2=w2, b2=state[p + "ffn_out.bias"],
                        ln1_g=state[p + "attn_norm.weight"], ln1_b=state[p + "attn_norm.bias"],
                        ln2_g=state[p + "ffn_norm.weight"], ln2_b=state[p + "ffn_norm.bias"])
    if not quantized:
        return fp32
    # (D, H*3*dh), so a head prefix is a column copy per (layer, k) (the engine's slice cache): rows + QGemm as
    # for W1 would save those copies but run slower at every budget (docs/results.md, 'Findings and decisions').
    wqkv, wqkv_s = quantize_columns(qkv.T)
    wo, wo_s = quantize_columns(wo)
    if rows:  # one scale per neuron, as for the (D, I) layout
        w1, w1_s = quantize_rows(w1)
        w1_s = w1_s.reshape(-1)
    else:
        w1, w1_s = quantize_columns(w1)
    w2, w2_s = quantize_columns(w2)
    return replace(fp32, wqkv=wqkv, wo=wo, w1=w1, w2=w2, wqkv_s=wqkv_s, wo_s=wo_s, w1_s=w1_s, w2_s=w2_s)


def fold_residual_biases(store: WeightStore, cfg: ModelConfig) -> WeightStore:
    """Carry each block's output bias in the residual stream, so that the graph needs no Add per block (fp32).

    Each block computes LN(x + f(x) + b) with f's last matrix product in a Gemm. With x' = x + b the block is
    LN(f(x' - b) + x'): the Gemm takes x' as its C input (no separate Add), and f's first product sees x' - b
    through its bias, W(x' - b) + c = Wx' + (c - Wb). x' is the previous LayerNorm's output with b added to its
    beta. So per layer l (bo = W_O's bias, b2 = W2's): ``bqkv`` -= Wqkv bo, ``ln1_b`` += b2, ``b1`` -= W1 b2,
    and the norm before layer l gets bo: ``emb_bf`` (emb_b + bo) for l = 0, else layer l-1's ``ln2_bf``
    (ln2_b + bo; ``ln2_b`` stays plain for a layer whose output is pooled: the last one, or the last before an
    exit). The fields ``bqkv``, ``ln1_b`` and ``b1`` hold the folded values in fp32 stores. Every fold is per
    output row (a head's Q/K/V rows, a neuron), so head and neuron prefixes stay prefixes. A layer with no
    head (no neuron) is LN(x') exactly, as the reference's LN(x + b); logits move within 1e-6 and every budget
    runs a little faster (docs/results.md, 'Findings and decisions'). int8's DynamicQuantizeMatMul has no C input,
    so int8 stores stay plain (bit-identical).
    """
    rows = w1_by_rows(cfg)
    emb, layers = store.embeddings, store.layers
    # emb_b stays plain: EngineBase.embed reads it.
    folded = replace(store, embeddings=replace(emb, emb_bf=emb.emb_b + layers[0].bo), layers=tuple(
        _fold_layer(lw, None if i + 1 == len(layers) else layers[i + 1].bo, rows) for i, lw in enumerate(layers)))
    return folded


def _fold_layer(lw: LayerWeights, next_bo: np.ndarray | None, rows: bool) -> LayerWeights:
    """One layer of ``fold_residual_biases``; ``next_bo``: the next layer's b_O (None for the last layer)."""
    bo, b2 = lw.bo.astype(np.float64), lw.b2.astype(np.float64)
    w1 = lw.w1.astype(np.float64)  # (I, D) rows, or (D, I)
    return replace(lw, bqkv=(lw.bqkv - lw.wqkv.astype(np.float64) @ bo).astype(np.float32), ln1_b=lw.ln1_b + lw.b2,
                   b1=(lw.b1 - (w1 @ b2 if rows else b2 @ w1)).astype(np.float32),
                   ln2_bf=None if next_bo is None else lw.ln2_b + next_bo)
