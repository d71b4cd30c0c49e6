"""Fast path for the adaptive model types: the encoder layer by layer, computing only what each input uses.

The reference (``models/``, eval mode) computes every head, key and dimension and multiplies the unchosen ones
by exactly 0. This engine gets the same numbers without computing them:
- BudgetFormer: per input and layer, s and p from the layer input, the top-k heads of p (k capped by the
  budget); Q/K/V and W_O are sliced to the kept heads, each kept head's output weighted by w_h = s * H * p_h.
- Adaptive span: each head attends only near its window w = ceil(z + R): queries in blocks of B, each block
  multiplying only the B + 2w - 2 keys its queries can reach (the ramp zeroes the few beyond w), heads with
  equal windows batched (heads are sorted by window at load); see ``_span`` for why not a strict window.
- AdaAttention: per input, each head's d' from the scorer; Q/K/V rows and W_O columns sliced to d'.
What each type chooses is engine/adaptive/model_types.py's (looked up once, at load), on models/' functions.
Every input runs at its own length (no padding). Inputs of a batch are packed into one (T, D) token matrix so
the feed-forward blocks and the projections of inputs that share a plan run as one matmul (``grouped``).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from headbudget.engine.adaptive.cost import Usage, plan_macs, span_block, span_blocked, span_pairs, usage_cost
from headbudget.engine.adaptive.model_types import Group, Layout, Plan, Weights, segment_mean, type_path
from headbudget.engine.base import EngineBase, check_budget, softmax, tokenized
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.precision import PRECISIONS
from headbudget.engine.types import BatchResult, EngineOptions, ExecutionPlan, ModelInfo, Prediction, Tokens
from headbudget.models.adaptive import AdaptiveAttention, AdaptiveClassifier
from headbudget.models.checkpoint import load_checkpoint
from headbudget.models.checkpoint_meta import CheckpointError
from headbudget.models.encoder import EncoderLayer
from headbudget.models.plan import uniform_plan

log = logging.getLogger(__name__)


@dataclass
class _Layer:
    """One encoder layer's weights laid out for head slicing (heads permuted by ``perm`` for span)."""

    qkv_w: torch.Tensor  # (H*3*dh, D): rows [q_h; k_h; v_h] per head, so a head set is one row gather
    qkv_b: torch.Tensor  # (H*3*dh,)
    out_w: torch.Tensor  # (H*dh, D): W_O transposed; head h's inputs are rows h*dh .. h*dh + dh - 1
    out_b: torch.Tensor  # (D,)
    attn: AdaptiveAttention  # the adaptive attention module, for its side network
    layout: Layout  # the heads' order and, for span, the layer's plan and ramp table
    attn_norm: nn.LayerNorm
    ffn_in: nn.Linear
    ffn_out: nn.Linear
    ffn_norm: nn.LayerNorm


def _layer(layer: EncoderLayer, layout: Layout) -> _Layer:
    """Re-lay one EncoderLayer's attention weights per head, heads in ``layout.perm`` order."""
    a = layer.attention
    assert isinstance(a, AdaptiveAttention)
    h, dh, d = a.n_heads, a.head_dim, a.query.weight.shape[1]
    w = torch.stack([a.query.weight, a.key.weight, a.value.weight]).view(3, h, dh, d).transpose(0, 1)
    b = torch.stack([a.query.bias, a.key.bias, a.value.bias]).view(3, h, dh).transpose(0, 1)  # (H, 3, dh)
    out = a.output.weight.t().reshape(h, dh, d)  # (H, dh, D)
    idx = torch.tensor(layout.perm)
    return _Layer(w[idx].reshape(h * 3 * dh, d).contiguous(), b[idx].reshape(-1).contiguous(),
                  out[idx].reshape(h * dh, d).contiguous(), a.output.bias, a, layout, layer.attn_norm,
                  layer.intermediate, layer.ffn_out, layer.ffn_norm)


def _ramp_is_one(layer: _Layer, heads: tuple[int, ...], n: int) -> bool:
    """Whether every one of ``heads`` (consecutive) sees every key of an ``n``-token input at full weight
    (span z >= n - 1): then they run, and are costed, as plain attention."""
    z = layer.layout.span_z
    return z is not None and float(z[heads[0] : heads[-1] + 1].min()) >= n - 1


RAMP_DENSE = -1  # a merged group: span heads of several windows, all run over every key with the ramp


def _merge_ramp_groups(plan: Plan, n: int) -> Plan:
    """The plan with adjacent span groups that would each run dense-with-ramp at length ``n`` merged into one
    (window RAMP_DENSE). Heads are sorted by window, so at short lengths most of a layer becomes one SDPA call
    instead of one per distinct window, whose fixed costs would outweigh what the spans save."""
    out: list[Group] = []
    for heads, width, window in plan:
        ramp_dense = window > 0 and not span_blocked(window, n)
        if ramp_dense and out and out[-1][2] == RAMP_DENSE and out[-1][1] == width:
            out[-1] = (out[-1][0] + heads, width, RAMP_DENSE)
        else:
            out.append((heads, width, RAMP_DENSE if ramp_dense else window))
    return tuple(out)


class AdaptiveEngine(EngineBase):
    """Engine over a BudgetFormer, span or AdaAttention checkpoint; fp32, PyTorch, one intra-op thread."""

    def __init__(self, model_dir: Path, options: EngineOptions, info: ModelInfo) -> None:
        spec = PRECISIONS.get(options.precision)
        if spec is None or not spec.torch_engines:
            raise ModelLoadError(f"{model_dir}: {info.model_type} checkpoints run on the fp32 adaptive torch path "
                                 f"only; precision {options.precision!r} is not available for them")
        try:
            model, _ = load_checkpoint(Path(model_dir))
        except CheckpointError as e:
            raise ModelLoadError(str(e)) from e
        model.requires_grad_(False)  # the re-laid weights below are then plain tensors, not autograd graphs
        path = type_path(model.cfg)
        if not isinstance(model, AdaptiveClassifier) or path is None:
            raise ModelLoadError(f"{model_dir}: model_type {model.cfg.model_type!r} is not an adaptive type")
        super().__init__(model_dir, model.cfg, options)
        torch.set_num_threads(options.threads)
        self.model, self.info, self.kind, self.path = model, info, model.cfg.model_type, path
        c = self.cfg
        self.n_heads, self.head_dim, self.scale = c.n_heads, c.head_dim, 1.0 / math.sqrt(c.head_dim)
        # Pack the batch (True) rather than run inputs one by one (False): faster for every adaptive type, mostly
        # through the packed feed-forward blocks (inputs rarely share a BudgetFormer head set).
        self.grouped = True
        self.layers: list[_Layer] = []
        for layer in model.encoder.layers:
            assert isinstance(layer, EncoderLayer) and isinstance(layer.attention, AdaptiveAttention)
            self.layers.append(_layer(layer, path.layout(layer.attention)))
        self._rows: dict[Plan, tuple[torch.Tensor, torch.Tensor] | None] = {}
        self._arange = torch.arange(c.max_position)
        self._dist = (self._arange[:, None] - self._arange[None, :]).abs()  # (S, S) token distances

    # -- the Engine interface ---------------------------------------------------------------------------
    def cap(self, budget: float) -> int:
        """Heads per layer an input may run at ``budget``: BudgetFormer's k_cap (1.0 = H = no cap); H for the
        types the budget does not bound."""
        return self.path.cap_heads(budget)

    def make_plan(self, budget: float) -> ExecutionPlan:
        """The cap, as every layer's head count: BudgetFormer's k_cap, so requests with one cap share a batch;
        span and AdaAttention run their learned configuration at every budget, so every request can share one
        (all heads). What each input ran is in its Prediction's cost."""
        return uniform_plan(self.cfg, self.cap(budget))

    def forward_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
        rows = [input_ids[i][attention_mask[i] != 0] for i in range(len(input_ids))]
        logits, _ = self.run_rows(rows, plan.heads[0])
        out: np.ndarray = logits.numpy()  # (B, C)
        return out

    def predict(self, texts: Sequence[str], budget: float, tokens: Tokens | None = None) -> BatchResult:
        """Classify under ``budget`` (the cap); each Prediction's cost is what that input really ran, and its
        budget_chosen what a type that chooses its own budget chose (within the cap)."""
        b = check_budget(budget)
        enc = tokenized(self.encoder, texts, tokens)
        t0 = time.perf_counter()
        logits_t, usages = self.run_rows([np.asarray(r, dtype=np.int64) for r in enc.ids], self.cap(b))
        latency = time.perf_counter() - t0
        logits = logits_t.numpy()
        probs = softmax(logits.astype(np.float64))
        labels, preds = self.cfg.labels, []
        for i, row in enumerate(logits.tolist()):
            n = len(enc.ids[i])
            cost = usage_cost(self.shape, usages[i], n)
            preds.append(Prediction(
                label=labels[int(np.argmax(logits[i]))], scores=dict(zip(labels, probs[i].tolist(), strict=True)),
                logits=row, n_tokens=n, truncated=enc.truncated[i], cost=cost,
                budget_chosen=self.path.budget_chosen(cost)))
        # The batch's heads: the mean over its inputs of the heads each ran, rounded (inputs choose their own).
        heads = round(sum(p.cost.heads_active for p in preds) / len(preds))
        return BatchResult(predictions=preds, budget=b, heads_active=heads, heads_total=self.cfg.total_heads,
                           latency_s=latency)

    def warmup(self) -> None:
        self.run_rows([np.array([101, 2023, 102], dtype=np.int64)] * 2, self.n_heads)

    # -- the forward pass -------------------------------------------------------------------------------
    def run_rows(self, rows: Sequence[np.ndarray], cap: int, adaptive: bool = True) -> tuple[torch.Tensor, list[Usage]]:
        """Logits (B, C) and per-input Usage for unpadded int64 rows; ``adaptive=False`` computes every head,
        key and dimension (the dense baseline of the benchmark, same code)."""
        with torch.inference_mode():
            if self.grouped:
                return self._forward_rows(rows, cap, adaptive)
            parts = [self._forward_rows([r], cap, adaptive) for r in rows]
            return torch.cat([p[0] for p in parts]), [p[1][0] for p in parts]

    def _forward_rows(self, rows: Sequence[np.ndarray], cap: int, adaptive: bool) -> tuple[torch.Tensor, list[Usage]]:
        """The packed forward: rows' tokens stacked into (T, D), attention per input, the rest per token."""
        lengths = [len(r) for r in rows]
        seg = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(lengths))  # (T,) input of each token
        emb = self.model.encoder.embeddings
        ids = torch.from_numpy(np.concatenate(rows))
        pos = torch.cat([self._arange[:n] for n in lengths])
        x = emb.word.weight[ids] + emb.position.weight[pos] + emb.token_type.weight[0]  # (T, D)
        x = emb.norm(x)
        usages = [Usage() for _ in rows]
        for layer in self.layers:
            plans, weights = self._choose(layer, x, seg, lengths, cap, adaptive, usages)
            y = self._attention(layer, x, lengths, plans, weights)  # (T, D)
            x = layer.attn_norm(x + y)
            x = layer.ffn_norm(x + layer.ffn_out(F.gelu(layer.ffn_in(x))))
        if self.cfg.pooling == "cls":
            pooled = x[torch.tensor([0, *np.cumsum(lengths)[:-1]])]  # (B, D)
        else:
            pooled = segment_mean(x, seg, lengths)
        return self.model.head(pooled), usages

    def _choose(self, layer: _Layer, x: torch.Tensor, seg: torch.Tensor, lengths: list[int], cap: int,
                adaptive: bool, usages: list[Usage]) -> tuple[list[Plan], Weights]:
        """Each input's plan for this layer (and BudgetFormer's head weights); records what it costs."""
        plans, weights = self.path.choose(layer.attn, layer.layout, x, seg, lengths, cap, adaptive)
        d = self.cfg.hidden_size
        for plan, n, u in zip(plans, lengths, usages, strict=True):
            widths = [w for heads, w, _ in plan for _ in heads]
            pairs = [self._pairs(layer, heads, win, n) for heads, _, win in plan for _ in heads]
            u.add(len(widths), plan_macs(d, n, widths, pairs), self.path.side_macs(n))
        return plans, weights

    def _pairs(self, layer: _Layer, heads: tuple[int, ...], window: int, n: int) -> int:
        """(query, key) pairs ``_span`` (window > 0) or plain attention multiplies per head."""
        if not window or _ramp_is_one(layer, heads, n):
            return n * n
        return span_pairs(window, n)

    def _attention(self, layer: _Layer, x: torch.Tensor, lengths: list[int], plans: list[Plan],
                   weights: Weights) -> torch.Tensor:
        """Attention output (T, D): inputs that share a plan share one projection matmul."""
        groups: dict[Plan, list[int]] = {}
        for i, plan in enumerate(plans):
            groups.setdefault(plan, []).append(i)
        if len(groups) == 1:
            return self._group(layer, x, lengths, plans[0], weights)
        starts = np.concatenate([[0], np.cumsum(lengths)])
        y = torch.empty_like(x)
        for plan, members in groups.items():
            tok = torch.from_numpy(np.concatenate([np.arange(starts[i], starts[i + 1]) for i in members]))
            y_g = self._group(layer, x.index_select(0, tok), [lengths[i] for i in members], plan,
                              [weights[i] for i in members])
            y.index_copy_(0, tok, y_g)
        return y

    def _group(self, layer: _Layer, x: torch.Tensor, lengths: list[int], plan: Plan,
               weights: Weights) -> torch.Tensor:
        """Inputs (packed x (T_g, D)) running one plan: sliced projections, per-input attention -> (T_g, D)."""
        rows = self._plan_rows(plan)
        if rows is None:  # every head at full width, in order: the whole weights, no gather
            qkv_w, qkv_b, out_w = layer.qkv_w, layer.qkv_b, layer.out_w
        else:
            qkv_w, qkv_b, out_w = layer.qkv_w[rows[0]], layer.qkv_b[rows[0]], layer.out_w[rows[1]]
        proj = F.linear(x, qkv_w, qkv_b)  # (T_g, sum 3 d')
        outs, start = [], 0
        for n, w in zip(lengths, weights, strict=True):
            outs.append(self._heads(layer, proj[start : start + n], plan, w))  # (n, sum d')
            start += n
        y = outs[0] if len(outs) == 1 else torch.cat(outs)
        return torch.addmm(layer.out_b, y, out_w)  # (T_g, D)

    def _heads(self, layer: _Layer, proj: torch.Tensor, plan: Plan, w: torch.Tensor | None) -> torch.Tensor:
        """One input's heads from its projections (n, sum 3 d') -> head outputs side by side (n, sum d')."""
        n, col, h0, ys = proj.shape[0], 0, 0, []
        for heads, width, window in _merge_ramp_groups(plan, n):
            g = len(heads)
            blk = proj[:, col : col + 3 * g * width].view(n, g, 3, width)
            q, k, v = (blk[:, :, j].transpose(0, 1) for j in range(3))  # (g, n, d') each
            if window == RAMP_DENSE:
                y = self._ramp_dense(layer, q, k, v, heads)
            elif window:
                y = self._span(layer, q, k, v, heads, window)
            else:  # the scale stays 1/sqrt(d_h) at every d', as the reference masks rather than rescales
                # 4-D: with (g, n, d') SDPA falls back to its much slower math path.
                y = F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale)[0]  # (g, n, d')
            if w is not None:
                y = y * w[h0 : h0 + g, None, None]
            ys.append(y.transpose(0, 1).reshape(n, g * width))
            col, h0 = col + 3 * g * width, h0 + g
        return ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)

    def _ramp_dense(self, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    heads: tuple[int, ...]) -> torch.Tensor:
        """Span heads (consecutive in the layer's order) over every key, the ramp as a per-head additive mask:
        q, k, v (g, n, dh) -> (g, n, dh). One SDPA for all of them, whatever their windows."""
        table = layer.layout.span_log_m
        assert table is not None
        n = q.shape[1]
        if _ramp_is_one(layer, heads, n):  # log m = 0 on every pair: plain attention
            return F.scaled_dot_product_attention(q[None], k[None], v[None], scale=self.scale)[0]
        bias = table[heads[0] : heads[-1] + 1][:, self._dist[:n, :n]]  # (g, n, n): log m per distance
        return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=bias[None], scale=self.scale)[0]

    def _span(self, layer: _Layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, ...],
              window: int) -> torch.Tensor:
        """SpanAttention for heads sharing ``window`` (consecutive in the layer's order): q, k, v (g, n, dh).

        Queries run in blocks of B = span_block(w) with one SDPA over each block's B + 2w - 2 keys (a strict
        per-query neighbourhood is many tiny matmuls, slower than dense SDPA); the ramp's log m (0 weight beyond the
        window) is the additive mask.
        """
        assert layer.layout.span_z is not None and layer.layout.span_log_m is not None
        g, n, dh = q.shape
        lo, hi = heads[0], heads[-1] + 1
        if not span_blocked(window, n):  # the band would not save enough: dense scores with the ramp
            return self._ramp_dense(layer, q, k, v, heads)
        table = layer.layout.span_log_m[lo:hi]  # (g, max_position): log m at each distance
        block = span_block(window)
        keys = block + 2 * window - 2
        n_blocks = -(-n // block)
        extra = n_blocks * block - n
        pad = (0, 0, window - 1, window - 1 + extra)
        kb = F.pad(k, pad).unfold(1, keys, block).transpose(-1, -2)  # (g, nb, keys, dh): key r = b B - (w-1) + j
        vb = F.pad(v, pad).unfold(1, keys, block).transpose(-1, -2)
        qb = F.pad(q, (0, 0, 0, extra)).reshape(g, n_blocks, block, dh)
        i, j = self._arange[:block], self._arange[:keys]
        dist = (i[:, None] + (window - 1) - j[None, :]).abs()  # (B, keys), the same in every block
        r = self._arange[:n_blocks, None] * block - (window - 1) + j[None, :]  # (nb, keys)
        outside = ((r < 0) | (r >= n))[None, :, None, :]  # zero padding before the first / after the last token
        bias = table[:, dist][:, None].expand(g, n_blocks, block, keys).masked_fill(outside, torch.finfo(q.dtype).min)
        y = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bias, scale=self.scale)  # (g, nb, B, dh)
        return y.reshape(g, n_blocks * block, dh)[:, :n]

    def _plan_rows(self, plan: Plan) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rows of qkv_w and out_w a plan uses (cached per plan); None when it is every row in order."""
        if plan not in self._rows:
            dh, qkv, out = self.head_dim, [], []
            for heads, width, _ in plan:
                for h in heads:
                    qkv += [h * 3 * dh + part * dh + j for part in range(3) for j in range(width)]
                    out += list(range(h * dh, h * dh + width))
            if len(self._rows) > 4096:  # bounded: a long-running server sees many head sets
                self._rows.clear()
            full = qkv == list(range(self.n_heads * 3 * dh))
            self._rows[plan] = None if full else (torch.tensor(qkv), torch.tensor(out))
        return self._rows[plan]

