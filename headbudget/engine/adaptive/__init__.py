"""The fast path for the adaptive model types (BudgetFormer, adaptive span, AdaAttention)."""
