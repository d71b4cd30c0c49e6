"""Fast (Rust) tokenization with explicit truncation, shared by training, the engine and the service."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from itertools import accumulate
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, pre_tokenizers

TOKENIZER_FILE = "tokenizer.json"
# Counting words without making them: ASCII control characters BERT's normalizer deletes (all but tab, newline and
# carriage return, which it reads as spaces) are deleted, so that a word never counts twice; then every space
# becomes b" " and every other byte b"x", and a word is where b"x" follows b" ".
_DELETED = bytes([*range(0, 9), 11, 12, *range(14, 32), 127])
_SPACE_OR_X = bytes(32 if b in (9, 10, 13, 32) else 120 for b in range(256))
_KEPT_CONTROLS = np.array([9, 10, 13], dtype=np.uint8)
# Files copied next to the weights so that a checkpoint folder is also a valid Hugging Face tokenizer folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


def _plain_words(texts: list[str]) -> np.ndarray | None:
    """Words per text of ASCII texts whose only control characters are tab, newline and carriage return (nothing is
    deleted, so no bytes are translated), else None. The same counts as ``_words`` in half its time, with no array
    larger than the texts' bytes: a larger one would be a fresh mapping, faulted in again on every request, where
    glibc's mmap threshold is fixed (engine/onnx/backend.py)."""
    joined = " " + " ".join(texts) + " "  # a space before every text, and after the last
    if not joined.isascii() or "\x7f" in joined:
        return None
    x = np.frombuffer(joined.encode("ascii"), dtype=np.uint8)
    if x.min() < 32 and not np.isin(x[x < 32], _KEPT_CONTROLS).all():  # min: one pass, where most have none
        return None
    space = x < 33
    begins = space[:-1] & ~space[1:]  # k: a word begins at byte k + 1
    ends = list(accumulate(len(t) + 1 for t in texts))  # text i's words begin in begins[ends[i - 1]:ends[i]]
    return np.array([np.count_nonzero(begins[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)])


def _words(texts: list[str]) -> np.ndarray:
    """Words per text, each text's deleted characters removed first (they can only join words)."""
    joined = " " + " ".join(texts)  # a space before every text
    marks = joined.encode("ascii", "ignore").translate(_SPACE_OR_X, _DELETED)
    if len(marks) == len(joined):  # all ASCII and nothing deleted: the texts' lengths are where they end
        lengths = [len(t) for t in texts]
    else:
        parts = [t.encode("ascii", "ignore").translate(_SPACE_OR_X, _DELETED) for t in texts]
        marks, lengths = b" " + b" ".join(parts), [len(p) for p in parts]
    is_x = np.frombuffer(marks, dtype=np.uint8) == ord("x")
    begins = np.flatnonzero(is_x[1:] & ~is_x[:-1])  # k: a word begins at byte k + 1
    ends = np.cumsum([n + 1 for n in lengths])  # each text's end, a space or the end of the bytes
    return np.diff(np.searchsorted(begins, ends), prepend=0)


@dataclass(frozen=True)
class Encoded:
    """Token ids of a batch of texts, and which ones were cut at the model's maximum length."""

    ids: list[list[int]]
    truncated: list[bool]

    def padded(self, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """Pad to the longest sequence in the batch: input_ids, attention_mask, both int64 (B, N)."""
        n = max(len(x) for x in self.ids)
        ids = np.full((len(self.ids), n), pad_id, dtype=np.int64)
        mask = np.zeros((len(self.ids), n), dtype=np.int64)
        for i, row in enumerate(self.ids):
            ids[i, : len(row)] = row
            mask[i, : len(row)] = 1
        return ids, mask


class TextEncoder:
    """Wraps a ``tokenizer.json``; truncates to ``max_length`` tokens keeping [CLS] ... [SEP]."""

    def __init__(self, folder: Path, max_length: int) -> None:
        path = Path(folder) / TOKENIZER_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path}: missing tokenizer file")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.tokenizer.no_padding()
        self.tokenizer.no_truncation()
        self.max_length = max_length
        self.pad_id = self.tokenizer.token_to_id("[PAD]") or 0
        # Without character offsets (nothing here reads them): the same ids, faster; the service tokenizes each
        # request's texts to price them and to run them.
        self._encode_batch = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        self._specials = len(self.tokenizer.encode("").ids)  # [CLS] and [SEP]
        self._splits_words = isinstance(self.tokenizer.pre_tokenizer, pre_tokenizers.BertPreTokenizer)

    def fewest_tokens(self, texts: list[str]) -> list[int]:
        """At most how many tokens each text has, from below, without tokenizing: microseconds where tokenizing
        takes milliseconds, so a request can be refused for its price before it is tokenized.

        Under BERT's pre-tokenizer every whitespace-separated word with a printable ASCII character gives at least
        one token (ASCII letters, digits and punctuation survive its normalizer; a word it cannot spell is one
        [UNK]); the words are counted on the text without its other characters, whose removal can only join words.
        Another pre-tokenizer: the special tokens alone."""
        if not self._splits_words or not texts:
            return [min(self.max_length, self._specials)] * len(texts)
        words = _plain_words(texts)
        if words is None:
            words = _words(texts)
        return np.minimum(words + self._specials, self.max_length).tolist()

    def encode(self, texts: list[str]) -> Encoded:
        """Tokenize a batch; sequences longer than ``max_length`` keep their head and the final [SEP]."""
        out: list[list[int]] = []
        cut: list[bool] = []
        for enc in self._encode_batch(texts):
            ids = enc.ids
            if len(ids) > self.max_length:
                ids = ids[: self.max_length - 1] + ids[-1:]
                cut.append(True)
            else:
                cut.append(False)
            out.append(ids)
        return Encoded(ids=out, truncated=cut)


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files that exist in ``src`` into a checkpoint folder."""
    dst.mkdir(parents=True, exist_ok=True)
    if not (Path(src) / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{Path(src) / TOKENIZER_FILE}: missing tokenizer file")
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copyfile(Path(src) / name, dst / name)
