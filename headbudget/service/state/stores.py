"""The state store a config asks for: Redis when ``[state] redis_url`` is set, else this process's memory."""

from __future__ import annotations

from headbudget.service.settings import StateConfig
from headbudget.service.state.store import MemoryState, StateStore


def make_state(config: StateConfig) -> StateStore:
    """The store the config asks for: Redis when ``redis_url`` is set, else memory."""
    if config.redis_url:
        from headbudget.service.state.redis_store import RedisState  # redis is imported only where it is used

        return RedisState(config)
    return MemoryState(config)
