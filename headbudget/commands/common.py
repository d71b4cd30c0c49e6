"""What every subcommand shares: the user-error type and argument validators."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from headbudget.engine.errors import EngineError
from headbudget.models.checkpoint_meta import (  # torch-free (models.checkpoint re-exports CheckpointError)
    CheckpointError,
    standin_of,
)
from headbudget.models.hf.families import PretrainedError  # torch-free


class CliError(Exception):
    """A user-facing error: printed as one line, exit code 2 unless said otherwise."""

    def __init__(self, message: str, exit_code: int = 2) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _data_error() -> type[Exception]:
    try:
        from headbudget.training.data import DataError
    except ImportError:  # training not importable (e.g. a serving-only install)
        return CliError
    return DataError


# Errors that come from bad input rather than bugs: one line, exit 2, no traceback.
USER_ERRORS: tuple[type[BaseException], ...] = (
    CheckpointError, PretrainedError, EngineError, _data_error(), FileNotFoundError, PermissionError,
)


def budget_arg(text: str) -> float:
    """argparse type: a budget the API would take, a finite number in [MIN_BUDGET, 1]."""
    from headbudget.service.http.schemas import MIN_BUDGET

    wrong = f"budget must be a number in [{MIN_BUDGET:g}, 1], got {text!r}"
    try:
        b = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(wrong) from None
    if not math.isfinite(b) or not MIN_BUDGET <= b <= 1.0:
        raise argparse.ArgumentTypeError(wrong)
    return b


def existing_dir(text: str) -> Path:
    """argparse type: a folder that exists."""
    p = Path(text)
    if not p.is_dir():
        raise argparse.ArgumentTypeError(f"folder {text!r} does not exist")
    return p


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def refuse_standin(config: dict[str, Any], model_dir: Path, override: str = "") -> None:
    """A timing stand-in (lab/standin.py) answers with its base's weights: never as the checkpoint."""
    standin = standin_of(config)
    if standin is not None:
        raise CliError(f"{model_dir} is a timing stand-in of {standin.get('sweep')}, not a trained checkpoint: "
                       "its answers are its base's" + (f" ({override})" if override else ""))


def parse_exits(text: str) -> tuple[int, ...]:
    """``--exits`` (models.config.parse_exits), a bad value as a CliError."""
    from headbudget.models.config import parse_exits as parse  # torch-free

    try:
        return parse(text)
    except ValueError as e:
        raise CliError(str(e)) from None
