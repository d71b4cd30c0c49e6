"""A whole training run: base model, data, the three stages (each resumable), the final checkpoint."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from headbudget.models.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from headbudget.models.classifier import BudgetedClassifier
from headbudget.models.config import SCOPES, GateConfig
from headbudget.models.factory import to_model_type
from headbudget.models.model_types import model_type
from headbudget.models.pretrained import Base, from_pretrained, minilm_path, random_init
from headbudget.models.tokenizer import TextEncoder, copy_tokenizer
from headbudget.training.batches import TokenizedSplit, tokenize
from headbudget.training.data import DataError, DataSet, load_data
from headbudget.training.evaluation import accuracy
from headbudget.training.recipes import RunConfig
from headbudget.training.stages import STAGES, Stage, run_stage

log = logging.getLogger(__name__)


def tokenizer_folder(base: str) -> Path:
    """Where the tokenizer of a base lives: MiniLM's for 'minilm' and 'tiny', the folder itself for a path."""
    return minilm_path() if base in ("minilm", "tiny") else Path(base)


def build_base(base: str, labels: tuple[str, ...], gate: GateConfig, seed: int, max_length: int) -> Base:
    """The untrained classifier for a base name or a local Hugging Face folder (encoder or fine-tuned classifier)."""
    if base == "tiny":
        # No dropout: the tiny base underfits the synthetic task rather than overfitting it, and with dropout
        # it stayed at chance for 25 epochs where without it it learned the task in 5 (measured).
        model = random_init(labels, gate, seed=seed, max_position=max(128, max_length), dropout=0.0)
        return Base(model=model, family="bert", head_loaded=False, note="tiny random encoder")
    folder = minilm_path() if base == "minilm" else Path(base)
    if not folder.is_dir():
        raise DataError(f"base {base!r}: expected minilm, tiny or an existing model folder")
    return from_pretrained(folder, labels, gate, seed=seed)


def _skip_dense(model: BudgetedClassifier, base: Base, val: TokenizedSplit) -> dict[str, Any]:
    """The dense stage's record when the base is already a fine-tuned classifier of the data's labels."""
    val_acc = accuracy(model, val, "dense")
    log.info("stage dense: skipped, %s (validation %.4f as loaded)", base.note, val_acc)
    return {"stage": "dense", "steps": 0, "best_val": val_acc, "history": [], "seconds": 0.0,
            "skipped": base.note}


def _as_run_gate(model: BudgetedClassifier, gate: GateConfig, stage: Stage, stage_dir: Path) -> BudgetedClassifier:
    """A finished stage's model with this run's gate settings; a stage copied from another run (variants that
    share its dense and budget stages) may carry other exits. Exits only act from the stage that starts them
    (stage 3) on, so an earlier stage takes the run's exits (fresh exit heads: stage 3 starts them from the classifier); anything else
    that differs is refused, not trained on."""
    have = model.cfg.gate
    if have == gate or model.cfg.model_type != "budgeted":
        return model
    if replace(have, exits=gate.exits) != gate or STAGES[stage].starts_exits:
        raise DataError(f"{stage_dir} was trained with gate settings {have}, this run asks for {gate}; "
                        "choose another --out or remove that stage")
    out = BudgetedClassifier(replace(model.cfg, gate=gate))
    missing, unexpected = out.load_state_dict(
        {k: v for k, v in model.state_dict().items() if not k.startswith("exits.")}, strict=False)
    assert all(k.startswith("exits.") for k in missing) and not unexpected, (missing, unexpected)
    return out.eval()


def _check_resume(out: Path, run: RunConfig) -> None:
    path = out / "run.json"
    if path.is_file():
        previous = json.loads(path.read_text())
        if previous != run.identity():
            raise DataError(f"{path}: {out} holds a different run (other base, data, recipe or seed); "
                            "choose another --out")
    else:
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(run.identity(), indent=2, sort_keys=True) + "\n")


def _run_base(run: RunConfig, ds: DataSet) -> Base:
    """The run's gate and its base model; a gate the model type or the base refuses is a DataError."""
    if run.scope in SCOPES and run.scope not in model_type(run.model_type).scopes:
        raise DataError(f"--scope {run.scope} is for the budgeted model type, not {run.model_type}")
    try:
        gate = GateConfig(structural=run.structural, scope=run.scope, exits=run.exits)
    except ValueError as e:
        raise DataError(str(e)) from None
    try:
        return build_base(run.base, ds.labels, gate, run.seed, run.recipe.max_length)
    except ValueError as e:  # the gate does not fit the base (an exit at or above its top layer)
        raise DataError(str(e)) from None


def _resume_stage(stage: str, stage_dir: Path, run_gate: GateConfig,
                  device: torch.device) -> tuple[BudgetedClassifier, dict[str, Any]]:
    """A finished stage's checkpoint and record, read back from its folder."""
    try:
        loaded, _ = load_checkpoint(stage_dir)
    except CheckpointError as e:
        raise DataError(f"cannot resume from {stage_dir}: {e}") from e
    model = _as_run_gate(loaded, run_gate, stage, stage_dir).to(device)
    record = json.loads((stage_dir / "done.json").read_text())
    log.info("stage %s: already done (%s), resuming after it", stage, _val_text(record["best_val"]))
    return model, record


def _run_stages(run: RunConfig, out: Path, model: BudgetedClassifier, base: Base, train_split: TokenizedSplit,
                val_split: TokenizedSplit, final_evaluation: bool) -> tuple[BudgetedClassifier, dict[str, Any]]:
    """Every stage of the model type in turn, each resumed from its folder when done; the final model and
    each stage's record."""
    recipe, device = run.recipe, torch.device(run.device)
    run_gate = model.cfg.gate  # what this run's model is, whatever a copied stage folder holds
    results: dict[str, Any] = {}
    teacher: BudgetedClassifier | None = None  # kept for later stages that name none of their own
    stages = model_type(run.model_type).stages
    for i, stage in enumerate(stages):
        spec = STAGES[stage]
        stage_dir = out / "stages" / stage
        if (stage_dir / "done.json").is_file():
            model, results[stage] = _resume_stage(stage, stage_dir, run_gate, device)
            continue
        if spec.teacher is not None:  # distil from a frozen copy of an earlier stage's model
            teacher, _ = load_checkpoint(out / "stages" / spec.teacher(recipe))
            teacher = teacher.to(device).eval()
        if spec.starts_exits and model.cfg.gate.exits:  # exits start from the classifier on top
            model.init_exits()
        if spec.adaptive:  # the dense warm start becomes the adaptive type here
            model = to_model_type(model, run.model_type, seed=run.seed + i)
        if spec.skipped_by_a_trained_head and base.head_loaded:
            record = _skip_dense(model, base, val_split)
        else:
            record = asdict(run_stage(model, stage, recipe, train_split, val_split, seed=run.seed + i,
                                      teacher=teacher, final=final_evaluation and i == len(stages) - 1))
        save_checkpoint(model, stage_dir, {"stage": stage, "model_type": model.cfg.model_type})
        results[stage] = record
        (stage_dir / "done.json").write_text(json.dumps(results[stage], indent=2) + "\n")
        log.info("stage %s: %s in %.0f s", stage, _val_text(record["best_val"], "best "), record["seconds"])
    return model, results


def _val_text(best_val: float | None, best: str = "") -> str:
    return f"{best}validation {best_val:.4f}" if best_val is not None else "no validation (its one evaluation would select nothing)"


def _checkpoint_meta(run: RunConfig, out: Path, ds: DataSet, max_length: int, base: Base,
                     results: dict[str, Any], t0: float) -> dict[str, Any]:
    """The final checkpoint's config.json metadata: the run, its data and each stage's figures."""
    return {
        "name": out.name,
        "model_type": run.model_type,
        "max_length": max_length,
        "base": run.base,
        "recipe": run.recipe.to_dict(),
        "seed": run.seed,
        "data": {"name": ds.name, "spec": run.data, "fingerprint": ds.fingerprint, "labels": list(ds.labels),
                 "n_train": len(ds.train), "n_validation": len(ds.validation), "n_test": len(ds.test),
                 "text_column": run.text_column, "label_column": run.label_column},
        "base_note": base.note,
        "stages": {k: {"best_val": v["best_val"], "steps": v["steps"], "seconds": v["seconds"],
                       **({"skipped": v["skipped"]} if "skipped" in v else {})} for k, v in results.items()},
        # Sum over stages, so that a resumed run still reports what the whole recipe took.
        "train_seconds": sum(float(v["seconds"]) for v in results.values()),
        "wall_seconds_this_invocation": time.perf_counter() - t0,
    }


def train(run: RunConfig, out: Path, final_evaluation: bool = True) -> Path:
    """Train (or resume) a budgeted checkpoint into ``out``; returns the checkpoint folder.

    ``final_evaluation`` False: the last stage, like the others, skips an evaluation that would select nothing, for a
    caller that measures the checkpoint itself (``make run``: the decider, on the whole validation split)."""
    t0 = time.perf_counter()
    recipe = run.recipe
    ds: DataSet = load_data(run.data, run.text_column, run.label_column, seed=run.seed,
                            synthetic_size=recipe.synthetic_size)
    base = _run_base(run, ds)
    # Only now: a run that cannot even start must not leave a run.json that blocks its corrected retry.
    _check_resume(out, run)
    log.info("base: %s", base.note)
    model = base.model.to(torch.device(run.device))
    tok_dir = tokenizer_folder(run.base)
    encoder = TextEncoder(tok_dir, min(recipe.max_length, model.cfg.max_position))
    train_split, val_split = tokenize(ds.train, encoder), tokenize(ds.validation.take(recipe.val_examples), encoder)
    log.info("data %s: %d train, %d validation, labels %s", ds.name, len(train_split), len(val_split), ds.labels)
    model, results = _run_stages(run, out, model, base, train_split, val_split, final_evaluation)
    save_checkpoint(model.cpu(), out, _checkpoint_meta(run, out, ds, encoder.max_length, base, results, t0))
    copy_tokenizer(tok_dir, out)
    return out
