"""What every backend shares: budget and input validation, tokenization, padding, answers and their cost."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import numpy as np

from headbudget.engine import passes
from headbudget.engine.decider import PredictorPoint, passes_cost, pooled_features, read_decider, run_auto
from headbudget.engine.errors import BudgetError, InputError, ModelLoadError
from headbudget.engine.meter import TokenMeter
from headbudget.engine.types import (
    Auto,
    BatchResult,
    Cost,
    EngineOptions,
    ExecutionPlan,
    ModelInfo,
    Prediction,
    Runnable,
    Tokens,
)
from headbudget.engine.weights.store import Embeddings
from headbudget.models.config import ModelConfig
from headbudget.models.model_types import model_type
from headbudget.models.plan import Shape, uniform_plan
from headbudget.models.tokenizer import TextEncoder


def check_budget(budget: object) -> float:
    """A finite number in [0, 1] as a float, else BudgetError (bool is refused: True is not a budget)."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float, np.floating)):
        raise BudgetError(f"budget must be a number in [0, 1], got {budget!r}")
    b = float(budget)
    if not math.isfinite(b) or not 0.0 <= b <= 1.0:
        raise BudgetError(f"budget must be a number in [0, 1], got {budget!r}")
    return b


def check_texts(texts: Sequence[str]) -> list[str]:
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        raise InputError("texts must be a list of strings")
    if not texts:
        raise InputError("empty batch: give at least one text")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise InputError(f"text {i} is {type(t).__name__}, not a string")
        if not t.strip():
            raise InputError(f"text {i} is empty")
    return list(texts)


def tokenized(encoder: TextEncoder, texts: Sequence[str], tokens: Tokens | None) -> Tokens:
    """``texts`` checked and tokenized, or ``tokens`` where the caller tokenized them already (a Meter of this
    engine's, whose tokenizer is a copy of ``encoder``'s)."""
    texts = check_texts(texts)
    if tokens is None:
        enc = encoder.encode(texts)
        return Tokens(enc.ids, enc.truncated)
    if len(tokens.ids) != len(texts) or len(tokens.truncated) != len(texts):
        raise InputError(f"{len(texts)} texts but tokens for {len(tokens.ids)}")
    return tokens


def pad(ids: Sequence[Sequence[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Pad to the longest sequence: input_ids int64 (B, N) and attention_mask int32 (B, N)."""
    lengths = [len(row) for row in ids]
    n = max(lengths)
    out = np.full((len(ids), n), pad_id, dtype=np.int64)
    mask = np.zeros((len(ids), n), dtype=np.int32)
    for i, row in enumerate(ids):
        out[i, : lengths[i]] = row
        mask[i, : lengths[i]] = 1
    return out, mask


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - logits.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)  # type: ignore[no-any-return]


def with_decider(model_dir: Path, info: ModelInfo) -> ModelInfo:
    """``info`` with the decider.json ``model_dir`` holds now; as it is when that file is missing or unusable (a
    running decider is not taken away), or when the model type takes none."""
    if not model_type(info.model_type).static_plans:
        return info
    decider = read_decider(Path(model_dir), info.checksum, info.labels)
    if decider is None or decider == info.decider:
        return info
    return replace(info, decider=decider, supports_auto=True)


class EngineBase:
    """Tokenization, budgets and answers; a backend implements ``make_plan`` and ``forward_ids``."""

    cfg: ModelConfig
    info: ModelInfo

    def __init__(self, model_dir: Path, cfg: ModelConfig, options: EngineOptions) -> None:
        self.model_dir, self.cfg, self.options = Path(model_dir), cfg, options
        max_length = options.max_length or cfg.max_position
        if not 2 <= max_length <= cfg.max_position:
            raise ModelLoadError(f"max_length {max_length} outside [2, {cfg.max_position}] for {model_dir}")
        try:
            self.encoder = TextEncoder(self.model_dir, max_length)
        except (FileNotFoundError, ValueError, OSError) as e:
            raise ModelLoadError(f"{model_dir}: tokenizer unusable ({e})") from e
        self.max_length = max_length
        self.shape = Shape.of(cfg)
        cap = options.max_activation_bytes
        one = passes.activation_bytes(self.shape, uniform_plan(cfg, cfg.n_heads), 1, max_length)
        if cap is not None and cap < one:
            raise ModelLoadError(f"max_activation_bytes {cap} is below one text of {max_length} tokens at every "
                                 f"head ({one} bytes, {-(-one // passes.MiB)} MiB) for {model_dir}")
        self._plans: dict[float, ExecutionPlan] = {}
        self._costs: dict[tuple[float, int], Cost] = {}  # (budget, tokens) -> one pass's cost (a decider's auto)

    def reload_decider(self) -> ModelInfo:
        self.info = with_decider(self.model_dir, self.info)
        return self.info

    # -- to implement ----------------------------------------------------------------------------------
    def make_plan(self, budget: float) -> ExecutionPlan:
        """The plan ``budget`` (already validated) turns into for this checkpoint."""
        raise NotImplementedError

    def forward_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, plan: ExecutionPlan) -> np.ndarray:
        """Logits (B, C) float32 for padded int64 ids and int32 mask (B, N), running ``plan``."""
        raise NotImplementedError

    def embedding_tables(self) -> Embeddings:
        """The embedding layer as the weight store lays it out (engine/weights/store.py ``Embeddings``). Backends whose
        type has static plans (the ones a decider serves) implement it."""
        raise NotImplementedError

    def embed(self, ids: Sequence[int]) -> np.ndarray:
        """The embedding layer's output (N, D) for one text's ids: word + position + type, LayerNorm, in numpy
        (a predictor decider's cheap features: no encoder layer runs)."""
        t = self.embedding_tables()
        idx = np.asarray(ids, dtype=np.int64)
        x = t.word[idx].astype(np.float32)
        if t.word_s is not None:
            x *= t.word_s[idx]
        x += t.pos_tt[: len(idx)]
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        return (x - mu) / np.sqrt(var + self.cfg.layer_norm_eps) * t.emb_g + t.emb_b  # type: ignore[no-any-return]

    # -- the Engine interface ---------------------------------------------------------------------------
    def plan(self, budget: float) -> ExecutionPlan:
        b = check_budget(budget)
        plan = self._plans.get(b)
        if plan is None:
            plan = self._plans[b] = self.make_plan(b)
        return plan

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        return tokenized(self.encoder, texts, None).counts()

    def meter(self) -> TokenMeter:
        # A tokenizer of its own: the Meter is called from other threads while this engine runs.
        return TokenMeter(TextEncoder(self.model_dir, self.max_length), self.shape, self.meter_plan)

    def meter_plan(self, budget: float) -> ExecutionPlan:
        """The plan for ``budget`` without touching the backend's state (the Meter calls it off this thread); a
        backend whose ``make_plan`` caches executor state overrides it."""
        return self.make_plan(check_budget(budget))

    def predict(self, texts: Sequence[str], budget: float, tokens: Tokens | None = None) -> BatchResult:
        b = check_budget(budget)
        enc = tokenized(self.encoder, texts, tokens)
        plan = self.plan(b)
        t0 = time.perf_counter()
        logits, ran = self.forward_rows(enc.ids, plan)
        latency = time.perf_counter() - t0
        probs = softmax(logits.astype(np.float64))
        labels = self.cfg.labels
        preds = []
        for i, row in enumerate(logits.tolist()):
            n = len(enc.ids[i])
            preds.append(Prediction(
                label=labels[int(np.argmax(logits[i]))],
                scores=dict(zip(labels, probs[i].tolist(), strict=True)),
                logits=row, n_tokens=n, truncated=enc.truncated[i], cost=plan.cost(self.shape, n),
            ))
        return BatchResult(predictions=preds, budget=b, heads_active=plan.heads_active,
                           heads_total=plan.heads_total, latency_s=latency, tokens_run=ran)

    def run(self, texts: Sequence[str], request: Runnable, tokens: Tokens | None = None) -> BatchResult:
        resolved = self.info.resolve(request)
        if isinstance(resolved, Auto):
            return self._decided(texts, resolved, tokens)
        return self.predict(texts, resolved.budget, tokens)

    def _decided(self, texts: Sequence[str], request: Auto, tokens: Tokens | None = None) -> BatchResult:
        """``Auto`` through the checkpoint's decider (``info.resolve`` checked there is one)."""
        decider = self.info.decider
        assert decider is not None
        c = check_budget(request.ceiling)
        enc = tokenized(self.encoder, texts, tokens)
        lengths = [len(ids) for ids in enc.ids]
        ran = 0

        def run_pass(budget: float, idx: list[int]) -> np.ndarray:
            nonlocal ran
            logits, tokens = self.forward_rows([enc.ids[i] for i in idx], self.plan(budget))
            ran += tokens
            return logits

        def pass_macs(budget: float, n: int) -> int:
            return self.pass_cost(budget, n).total_macs

        t0 = time.perf_counter()
        point = decider.point(request.target)
        features = self.features(enc.ids) if isinstance(point, PredictorPoint) else None
        runs = run_auto(decider, point, c, lengths, run_pass, pass_macs, features)
        latency = time.perf_counter() - t0
        labels, preds = self.cfg.labels, []
        for i, run in enumerate(runs):
            assert run.logits is not None
            logits = run.logits.astype(np.float32)
            probs = softmax(logits.astype(np.float64)[None, :])[0]
            cost = passes_cost([self.pass_cost(b, lengths[i]) for b in run.passes])
            preds.append(Prediction(
                label=labels[int(np.argmax(logits))], scores=dict(zip(labels, probs.tolist(), strict=True)),
                logits=logits.tolist(), n_tokens=lengths[i], truncated=enc.truncated[i], cost=cost,
                budget_chosen=run.passes[-1], passes=tuple(run.passes)))
        heads = round(sum(p.cost.heads_active for p in preds) / len(preds))
        return BatchResult(predictions=preds, budget=c, heads_active=heads, heads_total=self.cfg.total_heads,
                           latency_s=latency, tokens_run=ran)

    def forward_rows(self, rows: Sequence[Sequence[int]], plan: ExecutionPlan) -> tuple[np.ndarray, int]:
        """Logits (B, C) for tokenized texts and the tokens their passes ran, padding included; in passes of texts of about one length whose activations stay under
        ``max_activation_bytes`` (engine/passes.py); each pass pads to its own longest text. In fp32 a text's logits
        do not depend on its batchmates or padding; int8 quantizes each activation matrix of a pass as a whole
        (DynamicQuantizeMatMul), so there they move within quantization noise with what shares the pass."""
        cap = self.options.max_activation_bytes
        lengths = [len(r) for r in rows]
        groups = passes.split(lengths, (lambda b, n: True) if cap is None else
                              (lambda b, n: passes.activation_bytes(self.shape, plan, b, n) <= cap))
        parts, largest = [], 0
        for idx in groups:
            ids, mask = pad([rows[i] for i in idx], self.encoder.pad_id)
            largest = max(largest, passes.activation_bytes(self.shape, plan, *ids.shape))
            parts.append(self.forward_ids(ids, mask, plan))
        if len(parts) > 1 or largest > passes.KEEP_BYTES:  # passes.KEEP_BYTES says why
            self.give_back(plan)
        ran = passes.padded_tokens(lengths, groups)
        if len(parts) == 1:
            return parts[0], ran
        out = np.empty((len(rows), parts[0].shape[1]), dtype=parts[0].dtype)
        for idx, logits in zip(groups, parts, strict=True):
            out[idx] = logits
        return out, ran

    def give_back(self, plan: ExecutionPlan) -> None:
        """Return to the system the memory a large batch's passes took (a backend whose runtime keeps it)."""

    def pass_cost(self, budget: float, n_tokens: int) -> Cost:
        """One pass's cost at ``budget`` for a text of ``n_tokens`` (cached: a decider asks often)."""
        cost = self._costs.get((budget, n_tokens))
        if cost is None:
            if len(self._costs) > 50_000:  # ceilings are any number: keep the cache bounded
                self._costs.clear()
            cost = self._costs[(budget, n_tokens)] = self.plan(budget).cost(self.shape, n_tokens)
        return cost

    def features(self, rows: Sequence[Sequence[int]]) -> np.ndarray:
        """(B, D + 1) the predictor decider's features of tokenized texts (engine/decider.py)."""
        return np.stack([pooled_features(self.embed(ids), len(ids)) for ids in rows])

    def predict_ids(self, input_ids: np.ndarray, attention_mask: np.ndarray, budget: float) -> np.ndarray:
        """Logits (B, C) for pre-tokenized, padded inputs (evaluation and the benchmark)."""
        b = check_budget(budget)
        ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        mask = np.ascontiguousarray(attention_mask, dtype=np.int32)
        if ids.ndim != 2 or ids.shape != mask.shape or ids.shape[0] == 0 or ids.shape[1] == 0:
            raise InputError(f"input_ids and attention_mask must be equal non-empty (B, N), got {ids.shape}, {mask.shape}")
        if ids.shape[1] > self.max_length:
            raise InputError(f"sequence length {ids.shape[1]} exceeds max_length {self.max_length}")
        return self.forward_ids(ids, mask, self.plan(b))

    def warmup(self) -> None:
        pass

    def close(self) -> None:
        pass
