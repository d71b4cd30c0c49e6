"""Checkpoint weights as numpy arrays, laid out so that every budget is a prefix slice of every layer.

Torch-free on purpose: an ONNX Runtime serving process never imports torch (about 1 s and tens of MB of
resident memory it would not use). config.json and the digest come from ``models.checkpoint_meta`` (torch-free);
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
  stores are exactly as before (identity neuron order, W1 as (D, I)).
fp32 stores fold the residual biases (``fold_residual_biases``): the graph adds each block's output to the residual
inside the second Gemm (its C input), which saves an Add over (B*N, D) per block.
int8 stores (K, N) matrices with one symmetric scale per output column (whole-model W1: (N, K), one per
row), so that slicing heads out of Q/K/V (columns) or W_O (rows), or neurons out of W1 (one scale per neuron)
or W2 (rows: one scale per output feature over all I rows), never changes a kept weight's quantized value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from headbudget.engine.errors import ModelLoadError
from headbudget.engine.types import Precision
from headbudget.models.budget import GateParams
from headbudget.models.checkpoint_meta import (
    CONFIG,
    WEIGHTS,
    CheckpointError,
    model_config,
    read_config,
    weights_digest,
)
from headbudget.models.config import ModelConfig
from headbudget.models.plan import BudgetPolicy

Arrays = dict[str, np.ndarray]


def checkpoint_config(folder: Path) -> tuple[dict[str, Any], ModelConfig]:
    """config.json of a checkpoint and its ModelConfig (models.checkpoint_meta), errors as ModelLoadError."""
    try:
        config = read_config(Path(folder))
        return config, model_config(config, Path(folder) / CONFIG)
    except CheckpointError as e:
        raise ModelLoadError(str(e)) from e


def checkpoint_digest(folder: Path) -> str:
    """SHA-256 of model.safetensors (models.checkpoint_meta.weights_digest), errors as ModelLoadError."""
    try:
        return weights_digest(Path(folder))
    except OSError as e:
        raise ModelLoadError(f"{Path(folder) / WEIGHTS}: unreadable ({e})") from e


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

    A plan's neuron prefix is then a row view, so no budget needs a copy of W1. fp32 (ORT 1.32, one thread,
    128 x 384 tokens, Gemm over a weight fed as an input, medians of 7x50): transB=1 over a (w, D) row view took
    0.346 / 0.174 ms at w = 768 / 384 against 0.358 / 0.179 ms for transB=0 over a contiguous (D, w) copy, and
    the full width prepacked 0.624 vs 0.627 ms. int8 has no transposed DynamicQuantizeMatMul; it runs
    DynamicQuantizeLinear + QGemm(transB=1) + BiasGelu, bit-identical to DynamicQuantizeMatMul + Gelu over a
    (D, w) copy (``_Graph.ffn``). Measured (one thread, x (M, 384) times W1 of MiniLM, medians of 7x300 calls,
    interleaved): prepacked full width 0.304 / 0.112 ms against 0.296 / 0.109 (M = 128 / 43, +3%); a 768-neuron
    prefix fed per call 0.191 / 0.086 ms against 0.167 / 0.066 ms over the copy, since ORT transposes an
    unpacked B on every call. In the engine (A/B, three alternating processes per tree, 40 AG News texts,
    int8) that was within noise at the prepacked budgets and +5% at b = 0.75, which runs on the all-budget
    session; bought back in memory: the per-(layer, width) int8 copies of W1 were 21 MB over the 19 budgets of
    the AG News checkpoint, 45% of one dense int8 session (docs/results.md, 'Findings and decisions').
    """
    return cfg.gate.scope == "model"  # both precisions: one layout, one rule


def pack(state: Arrays, cfg: ModelConfig, policy: BudgetPolicy, precision: Precision) -> Arrays:
    """The engine's weight store: every array all budgets share, in the layout described above.

    ``policy`` gives the per-layer head order (``perms``) and, for whole-model budgets, the neuron order
    (``neuron_perms``); attention-scope checkpoints keep their neurons in place.
    """
    dh, perms = cfg.head_dim, policy.perms
    neuron_perms = policy.neuron_perms if cfg.gate.scope == "model" else None
    e = "encoder.embeddings."
    out: Arrays = {
        "word": state[e + "word.weight"],
        # Position and the (always 0) token type folded into one table: one Add fewer per call.
        "pos_tt": state[e + "position.weight"] + state[e + "token_type.weight"][0],
        "emb_g": state[e + "norm.weight"], "emb_b": state[e + "norm.bias"],
        "cls_w": state["classifier.weight"], "cls_b": state["classifier.bias"],
    }
    if cfg.pooler != "none":
        out["pool_w"], out["pool_b"] = state["pooler.weight"], state["pooler.bias"]
    for i, depth in enumerate(cfg.gate.exits):  # exit heads stay fp32, as the classifier does
        out[f"exit{depth}_w"], out[f"exit{depth}_b"] = state[f"exits.{i}.weight"], state[f"exits.{i}.bias"]
    if precision == "int8":
        # The word table is most of the model (30522 x 384 fp32 = 47 MB for MiniLM): int8 rows with one
        # scale each, dequantized after the Gather (only the B*N gathered rows), as quantize_dynamic does.
        out["word"], out["word_s"] = quantize_rows(out["word"])
        if w1_by_rows(cfg):  # QGemm's per-neuron zero points (all 0, symmetric), sliced per width
            out["w1_z"] = np.zeros(cfg.intermediate_size, np.int8)
    for layer in range(cfg.n_layers):
        p = f"encoder.layers.{layer}."
        # Feature indices of the heads in rank order: (H*dh,).
        cols = (perms[layer][:, None] * dh + np.arange(dh)[None, :]).reshape(-1)
        # Q/K/V rows interleaved per head, [q_h; k_h; v_h] for h in rank order: (H*3*dh, D) out x in, so that
        # the first 3*k*dh rows are the k kept heads and one GEMM computes all three projections.
        qkv = np.stack([state[p + f"attention.{m}.weight"][cols].reshape(cfg.n_heads, dh, -1)
                        for m in ("query", "key", "value")], axis=1).reshape(3 * cfg.n_heads * dh, -1)
        out[f"l{layer}.bqkv"] = np.stack([state[p + f"attention.{m}.bias"][cols].reshape(cfg.n_heads, dh)
                                          for m in ("query", "key", "value")], axis=1).reshape(-1)
        if precision == "int8":
            # (D, H*3*dh), so a head prefix is a column copy per (layer, k) (engine slice cache, ~11 MB on MiniLM
            # over 19 budgets). Rows + QGemm as for W1 was measured (A/B, three alternating processes per tree,
            # 40 AG News texts): +2-3% at every budget for those 11 MB; memory is within 2x without it.
            out[f"l{layer}.wqkv"], out[f"l{layer}.wqkv_s"] = quantize_columns(qkv.T)  # (D, H*3*dh)
        else:
            out[f"l{layer}.wqkv"] = np.ascontiguousarray(qkv)
        wo_t = np.ascontiguousarray(state[p + "attention.output.weight"][:, cols].T)  # (H*dh, D) in x out
        w1, b1, w2 = state[p + "intermediate.weight"], state[p + "intermediate.bias"], state[p + "ffn_out.weight"]
        if neuron_perms is not None:  # neurons in rank order: (I, D) rows, (I,) entries, (D, I) columns
            w1, b1, w2 = w1[neuron_perms[layer]], b1[neuron_perms[layer]], w2[:, neuron_perms[layer]]
        # W1 (D, I), or (I, D) where a neuron prefix must be a row view (w1_by_rows); W2 (I, D).
        rows = w1_by_rows(cfg)
        w1_t = np.ascontiguousarray(w1 if rows else w1.T)
        w2_t = np.ascontiguousarray(w2.T)
        for name, w in (("wo", wo_t), ("w1", w1_t), ("w2", w2_t)):
            if precision == "int8" and name == "w1" and rows:  # one scale per neuron, as for the (D, I) layout
                out[f"l{layer}.w1"], scale = quantize_rows(w)
                out[f"l{layer}.w1_s"] = scale.reshape(-1)
            elif precision == "int8":
                out[f"l{layer}.{name}"], out[f"l{layer}.{name}_s"] = quantize_columns(w)
            else:
                out[f"l{layer}.{name}"] = w
        out[f"l{layer}.bo"] = state[p + "attention.output.bias"]
        out[f"l{layer}.b1"] = b1
        out[f"l{layer}.b2"] = state[p + "ffn_out.bias"]
        for name, norm in (("ln1", "attn_norm"), ("ln2", "ffn_norm")):
            out[f"l{layer}.{name}_g"] = state[p + norm + ".weight"]
            out[f"l{layer}.{name}_b"] = state[p + norm + ".bias"]
    if folds_residual_biases(precision):
        fold_residual_biases(out, cfg)
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def folds_residual_biases(precision: Precision) -> bool:
    """Whether a store of ``precision`` holds folded biases (and its graphs add no residual): fp32 only, since
    int8's DynamicQuantizeMatMul has no C input to carry the residual."""
    return precision == "fp32"


def fold_residual_biases(store: Arrays, cfg: ModelConfig) -> None:
    """Carry each block's output bias in the residual stream, so that the graph needs no Add per block (fp32).

    Each block computes LN(x + f(x) + b) with f's last matrix product in a Gemm. With x' = x + b the block is
    LN(f(x' - b) + x'): the Gemm takes x' as its C input (no separate Add), and f's first product sees x' - b
    through its bias, W(x' - b) + c = Wx' + (c - Wb). x' is the previous LayerNorm's output with b added to its
    beta. So per layer l (bo = W_O's bias, b2 = W2's): ``bqkv`` -= Wqkv bo, ``ln1_b`` += b2, ``b1`` -= W1 b2,
    and the norm before layer l gets bo: ``emb_bf`` (emb_b + bo) for l = 0, else ``l{l-1}.ln2_bf`` (ln2_b + bo;
    ``ln2_b`` stays plain for a layer whose output is pooled: the last one, or the last before an exit). The
    names ``bqkv``, ``ln1_b`` and ``b1`` hold the folded values in fp32 stores. Every fold is per
    output row (a head's Q/K/V rows, a neuron), so head and neuron prefixes stay prefixes. A layer with no
    head (no neuron) is LN(x') exactly, as the reference's LN(x + b). Measured (AG News exits checkpoint, one
    thread, 200 AG News texts, the engine's graphs with and without the fold in one process, each call after
    an ORT dense call): b = 1 11.28 -> 11.08 ms, b = 0.5 5.54 -> 5.48, b = 0.25 3.02 -> 2.96 (-1 to -2%);
    logits within 1e-6. int8's DynamicQuantizeMatMul has no C input, so int8 stores stay plain (bit-identical).
    """
    rows = w1_by_rows(cfg)
    store["emb_bf"] = store["emb_b"] + store["l0.bo"]  # emb_b stays plain: EngineBase.embed reads it
    for layer in range(cfg.n_layers):
        p = f"l{layer}."
        bo, b2 = store[p + "bo"].astype(np.float64), store[p + "b2"].astype(np.float64)
        store[p + "bqkv"] = (store[p + "bqkv"] - store[p + "wqkv"].astype(np.float64) @ bo).astype(np.float32)
        store[p + "ln1_b"] = store[p + "ln1_b"] + store[p + "b2"]
        w1 = store[p + "w1"].astype(np.float64)  # (I, D) rows, or (D, I)
        store[p + "b1"] = (store[p + "b1"] - (w1 @ b2 if rows else b2 @ w1)).astype(np.float32)
        if layer + 1 < cfg.n_layers:
            store[p + "ln2_bf"] = store[p + "ln2_b"] + store[f"l{layer + 1}.bo"]

