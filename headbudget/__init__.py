"""headbudget: one budget-conditioned checkpoint, served with a per-request compute budget."""

__version__ = "0.1.0"
