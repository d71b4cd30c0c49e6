"""The FastAPI application factory: routes, error mapping, middleware, and the runtime's lifespan."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI

import headbudget
from headbudget.engine.protocol import Engine
from headbudget.service.errors import install_error_handlers
from headbudget.service.http.fastpath import ClassifyFastPath
from headbudget.service.http.middleware import RequestContextMiddleware
from headbudget.service.http.routes import classify, feedback, health, models, tei, usage
from headbudget.service.http.routes.docs import install_docs
from headbudget.service.http.routes.playground import install_playground
from headbudget.service.metrics import mark_worker_dead
from headbudget.service.runtime import Runtime
from headbudget.service.settings import ServeSettings, ServiceConfig, load_config
from headbudget.service.state.store import StateStore

log = logging.getLogger("headbudget.service")
# FastAPI's native OpenTelemetry (0.16x) asks the global OpenTelemetry providers on every request whether one is
# configured, a cost on every request (docs/decisions.md, 2026-11-24); the service configures none (its
# metrics are Prometheus'), so it is off.
_TELEMETRY_OFF: dict[str, Any] = ({"telemetry": {"tracing": False, "metrics": False, "logs": False}}
                                  if "telemetry" in inspect.signature(FastAPI.__init__).parameters else {})


def _install_sighup(runtime: Runtime) -> None:
    """Reload the config on SIGHUP (main thread of a process with a running loop only)."""
    try:
        asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, runtime.reload)
    except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or not POSIX
        log.debug("SIGHUP reload not available in this process")


def create_app(config: ServiceConfig, engine_factory: Callable[[], Engine], *, config_path: Path | None = None,
               extra_key_hashes: dict[str, str] | None = None, state: StateStore | None = None,
               decider_pending: bool = False) -> FastAPI:
    """A ready-to-serve app; the engine is loaded and warmed up during start-up, closed at shutdown."""
    runtime = Runtime(config, engine_factory, config_path=config_path, extra_key_hashes=extra_key_hashes,
                      state=state, decider_pending=decider_pending)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await runtime.start()
        _install_sighup(runtime)
        log.info("ready", extra={"model": runtime.info.name if runtime.info else None, "pid": os.getpid(),
                                 "state": runtime.state.kind})
        try:
            yield
        finally:
            log.info("shutting down: finishing queued requests")
            await runtime.stop()
            mark_worker_dead(os.getpid())

    app = FastAPI(title="headbudget", version=headbudget.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="Text classification where each request chooses how much of the model's compute "
                              "its answer gets: a budget in [0.1, 1], the fraction of the dense model's "
                              "multiply-adds.", **_TELEMETRY_OFF)
    app.state.runtime = runtime
    install_error_handlers(app)

    for router in (classify.router, feedback.router, models.router, usage.router, health.router, tei.router):
        app.include_router(router)
    install_docs(app)  # /docs and /redoc from the installed package's assets, not a CDN
    install_playground(app)
    app.add_middleware(ClassifyFastPath, runtime=runtime)  # inside the request context: ids, 413, logs, metrics
    app.add_middleware(RequestContextMiddleware, metrics=runtime.metrics,
                       max_body_bytes=config.server.max_body_bytes)
    return app


def default_engine_factory(settings: ServeSettings, prepacked_budgets: tuple[float, ...] | None = None,
                           max_activation_mb: int | None = None) -> Callable[[], Engine]:
    """Loads the checkpoint with the engine's factory (imported lazily: the one start-up call into it)."""

    def factory() -> Engine:
        from headbudget.engine.factory import load_engine

        engine: Engine = load_engine(settings.model_dir, settings.engine_options(prepacked_budgets, max_activation_mb))
        return engine

    return factory


def app_from_env() -> FastAPI:
    """uvicorn's factory for `headbudget serve`: settings from HEADBUDGET_SERVE, config from its file."""
    from headbudget.service.logs import configure_logging

    settings = ServeSettings.from_env()
    configure_logging(settings.log_level.upper(), settings.access_log)  # parsed once by the command
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until the loop's handler is installed at start-up
    config = load_config(settings.config_path)
    # The tiers' default budgets are what most requests run at: they get prepacked sessions (EngineOptions);
    # [server] max_activation_mb bounds the memory of every forward pass.
    factory = default_engine_factory(settings, config.default_budgets(), config.server.max_activation_mb)
    return create_app(config, factory, config_path=settings.config_path,
                      extra_key_hashes=settings.extra_key_hashes, decider_pending=settings.decider_pending)
