"""`headbudget compare`: train or reuse every method for every seed, evaluate on one test split, report.

Methods (METHODS.md sections 1 and 4; one row per method and budget in compare.json):

| method              | artifact                                               | trained for    |
|---------------------|--------------------------------------------------------|----------------|
| dense               | the dense warm start, all heads (reference, b = 1)     | -              |
| budgeted            | the three-stage run's final checkpoint                 | every budget   |
| soft-only           | the same run's stage-2 checkpoint, served with hard masks | every budget |
| posthoc             | dense weights + gradient-importance ranking, no training | every budget  |
| posthoc-structural  | the same with a per-layer floor                        | every budget   |
| posthoc+recovery    | posthoc, one epoch of dense-teacher distillation at b  | one budget     |
| static              | gates trained at one fixed b (stage 2, then stage 3)   | one budget     |

Everything is cached under ``out`` by a hash of what determines it, so a second invocation trains nothing
and a killed one resumes: ``runs/budgeted-s<seed>-<hash>`` is an ordinary ``headbudget train`` folder (the
dense warm start in its ``stages/dense`` is shared by every method of that seed), and every other artifact
is a checkpoint folder under ``artifacts/``, written last-file-first so that ``config.json`` marks it done.
Accuracies are cached beside each artifact (``eval.json``); latencies are measured afresh each time, in one
process and round-robin over all artifacts of a seed, so that their ratios are paired.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from headbudget.experiments import baselines
from headbudget.experiments.importance import Importance, head_importance, importance_heatmap
from headbudget.models.checkpoint import load_checkpoint, save_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.tokenizer import TextEncoder, copy_tokenizer
from headbudget.training.batches import TokenizedSplit, tokenize
from headbudget.training.data import DataSet, load_data
from headbudget.training.evaluation import accuracy
from headbudget.training.recipes import Recipe
from headbudget.training.trainer import RunConfig, tokenizer_folder, train

log = logging.getLogger(__name__)

# A latency probe: artifact folder -> predict(ids (1, N) int64, mask (1, N), budget) -> logits (1, C).
Predictor = Callable[[np.ndarray, np.ndarray, float], np.ndarray]
EngineFactory = Callable[[Path], Predictor]
PER_BUDGET = ("posthoc+recovery", "static")
METHODS = ("dense", "budgeted", "soft-only", "posthoc", "posthoc-structural", "posthoc+recovery", "static")


@dataclass(frozen=True)
class CompareConfig:
    """Everything a comparison depends on; parsed once by the CLI."""

    data: str
    seeds: tuple[int, ...]
    budgets: tuple[float, ...]
    recipe: Recipe
    base: str = "minilm"
    device: str = "cpu"
    text_column: str = "text"
    label_column: str = "label"
    importance_examples: int = 2000  # training examples for the gradient importance
    ablation_examples: int = 500  # validation examples for the mask-one-head score (0 = skip)
    test_limit: int | None = None  # test examples evaluated (None = all)
    latency_texts: int = 200  # test texts timed one by one per artifact (0 = skip latency)
    latency_repeats: int = 3  # passes over those texts; the median pass counts
    extra: dict[str, Any] = field(default_factory=dict)  # written to compare.json as is (e.g. the command)

    def run_config(self, seed: int) -> RunConfig:
        return RunConfig(base=self.base, data=self.data, recipe=self.recipe, seed=seed,
                         text_column=self.text_column, label_column=self.label_column, device=self.device)


def config_hash(identity: dict[str, Any]) -> str:
    """Short, stable hash of a JSON-able identity."""
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]


@dataclass
class SeedContext:
    """What every method of one seed shares: the run, the data, the dense warm start, the importance."""

    seed: int
    run_dir: Path
    run_identity: dict[str, Any]
    ds: DataSet
    train: TokenizedSplit
    val: TokenizedSplit
    test: TokenizedSplit
    dense: BudgetedClassifier
    importance: Importance
    trained: list[str] = field(default_factory=list)  # artifacts this invocation trained


def _done(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_budgeted(cfg: CompareConfig, seed: int, out: Path) -> tuple[Path, bool]:
    """The budgeted run of ``seed`` (trained or resumed unless already complete); returns (folder, trained)."""
    run = cfg.run_config(seed)
    folder = out / "runs" / f"budgeted-s{seed}-{config_hash(run.identity())}"
    if _done(folder) and all((folder / "stages" / s / "done.json").is_file() for s in ("dense", "budget", "hard")):
        log.info("budgeted s%d: cached (%s)", seed, folder)
        return folder, False
    log.info("budgeted s%d: training (%s)", seed, folder)
    train(run, folder)
    return folder, True


def prepare_seed(cfg: CompareConfig, seed: int, out: Path) -> SeedContext:
    """Train or reuse the budgeted run, tokenize the data, load the warm start, compute importance."""
    run_dir, trained = ensure_budgeted(cfg, seed, out)
    run = cfg.run_config(seed)
    recipe = cfg.recipe
    ds = load_data(cfg.data, cfg.text_column, cfg.label_column, seed=seed, synthetic_size=recipe.synthetic_size)
    dense, _ = load_checkpoint(run_dir / "stages" / "dense")
    dense = dense.to(cfg.device)
    encoder = TextEncoder(tokenizer_folder(cfg.base), min(recipe.max_length, dense.cfg.max_position))
    ctx = SeedContext(seed, run_dir, run.identity(), ds, tokenize(ds.train, encoder),
                      tokenize(ds.validation.take(recipe.val_examples), encoder),
                      tokenize(ds.test.take(cfg.test_limit), encoder), dense, None,  # type: ignore[arg-type]
                      ["budgeted"] if trained else [])
    ctx.importance = ensure_importance(cfg, ctx, out)
    return ctx


def _subset(data: TokenizedSplit, n: int | None) -> TokenizedSplit:
    n = len(data) if n is None else min(n, len(data))
    return TokenizedSplit(data.ids[:n], data.labels[:n], 0)


def ensure_importance(cfg: CompareConfig, ctx: SeedContext, out: Path) -> Importance:
    """Head importance of the seed's dense warm start, cached as importance.json."""
    ident = {"run": ctx.run_identity, "examples": cfg.importance_examples, "ablation": cfg.ablation_examples}
    folder = out / "artifacts" / f"importance-s{ctx.seed}-{config_hash(ident)}"
    path = folder / "importance.json"
    if path.is_file():
        d = json.loads(path.read_text())
        return Importance(np.asarray(d["gradient"]), np.asarray(d["gradient_raw"]),
                          None if d["ablation"] is None else np.asarray(d["ablation"]), d["base_loss"],
                          d["n_examples"])
    log.info("importance s%d: computing on %d training examples", ctx.seed, cfg.importance_examples)
    val = _subset(ctx.val, cfg.ablation_examples) if cfg.ablation_examples else None
    imp = head_importance(ctx.dense, _subset(ctx.train, cfg.importance_examples), val)
    folder.mkdir(parents=True, exist_ok=True)
    importance_heatmap(imp, folder / "importance.png", f"{ctx.ds.name}, dense warm start, seed {ctx.seed}")
    path.write_text(json.dumps({**imp.to_dict(), "identity": ident}, indent=2) + "\n")
    return imp


def _save_artifact(model: BudgetedClassifier, folder: Path, ctx: SeedContext, cfg: CompareConfig,
                   method: str, ident: dict[str, Any], seconds: float, budget: float | None) -> Path:
    meta = {"name": folder.name, "model_type": "budgeted", "method": method, "seed": ctx.seed,
            "budget": budget, "base": cfg.base, "max_length": min(cfg.recipe.max_length, model.cfg.max_position),
            "identity": ident, "train_seconds": seconds,
            "data": {"name": ctx.ds.name, "spec": cfg.data, "fingerprint": ctx.ds.fingerprint,
                     "labels": list(ctx.ds.labels), "text_column": cfg.text_column,
                     "label_column": cfg.label_column}}
    folder.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(tokenizer_folder(cfg.base), folder)
    save_checkpoint(model.cpu(), folder, meta)  # config.json last: it marks the artifact complete
    model.to(cfg.device)
    return folder


def ensure_artifact(cfg: CompareConfig, ctx: SeedContext, out: Path, method: str,
                    budget: float | None = None) -> Path:
    """The checkpoint folder of one method (one budget for per-budget methods), built unless cached."""
    if method == "budgeted":
        return ctx.run_dir
    ident = {"method": method, "budget": budget, "run": ctx.run_identity,
             "importance_examples": cfg.importance_examples, "version": 1}
    tag = f"{method.replace('+', '-')}-s{ctx.seed}" + (f"-b{budget:.2f}" if budget is not None else "")
    folder = out / "artifacts" / f"{tag}-{config_hash(ident)}"
    if _done(folder):
        log.info("%s: cached (%s)", tag, folder)
        return folder
    log.info("%s: %s (%s)", tag, "training" if method in PER_BUDGET else "building", folder)
    t0 = time.perf_counter()
    model = _build(cfg, ctx, folder, method, budget)
    if method in PER_BUDGET:
        ctx.trained.append(tag)
    return _save_artifact(model, folder, ctx, cfg, method, ident, time.perf_counter() - t0, budget)


def _build(cfg: CompareConfig, ctx: SeedContext, folder: Path, method: str, budget: float | None) -> BudgetedClassifier:
    ranking = ctx.importance.ranking()
    seed = ctx.seed + 100
    if method == "posthoc":
        return baselines.with_ranking(ctx.dense, ranking)
    if method == "posthoc-structural":
        return baselines.with_ranking(ctx.dense, ranking, structural=True)
    if method == "soft-only":
        model, _ = load_checkpoint(ctx.run_dir / "stages" / "budget")
        return model
    assert budget is not None
    if method == "posthoc+recovery":
        model = baselines.with_ranking(ctx.dense, ranking)
        baselines.recover(model, budget, cfg.recipe, ctx.train, ctx.val, ctx.dense, seed)
        return model
    if method == "static":
        soft_dir = folder / "stages" / "budget"
        if (soft_dir / "done.json").is_file():  # resume after the soft stage
            soft, _ = load_checkpoint(soft_dir)
            soft = soft.to(cfg.device)
        else:
            soft = baselines.reset_gates(ctx.dense)
            res = baselines.static_soft(soft, budget, cfg.recipe, ctx.train, ctx.val, seed)
            save_checkpoint(soft.cpu(), soft_dir, {"stage": "budget", "method": "static", "budget": budget})
            soft.to(cfg.device)
            (soft_dir / "done.json").write_text(json.dumps(asdict(res), indent=2) + "\n")
        model = copy.deepcopy(soft)  # stage 3 continues from the stage-2 weights and gates; soft is its teacher
        baselines.static_hard(model, budget, cfg.recipe, ctx.train, ctx.val, soft, seed + 1)
        return model
    raise ValueError(f"unknown method {method!r}")


def evaluate_artifact(folder: Path, method: str, budgets: tuple[float, ...], ctx: SeedContext,
                      cfg: CompareConfig) -> dict[float, dict[str, float]]:
    """Hard accuracy and cost at each budget on the seed's test split, cached in ``folder/eval.json``."""
    cache_path = folder / "eval.json"
    cache = json.loads(cache_path.read_text()) if cache_path.is_file() else {}
    model: BudgetedClassifier | None = None
    result: dict[float, dict[str, float]] = {}
    for b in budgets:
        key = f"{method}|test={len(ctx.test)}|{ctx.ds.fingerprint}|b={b:.4f}"
        if key not in cache:
            if model is None:
                model, _ = load_checkpoint(folder)
                model = model.to(cfg.device)
            mode = "dense" if method == "dense" else "hard"
            cache[key] = {"accuracy": accuracy(model, ctx.test, mode, b),
                          "cost": 1.0 if method == "dense" else model.hard_cost(b),
                          "heads_per_layer": [int(x) for x in model.gates.hard_mask(b).sum(1)]}
        result[b] = cache[key]
    cache_path.write_text(json.dumps(cache, indent=2) + "\n")
    return result


def seed_entries(cfg: CompareConfig, ctx: SeedContext, out: Path) -> list[tuple[str, float, Path]]:
    """(method, budget, artifact folder) for every evaluation of one seed, building what is missing."""
    entries: list[tuple[str, float, Path]] = [("dense", 1.0, ensure_artifact(cfg, ctx, out, "posthoc"))]
    for method in ("budgeted", "soft-only", "posthoc", "posthoc-structural"):
        folder = ensure_artifact(cfg, ctx, out, method)
        entries += [(method, b, folder) for b in cfg.budgets]
    for method in PER_BUDGET:  # evaluated only at the budget they were trained for
        entries += [(method, b, ensure_artifact(cfg, ctx, out, method, b)) for b in cfg.budgets]
    return entries


def measure_latency(entries: list[tuple[str, float, Path]], test: TokenizedSplit, factory: EngineFactory,
                    n_texts: int, repeats: int) -> dict[tuple[str, float], dict[str, float]]:
    """Median (over passes) mean per-text latency, batch 1, of every entry, timed round-robin in one process."""
    texts = [np.asarray([ids], dtype=np.int64) for ids in test.ids[:n_texts]]
    inputs = [(ids, np.ones_like(ids, dtype=np.int32)) for ids in texts]
    predictors: dict[Path, Predictor] = {}
    for _, _, folder in entries:
        if folder not in predictors:
            predictors[folder] = factory(folder)
    diffs: dict[tuple[str, float], float] = {}
    for method, b, folder in entries:  # warm-up, and the engine against the torch reference on a few texts
        model, _ = load_checkpoint(folder)
        gate = None if method == "dense" else model.hard_gates(b)
        worst = 0.0
        for ids, mask in inputs[:8]:
            got = predictors[folder](ids, mask, b)
            with torch.no_grad():
                ref = model(torch.from_numpy(ids), torch.from_numpy(mask.astype(np.int64)), gate).numpy()
            worst = max(worst, float(np.abs(got - ref).max()))
        diffs[(method, b)] = worst
    times: dict[tuple[str, float], list[float]] = {(m, b): [] for m, b, _ in entries}
    for _ in range(repeats):
        for method, b, folder in entries:
            predict = predictors[folder]
            t0 = time.perf_counter()
            for ids, mask in inputs:
                predict(ids, mask, b)
            times[(method, b)].append(1000.0 * (time.perf_counter() - t0) / max(1, len(inputs)))
    return {k: {"latency_ms": float(np.median(v)), "engine_max_abs_logit_diff": diffs[k]} for k, v in times.items()}


def spearman_figures(cfg: CompareConfig, ctx: SeedContext, entries: list[tuple[str, float, Path]]) -> dict[str, float]:
    """Rank agreement of head rankings: across budgets, and between the budgeted gates and importance."""
    from scipy.stats import spearmanr

    from headbudget.models.budget import crossing_logits
    from headbudget.training.sweep import gate_spearman

    budgeted, _ = load_checkpoint(ctx.run_dir)
    out = {"budgeted_g_025_075": gate_spearman(budgeted, 0.25, 0.75),
           "budgeted_vs_importance": float(spearmanr(-crossing_logits(budgeted.gates.params()).ravel(),
                                                     ctx.importance.gradient.ravel()).statistic)}
    static = {b: f for m, b, f in entries if m == "static"}
    if 0.25 in static and 0.75 in static:
        z = [crossing_logits(load_checkpoint(static[b])[0].gates.params()).ravel() for b in (0.25, 0.75)]
        out["static_025_vs_075"] = float(spearmanr(z[0], z[1]).statistic)
    return out


def run_compare(cfg: CompareConfig, out: Path, engine_factory: EngineFactory | None = None) -> dict[str, Any]:
    """Train or reuse everything, evaluate, time, and write compare.json, compare.md and compare.png."""
    from headbudget.experiments.compare_report import write_report

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    per_seed: dict[int, dict[str, Any]] = {}
    trained: list[str] = []
    n_test, dataset = 0, ""
    for seed in cfg.seeds:
        ctx = prepare_seed(cfg, seed, out)
        entries = seed_entries(cfg, ctx, out)
        trained += [t if t != "budgeted" else f"budgeted-s{seed}" for t in ctx.trained]
        results: dict[str, Any] = {}
        for method, b, folder in entries:
            ev = evaluate_artifact(folder, method, (b,), ctx, cfg)[b]
            results[f"{method}@{b:.2f}"] = {"method": method, "budget": b, "folder": str(folder), **ev,
                                            "train_seconds": _train_seconds(folder, method, ctx.run_dir)}
        if engine_factory is not None and cfg.latency_texts > 0:
            torch.set_num_threads(1)
            lat = measure_latency(entries, ctx.test, engine_factory, cfg.latency_texts, cfg.latency_repeats)
            for (method, b), v in lat.items():
                results[f"{method}@{b:.2f}"].update(v)
        stages = json.loads((ctx.run_dir / "config.json").read_text()).get("stages", {})
        per_seed[seed] = {"results": results, "spearman": spearman_figures(cfg, ctx, entries),
                          "dense_train_seconds": float(stages["dense"]["seconds"]),
                          "importance_ranking": ctx.importance.ranking().tolist()}
        n_test, dataset = len(ctx.test), ctx.ds.name
        log.info("seed %d: %d evaluations", seed, len(results))
    if not trained:
        log.info("nothing trained: every artifact was cached")
    doc = {"dataset": dataset, "data": cfg.data, "split": "test", "n_test": n_test, "base": cfg.base,
           "recipe": cfg.recipe.to_dict(), "seeds": list(cfg.seeds), "budgets": list(cfg.budgets),
           "latency": {"engine": "onnxruntime fp32, 1 thread, batch 1", "texts": cfg.latency_texts,
                       "repeats": cfg.latency_repeats} if engine_factory and cfg.latency_texts else None,
           "trained_this_run": trained, "wall_seconds": time.perf_counter() - t0, **cfg.extra,
           "per_seed": {str(k): v for k, v in per_seed.items()}}
    write_report(doc, out)
    return doc


def _train_seconds(folder: Path, method: str, run_dir: Path) -> float:
    """Training time behind one artifact, without the dense warm start (counted once per seed, separately)."""
    stages = json.loads((run_dir / "config.json").read_text()).get("stages", {})
    if method == "budgeted":
        return float(stages["budget"]["seconds"] + stages["hard"]["seconds"])
    if method == "soft-only":
        return float(stages["budget"]["seconds"])
    if method in PER_BUDGET:
        return float(json.loads((folder / "config.json").read_text()).get("train_seconds", 0.0))
    return 0.0  # dense (the warm start itself), posthoc: no training
