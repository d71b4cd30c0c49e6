"""Hugging Face interop: reading BERT-family checkpoints and exporting ours as a Hugging Face folder."""
