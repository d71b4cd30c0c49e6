"""Latency of the adaptive fast path against the same checkpoint run dense, at fixed sequence lengths.

Protocol as experiments/bench.py: one thread, batch 1, pre-tokenized inputs, warm-up, then the median of
``repeats`` rounds, every round running every method once on the same input (round-robin), in one process:
- ``adaptive``: AdaptiveEngine computing only the heads, keys and dimensions each input uses;
- ``fast_dense``: the same code with the adaptive choice disabled (every head, key and dimension);
- ``reference``: the PyTorch model of models/ in eval mode (computes everything, multiplies by 0).
Each round gets a different input (the adaptive choice is per input): real texts' token ids concatenated to
the length when a data folder is given, else random ids from the vocabulary.

    python -m headbudget.experiments.adaptive.bench --model DIR --lengths 128,512 [--data DIR] > bench.json
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from headbudget.commands.parser import OneLineParser
from headbudget.engine.adaptive.backend import AdaptiveEngine
from headbudget.engine.adaptive.cost import usage_cost
from headbudget.engine.errors import ModelLoadError
from headbudget.engine.factory import load_engine
from headbudget.engine.names import BACKEND_NAMES
from headbudget.engine.types import Backend, EngineOptions
from headbudget.experiments.bench import data_texts, time_round_robin

CLS, SEP = 101, 102


class Other(NamedTuple):
    """Another checkpoint timed beside the adaptive one: its engine at ``budget`` on ``backend``."""

    name: str
    folder: Path
    budget: float
    backend: Backend = "onnxruntime"


def synthetic_rows(engine: AdaptiveEngine, length: int, count: int, data: Path | None,
                   seed: int = 0) -> list[np.ndarray]:
    """``count`` int64 rows of exactly ``length`` tokens, [CLS] ... [SEP]."""
    rng = np.random.default_rng(seed)
    if data is None:
        body = rng.integers(1000, engine.cfg.vocab_size, (count, length - 2))
        return [np.concatenate([[CLS], b, [SEP]]).astype(np.int64) for b in body]
    texts = data_texts(data, 500, seed)
    pieces = [np.asarray(ids[1:-1], dtype=np.int64) for ids in engine.encoder.encode(texts).ids]  # no CLS/SEP
    rows = []
    for _ in range(count):
        order = rng.permutation(len(pieces))
        stream = np.concatenate([pieces[i] for i in order])  # every text once: far more than 512 tokens
        reps = (length - 2) // max(1, len(stream)) + 1
        rows.append(np.concatenate([[CLS], np.tile(stream, reps)[: length - 2], [SEP]]).astype(np.int64))
    return rows


def bench_lengths(model_dir: Path, lengths: Sequence[int] = (128, 512), repeats: int = 20, warmup: int = 3,
                  data: Path | None = None) -> dict[str, Any]:
    """Median ms of adaptive / fast-dense / reference forwards at each length, and the speedups."""
    engine = load_engine(Path(model_dir), EngineOptions(backend="torch", threads=1))
    if not isinstance(engine, AdaptiveEngine):
        raise ModelLoadError(f"{model_dir}: model_type {engine.info.model_type!r} is not an adaptive type")
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got {repeats}, {warmup}")
    cap, model = engine.n_heads, engine.model  # BudgetFormer uncapped: its own choice (budget=auto)
    out: dict[str, Any] = {"model": str(model_dir), "model_type": engine.kind, "threads": 1, "batch_size": 1,
                           "repeats": repeats, "warmup": warmup, "inputs": "data" if data else "random",
                           "lengths": {}}
    for length in lengths:
        if not 2 <= length <= engine.max_length:
            raise ValueError(f"length {length} outside [2, {engine.max_length}] for this checkpoint")
        rows = synthetic_rows(engine, length, repeats + warmup, data)
        batches = [(r[None], np.ones((1, length), dtype=np.int64)) for r in rows]

        def reference(ids: np.ndarray, mask: np.ndarray) -> object:
            with torch.inference_mode():
                return model(torch.from_numpy(ids), torch.from_numpy(mask))

        methods: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {"adaptive": lambda ids, mask: engine.run_rows([ids[0]], cap),
                   "fast_dense": lambda ids, mask: engine.run_rows([ids[0]], cap, adaptive=False),
                   "reference": reference}
        times = time_round_robin(methods, batches, warmup)
        ms = {k: round(float(np.median(v)) * 1000, 3) for k, v in times.items()}
        ratios, diff = [], 0.0
        for ids, mask in batches[warmup:]:
            logits, usage = engine.run_rows([ids[0]], cap)
            ratios.append(usage_cost(engine.shape, usage[0], length).attention_ratio)
            ref = reference(ids, mask)
            assert isinstance(ref, torch.Tensor)
            diff = max(diff, float((logits - ref).abs().max()))
        out["lengths"][str(length)] = {
            **{f"{k}_ms": v for k, v in ms.items()},
            "speedup_vs_fast_dense": round(ms["fast_dense"] / ms["adaptive"], 3),
            "speedup_vs_reference": round(ms["reference"] / ms["adaptive"], 3),
            "attention_mac_ratio": round(float(np.mean(ratios)), 4),  # adaptive attention MACs / dense
            "max_abs_logit_diff": diff,
        }
    return out


def bench_texts(model_dir: Path, data: Path, n: int = 300, warmup: int = 10,
                others: Sequence[Other] = (), cap_budget: float = 1.0) -> dict[str, Any]:
    """Real texts at their own lengths (batch 1): adaptive vs fast dense, and other checkpoints' engines.

    ``others`` run through ``load_engine`` on their backend (ONNX Runtime by default; ``torch`` for a
    like-for-like comparison with the adaptive PyTorch path) in the same rounds, so every method sees the same
    texts in the same process; each timed number is the median over the texts of one call per text.
    """
    engine = load_engine(Path(model_dir), EngineOptions(backend="torch", threads=1))
    if not isinstance(engine, AdaptiveEngine):
        raise ModelLoadError(f"{model_dir}: model_type {engine.info.model_type!r} is not an adaptive type")
    cap = engine.cap(cap_budget)
    texts = data_texts(data, n + warmup)
    rows = [np.asarray(ids, dtype=np.int64) for ids in engine.encoder.encode(texts).ids]
    batches = [(r[None], np.ones((1, len(r)), dtype=np.int64)) for r in rows]
    methods: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
        "adaptive": lambda ids, mask: engine.run_rows([ids[0]], cap),
        "fast_dense": lambda ids, mask: engine.run_rows([ids[0]], cap, adaptive=False),
    }
    loaded = []
    for name, folder, budget, backend in others:
        other = load_engine(Path(folder), EngineOptions(backend=backend, threads=1))
        other.warmup()
        loaded.append(other)
        methods[name] = (lambda e, b: lambda ids, mask: e.predict_ids(ids, mask, b))(other, budget)
    times = time_round_robin(methods, batches, warmup, "warm")
    ratios = []
    for ids, _ in batches[warmup:]:
        _, usage = engine.run_rows([ids[0]], cap)
        ratios.append(usage_cost(engine.shape, usage[0], ids.shape[1]).attention_ratio)
    for other in loaded:
        other.close()
    ms = {k: round(float(np.median(v)) * 1000, 3) for k, v in times.items()}
    return {"model": str(model_dir), "model_type": engine.kind, "threads": 1, "batch_size": 1, "texts": n,
            "data": str(data), "cap_budget": cap_budget,
            "median_tokens": float(np.median([len(r) for r in rows[warmup:]])),
            "others": [{"name": o.name, "model": str(o.folder), "budget": o.budget, "backend": o.backend}
                       for o in others],
            **{f"{k}_ms": v for k, v in ms.items()},
            "speedup_vs_fast_dense": round(ms["fast_dense"] / ms["adaptive"], 3),
            "attention_mac_ratio": round(float(np.mean(ratios)), 4)}


def main(argv: Sequence[str] | None = None) -> int:
    """The CLI: JSON on stdout; bad input is one line on stderr and exit code 2."""
    parser = OneLineParser(prog="python -m headbudget.experiments.adaptive.bench", description=__doc__)
    parser.add_argument("--model", type=Path, required=True, help="checkpoint folder of an adaptive type")
    parser.add_argument("--lengths", default="128,512", help="comma-separated sequence lengths")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--data", type=Path, default=None, help="folder with test.csv/train.csv (real token ids)")
    parser.add_argument("--texts", type=int, default=0,
                        help="instead of fixed lengths: this many real texts from --data at their own lengths")
    parser.add_argument("--compare", action="append", default=[], metavar="NAME=DIR@BUDGET[:BACKEND]",
                        help="with --texts: also time another checkpoint's engine at a budget (repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.texts:
            if args.data is None:
                raise ValueError("--texts needs --data")
            others = []
            for item in args.compare:
                name, _, rest = item.partition("=")
                folder, _, budget = rest.rpartition("@")
                budget, _, backend = budget.partition(":")
                if not name or not folder or backend not in ("", *BACKEND_NAMES):
                    raise ValueError(f"--compare {item!r}: expected NAME=DIR@BUDGET[:{'|'.join(BACKEND_NAMES)}]")
                others.append(Other(name, Path(folder), float(budget), "torch" if backend == "torch" else "onnxruntime"))
            print(json.dumps(bench_texts(args.model, args.data, args.texts, args.warmup, others), indent=2))
            return 0
        lengths = [int(x) for x in args.lengths.split(",") if x.strip()]
        if not lengths:
            raise ValueError("--lengths is empty")
        if not args.model.is_dir():
            raise ModelLoadError(f"{args.model}: no such checkpoint folder")
        result = bench_lengths(args.model, lengths, args.repeats, args.warmup, args.data)
    except (ModelLoadError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
