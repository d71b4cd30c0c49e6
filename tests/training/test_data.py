"""Data loading: file formats, columns, labels, seeded validation split, the synthetic task."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from headbudget.training.data import DataError, load_data, load_folder
from headbudget.training.synthetic import synthetic_dataset


def write(folder: Path, name: str, rows: list[tuple[str, str]], fmt: str = "csv", cols: tuple[str, str] = ("text", "label")) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({cols[0]: t, cols[1]: y}) + "\n" for t, y in rows))
    else:
        import csv

        with open(path, "w", newline="") as f:
            w = csv.writer(f, delimiter="\t" if fmt == "tsv" else ",")
            w.writerow(cols)
            w.writerows(rows)


ROWS = [(f"text number {i}", "pos" if i % 2 else "neg") for i in range(40)]


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl"])
def test_formats(tmp_path: Path, fmt: str) -> None:
    write(tmp_path, "train", ROWS, fmt)
    write(tmp_path, "test", ROWS[:10], fmt)
    ds = load_folder(tmp_path)
    assert ds.labels == ("neg", "pos")
    assert len(ds.train) + len(ds.validation) == 40 and len(ds.test) == 10
    assert ds.test.labels[:2] == [0, 1]


def test_custom_columns(tmp_path: Path) -> None:
    write(tmp_path, "train", ROWS, cols=("sentence", "y"))
    write(tmp_path, "test", ROWS[:4], cols=("sentence", "y"))
    assert len(load_folder(tmp_path, text_col="sentence", label_col="y").test) == 4
    with pytest.raises(DataError, match="no column 'text'"):
        load_folder(tmp_path)


def test_validation_split_is_seeded(tmp_path: Path) -> None:
    write(tmp_path, "train", ROWS)
    write(tmp_path, "test", ROWS[:4])
    a, b, c = load_folder(tmp_path, seed=1), load_folder(tmp_path, seed=1), load_folder(tmp_path, seed=2)
    assert a.validation.texts == b.validation.texts != c.validation.texts
    assert not set(a.validation.texts) & set(a.train.texts)


def test_unknown_test_label(tmp_path: Path) -> None:
    write(tmp_path, "train", ROWS)
    write(tmp_path, "test", ROWS[:4] + [("odd one", "neutral")])
    with pytest.raises(DataError, match="labels not in the training data: 'neutral'"):
        load_folder(tmp_path)


def test_empty_and_missing(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="no train"):
        load_folder(tmp_path)
    write(tmp_path, "train", [])
    write(tmp_path, "test", ROWS[:4])
    with pytest.raises(DataError, match="at least 2"):
        load_folder(tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        load_data(str(tmp_path / "nowhere"))


def test_single_label(tmp_path: Path) -> None:
    write(tmp_path, "train", [("a", "x"), ("b", "x")])
    write(tmp_path, "test", [("a", "x")])
    with pytest.raises(DataError, match="only one label"):
        load_folder(tmp_path)


def test_synthetic_task() -> None:
    ds = synthetic_dataset(n_train=400, seed=3)
    assert ds.labels == ("different", "same")
    assert 0.4 < sum(ds.train.labels) / len(ds.train) < 0.6
    for text, y in zip(ds.train.texts[:50], ds.train.labels[:50], strict=True):
        words = text.split()
        marks = [i for i, w in enumerate(words) if w == "marker"]
        assert len(marks) == 2
        assert (words[marks[0] + 1] == words[marks[1] + 1]) == bool(y)
    assert synthetic_dataset(n_train=400, seed=3).train.texts == ds.train.texts


def test_synthetic_words_are_single_tokens() -> None:
    from headbudget.models.pretrained import minilm_path
    from headbudget.models.tokenizer import TextEncoder

    text = synthetic_dataset(n_train=10).train.texts[0]
    ids = TextEncoder(minilm_path(), 64).encode([text]).ids[0]
    assert len(ids) == len(text.split()) + 2  # [CLS] words [SEP]


def test_named_data_are_found_beside_the_checkout_from_any_folder(monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    import headbudget
    from headbudget.training.data import data_roots

    monkeypatch.delenv("HEADBUDGET_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    checkout = Path(headbudget.__file__).resolve().parents[1]
    assert checkout.parent / "shared" / "data" in data_roots()
