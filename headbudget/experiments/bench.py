"""The latency benchmark: the engine at several budgets against the dense runtimes, in one process.

Protocol (docs/method.md §10): one thread, eval mode, pre-tokenized inputs, warm-up, then the median and p90 of
``repeats`` timed calls. Methods are timed round-robin (every round runs every method once on the same
batch), so load from other processes on a shared machine hits all of them alike.
"""

from __future__ import annotations

import csv
import json
import logging
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any, Literal

import numpy as np

from headbudget.engine.base import pad
from headbudget.engine.protocol import TokenEngine
from headbudget.engine.types import EngineOptions, Precision

log = logging.getLogger(__name__)
BENCH_BUDGETS = (1.0, 0.75, 0.5, 0.25, 0.1)
Cache = Literal["cold", "warm", "steady"]
# What ran on the core before a timed call, i.e. where its weights are read from:
# - cold (the default): every other method of the round, whose weights evict its own, as in a server whose
#   requests switch budget (and model) call by call;
# - warm: one untimed call of the same method on the same input;
# - steady: a run of calls of the same method back to back (a batch job's pattern): the rounds go in blocks of
#   STEADY_BLOCK texts, and each method times a block right after an untimed pass over it. Why both: one call
#   does not refill the caches, so a budget's time depends on what ran before it. The served path is the cold
#   case even at one budget: the server's own work between two passes stirs the caches (docs/results.md, 'Cache
#   state and the small budgets').
CACHES: tuple[Cache, ...] = ("cold", "warm", "steady")
STEADY_BLOCK = 10


@dataclass(frozen=True)
class BenchConfig:
    model_dir: Path
    seq_len: int = 128
    batch_size: int = 1
    data: Path | None = None  # folder with test.csv / train.csv: real lengths instead of seq_len
    precision: Precision = "fp32"
    repeats: int = 30
    warmup: int = 5
    threads: int = 1
    # Fresh processes per memory figure, the median kept (0: no memory figure); each costs an interpreter start.
    memory_probes: int = 3
    cache: Cache = "cold"  # see CACHES


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def code_commit(short: bool = True) -> str:
    """The commit of the headbudget code that runs (a checkout on PYTHONPATH measures older code)."""
    import headbudget

    cmd = ["git", "-C", str(Path(headbudget.__file__).parent), "rev-parse", *(["--short"] if short else []), "HEAD"]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def data_texts(folder: Path, n: int, seed: int = 0) -> list[str]:
    """``n`` texts sampled from test.csv (else train.csv) of ``folder``; column ``text`` or the first one."""
    for name in ("test.csv", "train.csv"):
        path = Path(folder) / name
        if path.is_file():
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            if not rows:
                break
            col = "text" if "text" in rows[0] else next(iter(rows[0]))
            return [r[col] for r in random.Random(seed).sample(rows, min(n, len(rows)))]
    raise FileNotFoundError(f"{folder}: no test.csv or train.csv with rows")


def make_batches(engine: TokenEngine, cfg: BenchConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    """One padded (ids, mask) batch per timed round: real texts with --data, else fixed-length tokens."""
    rounds = cfg.repeats + cfg.warmup
    if cfg.data is not None:
        texts = data_texts(cfg.data, rounds * cfg.batch_size)
        texts = (texts * (rounds * cfg.batch_size // len(texts) + 1))[: rounds * cfg.batch_size]
        enc = engine.encoder.encode(texts)
        return [pad(enc.ids[i : i + cfg.batch_size], engine.encoder.pad_id)
                for i in range(0, len(texts), cfg.batch_size)]
    rng = np.random.default_rng(0)
    out = []
    for _ in range(rounds):
        ids = rng.integers(1000, 20000, (cfg.batch_size, cfg.seq_len), dtype=np.int64)
        ids[:, 0], ids[:, -1] = 101, 102
        out.append((ids, np.ones_like(ids, dtype=np.int32)))
    return out


def time_round_robin(methods: dict[str, Callable[[np.ndarray, np.ndarray], object]],
                     batches: Sequence[tuple[np.ndarray, np.ndarray]], warmup: int,
                     cache: Cache = "cold", shuffle: bool = False) -> dict[str, list[float]]:
    """Per-method call times, one per batch after the first ``warmup``, in batch order (so rounds stay paired
    across methods); ``cache`` says what runs before each timed call (CACHES). ``shuffle``: each round runs the
    methods in its own (seeded) order, so that in the cold case no method always follows the same one: with a
    fixed order, b = 0.1 always ran right after b = 1 and paid for its evictions in every round."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    block = STEADY_BLOCK if cache == "steady" else 1
    names, rng = list(methods), random.Random(0)
    for start in range(0, len(batches), block):
        chunk = list(enumerate(batches[start : start + block], start))
        ordered = rng.sample(names, len(names)) if shuffle else names
        # cold: methods alternate call by call; warm and steady: each timed pass follows an untimed one
        order = ([(i, b, name, True) for i, b in chunk for name in ordered] if cache == "cold" else
                 [(i, b, name, timed) for name in ordered for timed in (False, True) for i, b in chunk])
        for i, (ids, mask), name, timed in order:
            t0 = time.perf_counter()
            methods[name](ids, mask)
            if timed and i >= warmup:
                times[name].append(time.perf_counter() - t0)
    return times


def ratio_ci95(num: Sequence[float], den: Sequence[float], resamples: int = 2000, seed: int = 0) -> list[float]:
    """95% interval of median(num) / median(den) over rounds resampled with replacement, kept paired.

    Why: with ``--data`` every round is another text, so a 30-round median moves with which texts were drawn
    (b = 0.25's share of the bound was 90.6% on 30 texts and 88.3% on 300 in one session); the interval says
    how far a headline ratio can be trusted. Percentile bootstrap: the rounds' times are not normal."""
    a, b = np.asarray(num), np.asarray(den)
    idx = np.random.default_rng(seed).integers(0, len(a), (resamples, len(a)))  # (R, n) paired round indices
    ratios = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    return [round(float(q), 3) for q in np.quantile(ratios, [0.025, 0.975])]


def _ms(values: Sequence[float], q: float) -> float:
    return round(float(np.quantile(np.asarray(values), q)) * 1000, 3)


def memory_figure(model_dir: Path, dense_onnx: Path, precision: str, probes: int = 3) -> dict[str, Any]:
    """Resident memory of an engine serving all 19 budgets vs one dense ORT session, each in a fresh process.

    Both processes import the same modules first and report the growth after that, so the figure is
    about the model, not the interpreter (importing headbudget.models currently pulls in torch). The engine
    is measured twice: as served (budgets 0.25 and 0.5 with prepacked sessions of their own, which cost their
    plan's share of the weights again) and with no prepacked budget (every budget on the one dynamic session),
    so that the memory each prepacked budget buys its speed with is on the record. Each figure is the median
    of ``probes`` processes (``samples_mb`` holds them all): one process's reading is not stable (a dense fp32
    session read 115 or 130 MB from one process to the next, the same file).
    """
    samples: dict[str, list[float]] = {"engine": [], "engine_unprepacked": [], "dense": []}
    sessions = 0
    for kind, prepacked, key in (("engine", None, "engine"), ("engine", (), "engine_unprepacked"),
                                 ("dense", None, "dense")):
        arg = json.dumps({"kind": kind, "model_dir": str(model_dir), "dense": str(dense_onnx), "precision": precision,
                          "prepacked": prepacked})
        for _ in range(probes):
            proc = subprocess.run([sys.executable, "-c", "from headbudget.experiments.bench import _memory_child as m; m()",
                                   arg], capture_output=True, text=True, timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"memory probe failed: {proc.stderr[-2000:]}")
            figure = json.loads(proc.stdout.strip().splitlines()[-1])
            samples[key].append(figure[f"{kind}_mb"])
            if key == "engine":
                sessions = figure["engine_sessions"]
    out: dict[str, Any] = {f"{key}_mb": float(np.median(values)) for key, values in samples.items()}
    out["engine_sessions"] = sessions
    out["engine_over_dense"] = round(out["engine_mb"] / out["dense_mb"], 3)
    out["engine_unprepacked_over_dense"] = round(out["engine_unprepacked_mb"] / out["dense_mb"], 3)
    out["samples_mb"] = samples
    return out


def _bare_run(engine: TokenEngine, ids: np.ndarray, mask: np.ndarray, budget: float) -> Callable[[], object] | None:
    """The ONNX engine's session run alone on ``ids``, its inputs wrapped once outside the timed call (None for a
    backend without sessions): what ``predict_ids`` adds in Python is the difference."""
    from headbudget.engine.onnx.backend import OnnxEngine

    if not isinstance(engine, OnnxEngine):
        return None
    sess, feeds = engine._runner(engine.plan(budget))  # noqa: SLF001 - the benchmark times the engine's own call
    feeds = {**feeds, "input_ids": sess.value(ids), "attention_mask": sess.value(mask)}
    options = engine._run_options  # noqa: SLF001

    def run() -> object:
        return sess.run(feeds, options)
    return run


def _memory_child() -> None:
    import onnxruntime  # noqa: F401 - imported before the baseline on both sides

    from headbudget.engine import factory  # noqa: F401
    from headbudget.engine.onnx import backend
    from headbudget.experiments.peers import ort_session

    arg = json.loads(sys.argv[-1])
    base = rss_mb()
    ids, mask = np.full((1, 128), 1000, dtype=np.int64), np.ones((1, 128), dtype=np.int32)
    if arg["kind"] == "engine":
        options = EngineOptions(precision=arg["precision"])
        if arg.get("prepacked") is not None:
            options = replace(options, prepacked_budgets=tuple(arg["prepacked"]))
        engine = factory.load_engine(Path(arg["model_dir"]), options)
        assert isinstance(engine, backend.OnnxEngine)  # the default backend: its sessions are counted
        engine.warmup()
        for b in (1.0, 0.5, 0.1):
            engine.predict_ids(ids, mask, b)
        print(json.dumps({"engine_mb": round(rss_mb() - base, 1), "engine_sessions": engine.n_sessions}))
    else:
        dense = Path(arg["dense"])
        session = ort_session(dense if arg["precision"] == "fp32" else dense.with_name("dense-int8.onnx"))
        session.run(None, {"input_ids": ids, "attention_mask": mask.astype(np.int64)})
        print(json.dumps({"dense_mb": round(rss_mb() - base, 1)}))


def _at_budget(engine: TokenEngine, budget: float, ids: np.ndarray, mask: np.ndarray) -> object:
    return engine.predict_ids(ids, mask, budget)


def run_bench(cfg: BenchConfig) -> dict[str, Any]:
    """Measure everything bench.json holds; see the CLI (headbudget bench) for the table."""
    import torch

    from headbudget.engine.factory import load_engine
    from headbudget.experiments import peers
    from headbudget.models.checkpoint import load_checkpoint

    torch.set_num_threads(cfg.threads)
    model, _ = load_checkpoint(cfg.model_dir)
    engine = load_engine(cfg.model_dir, EngineOptions(precision=cfg.precision, threads=cfg.threads))
    engine.warmup()
    batches = make_batches(engine, cfg)
    work = Path(tempfile.mkdtemp(prefix="headbudget-bench-"))
    dense_fp32, dense_int8 = peers.export_dense(model, work)
    methods: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
        f"engine@{b}": partial(_at_budget, engine, b) for b in BENCH_BUDGETS
    }
    methods.update({
        "hf_eager": peers.torch_runner(peers.hf_model(model, "eager")),
        "hf_sdpa": peers.torch_runner(peers.hf_model(model, "sdpa")),
        "ort_fp32": peers.ort_runner(peers.ort_session(dense_fp32, cfg.threads)),
        "ort_int8": peers.ort_runner(peers.ort_session(dense_int8, cfg.threads)),
    })
    times = time_round_robin(methods, batches, cfg.warmup, cfg.cache)
    lengths = [int(m.sum(1).mean()) for _, m in batches[cfg.warmup:]]
    n_cost = int(np.median(lengths))
    dense_key = "ort_fp32" if cfg.precision == "fp32" else "ort_int8"
    result: dict[str, Any] = {
        "model": engine.info.name, "seq_len": cfg.seq_len if cfg.data is None else "data",
        "median_tokens": n_cost, "batch_size": cfg.batch_size, "threads": cfg.threads,
        "precision": cfg.precision, "repeats": cfg.repeats, "cache": cfg.cache,
        "cpu": cpu_name(), "rows": _budget_rows(engine, times, dense_key, n_cost),
        "peers": {f"{k}_ms": _ms(times[k], 0.5) for k in ("hf_eager", "hf_sdpa", "ort_fp32", "ort_int8")},
        "max_abs_logit_diff": max_logit_diff(engine, model, batches[: 3]),
    }
    result["overhead"] = overhead(engine, methods[dense_key], cfg, times, dense_key)
    result["overhead_ms"] = result["overhead"]["overhead_ms"]
    if cfg.memory_probes:
        result["memory"] = memory_figure(cfg.model_dir, dense_fp32, cfg.precision, cfg.memory_probes)
    result["rss_mb"] = round(rss_mb(), 1)
    return result


def _budget_rows(engine: TokenEngine, times: dict[str, list[float]], dense_key: str, n_cost: int) -> list[dict[str, Any]]:
    """One row per benchmark budget: its latency and its speed-up over b = 1 and over the dense ORT peer."""
    ort_dense = _ms(times[dense_key], 0.5)
    b1 = _ms(times["engine@1.0"], 0.5)
    rows = []
    for b in BENCH_BUDGETS:
        med = _ms(times[f"engine@{b}"], 0.5)
        plan = engine.plan(b)
        rows.append({"budget": b, "heads_active": plan.heads_active, "latency_ms": med,
                     "p90_ms": _ms(times[f"engine@{b}"], 0.9), "speedup_vs_b1": round(b1 / med, 3),
                     "speedup_vs_ort_dense": round(ort_dense / med, 3),
                     "speedup_vs_b1_ci95": ratio_ci95(times["engine@1.0"], times[f"engine@{b}"]),
                     "speedup_vs_ort_dense_ci95": ratio_ci95(times[dense_key], times[f"engine@{b}"]),
                     "flop_bound_speedup": round(plan.flop_bound_speedup(engine.shape, n_cost), 3)})
    return rows


def max_logit_diff(engine: TokenEngine, model: Any, batches: Sequence[tuple[np.ndarray, np.ndarray]]) -> float:
    """Largest |engine - masked reference| logit over the benchmark budgets and a few batches."""
    import torch

    worst = 0.0
    for b in BENCH_BUDGETS:
        for ids, mask in batches:
            with torch.no_grad():
                ref = model.hard_logits(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), b).numpy()
            worst = max(worst, float(np.abs(engine.predict_ids(ids, mask, b) - ref).max()))
    return worst


def _paired_ms(a: Sequence[float], b: Sequence[float]) -> float:
    """Median of per-round differences a - b in ms: both ran in the same round, so shared load cancels."""
    return round(float(np.median(np.asarray(a) - np.asarray(b))) * 1000, 3)


def overhead(engine: TokenEngine, ort_dense: Callable[[np.ndarray, np.ndarray], object], cfg: BenchConfig,
             times: dict[str, list[float]], dense_key: str) -> dict[str, float]:
    """Fixed per-call cost of the engine over ORT dense (same precision), and where it comes from.

    - ``overhead_ms``: engine at b = 1 minus ORT dense on a 2-token input, median of paired rounds, each
      call timed right after an untimed call of the same method (its weights warm in cache). Both read
      the same (prepacked) weights, so the reads cancel and what is left is per-call work: Python, feeds,
      the If nodes and the small ops of each graph. Negative: the engine's fixed cost is the smaller.
    - ``wrapper_ms``: ``predict_ids`` minus a bare ``run`` of the engine's session with the same feeds
      (input checks and OrtValue wrapping in Python); ``predict_minus_predict_ids_ms``: tokenization,
      padding and building answers for one AG-News-length text.
    - ``engine_minus_ort_at_bench_lengths_ms``: the same paired difference at the benchmark's own lengths.
    """
    ids, mask = np.array([[101, 102]], dtype=np.int64), np.ones((1, 2), dtype=np.int32)
    text = ["Stocks rallied on Wall Street on Tuesday as oil prices fell for a third day, lifting airline "
            "shares and easing worries about inflation ahead of the Federal Reserve meeting."]
    enc = engine.encoder.encode(text)
    tids, tmask = pad(enc.ids, engine.encoder.pad_id)
    rounds = [(ids, mask)] * (max(cfg.repeats, 30) * 2 + 5)
    methods: dict[str, Callable[[np.ndarray, np.ndarray], object]] = {
        "engine": lambda i, m: engine.predict_ids(i, m, 1.0), "ort": ort_dense}
    bare = _bare_run(engine, ids, mask, 1.0)
    if bare is not None:
        methods["bare"] = lambda i, m: bare()
    t = time_round_robin(methods, rounds, 5, "warm")  # at 2 tokens cache warmth would dominate
    t2 = time_round_robin({"predict": lambda i, m: engine.predict(text, 1.0),
                           "predict_ids": lambda i, m: engine.predict_ids(tids, tmask, 1.0)}, rounds, 5, "warm")
    out = {"overhead_ms": _paired_ms(t["engine"], t["ort"]),
           "engine_2_tokens_ms": _ms(t["engine"], 0.5), "ort_dense_2_tokens_ms": _ms(t["ort"], 0.5),
           "engine_minus_ort_at_bench_lengths_ms": _paired_ms(times["engine@1.0"], times[dense_key]),
           "predict_minus_predict_ids_ms": _paired_ms(t2["predict"], t2["predict_ids"]),
           "text_tokens": len(enc.ids[0])}
    if bare is not None:
        out["wrapper_ms"] = _paired_ms(t["engine"], t["bare"])
    return out
