"""Fixtures of the ops tests: the live service (shared with tests/loadtest, see live.py)."""

from tests.ops.live import live_service  # noqa: F401  (a session fixture, started only by tests that use it)
