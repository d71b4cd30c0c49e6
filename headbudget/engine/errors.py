"""Domain errors of the engine; the service maps them to HTTP status codes in one place."""


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelLoadError(EngineError):
    """The checkpoint cannot be loaded (missing, truncated, foreign, or an ONNX build failed)."""


class BudgetError(EngineError, ValueError):
    """A budget that is not a finite number in [0, 1], or a mode the checkpoint cannot serve."""


class InputError(EngineError, ValueError):
    """Texts the engine cannot run: empty batch, empty text, wrong type."""
