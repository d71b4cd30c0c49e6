"""A fake Engine for unit tests of the serving layer: deterministic answers, controllable speed, call log."""

from __future__ import annotations

import contextlib
import hashlib
import math
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any

from headbudget.engine.errors import BudgetError, InputError
from headbudget.engine.types import (
    Auto,
    BatchResult,
    BenchRecord,
    Cost,
    ExecutionPlan,
    ModelInfo,
    Prediction,
    Runnable,
    SweepRecord,
    Tokens,
)


class FakeEngine:
    """Follows the Engine protocol; asserts it is never called from two threads at once."""

    def __init__(self, *, labels: Sequence[str] = ("negative", "positive"), n_layers: int = 2, n_heads: int = 4,
                 max_length: int = 32, delay_s: float = 0.0, per_token_s: float = 0.0,
                 sweep: dict[str, Any] | None = None, bench: dict[str, Any] | None = None,
                 supports_auto: bool = False) -> None:
        self.info = ModelInfo(name="fake", checksum="0" * 64, labels=tuple(labels), n_layers=n_layers,
                              n_heads=n_heads, max_length=max_length, supports_auto=supports_auto,
                              sweep=SweepRecord.parse(sweep), bench=BenchRecord.parse(bench))
        self.delay_s = delay_s
        self.per_token_s = per_token_s
        self.calls: list[tuple[list[str], float]] = []
        self.warmed = False
        self.closed = False
        self.gate = threading.Event()  # cleared: predict blocks until set (to hold a batch in flight)
        self.gate.set()
        self.entered = threading.Event()  # set when a call reaches the gate: a batch is in flight
        self._thread: int | None = None  # the thread inside a call now
        self._lock = threading.Lock()
        self._depth = 0
        self.threads: set[int] = set()  # every thread that ever called
        self.runs_with_tokens: list[bool] = []  # per run(): whether it was given its Meter's token ids
        self.metered: list[int] = []  # per Meter.tokenize call: how many texts it tokenized
        self.floor_gap = 0  # tokens the Meter's fewest_tokens leaves out of each text's count (a looser bound)

    @contextlib.contextmanager
    def _one_thread(self) -> Iterator[None]:
        """The Engine contract: never called from two threads at once."""
        me = threading.get_ident()
        with self._lock:
            assert self._thread in (None, me), "the engine was called from two threads at once"
            self._thread, self._depth = me, self._depth + 1
            self.threads.add(me)
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._thread = None

    def _k(self, budget: float) -> int:
        """Heads the batch runs at ``budget``, all layers together (nested: the count fixes the heads)."""
        total = self.info.n_layers * self.info.n_heads
        return min(total, max(1, math.floor(budget * total + 0.5 + 1e-9)))

    def plan(self, budget: float) -> ExecutionPlan:
        """The first k heads in (layer, head) order."""
        k, h = self._k(budget), self.info.n_heads
        return ExecutionPlan(heads=tuple(min(h, max(0, k - layer * h)) for layer in range(self.info.n_layers)),
                             n_heads=h)

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        with self._one_thread():
            return self._count_tokens(texts)

    def _count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        out = []
        for t in texts:
            n = len(t.split()) + 2
            out.append((min(n, self.info.max_length), n > self.info.max_length))
        return out

    def predict(self, texts: Sequence[str], budget: float) -> BatchResult:
        with self._one_thread():
            return self._predict(texts, budget)

    def run(self, texts: Sequence[str], request: Runnable, tokens: Tokens | None = None) -> BatchResult:
        """As the real engines: the checkpoint resolves the request, a Fixed runs ``predict``; ``tokens`` (its
        Meter's) are recorded, and the texts counted again all the same."""
        self.runs_with_tokens.append(tokens is not None)
        resolved = self.info.resolve(request)
        if isinstance(resolved, Auto):
            return self.run_auto(texts, resolved)
        return self.predict(texts, resolved.budget)

    def run_auto(self, texts: Sequence[str], request: Auto) -> BatchResult:
        """An Auto through a decider; a fake with one overrides this."""
        raise BudgetError("this fake has no decider")

    def _predict(self, texts: Sequence[str], budget: float) -> BatchResult:
        if not texts or any(not t.strip() for t in texts):
            raise InputError("empty text")
        self.entered.set()
        self.gate.wait(30)
        self.calls.append((list(texts), budget))
        counts = self.count_tokens(texts)
        k = self.plan(budget).heads_active
        total = self.info.n_layers * self.info.n_heads
        started = time.perf_counter()
        work = len(texts) * max(n for n, _ in counts) * (0.1 + 0.9 * self.run_fraction(budget))
        time.sleep(self.delay_s + self.per_token_s * work)
        preds = []
        for text, (n, truncated) in zip(texts, counts, strict=True):
            active, chosen = self.heads_for(text, budget)
            h = int(hashlib.sha256(f"{text}|{active}".encode()).hexdigest(), 16)
            p = 0.5 + ((h % 1000) / 1000 - 0.5) * 0.9
            scores = {self.info.labels[0]: 1 - p, self.info.labels[1]: p}
            label = max(scores, key=lambda lab: scores[lab])
            cost = self.text_cost(active, n)
            preds.append(Prediction(label=label, scores=scores, logits=[0.0, 0.0], n_tokens=n, truncated=truncated,
                                    cost=cost, budget_chosen=chosen))
        return BatchResult(predictions=preds, budget=budget, heads_active=k, heads_total=total,
                           latency_s=time.perf_counter() - started)

    def text_cost(self, active: int, n: int) -> Cost:
        """One text's cost with ``active`` heads on ``n`` tokens: 1000 MACs a token in attention, 2000 in the rest
        of the forward pass (which always runs here)."""
        total, dense = self.info.n_layers * self.info.n_heads, 1000 * n
        attention = dense * active // total
        return Cost(heads_active=active, heads_total=total, attention_macs=attention, attention_macs_dense=dense,
                    total_macs=attention + 2 * dense, total_macs_dense=3 * dense)

    def cap_heads(self, budget: float) -> int:
        """The most heads a text may run at ``budget`` (what the plan says)."""
        return self._k(budget)

    def meter(self) -> FakeMeter:
        return FakeMeter(self)

    def run_fraction(self, budget: float) -> float:
        """The fraction of heads a batch at ``budget`` runs (its simulated speed)."""
        return self._k(budget) / (self.info.n_layers * self.info.n_heads)

    def heads_for(self, text: str, budget: float) -> tuple[int, float | None]:
        """(heads active, Prediction.budget_chosen) for one text: one mask for the whole batch, nothing chosen."""
        return self._k(budget), None

    def warmup(self) -> None:
        self.warmed = True

    def reload_decider(self) -> ModelInfo:
        return self.info

    def close(self) -> None:
        self.closed = True


class FakeMeter:
    """The fake engine's Meter: its token count and its cost at the plan's heads, without the engine's lock."""

    def __init__(self, engine: FakeEngine) -> None:
        self._engine = engine

    def count_tokens(self, texts: Sequence[str]) -> list[tuple[int, bool]]:
        return self._engine._count_tokens(texts)

    def fewest_tokens(self, texts: Sequence[str]) -> list[int]:
        return [max(2, n - self._engine.floor_gap) for n, _ in self._engine._count_tokens(texts)]

    def tokenize(self, texts: Sequence[str]) -> Tokens:
        self._engine.metered.append(len(texts))
        counts = self._engine._count_tokens(texts)
        return Tokens([[0] * n for n, _ in counts], [cut for _, cut in counts])

    def cost(self, budget: float, n_tokens: int) -> Cost:
        return self._engine.text_cost(self._engine.cap_heads(budget), n_tokens)


class FakeBudgetFormer(FakeEngine):
    """A checkpoint that predicts its own budget per text (the BudgetFormer engine contract): ``budget`` is a
    cap, k = min(k_predicted, round(budget * H)) heads per layer; the plan is the cap in every layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.info = replace(self.info, name="fake-budgetformer", model_type="budgetformer", supports_auto=True)

    def predicted_heads(self, text: str) -> int:
        """Heads per layer this text asks for: 1 + len(text) % H (varies with the text, deterministically)."""
        return 1 + len(text) % self.info.n_heads

    def predicted_budget(self, text: str) -> float:
        """The text's own budget (what ``auto`` runs)."""
        return self.predicted_heads(text) / self.info.n_heads

    def _cap(self, budget: float) -> int:
        return min(self.info.n_heads, max(1, math.floor(budget * self.info.n_heads + 0.5 + 1e-9)))

    def plan(self, budget: float) -> ExecutionPlan:
        return ExecutionPlan(heads=(self._cap(budget),) * self.info.n_layers, n_heads=self.info.n_heads)

    def run_fraction(self, budget: float) -> float:
        return self._cap(budget) / self.info.n_heads

    def cap_heads(self, budget: float) -> int:
        return self._cap(budget) * self.info.n_layers

    def heads_for(self, text: str, budget: float) -> tuple[int, float | None]:
        """Its own heads per layer within the cap; what it chose is that fraction of the heads."""
        k = min(self.predicted_heads(text), self._cap(budget))
        return k * self.info.n_layers, k / self.info.n_heads
