"""The reference backend: the training-time PyTorch model, which the fast backends must match."""
