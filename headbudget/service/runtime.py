"""What one server process holds while it runs: config (reloadable), engine queue, state store, metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from headbudget.engine.protocol import Engine
from headbudget.engine.types import ModelInfo
from headbudget.service.accounting.auth import RateMemo
from headbudget.service.accounting.compute import ComputeUnit
from headbudget.service.accounting.journal import UsageJournal, replay_while_running
from headbudget.service.metrics import Metrics
from headbudget.service.scheduling.batching import Batcher
from headbudget.service.settings import ConfigError, ServiceConfig, load_config, utc_text
from headbudget.service.state.store import StateStore, StateUnavailable
from headbudget.service.state.stores import make_state

log = logging.getLogger("headbudget.service")


class Runtime:
    """The service's moving parts; one per process, reached from handlers through ``RuntimeDep``."""

    def __init__(self, config: ServiceConfig, engine_factory: Callable[[], Engine], *,
                 config_path: Path | None = None, extra_key_hashes: dict[str, str] | None = None,
                 state: StateStore | None = None, decider_pending: bool = False) -> None:
        self.config = config
        self.config_path = config_path
        self.extra_key_hashes = dict(extra_key_hashes or {})
        self.rate_memo = RateMemo()  # keys the request rate refuses at the moment (auth.RateMemo)
        self.metrics = Metrics(config.latency_targets_s(), per_key=config.metrics.per_key)
        self.state: StateStore = state if state is not None else make_state(config.state)
        self.batcher = Batcher(engine_factory, config.server, self.metrics)
        self.info: ModelInfo | None = None
        self.decider_pending = decider_pending  # until a decider made beside the server is loaded
        self.unit: ComputeUnit | None = None  # what charges are counted in, from the checkpoint (service/accounting/compute.py)
        self.grid_heads: dict[float, int] = {}  # grid budget -> most heads it buys, computed at start-up
        self.grid_neurons: dict[float, int] = {}  # grid budget -> feed-forward neurons (whole-model budgets only)
        self.grid_depth: dict[float, int] = {}  # grid budget -> layers run, where the plan stops at an exit
        self.draining = False
        self.state_ok = True
        folder = config.state.journal_dir  # in memory, usage cannot fail to be recorded: no journal
        self.journal = (UsageJournal(Path(folder), config.state.journal_max_bytes)
                        if folder and config.state.redis_url else None)
        self._replays: asyncio.Task[None] | None = None
        # Keys revoked anywhere the state store reaches (every replica's config, `headbudget keys revoke`): refused
        # here without a reload.
        self.revoked: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()  # reload's, kept until done
        self._revocations: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Load and warm the model; refuse (ConfigError) a config it cannot serve; publish offline accuracy."""
        info = await self.batcher.start()
        try:
            self.config.check_model(info.name, info.supports_auto)
        except ConfigError as e:
            log.error("refusing to start: %s", e)
            await self.stop()
            raise
        self.info = info
        # "auto" labels 1.0 where a number is a cap (BudgetFormer); a decider's auto runs are labelled by the batcher.
        self.metrics.supports_auto = info.supports_auto and info.decider is None
        assert self.batcher.planner is not None and self.batcher.engine is not None and self.batcher.meter is not None
        self.unit = ComputeUnit.of(self.batcher.meter)
        engine = self.batcher.engine
        plans = {b: engine.plan(b) for b in self.budget_grid()}
        self.grid_heads = {b: p.heads_active for b, p in plans.items()}
        self.grid_neurons = {b: sum(p.ffn) for b, p in plans.items() if p.ffn is not None}
        self.grid_depth = {b: p.depth for b, p in plans.items() if p.depth is not None}
        self.metrics.set_offline_accuracy(list(self.info.sweep.accuracy.items()) if self.info.sweep else [])
        self.metrics.declare_tiers(self.config.tiers)
        self.state_ok = await self.state.ping()
        self.metrics.set_state_up(self.state_ok)
        if self.journal is not None:  # what this or an earlier process could not record goes to the store
            self._replays = asyncio.create_task(replay_while_running(self.journal, self.state))
        self._revocations = asyncio.create_task(self.state.watch_revocations(self.own_revocations, self.revoked.update))

    def own_revocations(self) -> dict[str, str]:
        """The keys this config revokes, for the state store (key SHA-256 -> when)."""
        return {k.sha256: utc_text(k.revoked_at) if k.revoked_at else "" for k in self.config.keys if k.revoked}

    async def _share_revocations(self) -> None:
        try:
            await self.state.revoke(self.own_revocations())
        except StateUnavailable as e:  # the watcher sends them when the store is back
            log.warning("revocations not shared through the state store yet: %s", e)

    async def stop(self) -> None:
        """Finish queued work, close the engine and the state store."""
        self.draining = True
        await self.batcher.stop()
        for task in (self._replays, self._revocations):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await self.state.close()

    def budget_grid(self) -> list[float]:
        """The budgets /v1/models lists: sweep.json's points, else the service's grid."""
        sweep = self.info.sweep if self.info else None
        budgets = sweep.budgets if sweep else []
        planner = self.batcher.planner
        return budgets or (list(planner.grid) if planner else [])

    def reload(self) -> bool:
        """Re-read the config file (SIGHUP); keep the old config when the new one is invalid. A decider.json made
        since start-up is taken too."""
        self._reload_decider()
        if self.config_path is None:
            return False
        try:
            new = load_config(self.config_path)
            if self.info is not None:
                new.check_model(self.info.name, self.info.supports_auto)
        except ConfigError as e:
            log.error("config reload failed, keeping the running config: %s", e)
            return False
        if new.state != self.config.state:
            log.warning("[state] changes need a restart; keeping the running state store")
        if new.server.max_activation_mb != self.config.server.max_activation_mb:
            log.warning("[server] max_activation_mb changes need a restart; the engine keeps %d MiB",
                        self.config.server.max_activation_mb)
        if new.metrics != self.config.metrics:
            log.warning("[metrics] changes need a restart; keeping the running metrics' labels")
        self.config = new
        self.rate_memo.clear()  # the new tiers' rates decide from here
        self.batcher.server = new.server
        self.metrics.declare_tiers(new.tiers)
        with contextlib.suppress(RuntimeError):  # RuntimeError: no loop runs (then the watcher shares them)
            if self.own_revocations():  # to the other replicas, which may not have read the new file
                self._tasks.add(task := asyncio.get_running_loop().create_task(self._share_revocations()))
                task.add_done_callback(self._tasks.discard)
        log.info("config reloaded", extra={"tiers": sorted(new.tiers), "keys": len(new.keys)})
        return True

    def _reload_decider(self) -> None:
        engine = self.batcher.engine
        if engine is None or self.info is None:
            return
        info = engine.reload_decider()
        # The reload that follows the decider's making, or its failure: auto is no longer "not yet" either way.
        self.decider_pending = False
        if info.decider is not None and info.decider != self.info.decider:
            self.info = info
            log.info("budget=auto: the checkpoint's decider.json serves it from now on")

    async def readiness(self) -> tuple[bool, dict[str, str]]:
        """(ready?, the checks that decide it) for /readyz."""
        checks: dict[str, str] = {}
        model_ok = self.batcher.ready and self.info is not None
        checks["model"] = "ready" if model_ok else "not loaded"
        checks["shutdown"] = "draining" if self.draining else "no"
        up = await self.state.ping()
        if up != self.state_ok:
            self.state_ok = up
            self.metrics.set_state_up(up)
        state_ok = up or self.config.state.on_error == "open"
        checks["state"] = f"{self.state.kind} " + ("ok" if up else f"down (failing {self.config.state.on_error})")
        return model_ok and not self.draining and state_ok, checks
