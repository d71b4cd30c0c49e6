"""A labelled data set and its splits, as every loader (training/data.py, the synthetic task) returns them."""

from __future__ import annotations

from dataclasses import dataclass


class DataError(ValueError):
    """Data that cannot be used: missing files or columns, empty sets, labels unseen in training."""


@dataclass(frozen=True)
class Split:
    """Texts and integer labels (indices into ``DataSet.labels``)."""

    texts: list[str]
    labels: list[int]

    def __len__(self) -> int:
        return len(self.texts)

    def take(self, n: int | None) -> Split:
        """The first ``n`` examples (all when ``n`` is None)."""
        return self if n is None or n >= len(self) else Split(self.texts[:n], self.labels[:n])


@dataclass(frozen=True)
class DataSet:
    """train / validation (seeded split of train) / test, with the label names and a content fingerprint."""

    name: str
    labels: tuple[str, ...]
    train: Split
    validation: Split
    test: Split
    fingerprint: str

    def split(self, name: str) -> Split:
        """A split by name: train, validation (alias val) or test."""
        table = {"train": self.train, "validation": self.validation, "val": self.validation, "test": self.test}
        if name not in table:
            raise DataError(f"unknown split {name!r}; expected train, validation or test")
        return table[name]
