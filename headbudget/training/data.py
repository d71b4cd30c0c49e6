"""Labelled text data: a folder of train/test files, a Hugging Face dataset name, or the synthetic task."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import random
from pathlib import Path

# re-exported: what the loaders return and raise
from headbudget.training.dataset import DataError as DataError
from headbudget.training.dataset import DataSet as DataSet
from headbudget.training.dataset import Split as Split
from headbudget.training.synthetic import synthetic_dataset

SPLIT_FILES = ("csv", "tsv", "jsonl")


def data_roots() -> list[Path]:
    """Where named data sets are looked up: $HEADBUDGET_DATA, then ../shared/data beside the checkout."""
    roots = []
    if os.environ.get("HEADBUDGET_DATA"):
        roots.append(Path(os.environ["HEADBUDGET_DATA"]))
    roots.append(Path.cwd().parent / "shared" / "data")
    roots.append(Path(__file__).resolve().parents[3] / "shared" / "data")  # beside this checkout, from anywhere
    return list(dict.fromkeys(roots))  # run from the checkout, the last two are one folder


def _find_file(folder: Path, stem: str) -> Path | None:
    for ext in SPLIT_FILES:
        p = folder / f"{stem}.{ext}"
        if p.is_file():
            return p
    return None


def read_rows(path: Path, text_col: str, label_col: str) -> list[tuple[str, str]]:
    """(text, label) pairs from a .csv, .tsv or .jsonl file, checking that both columns exist."""
    rows: list[tuple[str, str]] = []
    try:
        if path.suffix == ".jsonl":
            with open(path, encoding="utf-8") as f:
                for i, line in enumerate(f, 1):
                    if not line.strip():
                        continue
                    try:
                        obj = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}:{i}: not valid JSON ({e.msg})") from None
                    if text_col not in obj or label_col not in obj:
                        raise DataError(f"{path}:{i}: needs fields {text_col!r} and {label_col!r}")
                    rows.append((str(obj[text_col]), str(obj[label_col])))
            return rows
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
            cols = reader.fieldnames or []
            for col in (text_col, label_col):
                if col not in cols:
                    raise DataError(f"{path}: no column {col!r} (columns: {', '.join(cols) or 'none'})")
            for r in reader:
                rows.append((r[text_col] or "", r[label_col] or ""))
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason})") from None
    except csv.Error as e:
        raise DataError(f"{path}: malformed {path.suffix[1:]} ({e})") from None
    return rows


def _label_order(names: set[str]) -> tuple[str, ...]:
    """Numeric labels sort as numbers, names alphabetically: a stable order independent of file order."""
    try:
        return tuple(sorted(names, key=lambda s: float(s)))
    except ValueError:
        return tuple(sorted(names))


def _fingerprint(*paths: Path) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def split_validation(texts: list[str], labels: list[int], fraction: float, seed: int) -> tuple[Split, Split]:
    """Seeded shuffle of the training rows into (train, validation)."""
    idx = list(range(len(texts)))
    random.Random(seed).shuffle(idx)
    n_val = max(1, int(round(len(idx) * fraction)))
    val, tr = idx[:n_val], idx[n_val:]
    pick = lambda ids: Split([texts[i] for i in ids], [labels[i] for i in ids])  # noqa: E731
    return pick(tr), pick(val)


def load_folder(
    folder: Path, text_col: str = "text", label_col: str = "label", val_fraction: float = 0.1, seed: int = 7
) -> DataSet:
    """A folder with train.{csv,tsv,jsonl} and test.{csv,tsv,jsonl}."""
    train_path, test_path = _find_file(folder, "train"), _find_file(folder, "test")
    if train_path is None or test_path is None:
        missing = "train" if train_path is None else "test"
        raise DataError(f"{folder}: no {missing}.csv, {missing}.tsv or {missing}.jsonl")
    train_rows = [(t, y) for t, y in read_rows(train_path, text_col, label_col) if t.strip()]
    test_rows = [(t, y) for t, y in read_rows(test_path, text_col, label_col) if t.strip()]
    if len(train_rows) < 2:
        raise DataError(f"{train_path}: needs at least 2 non-empty examples, found {len(train_rows)}")
    if not test_rows:
        raise DataError(f"{test_path}: no non-empty examples")
    labels = _label_order({y for _, y in train_rows})
    if len(labels) < 2:
        raise DataError(f"{train_path}: only one label ({labels[0]!r}); a classifier needs two or more")
    index = {name: i for i, name in enumerate(labels)}
    unseen = sorted({y for _, y in test_rows} - set(index))
    if unseen:
        raise DataError(f"{test_path}: labels not in the training data: {', '.join(map(repr, unseen[:5]))}")
    train, val = split_validation([t for t, _ in train_rows], [index[y] for _, y in train_rows], val_fraction, seed)
    test = Split([t for t, _ in test_rows], [index[y] for _, y in test_rows])
    return DataSet(folder.name, labels, train, val, test, _fingerprint(train_path, test_path))


def load_hf(name: str, text_col: str, label_col: str, val_fraction: float, seed: int) -> DataSet:
    """A Hugging Face dataset by name (needs the ``datasets`` package and a network)."""
    try:
        import datasets  # type: ignore[import-not-found]
    except ImportError:
        raise DataError(f"{name!r} is not a folder here, and the `datasets` package is not installed to "
                        f"download it; looked in: {', '.join(str(r) for r in data_roots())}") from None
    try:
        ds = datasets.load_dataset(name)
    except Exception as e:  # noqa: BLE001 - network and hub errors come in many types
        raise DataError(f"cannot load Hugging Face dataset {name!r} ({type(e).__name__}); also looked in: "
                        f"{', '.join(str(r) for r in data_roots())}") from None
    feats = ds["train"].features[label_col]
    names = tuple(getattr(feats, "names", None) or sorted({str(y) for y in ds["train"][label_col]}))
    def conv(split: str) -> Split:  # noqa: E306
        part = ds[split]
        ys = [int(y) if hasattr(feats, "names") else names.index(str(y)) for y in part[label_col]]
        return Split([str(t) for t in part[text_col]], ys)
    full = conv("train")
    train, val = split_validation(full.texts, full.labels, val_fraction, seed)
    test = conv("test" if "test" in ds else "validation")
    return DataSet(name.replace("/", "_"), names, train, val, test, hashlib.sha256(name.encode()).hexdigest()[:16])


def load_data(
    spec: str, text_col: str = "text", label_col: str = "label", val_fraction: float = 0.1, seed: int = 7,
    synthetic_size: int = 4000,
) -> DataSet:
    """Resolve ``spec``: 'synthetic', a folder path, a data set name under the data roots, or a HF name."""
    if spec == "synthetic":
        return synthetic_dataset(n_train=synthetic_size, seed=seed)
    path = Path(spec)
    if path.is_dir():
        return load_folder(path, text_col, label_col, val_fraction, seed)
    if path.exists():
        raise DataError(f"{spec}: is a file; --data takes a folder with train and test files")
    if "/" not in spec or not spec.startswith((".", "/")):
        for root in data_roots():
            if (root / spec).is_dir():
                return load_folder(root / spec, text_col, label_col, val_fraction, seed)
    if spec.startswith((".", "/")) or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        raise DataError(f"data folder {spec!r} does not exist (also looked in "
                        f"{', '.join(str(r) for r in data_roots())})")
    return load_hf(spec, text_col, label_col, val_fraction, seed)
