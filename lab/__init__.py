"""One-off investigations run from the repository root (``python -m lab.NAME``); not part of the package."""
