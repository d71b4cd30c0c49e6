"""The marked-token task of the budgeted-attention paper: sparse evidence, trains in seconds.

Each text is a row of filler words; two marker tokens sit at random positions, each followed by a value
word. The label says whether the two values match. Deciding equality of two tokens at unrelated positions
takes attention (token-wise layers and mean pooling cannot compare them), and the evidence is sparse: two
of sixteen positions. Values are drawn from their own words, which keeps the task learnable by the tiny
base in seconds (a version with values hidden among identical fillers needed minutes to leave chance).
"""

from __future__ import annotations

import hashlib
import random

from headbudget.training.dataset import DataSet, Split

# Words that are single tokens in the BERT uncased vocabulary, so the text round-trips through the tokenizer.
WORDS = ("red", "blue", "green", "black", "white", "brown", "pink", "gray")
VALUES = ("one", "two", "three", "four")
MARKER = "marker"
LABELS = ("different", "same")


def make_example(rng: random.Random, length: int) -> tuple[str, int]:
    """One text of ``length`` words and its label (1 = the values after the two markers match)."""
    words = [rng.choice(WORDS) for _ in range(length)]
    p1 = rng.randrange(0, length // 2 - 1)
    p2 = rng.randrange(length // 2, length - 1)
    same = rng.random() < 0.5
    v1 = rng.choice(VALUES)
    v2 = v1 if same else rng.choice([w for w in VALUES if w != v1])
    words[p1], words[p1 + 1] = MARKER, v1
    words[p2], words[p2 + 1] = MARKER, v2
    return " ".join(words), int(same)


def _split(n: int, rng: random.Random, length: int) -> Split:
    pairs = [make_example(rng, length) for _ in range(n)]
    return Split([t for t, _ in pairs], [y for _, y in pairs])


def synthetic_dataset(n_train: int = 4000, n_test: int = 1000, length: int = 16, seed: int = 7) -> DataSet:
    """Seeded train / validation / test splits of the marked-token task."""
    rng = random.Random(seed)
    train = _split(n_train, rng, length)
    val = _split(max(200, n_train // 10), rng, length)
    test = _split(n_test, rng, length)
    fp = hashlib.sha256(f"synthetic:{n_train}:{n_test}:{length}:{seed}".encode()).hexdigest()[:16]
    return DataSet("synthetic", LABELS, train, val, test, fp)
