"""RateMemo: a key the request rate refused stays refused, from this process's memory, exactly until the store
would admit it again, and no longer."""

from __future__ import annotations

from headbudget.service.accounting.auth import RateMemo


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refused_key_is_refused_until_its_retry_after_and_then_forgotten() -> None:
    clock = Clock()
    memo = RateMemo(clock)
    assert not memo and memo.refused_for("k") is None
    asked_at = clock()
    clock.now += 0.004  # the store's answer came back later than it was asked
    memo.note("k", asked_at, 1.5)
    assert memo and memo.refused_for("other") is None
    left = memo.refused_for("k")
    assert left is not None and abs(left - 1.496) < 1e-9  # counted from the asking, never past the store's refusal
    clock.now = asked_at + 1.5
    assert memo.refused_for("k") is None and not memo  # expired: forgotten


def test_a_reload_clears_it_and_it_stays_bounded() -> None:
    clock = Clock()
    memo = RateMemo(clock)
    memo.note("k", clock(), 10.0)
    memo.clear()
    assert memo.refused_for("k") is None
    for i in range(RateMemo.MAX_KEYS):
        memo.note(f"old{i}", clock(), 1.0)
    clock.now += 2.0  # every entry so far has expired
    memo.note("new", clock(), 1.0)
    assert len(memo._until) == 1 and memo.refused_for("new") is not None
