"""Fixtures of the load-test tests: the live service of tests/ops/live.py (one server for both packages)."""

from tests.ops.live import live_service  # noqa: F401  (a session fixture, started only by tests that use it)
