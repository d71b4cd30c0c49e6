"""The compute unit, and what a request is charged in it.

One **compute unit** is the multiply-adds of the whole dense model on one token at the reference length: the dense
forward pass of a text of ``REFERENCE_TOKENS`` tokens, divided by that length. A text is charged the multiply-adds
its plan ran on its own tokens (``Cost.total_macs``, attention's quadratic term included), in that unit: a dense
text of n tokens costs about n units, the same text at a budget b about n x cost(b). A request's charge is the sum
of its texts'. Charges are integers in milli-units, each text's rounded up, so that quotas and usage add up
exactly; answers show units with three decimals.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import repeat

from headbudget.engine.protocol import Meter
from headbudget.engine.types import Cost, Prediction, Tokens
from headbudget.service.errors import ComputeCapExceeded
from headbudget.service.settings import TierConfig

REFERENCE_TOKENS = 128
MILLI = 1000  # milli-units per unit


def units(milli: int) -> float:
    """Milli-units as units, as answers and logs show them."""
    return round(milli / MILLI, 3)


def unit_text(value: float) -> str:
    """Units as answers' headers and messages write them: up to three decimals, no exponent (12345.678, 7.5)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def milli_of_units(value: float) -> int:
    """A configured amount of units (a quota, a cap) in milli-units, the nearest one."""
    return round(value * MILLI)


@dataclass(frozen=True)
class ComputeUnit:
    """The unit of the loaded checkpoint: ``reference_macs``, the dense model's multiply-adds on one text of
    ``REFERENCE_TOKENS`` tokens, is worth ``REFERENCE_TOKENS`` units."""

    reference_macs: int

    @classmethod
    def of(cls, meter: Meter) -> ComputeUnit:
        return cls(meter.cost(1.0, REFERENCE_TOKENS).total_macs_dense)

    @property
    def macs(self) -> float:
        """Multiply-adds in one unit."""
        return self.reference_macs / REFERENCE_TOKENS

    def milli(self, macs: int) -> int:
        """``macs`` multiply-adds in milli-units, rounded up (integer arithmetic: exact)."""
        return -(-macs * REFERENCE_TOKENS * MILLI // self.reference_macs)

    def describe(self) -> str:
        return (f"one compute unit = the multiply-adds of the whole dense model on one token of a "
                f"{REFERENCE_TOKENS}-token text ({self.macs:,.0f} multiply-adds on this checkpoint); a text of n "
                f"tokens at budget b is charged about n x cost(b) units")


@dataclass(frozen=True)
class Bill:
    """What one answered request is charged: milli-units per text, its tokens, and what it saved."""

    texts: tuple[int, ...]  # milli-units per text
    tokens: int
    saved: int  # milli-units the dense model would have cost on top (dense minus what ran)

    @property
    def total(self) -> int:
        return sum(self.texts)


def text_charge(unit: ComputeUnit, cost: Cost) -> tuple[int, int]:
    """(milli-units charged, milli-units saved against the dense pass) for one text's cost."""
    run = unit.milli(cost.total_macs)
    # Under a decider's auto a text's passes add up and may pass the dense cost: that saved nothing.
    return run, max(0, unit.milli(cost.total_macs_dense) - run)


def bill(unit: ComputeUnit, predictions: Sequence[Prediction]) -> Bill:
    """The charge of what ran: each answer's own cost."""
    charges = [text_charge(unit, p.cost) for p in predictions]
    return Bill(texts=tuple(c for c, _ in charges), tokens=sum(p.n_tokens for p in predictions),
                saved=sum(s for _, s in charges))


@dataclass(frozen=True)
class Quote:
    """A request priced before it runs, at the most it may run: each text's tokens and charge, and the token ids
    counted, which the engine then runs instead of tokenizing the texts again."""

    budget: float  # the budget it was priced at
    tokens: tuple[tuple[int, bool], ...]  # (tokens, truncated?) per text, as the engine will count them
    texts: tuple[int, ...]  # milli-units per text
    token_ids: Tokens | None = None  # the texts as the Meter tokenized them
    tokenize_cpu_s: float = 0.0  # CPU time that took: the engine's work, done ahead (Batcher counts it as such)
    exact: bool = True  # False: a floor from the texts' words (``floor_quote``), no tokenizer involved

    @property
    def total(self) -> int:
        return sum(self.texts)


def quote(meter: Meter, unit: ComputeUnit, texts: Sequence[str], budget: float) -> Quote:
    """Price ``texts`` at ``budget`` with exact token counts."""
    started = time.thread_time()
    enc = meter.tokenize(texts)
    cpu_s = time.thread_time() - started
    tokens = tuple(enc.counts())
    return Quote(budget, tokens, _charges(meter, unit, budget, [n for n, _ in tokens]), enc, cpu_s)


def floor_quote(meter: Meter, unit: ComputeUnit, texts: Sequence[str], budget: float) -> Quote:
    """The least ``texts`` can be charged at ``budget``, from a lower bound on their tokens that needs no tokenizer
    (``Meter.fewest_tokens``): a request the rate, the quota or the cap refuses even at this price is refused
    before it is tokenized."""
    counts = meter.fewest_tokens(texts)
    return Quote(budget, tuple(zip(counts, repeat(False))), _charges(meter, unit, budget, counts), exact=False)


def _charges(meter: Meter, unit: ComputeUnit, budget: float, counts: Sequence[int]) -> tuple[int, ...]:
    """Milli-units per text of ``counts`` tokens at ``budget``, each distinct count priced once (a large request's
    texts are mostly cut at one length)."""
    each = {n: unit.milli(meter.cost(budget, n).total_macs) for n in set(counts)}
    return tuple(map(each.__getitem__, counts))


def check_cap(tier: TierConfig, priced: Quote) -> None:
    """422 ``compute_cap_exceeded`` when one request would cost more than its tier lets a request cost: its
    ``max_request_compute``, or what a key may spend at once (``compute_burst``), which it could never pass."""
    caps = [(cap, name) for cap, name in ((tier.max_request_compute, "max_request_compute"),
                                          (tier.burst_units, "compute_burst")) if cap is not None]
    if not caps:
        return
    cap, name = min(caps, key=lambda c: c[0])  # on a tie, the explicit cap is named
    if priced.total <= milli_of_units(cap):
        return
    n_tokens = sum(n for n, _ in priced.tokens)
    at = "up to" if priced.exact else "at least"
    tokens = f"{n_tokens} tokens" if priced.exact else f"at least {n_tokens} tokens"
    raise ComputeCapExceeded(
        f"this request would be charged {at} {unit_text(units(priced.total))} compute units ({len(priced.texts)} "
        f"texts, {tokens} at budget {priced.budget:g}), over tier {tier.name!r}'s {name} of "
        f"{unit_text(cap)} units per request; send fewer or shorter texts, or a lower budget")
