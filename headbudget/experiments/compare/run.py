"""`headbudget compare`: train or reuse every method for every seed, evaluate on one test split, report.

Methods (docs/method.md §6 and §9; one row per method and budget in compare.json):

| method              | artifact                                               | trained for    |
|---------------------|--------------------------------------------------------|----------------|
| dense               | the dense warm start, all heads (reference, b = 1)     | -              |
| budgeted            | the three-stage run's final checkpoint                 | every budget   |
| soft-only           | the same run's stage-2 checkpoint, served with hard masks | every budget |
| posthoc             | dense weights + gradient-importance ranking, no training | every budget  |
| posthoc-structural  | the same with a per-layer floor                        | every budget   |
| posthoc+recovery    | posthoc, one epoch of dense-teacher distillation at b  | one budget     |
| static              | gates trained at one fixed b (stage 2, then stage 3)   | one budget     |

With ``scope="model"`` (docs/method.md §4) the budget spans heads and feed-forward neuron groups,
and every method is placed by its measured latency:

| method              | artifact                                               | trained for    |
|---------------------|--------------------------------------------------------|----------------|
| dense               | the model-scope run's dense warm start (reference, b = 1) | -           |
| budgeted            | the ``--scope model`` three-stage run (also served at b = 1) | every budget |
| soft-only           | its stage-2 checkpoint, served with hard masks         | every budget   |
| attention-only      | the attention-scope three-stage run of the same seed   | every budget   |
| posthoc-model       | dense weights + importance ranking of heads and groups, no training | every budget |
| layerdrop           | the first L - L // 2 layers (MiniLM: top 3 of 6 dropped), distilled | b = 1 only |
| ffn-half            | half of each layer's feed-forward neurons, by importance, distilled | b = 1 only |

The model-scope run is ``runs/budgeted-model-s<seed>-<hash>``; its dense warm start is the reference, the
teacher and the source of the baselines, and the attention-only run is the ordinary attention-scope run of
the same seed and recipe (``runs/budgeted-s<seed>-<hash>``, shared with an attention comparison in the same
folder; its own warm start is trained the same way, bit-identical on CPU).

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
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from headbudget.experiments import baselines
from headbudget.experiments.compare.measure import (
    EngineFactory,
    Predictor,
    macs_ratio,
    measure_latency,
    spearman_figures,
)
from headbudget.experiments.importance import Importance, head_importance, importance_heatmap
from headbudget.models.checkpoint import load_checkpoint, save_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import SCOPE_SPECS, SCOPES, Scope, ScopeSpec
from headbudget.models.tokenizer import TextEncoder, copy_tokenizer
from headbudget.training.batches import TokenizedSplit, tokenize
from headbudget.training.data import DataSet, load_data
from headbudget.training.evaluation import accuracy
from headbudget.training.recipes import Recipe, RunConfig
from headbudget.training.trainer import tokenizer_folder, train

log = logging.getLogger(__name__)
__all__ = ["CompareConfig", "EngineFactory", "Predictor", "run_compare"]

PER_BUDGET = ("posthoc+recovery", "static")
METHODS = ("dense", "budgeted", "soft-only", "posthoc", "posthoc-structural", "posthoc+recovery", "static")
# Whole-model scope: the dedicated small models a user would train instead (one artifact, one point, b = 1).
SMALL = ("layerdrop", "ffn-half")
MODEL_METHODS = ("dense", "budgeted", "soft-only", "attention-only", "posthoc-model", *SMALL)

# The budgeted run's folder per scope: runs/<name>-s<seed>-<hash>. A budget that spans the feed-forward groups
# (ScopeSpec.gates_ffn) is compared against the attention-scope run of the same seed (attention-only) and
# dedicated small models, and every method is placed by its measured latency rather than by budget.
RUN_NAMES: Mapping[Scope, str] = MappingProxyType({"attention": "budgeted", "model": "budgeted-model"})


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
    # What the budget spans: "attention" (the published comparison) or "model" (heads and feed-forward groups,
    # against the attention-only run and dedicated small models, placed by latency).
    # Only "model" enters the cache hashes (through the run identity), so attention caches keep theirs.
    scope: Scope = "attention"
    latency_engine: str = "onnxruntime fp32, 1 thread, batch 1"  # what the injected latency probe runs
    exits: tuple[int, ...] = ()  # the whole-model run's exits (layer skipping); never the attention-only run's

    def __post_init__(self) -> None:
        if self.scope not in SCOPE_SPECS:
            raise ValueError(f"unknown scope {self.scope!r}; {' or '.join(SCOPES)}")

    @property
    def spec(self) -> ScopeSpec:
        """What the comparison's budget spans (``SCOPE_SPECS``)."""
        return SCOPE_SPECS[self.scope]

    def run_config(self, seed: int, scope: Scope | None = None) -> RunConfig:
        run_scope = scope or self.scope
        return RunConfig(base=self.base, data=self.data, recipe=self.recipe, seed=seed,
                         text_column=self.text_column, label_column=self.label_column, device=self.device,
                         scope=run_scope, exits=self.exits if SCOPE_SPECS[run_scope].exits else ())


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
    attention_dir: Path | None = None  # the attention-scope run (whole-model scope: the attention-only method)


def _done(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()


def ensure_budgeted(cfg: CompareConfig, seed: int, out: Path, scope: Scope | None = None) -> tuple[Path, bool]:
    """The budgeted run of ``seed`` (trained or resumed unless already complete); returns (folder, trained).

    ``scope`` (default the comparison's): the attention-scope run is ``budgeted-s<seed>-*`` whatever the
    comparison's scope, so a model-scope comparison reuses an attention comparison's runs in the same folder.
    """
    run = cfg.run_config(seed, scope)
    name = RUN_NAMES[run.scope]
    folder = out / "runs" / f"{name}-s{seed}-{config_hash(run.identity())}"
    if _done(folder) and all((folder / "stages" / s / "done.json").is_file() for s in ("dense", "budget", "hard")):
        log.info("%s s%d: cached (%s)", name, seed, folder)
        return folder, False
    log.info("%s s%d: training (%s)", name, seed, folder)
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
                      [f"budgeted-s{seed}"] if trained else [])
    if cfg.spec.gates_ffn:
        ctx.attention_dir, trained = ensure_budgeted(cfg, seed, out, scope="attention")
        ctx.trained += [f"attention-only-s{seed}"] if trained else []
    ctx.importance = ensure_importance(cfg, ctx, out)
    return ctx


def _subset(data: TokenizedSplit, n: int | None) -> TokenizedSplit:
    n = len(data) if n is None else min(n, len(data))
    return TokenizedSplit(data.ids[:n], data.labels[:n], 0)


def ensure_importance(cfg: CompareConfig, ctx: SeedContext, out: Path) -> Importance:
    """Head importance of the seed's dense warm start, cached as importance.json."""
    ident = {"run": ctx.run_identity, "examples": cfg.importance_examples, "ablation": cfg.ablation_examples}
    # Whole-model scope: feed-forward neurons and groups are scored too (the run identity already differs).
    group = ctx.dense.cfg.gate.ffn_group if cfg.spec.gates_ffn else None
    folder = out / "artifacts" / f"importance-s{ctx.seed}-{config_hash(ident)}"
    path = folder / "importance.json"
    if path.is_file():
        return Importance.from_dict(json.loads(path.read_text()))
    log.info("importance s%d: computing on %d training examples", ctx.seed, cfg.importance_examples)
    val = _subset(ctx.val, cfg.ablation_examples) if cfg.ablation_examples else None
    imp = head_importance(ctx.dense, _subset(ctx.train, cfg.importance_examples), val, ffn_group=group)
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
    if method == "attention-only":
        assert ctx.attention_dir is not None, "the attention-only method belongs to the whole-model scope"
        return ctx.attention_dir
    ident = {"method": method, "budget": budget, "run": ctx.run_identity,
             "importance_examples": cfg.importance_examples, "version": 1}
    tag = f"{method.replace('+', '-')}-s{ctx.seed}" + (f"-b{budget:.2f}" if budget is not None else "")
    folder = out / "artifacts" / f"{tag}-{config_hash(ident)}"
    if _done(folder):
        log.info("%s: cached (%s)", tag, folder)
        return folder
    trains = method in PER_BUDGET or method in SMALL
    log.info("%s: %s (%s)", tag, "training" if trains else "building", folder)
    t0 = time.perf_counter()
    model = _build(cfg, ctx, folder, method, budget)
    if trains:
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
    if method == "posthoc-model":
        return baselines.with_ranking(ctx.dense, ctx.importance.unit_ranking())
    if method in SMALL:
        return baselines.small_model(method, ctx.dense, ctx.importance.neuron_raw, cfg.recipe, ctx.train, ctx.val,
                                     seed)
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
            mask = model.gates.hard_mask(b)  # (L, U): the heads, then any feed-forward groups
            cache[key] = {"accuracy": accuracy(model, ctx.test, mode, b),
                          "cost": 1.0 if method == "dense" else model.hard_cost(b),
                          "heads_per_layer": [int(x) for x in mask[:, :model.cfg.n_heads].sum(1)]}
            if cfg.spec.gates_ffn:
                g = model.cfg.gate
                cache[key]["macs_ratio"] = macs_ratio(model, None if method == "dense" else b, ctx.dense.cfg)
                cache[key]["neurons_per_layer"] = (
                    [int(x) * g.ffn_group for x in mask[:, model.cfg.n_heads:].sum(1)]
                    if g.scope_spec.gates_ffn and method != "dense" else [model.cfg.intermediate_size] * model.cfg.n_layers)
        result[b] = cache[key]
    cache_path.write_text(json.dumps(cache, indent=2) + "\n")
    return result


def seed_entries(cfg: CompareConfig, ctx: SeedContext, out: Path) -> list[tuple[str, float, Path]]:
    """(method, budget, artifact folder) for every evaluation of one seed, building what is missing."""
    if cfg.spec.gates_ffn:
        return model_scope_entries(cfg, ctx, out)
    entries: list[tuple[str, float, Path]] = [("dense", 1.0, ensure_artifact(cfg, ctx, out, "posthoc"))]
    for method in ("budgeted", "soft-only", "posthoc", "posthoc-structural"):
        folder = ensure_artifact(cfg, ctx, out, method)
        entries += [(method, b, folder) for b in cfg.budgets]
    for method in PER_BUDGET:  # evaluated only at the budget they were trained for
        entries += [(method, b, ensure_artifact(cfg, ctx, out, method, b)) for b in cfg.budgets]
    return entries


def model_scope_entries(cfg: CompareConfig, ctx: SeedContext, out: Path) -> list[tuple[str, float, Path]]:
    """The whole-model comparison's evaluations: the budgeted curve runs up to b = 1 (so that it reaches the
    latencies of the attention-only checkpoint's budgets), the small models are one point each, at b = 1."""
    posthoc = ensure_artifact(cfg, ctx, out, "posthoc-model")
    curve = tuple(sorted({*cfg.budgets, 1.0}))
    entries: list[tuple[str, float, Path]] = [("dense", 1.0, posthoc)]
    entries += [("budgeted", b, ctx.run_dir) for b in curve]
    for method in ("soft-only", "attention-only", "posthoc-model"):
        folder = ensure_artifact(cfg, ctx, out, method)
        entries += [(method, b, folder) for b in cfg.budgets]
    entries += [(m, 1.0, ensure_artifact(cfg, ctx, out, m)) for m in SMALL]
    return entries


def run_compare(cfg: CompareConfig, out: Path, engine_factory: EngineFactory | None = None) -> dict[str, Any]:
    """Train or reuse everything, evaluate, time, and write compare.json, compare.md and compare.png."""
    if cfg.spec.gates_ffn:  # the whole-model scope is placed by measured latency
        from headbudget.experiments.latency_placement import write_report
    else:
        from headbudget.experiments.compare.report import write_report

    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    per_seed: dict[int, dict[str, Any]] = {}
    trained: list[str] = []
    n_test, dataset = 0, ""
    for seed in cfg.seeds:
        ctx = prepare_seed(cfg, seed, out)
        entries = seed_entries(cfg, ctx, out)
        trained += ctx.trained
        results: dict[str, Any] = {}
        for method, b, folder in entries:
            ev = evaluate_artifact(folder, method, (b,), ctx, cfg)[b]
            results[f"{method}@{b:.2f}"] = {"method": method, "budget": b, "folder": str(folder), **ev,
                                            "train_seconds": _train_seconds(folder, method, ctx.run_dir)}
            if method in SMALL:  # the small model's own shape, for the report
                c = json.loads((folder / "config.json").read_text())["model"]
                results[f"{method}@{b:.2f}"].update(n_layers=c["n_layers"], intermediate_size=c["intermediate_size"])
        if engine_factory is not None and cfg.latency_texts > 0:
            torch.set_num_threads(1)
            lat = measure_latency(entries, ctx.test, engine_factory, cfg.latency_texts, cfg.latency_repeats)
            for (method, b), v in lat.items():
                results[f"{method}@{b:.2f}"].update(v)
        stages = json.loads((ctx.run_dir / "config.json").read_text()).get("stages", {})
        per_seed[seed] = {"results": results, "spearman": spearman_figures(cfg, ctx, entries),
                          "dense_train_seconds": float(stages["dense"]["seconds"]),
                          "importance_ranking": ctx.importance.ranking().tolist()}
        if cfg.spec.gates_ffn:
            per_seed[seed]["unit_ranking"] = ctx.importance.unit_ranking().tolist()
        n_test, dataset = len(ctx.test), ctx.ds.name
        log.info("seed %d: %d evaluations", seed, len(results))
    if not trained:
        log.info("nothing trained: every artifact was cached")
    doc = {"dataset": dataset, "data": cfg.data, "split": "test", "n_test": n_test, "base": cfg.base,
           "recipe": cfg.recipe.to_dict(), "seeds": list(cfg.seeds), "budgets": list(cfg.budgets),
           "latency": {"engine": cfg.latency_engine, "texts": cfg.latency_texts,
                       "repeats": cfg.latency_repeats} if engine_factory and cfg.latency_texts else None,
           "trained_this_run": trained, "wall_seconds": time.perf_counter() - t0, **cfg.extra,
           **({"scope": cfg.scope} if cfg.spec.gates_ffn else {}),  # how readers of compare.json tell the scopes apart
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
    if method == "attention-only":  # its own run's stages 2 and 3 (its warm start: same recipe and seed)
        own = json.loads((folder / "config.json").read_text()).get("stages", {})
        return float(own["budget"]["seconds"] + own["hard"]["seconds"])
    if method in PER_BUDGET or method in SMALL:
        return float(json.loads((folder / "config.json").read_text()).get("train_seconds", 0.0))
    return 0.0  # dense (the warm start itself), posthoc: no training
