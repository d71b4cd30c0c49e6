"""Fixtures of the service tests: in-process apps over a fake engine, real servers, a real redis-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from headbudget.service.accounting.auth import hash_key
from headbudget.service.app import create_app
from headbudget.service.settings import ServiceConfig, StateConfig, parse_config
from headbudget.service.state.store import MemoryState, StateStore
from tests.service.fakes import FakeEngine

HOST = "127.0.0.1"
KEYS = {"cheap": "hb_test_cheap_key_000000000000000000000", "balanced": "hb_test_balanced_key_0000000000000000",
        "quality": "hb_test_quality_key_00000000000000000", "flex": "hb_test_flex_key_00000000000000000000"}


def config_dict(**server: Any) -> dict[str, Any]:
    """Three tiers (cheap degrades, quality has priority) and a key per tier; ``server`` overrides [server]."""
    return {
        "server": {"max_wait_ms": 5.0, **server},
        "tiers": {
            "cheap": {"default_budget": 0.25, "max_budget": 0.5, "rate_limit": 6000, "burst": 100, "priority": 0,
                      "max_queue": 64},
            "balanced": {"default_budget": 0.5, "max_budget": 1.0, "rate_limit": 6000, "burst": 100,
                         "priority": 5},
            "quality": {"default_budget": 1.0, "max_budget": 1.0, "rate_limit": 6000, "burst": 100,
                        "priority": 10},
            "flex": {"default_budget": 1.0, "max_budget": 1.0, "rate_limit": 6000, "burst": 100, "priority": 0,
                     "latency_target_ms": 200, "min_budget": 0.1, "max_queue": 256},
        },
        "keys": [{"sha256": hash_key(k), "tier": t, "name": f"test-{t}"} for t, k in KEYS.items()],
    }


def make_config(**server: Any) -> ServiceConfig:
    return parse_config(config_dict(**server))


@contextlib.asynccontextmanager
async def running_app(config: ServiceConfig | None = None, engine: FakeEngine | None = None,
                      state: StateStore | None = None) -> AsyncIterator[tuple[httpx.AsyncClient, Any, FakeEngine]]:
    """An app over a fake engine with its lifespan running, and an httpx client talking to it in process."""
    engine = engine or FakeEngine()
    app = create_app(config or make_config(), lambda: engine, state=state)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=(HOST, 5555), raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            yield client, app, engine


async def held(engine: FakeEngine) -> None:
    """Until the engine holds a batch at its gate (``FakeEngine.entered``)."""
    if not await asyncio.to_thread(engine.entered.wait, 10):
        raise AssertionError("no request reached the engine")


async def queued_behind_first(engine: FakeEngine, first_budget: float, budgets: list[float | str],
                              max_wait_ms: float = 50) -> list[httpx.Response]:
    """One request at ``first_budget`` whose batch the engine holds, then one request per budget queued behind
    it, then the engine released: the answers, first one first (the batch-window tests)."""
    engine.gate.clear()  # hold the first batch so that the rest queue up behind it
    async with running_app(make_config(max_wait_ms=max_wait_ms), engine=engine) as (client, _, _):
        first = asyncio.create_task(client.post(f"/classify?budget={first_budget}", json={"text": "first"},
                                                headers=headers()))
        await held(engine)
        tasks = [asyncio.create_task(client.post(f"/classify?budget={b}", json={"text": f"t{i}"},
                                                 headers=headers()))
                 for i, b in enumerate(budgets)]
        await asyncio.sleep(0.1)
        engine.gate.set()
        return list(await asyncio.gather(first, *tasks))


async def first_then_queued(engine: FakeEngine, n: int,
                            send: Callable[[], Awaitable[httpx.Response]]) -> list[asyncio.Task[httpx.Response]]:
    """``n`` requests: the first until the engine holds its batch (planned alone, with nothing queued behind it:
    on a slow machine all ``n`` could otherwise reach the queue before the first plan), then the rest behind it."""
    first = asyncio.create_task(send())
    await held(engine)
    rest = [asyncio.create_task(send()) for _ in range(n - 1)]
    await asyncio.sleep(0.2)
    return [first, *rest]


async def auto_burst_under_load(engine: FakeEngine, bench_calibration: bool = True) -> list[dict[str, Any]]:
    """Twelve ``budget=auto`` requests of one 100-token text, held behind the engine's gate, on the flex tier with
    a 300 ms latency target: the degrade tests. Every answer is a 200; returns each one's single result."""
    engine.gate.clear()
    d = config_dict(max_wait_ms=0, max_batch_size=1)
    d["tiers"]["flex"].update(latency_target_ms=300)  # flex: max_budget 1.0, min_budget 0.1
    text = " ".join(["w"] * 98)  # 100 tokens
    async with running_app(parse_config(d), engine=engine) as (client, app, _):
        if bench_calibration:  # the fakes run 5x slower than their benchmark table says
            app.state.runtime.batcher.latency.observe(1.0, 100, 50.0)
            app.state.runtime.batcher.latency.observe(0.1, 100, 9.5)
        tasks = await first_then_queued(engine, 12, lambda: client.post(
            "/classify?budget=auto", json={"text": text}, headers=headers("flex")))
        engine.gate.set()
        rs = await asyncio.gather(*tasks)
    assert [r.status_code for r in rs] == [200] * 12, [r.text for r in rs if r.status_code != 200]
    results = [r.json()["results"][0] for r in rs]
    assert all(x["budget_requested"] == "auto" for x in results)
    return results


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def headers(tier: str = "balanced") -> dict[str, str]:
    return {"X-API-Key": KEYS[tier]}


# -- real processes ----------------------------------------------------------------------------------------
def cid() -> str:
    """A fresh charge id: what every compute write of one request counts under."""
    return uuid.uuid4().hex


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_until(check: Callable[[], bool], timeout_s: float, what: str, proc: subprocess.Popen[bytes],
               log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        with contextlib.suppress(OSError, httpx.HTTPError):
            if check():
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} not ready after {timeout_s} s:\n{log.read_text()[-3000:]}")


def stop_process(proc: subprocess.Popen[bytes], sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
    """Signal the process group, wait, then SIGKILL anything left; returns the exit code."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(10)


def service_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    return env


class Server:
    """A running `headbudget serve` subprocess."""

    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path, stdout: Path, config: Path) -> None:
        self.proc, self.url, self.log, self.stdout, self.config = proc, url, log, stdout, config

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def start_server(model: Path, config_text: str, tmp: Path, *, workers: int = 1,
                 extra: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[Server]:
    """`headbudget serve` on a free loopback port until the block ends (then SIGTERM, then SIGKILL)."""
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / "service.toml"
    config.write_text(config_text)
    port = free_port()
    log, out = tmp / "server.log", tmp / "server.out"
    cmd = [sys.executable, "-m", "headbudget.cli", "serve", "--model", str(model), "--config", str(config),
           "--host", HOST, "--port", str(port), "--workers", str(workers), *extra]
    with open(log, "wb") as err_f, open(out, "wb") as out_f:
        proc = subprocess.Popen(cmd, stdout=out_f, stderr=err_f, env={**service_env(), **(env or {})},
                                start_new_session=True)
    url = f"http://{HOST}:{port}"
    try:
        wait_until(lambda: httpx.get(f"{url}/readyz", timeout=2).status_code == 200, 180, "headbudget serve",
                   proc, log)
        yield Server(proc, url, log, out, config)
    finally:
        stop_process(proc)


def toml_of(d: dict[str, Any]) -> str:
    """A small TOML writer for the test configs (tables, arrays of tables, scalars)."""
    lines: list[str] = []

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v + '"'
        return repr(v)

    for section, body in d.items():
        if section == "tiers":
            for name, tier in body.items():
                lines.append(f"[tiers.{name}]")
                lines += [f"{k} = {scalar(v)}" for k, v in tier.items()]
        elif section == "keys":
            for key in body:
                lines.append("[[keys]]")
                lines += [f"{k} = {scalar(v)}" for k, v in key.items()]
        else:
            lines.append(f"[{section}]")
            lines += [f"{k} = {scalar(v)}" for k, v in body.items()]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def redis_process(tmp: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """A throw-away redis-server on a free loopback port: (url, process)."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (Debian package redis-server; `make system-deps`)")
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = tmp / "redis.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen([exe, "--bind", HOST, "--port", str(port), "--save", "", "--appendonly", "no",
                                 "--dir", str(tmp)], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ping() -> bool:
            with socket.create_connection((HOST, port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")

        wait_until(ping, 20, "redis-server", proc, log)
        yield f"redis://{HOST}:{port}/0", proc
    finally:
        stop_process(proc, timeout_s=10)


def engine_factory_available() -> str | None:
    """Why the real engine cannot be used, or None."""
    try:
        import headbudget.engine.factory  # noqa: F401
    except ImportError as e:
        return f"headbudget.engine.factory is not available yet ({e})"
    return None


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A redis-server of this module's tests on a free port (skipped where none is installed)."""
    with redis_process(tmp_path_factory.mktemp("redis")) as (url, _):
        yield url


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[StateStore]:
    """Each state store, empty: in memory, and in Redis (flushed)."""
    config = StateConfig(accuracy_window=3, feedback_ttl_s=60)
    if request.param == "memory":
        yield MemoryState(config)
        return
    from headbudget.service.state.redis_store import RedisState  # needs the redis package only here

    s = RedisState(config.model_copy(update={"redis_url": request.getfixturevalue("redis_url")}))
    await s._redis.flushdb()
    yield s
    await s.close()


async def two_tier_traffic(url: str, rounds: int) -> list[tuple[str, httpx.Response]]:
    """Requests of a cheap and a quality key over /classify and the TEI routes (/predict, /), ``rounds`` rounds of
    four at once with growing sizes; every (tier, answer), each asserted 200."""
    out: list[tuple[str, httpx.Response]] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for i in range(rounds):
            calls = [("cheap", c.post("/classify", json={"texts": ["short text"] * (1 + i % 3)},
                                      headers=headers("cheap"))),
                     ("quality", c.post("/classify", json={"text": "a somewhat longer text " * (1 + i)},
                                        headers=headers("quality"))),
                     ("quality", c.post("/predict", json={"inputs": [["tei text"]] * (1 + i % 4)},
                                        headers=headers("quality"))),
                     ("cheap", c.post("/", json={"inputs": "root route"}, headers=headers("cheap")))]
            for (tier, _), r in zip(calls, await asyncio.gather(*(call for _, call in calls)), strict=True):
                assert r.status_code == 200, r.text
                out.append((tier, r))
    return out


def charge_of(r: httpx.Response) -> str:
    """A request's charge as its answer states it: the TEI routes' header or /classify's field."""
    return r.headers["x-charge"] if "x-charge" in r.headers else str(r.json()["charge"])

