"""The engine's kinds by name, importable without numpy or onnxruntime: the client-only install's CLI builds
its parser from them."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, get_args

Backend = Literal["onnxruntime", "torch"]
Precision = Literal["fp32", "int8"]
# Every name of each, in order: what command lines offer as choices.
BACKEND_NAMES: tuple[Backend, ...] = get_args(Backend)
PRECISION_NAMES: tuple[Precision, ...] = get_args(Precision)
# What `headbudget serve` and `headbudget bench` run unless told: the int8 engine, faster than fp32 at its
# accuracy within quantization noise (docs/results.md). serve falls back to fp32 where there is no int8 engine.
DEFAULT_PRECISION: Precision = "int8"


class DeciderKind(StrEnum):
    """The two kinds of ``budget=auto`` decider (engine/decider.py); the value is ``kind`` in decider.json."""

    CASCADE = "cascade"  # a cheap pass first, a larger one for the texts it is unsure of
    PREDICTOR = "predictor"  # one pass per text, at a level predicted from its embeddings


# What `headbudget decider` makes unless told otherwise: the kind that won the comparison on every checkpoint
# measured (docs/results.md, 'Findings and decisions').
DEFAULT_KIND = DeciderKind.CASCADE
