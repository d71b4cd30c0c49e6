"""The engine's kinds by name, importable without numpy or onnxruntime: the client-only install's CLI builds
its parser from them."""

from __future__ import annotations

from typing import Literal

Backend = Literal["onnxruntime", "torch"]
Precision = Literal["fp32", "int8"]
# What `headbudget serve` and `headbudget bench` run unless told: the int8 engine, faster than fp32 at its
# accuracy within quantization noise (docs/results.md). serve falls back to fp32 where there is no int8 engine.
DEFAULT_PRECISION: Precision = "int8"
