"""Defaults that agree across commands: what `bench` times is what `serve` serves, and `train` budgets the model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from headbudget.cli import build_parser
from headbudget.commands.serve import default_precision
from headbudget.engine.types import DEFAULT_PRECISION


def _action(command: str, dest: str) -> Any:
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # noqa: SLF001
    return next(a for a in sub._actions if a.dest == dest)  # noqa: SLF001


def test_bench_times_the_precision_serve_serves(tiny_checkpoint: Path) -> None:
    args = build_parser().parse_args(["bench", "--model", str(tiny_checkpoint), "--out", "b.json"])
    assert args.precision == DEFAULT_PRECISION == default_precision(tiny_checkpoint, "onnxruntime") == "int8"
    assert default_precision(tiny_checkpoint, "torch") == "fp32"  # no int8 engine there
    assert DEFAULT_PRECISION in _action("serve", "precision").help


def test_train_budgets_the_whole_model_unless_told() -> None:
    from headbudget.commands.train import resolve

    args = build_parser().parse_args(["train", "--data", "synthetic", "--out", "o"])
    assert resolve(args).scope == "model"
