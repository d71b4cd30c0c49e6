"""The tokenizer-free lower bound on a text's tokens (``TextEncoder.fewest_tokens``): never above what the tokenizer
counts, for texts of any characters, and tight for plain English."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from headbudget.models.pretrained import minilm_path
from headbudget.models.tokenizer import TextEncoder

# Characters that stress the bound: ASCII controls (the normalizer deletes them), other whitespace, combining marks
# (stripped with the accents), CJK (one token each), non-ASCII punctuation, letters with accents, emoji.
POOL = (list("abcXYZ019 .,;'!-_/") + ["\t", "\n", "\r", "\x0b", "\x0c", "\x1c", "\x1f", "\x7f", "\x00", "\x85",
        "\u00a0", "\u2028", "\u200b", "\u0301", "\ufffd", "\u4e2d", "\u6587", "\u2014", "\u00e9", "\u00df", "\u0130",
        "\U0001f600", "\ufb01"])


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    return TextEncoder(minilm_path(), 64)


def test_the_bound_never_passes_the_count(encoder: TextEncoder) -> None:
    rng = random.Random(0)
    texts = ["".join(rng.choice(POOL) for _ in range(rng.randrange(1, 60))) for _ in range(3000)]
    texts += ["ab\x1fcd", "x.y.z", "\u0301 \u0301", "a" * 300, "word " * 100]
    counted = [len(ids) for ids in encoder.encode(texts).ids]
    assert any(f < n for f, n in zip(encoder.fewest_tokens(texts), counted, strict=True))  # a bound, not a count
    for text, floor, n in zip(texts, encoder.fewest_tokens(texts), counted, strict=True):
        assert floor <= n, repr(text)


def test_the_bound_is_tight_for_plain_words_and_stops_at_the_length(encoder: TextEncoder) -> None:
    texts = ["the market rose as oil fell", "word " * 100]
    assert encoder.fewest_tokens(texts) == [len(ids) for ids in encoder.encode(texts).ids] == [8, 64]


def test_another_pre_tokenizer_bounds_by_the_special_tokens(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert TextEncoder(tmp_path, 16).fewest_tokens(["a a a", "a"]) == [0, 0]


def test_plain_texts_are_counted_without_translating_them_and_alike() -> None:
    """ASCII texts whose only controls are tab, newline and return take the path that translates no bytes; it
    counts what the general path counts, empty texts and edges included; any other character sends the batch to
    the general path."""
    from headbudget.models.tokenizer import _plain_words, _words

    rng = random.Random(1)
    plain = list("ab ,.-\t\n\r")
    for _ in range(500):
        texts = ["".join(rng.choice(plain) for _ in range(rng.randrange(0, 30))) for _ in range(rng.randrange(1, 6))]
        fast = _plain_words(texts)
        assert fast is not None and fast.tolist() == _words(texts).tolist(), texts
    for odd in ("\x0b", "\x00", "\x7f", "\u00e9", "\u00a0"):
        assert _plain_words(["plain words", f"one{odd}word"]) is None
    assert _plain_words(["", "a b", ""]).tolist() == [0, 2, 0]  # type: ignore[union-attr]


def test_no_texts_no_bounds(encoder: TextEncoder) -> None:
    assert encoder.fewest_tokens([]) == []
